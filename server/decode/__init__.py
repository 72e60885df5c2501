"""Decode scheduling: the shared pipeline, its lanes and capacity model, and each stream's
driver through it. The engine is injected; nothing here imports MLX."""
