"""The streaming core: one client's session, its VAD, buffer, commit policy and language.

No I/O, no asyncio, no MLX: fed audio and typed calls, it emits events and decode jobs, and
``engine_api`` is the contract a speech engine meets.
"""
