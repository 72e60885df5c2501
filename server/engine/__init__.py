"""The MLX Whisper engine: model loading and conversion, KV-cached decoding, batching.

Importing this package loads OpenBLAS before anything imports ``mlx.core`` (see ``blas``).
"""

from __future__ import annotations

from server.engine.blas import preload_openblas

preload_openblas()
