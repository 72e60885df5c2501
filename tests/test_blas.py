"""Thread settings of the two OpenBLAS copies in the process (``server/engine/blas.py``):
the one preloaded for MLX, and numpy's own, which the numpy token step and the speaker
encoder multiply on."""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import pytest

from server.engine.blas import set_blas_threads, set_numpy_blas_threads


def _numpy_blas_threads() -> int:
    libs = Path(np.__file__).resolve().parent.parent / "numpy.libs"
    (lib,) = libs.glob("libscipy_openblas*.so*")
    handle = ctypes.CDLL(str(lib))
    for name in ("scipy_openblas_get_num_threads64_", "scipy_openblas_get_num_threads"):
        getter = getattr(handle, name, None)
        if getter is not None:
            return int(getter())
    raise AssertionError(f"no thread getter in {lib.name}")


def test_numpy_blas_gets_the_thread_count_asked_for() -> None:
    before = _numpy_blas_threads()
    try:
        assert set_numpy_blas_threads(2)
        assert _numpy_blas_threads() == 2
        assert set_numpy_blas_threads(1)
        assert _numpy_blas_threads() == 1
    finally:
        set_numpy_blas_threads(before)


def test_a_thread_count_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="threads must be >= 1"):
        set_numpy_blas_threads(0)
    with pytest.raises(ValueError, match="threads must be >= 1"):
        set_blas_threads(0)
