"""``client.reconnect``: one source over several sessions, against real servers in this
process with the scripted engine (what is tested is the client's bookkeeping, not words).

A server that shuts down mid-stream, one that drops the connection, one that is full and
one that never gets ready; the pure parts (backoff, what is retried) on their own. The
timeline the sessions are joined on: ``tests/test_timeline.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import itertools
import random
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from websockets.asyncio.client import connect

from client.reconnect import (
    SEAM_WORDS,
    ResumedStream,
    RetryPolicy,
    retryable,
    stream_with_reconnect,
)
from client.sources import FileSource, SourceError
from client.stream import ConnectError, StreamFailed, retry_after_s
from client.timeline import RESUME_BEFORE_SEAM_S
from server.config import ServerConfig
from server.protocol.formats import AudioFormat
from server.protocol.messages import (
    ErrorMessage,
    FinalMessage,
    ServerMessage,
)
from server.serve.app import WhisperwireServer
from tests.helpers import ScriptedEngine
from tests.instances import free_port

CLIP = "librispeech_test-clean/1089-134686-0000.wav"  # 10.4 s with pauses: several finals
FAST = RetryPolicy(backoff_first_s=0.05, backoff_max_s=0.2)
WAIT_S = 60.0

on_session_loop = pytest.mark.asyncio(loop_scope="session")


# --------------------------------------------------------------------------- pure parts


def test_backoff_doubles_up_to_its_cap_with_jitter() -> None:
    policy = RetryPolicy(backoff_first_s=0.5, backoff_max_s=4.0, jitter=0.2)
    rng = random.Random(7)
    waits = [policy.backoff_s(n, rng) for n in range(1, 7)]
    for wait, base in zip(waits, (0.5, 1.0, 2.0, 4.0, 4.0, 4.0), strict=True):
        assert 0.8 * base <= wait <= 1.2 * base
    with pytest.raises(ValueError, match="jitter"):
        RetryPolicy(jitter=1.0)


def test_a_servers_retry_after_replaces_the_backoff_up_to_a_cap() -> None:
    policy = RetryPolicy(backoff_first_s=0.5, jitter=0.2, retry_after_max_s=30.0)
    rng = random.Random(7)
    assert 0.8 * 5 <= policy.backoff_s(1, rng, retry_after_s=5.0) <= 1.2 * 5
    assert 0.8 * 5 <= policy.backoff_s(4, rng, retry_after_s=5.0) <= 1.2 * 5  # not doubled
    assert 0.8 * 30 <= policy.backoff_s(1, rng, retry_after_s=3600.0) <= 1.2 * 30


@pytest.mark.parametrize(
    ("header", "seconds"),
    [("5", 5.0), (" 12 ", 12.0), (None, None), ("soon", None), ("-3", None)],
)
def test_retry_after_is_read_as_delay_seconds(header: str | None, seconds: float | None) -> None:
    assert retry_after_s(header) == seconds


def test_retry_after_as_an_http_date() -> None:
    later = email.utils.formatdate(time.time() + 30, usegmt=True)
    wait = retry_after_s(later)
    assert wait is not None and 28 <= wait <= 31


def test_what_is_retried() -> None:
    # A server that is there but busy, loading or draining: always.
    assert retryable(ConnectError("x", status=503), connected_before=False)
    assert retryable(StreamFailed("x", close_code=1013), connected_before=False)
    full = ErrorMessage("server_full", "full", True, 0.0)
    assert retryable(StreamFailed("x", error=full), connected_before=False)
    # Nothing listening: a wrong URL at first, a restarting server later.
    assert not retryable(ConnectError("refused"), connected_before=False)
    assert retryable(ConnectError("refused"), connected_before=True)
    for code in (1001, 1006, 1011):
        assert retryable(StreamFailed("x", close_code=code), connected_before=True)
    # What a new connection cannot fix.
    for status in (400, 401, 403, 404):
        assert not retryable(ConnectError("x", status=status), connected_before=True)
    for code in (1003, 1008, 1009):
        assert not retryable(StreamFailed("x", close_code=code), connected_before=True)
    assert not retryable(StreamFailed("no 'done'"), connected_before=True)


# --------------------------------------------------------------------------- real servers


@contextlib.asynccontextmanager
async def scripted(port: int = 0, **overrides: object) -> AsyncIterator[WhisperwireServer]:
    config = ServerConfig(host="127.0.0.1", port=port, warmup=False, **overrides)  # type: ignore[arg-type]
    async with WhisperwireServer(ScriptedEngine, server=config) as server:
        yield server


def seam_start(finals: tuple[FinalMessage, ...]) -> float:
    """Where a session after these finals starts: ``RESUME_BEFORE_SEAM_S`` before their last
    ``SEAM_WORDS`` words."""
    return max(
        0.0, [w for f in finals for w in f.words][-SEAM_WORDS:][0].start - RESUME_BEFORE_SEAM_S
    )


def check_one_timeline(resumed: ResumedStream, duration_s: float) -> None:
    """The merged result covers the whole source once, its finals in order."""
    merged = resumed.result
    assert merged.done.audio_received_s == pytest.approx(duration_s, abs=0.002)
    assert merged.stats.audio_s == pytest.approx(duration_s, abs=0.002)
    finals = merged.finals
    assert [f.segment_id for f in finals] == list(range(len(finals)))
    assert merged.done.segments == len(finals)
    for session in resumed.sessions:  # in order within each session
        assert all(a.start <= b.start for a, b in itertools.pairwise(session.finals))
    for session in resumed.sessions:
        done = session.done
        assert done.transcribed_s == pytest.approx(done.speech_s, abs=0.003)


@on_session_loop
async def test_a_session_finished_by_a_shutdown_goes_on_in_a_new_session(
    speech_dir: Path,
) -> None:
    """The server finishes the session (finals, done, 1001) mid-stream and a new one takes
    the port; the client resumes from what ``done`` said was received."""
    port = free_port()
    source = FileSource(speech_dir / CLIP)
    seen: list[ServerMessage] = []
    reconnects: list[str] = []
    halfway = asyncio.Event()

    def on_message(message: ServerMessage) -> None:
        seen.append(message)
        if message.audio_received_s >= 4.0:
            halfway.set()

    async with scripted(port) as first:
        streaming = asyncio.create_task(
            stream_with_reconnect(
                first.url + "/v1/stream",
                source,
                pace=0.25,
                retry=FAST,
                on_message=on_message,
                on_reconnect=lambda why, _: reconnects.append(why),
            )
        )
        await asyncio.wait_for(halfway.wait(), WAIT_S)
    async with scripted(port):  # the same address, a new server: as after a restart
        resumed = await asyncio.wait_for(streaming, WAIT_S)
    assert len(resumed.sessions) == 2 and reconnects, reconnects
    first, second = resumed.sessions
    cut_s = first.done.audio_received_s
    assert 4.0 <= cut_s < source.duration_s - 1.0
    # The next session hears the last final words again, and what follows them up to the
    # cut, which may hold a word cut in half.
    resume_s = seam_start(first.finals)
    assert 0 < resume_s <= cut_s
    assert second.done.audio_received_s == pytest.approx(source.duration_s - resume_s, abs=0.002)
    check_one_timeline(resumed, source.duration_s)
    later = resumed.result.finals[len(first.finals) :]
    assert later and all(f.start >= resume_s - 0.002 for f in later)
    # What on_message saw is what the result holds: the finals, their ids numbered on.
    shown = [m for m in seen if isinstance(m, FinalMessage)]
    assert tuple(shown) == resumed.result.finals


@on_session_loop
async def test_a_dropped_connection_resends_the_audio_since_the_last_final(
    speech_dir: Path,
) -> None:
    source = FileSource(speech_dir / CLIP)
    finals: list[FinalMessage] = []
    got_final = asyncio.Event()

    def on_message(message: ServerMessage) -> None:
        if isinstance(message, FinalMessage) and message.text.strip():
            finals.append(message)
            got_final.set()

    async with scripted() as server:
        streaming = asyncio.create_task(
            stream_with_reconnect(
                server.url + "/v1/stream",
                source,
                pace=0.25,
                retry=FAST,
                on_message=on_message,
                finals="words",  # finals while the clip's one utterance goes on
            )
        )
        await asyncio.wait_for(got_final.wait(), WAIT_S)
        server.abort_connections()  # TCP gone: no close frame, no done
        covered_s = seam_start(tuple(finals))  # what it had made final when it dropped
        delivered = len(finals)
        resumed = await asyncio.wait_for(streaming, WAIT_S)
    (only,) = resumed.sessions  # the lost session has no result; the resumed one does
    sent_again_s = only.done.audio_received_s
    assert sent_again_s == pytest.approx(source.duration_s - covered_s, abs=0.002)
    # The merged timeline keeps the finals delivered before the drop; the resumed session's
    # follow from the seam on.
    assert list(resumed.result.finals[:delivered]) == finals[:delivered]
    assert resumed.result.finals[delivered].start >= covered_s - 0.002
    assert resumed.result.done.audio_received_s == pytest.approx(source.duration_s, abs=0.002)


@on_session_loop
async def test_a_full_server_is_retried_until_a_session_ends(speech_dir: Path) -> None:
    source = FileSource(speech_dir / "ljspeech/LJ001-0004.wav")
    reconnects: list[str] = []
    async with scripted(max_sessions=1, capacity_limit=False) as server:
        url = server.url + "/v1/stream"
        async with connect(url) as holder:
            await holder.recv()
            streaming = asyncio.create_task(
                stream_with_reconnect(
                    url,
                    source,
                    pace=0,
                    retry=FAST,
                    on_reconnect=lambda why, _: reconnects.append(why),
                )
            )
            while not reconnects:
                await asyncio.sleep(0.01)  # refused at least once while the slot is held
        resumed = await asyncio.wait_for(streaming, WAIT_S)
    assert "HTTP 503" in reconnects[0] and "concurrent sessions" in reconnects[0]
    check_one_timeline(resumed, source.duration_s)


@on_session_loop
async def test_a_full_server_is_waited_out_as_its_retry_after_asks(speech_dir: Path) -> None:
    source = FileSource(speech_dir / "ljspeech/LJ001-0004.wav")
    waits: list[float] = []
    async with scripted(max_sessions=1, retry_after_s=1) as server:
        url = server.url + "/v1/stream"
        async with connect(url) as holder:
            await holder.recv()
            streaming = asyncio.create_task(
                stream_with_reconnect(
                    url, source, pace=0, retry=FAST, on_reconnect=lambda _, s: waits.append(s)
                )
            )
            while not waits:
                await asyncio.sleep(0.01)
        resumed = await asyncio.wait_for(streaming, WAIT_S)
    # The server's 1 s, not FAST's 0.05 s backoff (each within the policy's 20% jitter).
    assert waits and all(0.8 <= s <= 1.2 for s in waits), waits
    check_one_timeline(resumed, source.duration_s)


@on_session_loop
async def test_what_retrying_cannot_fix_fails_at_once(speech_dir: Path) -> None:
    source = FileSource(speech_dir / "ljspeech/LJ001-0004.wav")
    reconnects: list[str] = []
    async with scripted(api_key="k") as server:
        with pytest.raises(ConnectError) as refused:
            await stream_with_reconnect(
                server.url + "/v1/stream",
                source,
                retry=FAST,
                on_reconnect=lambda why, _: reconnects.append(why),
            )
    assert refused.value.status == 401
    with pytest.raises(ConnectError, match="is whisperwire-server running"):
        await stream_with_reconnect(f"ws://127.0.0.1:{free_port()}/v1/stream", source)
    assert reconnects == []


@on_session_loop
async def test_retries_run_out_on_a_server_that_never_gets_ready(speech_dir: Path) -> None:
    release = threading.Event()

    def never_loads() -> ScriptedEngine:
        release.wait(WAIT_S)  # on the decode thread, like a model that takes its time
        return ScriptedEngine()

    server = WhisperwireServer(never_loads, server=ServerConfig(host="127.0.0.1", port=0))
    await server.start()
    reconnects: list[str] = []
    try:
        with pytest.raises(ConnectError) as refused:
            await stream_with_reconnect(
                server.url + "/v1/stream",
                FileSource(speech_dir / "ljspeech/LJ001-0004.wav"),
                retry=RetryPolicy(max_retries=2, backoff_first_s=0.05, backoff_max_s=0.1),
                on_reconnect=lambda why, _: reconnects.append(why),
            )
    finally:
        release.set()
        await server.shutdown()
    assert refused.value.status == 503
    assert len(reconnects) == 2


class FailingSource:
    """An ``AudioSource`` double: a second of silence, then it breaks (a microphone that
    was unplugged)."""

    audio_format = AudioFormat(16000, "pcm_s16le")
    live = False

    async def chunks(self) -> AsyncIterator[bytes]:
        for _ in range(10):
            yield bytes(3200)
        raise SourceError("the microphone went away")

    def stop(self) -> None:
        return None


@on_session_loop
async def test_a_source_that_breaks_ends_the_stream_with_its_error() -> None:
    async with scripted() as server:
        with pytest.raises(SourceError, match="went away"):
            await stream_with_reconnect(server.url + "/v1/stream", FailingSource(), pace=0)
