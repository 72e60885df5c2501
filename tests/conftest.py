"""Session fixtures shared by the suite: real speech and one warmed engine.

Helpers that are not fixtures live in ``tests/helpers.py``; the speech corpus they read
(manifest, clips, word error rate) in ``bench/corpus.py``, shared with the benchmarks.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import pytest_asyncio

from bench.corpus import ManifestRow, find_speech_dir, load_clip, read_manifest
from tests.helpers import decoded_once

if TYPE_CHECKING:
    from server.engine.engine import Engine


def pytest_sessionstart(session: pytest.Session) -> None:
    """Under pytest-xdist (``make test`` runs ``-n``), the controller converts the packaged
    models into the model cache before the workers start: each worker's ``engine`` fixture
    and the ``whisperwire-server`` processes some tests start would otherwise convert the
    same model at once, into the same cache folder. Cached already, this only loads them."""
    config = session.config
    if not getattr(config.option, "numprocesses", None) or hasattr(config, "workerinput"):
        return
    from server.engine.store import load_model
    from server.protocol.errors import ModelNotFoundError

    for name in ("tiny.en", "base"):
        with contextlib.suppress(ModelNotFoundError):  # base: the tests that need it skip
            load_model(name)


# Fixtures that load the real model or start a real server: a test that uses one is "heavy"
# (``make check`` leaves those to ``make test``), as are the slow and browser ones.
HEAVY_FIXTURES = frozenset(
    {"engine", "base_engine", "offline_text", "server_url", "speakers_server_url"}
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Marks the heavy tests (``HEAVY_FIXTURES``, ``slow``, ``browser``, and the modules that
    mark themselves). Under pytest-xdist, the ``slow`` tests go first, then the ``browser``
    ones (order only): started last, a test of a minute keeps one worker busy after the
    others have run out of work. The order is the workers' collection, which the controller
    schedules from (it collects nothing itself; a worker's ``numprocesses`` is None)."""
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        if (
            fixtures & HEAVY_FIXTURES
            or item.get_closest_marker("slow")
            or item.get_closest_marker("browser")
        ):
            item.add_marker(pytest.mark.heavy)
    if hasattr(config, "workerinput"):
        items.sort(key=_start_order)


def _start_order(item: pytest.Item) -> int:
    if item.get_closest_marker("slow"):
        return 0
    return 1 if item.get_closest_marker("browser") else 2


@pytest.fixture(scope="session")
def speech_dir() -> Path:
    """The real-speech folder (see ``bench.corpus.find_speech_dir``); skips when absent."""
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


@pytest.fixture(scope="session")
def offline_text(engine: Engine, tmp_path_factory: pytest.TempPathFactory) -> Callable[[Path], str]:
    """The default model's offline transcript of a recording, decoded once per run: several
    accuracy tests hold their streams against the same recordings (LJ long is 221 s). Under
    pytest-xdist the workers share the transcripts through files in the run's temporary
    folder; the first worker to ask decodes while the others wait for it."""
    from server.engine.offline import transcribe_audio

    texts: dict[Path, str] = {}
    shared: Path | None = None
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = tmp_path_factory.getbasetemp().parent / "offline-text"
        shared.mkdir(exist_ok=True)

    def decode(path: Path) -> str:
        return transcribe_audio(engine, load_clip(path)).text

    def text(path: Path) -> str:
        if path not in texts:
            texts[path] = decode(path) if shared is None else decoded_once(shared, path, decode)
        return texts[path]

    return text


@pytest.fixture(scope="session")
def base_engine() -> Iterator[Engine]:
    """The multilingual ``base`` model (the ``base`` extra, which ``make install`` installs),
    loaded once per session, for the language-detection tests."""
    from server.engine.engine import Engine, EngineConfig

    eng = Engine.load(EngineConfig(model="base"))
    eng.warmup()
    yield eng


@pytest_asyncio.fixture(loop_scope="session", scope="session")
async def server_url(engine: Engine) -> AsyncIterator[str]:
    """A real server with the real model, in this process on 127.0.0.1 and a free port.

    Yields its base URL, ``ws://127.0.0.1:PORT`` (the stream is at ``/v1/stream``, the HTTP
    routes at the same host and port). Ready (model warmed) before the first test uses it.
    Tests that use it run on the session's event loop:
    ``pytestmark = pytest.mark.asyncio(loop_scope="session")``.
    """
    from server.config import PipelineConfig, ServerConfig
    from server.serve.app import WhisperwireServer

    # Recognition tests run several streams at once on a CPU the capacity estimate says
    # carries one or two: they test transcripts, not admission.
    config = ServerConfig(host="127.0.0.1", port=0, max_sessions=16, capacity_limit=False)
    pipeline = PipelineConfig(max_batch_size=8, batch_wait_ms=5.0)
    async with WhisperwireServer(lambda: engine, server=config, pipeline=pipeline) as server:
        yield server.url


@pytest_asyncio.fixture(loop_scope="session", scope="session")
async def speakers_server_url(engine: Engine) -> AsyncIterator[str]:
    """As ``server_url``, started with ``--speakers`` (speaker labels for streams that ask,
    v1 streams by default) and one decode lane of the same engine."""
    from server.config import PipelineConfig, ServerConfig, StreamingConfig
    from server.core.speakers import SpeakerConfig
    from server.serve.app import WhisperwireServer

    config = ServerConfig(host="127.0.0.1", port=0, max_sessions=16, capacity_limit=False)
    pipeline = PipelineConfig(max_batch_size=8, batch_wait_ms=5.0)
    streaming = StreamingConfig(speakers=SpeakerConfig(enabled=True))
    async with WhisperwireServer(
        lambda: engine, server=config, pipeline=pipeline, streaming=streaming
    ) as server:
        yield server.url
