"""Make MLX's CPU matmuls fast, and check that they are.

The ``mlx-cpu`` wheel links a reference BLAS (about 4 GFLOP/s on our 2-core machines).
Loading OpenBLAS into the process with RTLD_GLOBAL *before* ``mlx.core`` is imported routes
MLX's ``cblas_sgemm`` calls to it (about 20x faster). The order is guaranteed by where the
imports are: this package's ``__init__`` runs ``preload_openblas()`` before any of its modules
(``engine``, ``decoder``, ``model``, ``cpu_kernels``) imports ``mlx.core``, and code outside
the package (benchmarks, tests) gets ``mlx.core`` from ``import_mlx()``.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import cast

import numpy as np
import numpy.typing as npt

logger = logging.getLogger("server.engine.blas")

OPENBLAS_ENV = "WHISPERWIRE_OPENBLAS"  # a path to libopenblas.so, or "off"
SLOW_GFLOPS = 10.0  # the reference BLAS gives 3-4; OpenBLAS 100+, and 15+ on a loaded host


@dataclass(frozen=True)
class BlasStatus:
    library: str | None  # path of the preloaded OpenBLAS, None if none was loaded
    gflops: float | None  # measured float32 matmul throughput, None if not probed
    device: str


_state: dict[str, str | None] = {}  # process-wide by nature: a shared library loads once
_handle: list[ctypes.CDLL] = []


def find_openblas() -> Path | None:
    """Locate ``libopenblas.so`` from cmeel-openblas (or ``$WHISPERWIRE_OPENBLAS``)."""
    override = os.environ.get(OPENBLAS_ENV)
    if override:
        return None if override.lower() == "off" else Path(override)
    for entry in sys.path:
        for name in ("libopenblas.so", "libopenblas.so.0"):
            candidate = Path(entry) / "cmeel.prefix" / "lib" / name
            if candidate.is_file():
                return candidate
    return None


def preload_openblas() -> str | None:
    """Load OpenBLAS globally, once, if we are on Linux and mlx.core is not imported yet."""
    if "loaded" in _state:
        return _state["loaded"]
    path: str | None = None
    if sys.platform.startswith("linux"):
        if "mlx.core" in sys.modules:
            logger.warning("mlx.core was imported before OpenBLAS could be preloaded")
        else:
            lib = find_openblas()
            if lib is not None:
                try:
                    _handle.append(ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL))
                    path = str(lib)
                except OSError as exc:
                    logger.warning("could not load %s: %s", lib, exc)
    _state["loaded"] = path
    return path


def set_blas_threads(threads: int) -> bool:
    """Set the preloaded OpenBLAS's thread count; False when none is loaded.

    OpenBLAS workers spin while waiting for work. On a 2-core machine where the decode
    thread shares the cores with the features thread, the event loop or other processes,
    two spinning workers slowed decoding 6-8x in our measurements; one thread per matmul
    degrades gracefully.
    """
    if threads < 1:
        raise ValueError(f"threads must be >= 1; got {threads}")
    if not _handle:
        return False
    setter = getattr(_handle[0], "openblas_set_num_threads", None)
    if setter is None:
        return False
    setter(ctypes.c_int(threads))
    return True


def set_numpy_blas_threads(threads: int) -> bool:
    """Set numpy's own OpenBLAS (the ``scipy-openblas`` copy in ``numpy.libs``, not the one
    MLX is given) to ``threads`` threads; False when it cannot be found.

    The decoder's numpy token step (``cpu_step``) and the speaker encoder run their matrix
    products there. With numpy's default of a thread per core its workers spin for each one:
    on our shared 2-core machines the speaker encoder's window took 24-56 ms and four windows
    170-720 ms, against 12 and 42 ms on one thread.
    """
    if threads < 1:
        raise ValueError(f"threads must be >= 1; got {threads}")
    libs = Path(np.__file__).resolve().parent.parent / "numpy.libs"
    for lib in sorted(libs.glob("libscipy_openblas*.so*")) + sorted(libs.glob("libopenblas*.so*")):
        try:
            handle = ctypes.CDLL(str(lib))
        except OSError:
            continue
        for name in (
            "scipy_openblas_set_num_threads64_",
            "scipy_openblas_set_num_threads",
            "openblas_set_num_threads64_",
            "openblas_set_num_threads",
        ):
            setter = getattr(handle, name, None)
            if setter is not None:
                setter(ctypes.c_int(threads))
                logger.info("numpy's OpenBLAS (%s) set to %d thread(s)", lib.name, threads)
                return True
    logger.warning("numpy's OpenBLAS was not found: its matrix products use its own threads")
    return False


CBLAS_ROW_MAJOR = 101
CBLAS_NO_TRANS = 111
CBLAS_TRANS = 112
# alpha, A, lda, x or B, its stride, beta, y or C, its stride: the same in sgemv and sgemm.
_PRODUCT_ARGS: list[type] = [ctypes.c_float, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
_PRODUCT_ARGS += [ctypes.c_int, ctypes.c_float, ctypes.c_void_p, ctypes.c_int]


def _declared(name: str, leading_ints: int) -> Callable[..., None] | None:
    """The preloaded OpenBLAS's product ``name`` (``leading_ints`` int arguments, then
    ``_PRODUCT_ARGS``) with its argument types declared, so a call costs a microsecond or
    two, not the ten that undeclared arguments take (pointers go as ints); None when no
    OpenBLAS is loaded."""
    if not _handle:
        return None
    function = getattr(_handle[0], name, None)
    if function is None:
        return None
    if function.argtypes is None:
        function.argtypes = [ctypes.c_int] * leading_ints + _PRODUCT_ARGS
        function.restype = None
    return cast(Callable[..., None], function)


def sgemv() -> Callable[..., None] | None:
    """``cblas_sgemv`` of the preloaded OpenBLAS (see ``_declared``)."""
    return _declared("cblas_sgemv", 4)  # order, trans, m, n


def sgemm() -> Callable[..., None] | None:
    """``cblas_sgemm`` of the preloaded OpenBLAS (see ``_declared``).

    For a few rows it beats numpy's own OpenBLAS (the ``scipy-openblas`` build): the output
    projection for five rows 8.1 ms against 12.6, a 384 x 1536 layer 0.18 ms against 0.41.
    """
    return _declared("cblas_sgemm", 6)  # order, two trans, m, n, k


def vector_matrix(
    x: npt.NDArray[np.float32], a: npt.NDArray[np.float32]
) -> npt.NDArray[np.float32] | None:
    """``x @ a`` for a few rows ``x`` (rows, k) and a C-contiguous float32 ``a`` (k, n), one
    ``cblas_sgemv`` per row; None when no OpenBLAS is loaded.

    MLX hands every float32 matmul to ``cblas_sgemm``, which packs the whole right-hand
    matrix even for a single row: for Whisper's output projection (51864 x 384, 80 MB) that
    costs 15-20 ms a token on our CPUs, where ``sgemv`` streams the matrix once in 5-6 ms.
    """
    gemv = sgemv()
    if gemv is None or x.dtype != np.float32 or a.dtype != np.float32:
        return None
    if not a.flags["C_CONTIGUOUS"] or x.ndim != 2 or a.ndim != 2 or x.shape[1] != a.shape[0]:
        return None
    rows = np.ascontiguousarray(x)
    k, n = a.shape
    out = np.empty((rows.shape[0], n), dtype=np.float32)
    for i in range(rows.shape[0]):
        gemv(
            CBLAS_ROW_MAJOR,
            CBLAS_TRANS,
            k,
            n,
            1.0,
            a.ctypes.data,
            n,
            rows[i].ctypes.data,
            1,
            0.0,
            out[i].ctypes.data,
            1,
        )
    return out


def import_mlx() -> ModuleType:
    """Import ``mlx.core`` after the OpenBLAS preload; use this instead of a bare import."""
    preload_openblas()
    import mlx.core as mx

    return mx


def measure_gflops(size: int = 512, repeats: int = 10) -> float:
    """Float32 matmul throughput of MLX's default device, in GFLOP/s (best of ``repeats``)."""
    mx = import_mlx()
    a = mx.random.normal((size, size), dtype=mx.float32)
    b = mx.random.normal((size, size), dtype=mx.float32)
    mx.eval(a @ b)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        mx.eval(a @ b)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best / 1e9


def check_blas() -> BlasStatus:
    """Preload, probe and log; warn loudly when CPU matmuls are slow."""
    lib = preload_openblas()
    mx = import_mlx()
    device = str(mx.default_device())
    on_gpu = bool(mx.metal.is_available() or mx.cuda.is_available())
    if on_gpu:
        logger.info("MLX device %s; BLAS preload not needed", device)
        return BlasStatus(lib, None, device)
    gflops = measure_gflops()
    if gflops < SLOW_GFLOPS:
        logger.warning(
            "SLOW CPU MATMULS: %.1f GFLOP/s (OpenBLAS %s). Install cmeel-openblas or set %s to a "
            "libopenblas.so; expect ~20x slower decoding",
            gflops,
            lib or "not loaded",
            OPENBLAS_ENV,
        )
    else:
        logger.info("MLX on %s, float32 matmul %.0f GFLOP/s (OpenBLAS %s)", device, gflops, lib)
    return BlasStatus(lib, gflops, device)
