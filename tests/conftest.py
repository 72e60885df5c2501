"""Session fixtures shared by the suite: real speech and one warmed engine.

Helpers that are not fixtures live in ``tests/helpers.py``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.helpers import ManifestRow, find_speech_dir, read_manifest

if TYPE_CHECKING:
    from server.engine.engine import Engine


@pytest.fixture(scope="session")
def speech_dir() -> Path:
    """The real-speech folder (see ``tests/helpers.find_speech_dir``); skips when absent."""
    found = find_speech_dir()
    if found is None:
        pytest.skip("real speech recordings (shared/speech) not found")
    return found


@pytest.fixture(scope="session")
def manifest(speech_dir: Path) -> list[ManifestRow]:
    """Rows of ``manifest.tsv``: file, seconds, language, transcript."""
    return read_manifest(speech_dir / "manifest.tsv")


@pytest.fixture(scope="session")
def engine() -> Iterator[Engine]:
    """The default model (tiny.en), loaded once per session and warmed."""
    # Imported lazily: loading MLX is needed only by the tests that use the engine.
    from server.engine.engine import Engine, EngineConfig

    eng = Engine.load(EngineConfig())
    eng.warmup()
    yield eng
