"""The server end to end: real servers on port 0 in this process, real WebSocket clients.

Recognition tests use the real model (the ``server_url`` fixture). Tests of limits, security
and readiness use ``ScriptedEngine`` (no model, instant) on servers of their own. Audio is
sent in 100 ms frames back to back, faster than real time: the server must queue, not drop.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import ssl
import subprocess
import sys
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from server.app import WhisperwireServer
from server.config import ServerConfig
from server.errors import ModelNotFoundError
from server.pipeline import SpeechEngine
from tests.helpers import (
    ManifestRow,
    ScriptedEngine,
    StreamOutcome,
    http_get,
    load_clip,
    metric_value,
    normalize,
    pcm_frames,
    stream_frames,
    wer,
)

if TYPE_CHECKING:
    from server.engine.engine import Engine

pytestmark = pytest.mark.asyncio(loop_scope="session")

REPO = Path(__file__).resolve().parents[1]
WAIT_S = 120.0  # a bound for waits on the real model on a busy 2-core machine
MAX_WER_CLIP = 0.35  # one short clip, streamed: a word or two wrong is allowed
MAX_WER_CORPUS = 0.2  # tiny.en offline is ~0.05-0.1 on these clips
END_TO_END_CLIPS = (
    "librispeech_test-clean/1089-134686-0000.wav",  # 10.4 s, long enough to cut a window
    "ljspeech/LJ001-0004.wav",  # punctuated reference
)
CONCURRENT_CLIPS = (
    "librispeech_test-clean/1089-134686-0001.wav",
    "misc_en/arctic_a0024.wav",
    "ljspeech/LJ001-0011.wav",
    "librispeech_test-clean/61-70968-0000.wav",
    "ljspeech/LJ001-0004.wav",
    "librispeech_test-clean/1089-134691-0001.wav",
    "ljspeech/LJ001-0006.wav",
    "librispeech_misc/lightning-whisper-mlx_ls_test.wav",
)


def stream_url(base: str, **query: str) -> str:
    url = base + "/v1/stream"
    if query:
        url += "?" + "&".join(f"{k}={v}" for k, v in query.items())
    return url


def http_url(base: str) -> str:
    return "http" + base.removeprefix("ws")


def reference(manifest: list[ManifestRow], file: str) -> str:
    return next(row.transcript for row in manifest if row.file == file)


def check_message_shapes(outcome: StreamOutcome) -> None:
    """What every stream owes its client: protocol order and fields."""
    kinds = [m["type"] for m in outcome.messages]
    assert kinds[0] == "ready" and kinds[-1] == "done", kinds
    assert all("audio_received_s" in m for m in outcome.messages)
    finals = outcome.of_type("final")
    ids = [f["segment_id"] for f in finals]
    assert ids == sorted(set(ids)), ids  # segment ids only grow
    assert outcome.messages[-1]["segments"] == len(finals)
    for f in finals:
        assert f["start"] <= f["end"]
        assert all(w["start"] <= w["end"] for w in f["words"])
    assert outcome.close_code == 1000


@contextlib.asynccontextmanager
async def scripted_server(
    engine: SpeechEngine | None = None, **overrides: Any
) -> AsyncIterator[WhisperwireServer]:
    """A server on a free port with the scripted test-double engine (or ``engine``)."""
    config = ServerConfig(host="127.0.0.1", port=0, **overrides)
    chosen = engine or ScriptedEngine()
    async with WhisperwireServer(lambda: chosen, server=config) as server:
        yield server


# --------------------------------------------------------------------------- recognition


async def test_clips_stream_end_to_end(
    server_url: str, speech_dir: Path, manifest: list[ManifestRow]
) -> None:
    refs, hyps = [], []
    for file in END_TO_END_CLIPS:
        frames = pcm_frames(load_clip(speech_dir / file))
        outcome = await asyncio.wait_for(stream_frames(stream_url(server_url), frames), WAIT_S)
        check_message_shapes(outcome)
        ready = outcome.messages[0]
        assert ready["model"] == "tiny.en" and ready["sample_rate"] == 16000
        assert outcome.of_type("speech_started")
        assert not outcome.of_type("error")
        done = outcome.messages[-1]
        assert done["audio_received_s"] == pytest.approx(len(frames) * 0.1, abs=0.11)
        assert wer(reference(manifest, file), outcome.text) <= MAX_WER_CLIP, outcome.text
        refs.append(reference(manifest, file))
        hyps.append(outcome.text)
    assert wer(refs, hyps) <= MAX_WER_CORPUS


async def test_eight_concurrent_clients_are_batched(
    server_url: str, speech_dir: Path, manifest: list[ManifestRow]
) -> None:
    before = (await http_get(http_url(server_url) + "/metrics"))[2].decode()
    clips = [pcm_frames(load_clip(speech_dir / f)) for f in CONCURRENT_CLIPS]
    outcomes = await asyncio.wait_for(
        asyncio.gather(*(stream_frames(stream_url(server_url), c) for c in clips)), WAIT_S * 2
    )
    refs = [reference(manifest, f) for f in CONCURRENT_CLIPS]
    for file, ref, outcome in zip(CONCURRENT_CLIPS, refs, outcomes, strict=True):
        check_message_shapes(outcome)
        assert not outcome.of_type("error"), (file, outcome.of_type("error"))
        assert wer(ref, outcome.text) <= MAX_WER_CLIP, (file, outcome.text)
    assert wer(refs, [o.text for o in outcomes]) <= MAX_WER_CORPUS
    after = (await http_get(http_url(server_url) + "/metrics"))[2].decode()

    def batched(page: str) -> float:
        # engine calls with more than one window: all calls minus those of size 1
        return metric_value(page, "whisperwire_decode_batch_size_count") - metric_value(
            page, 'whisperwire_decode_batch_size_bucket{le="1"}'
        )

    assert batched(after) > batched(before), "the decode worker never batched two windows"


async def test_shutdown_delivers_finals_and_done(
    engine: Engine, speech_dir: Path, manifest: list[ManifestRow]
) -> None:
    file = "librispeech_test-clean/1089-134686-0000.wav"
    frames = pcm_frames(load_clip(speech_dir / file))
    config = ServerConfig(host="127.0.0.1", port=0, warmup=False)  # the fixture warmed it
    server = WhisperwireServer(lambda: engine, server=config)
    async with server:
        async with connect(stream_url(server.url)) as ws:
            messages: list[dict[str, Any]] = [json.loads(await ws.recv())]
            for frame in frames[:50]:  # 5 s of speech
                await ws.send(frame)
            while messages[-1]["type"] != "speech_started":
                messages.append(json.loads(await asyncio.wait_for(ws.recv(), WAIT_S)))
            shutting_down = asyncio.create_task(server.shutdown())
            with contextlib.suppress(ConnectionClosed):
                for frame in frames[50:]:  # the client streams on; the server finishes
                    await ws.send(frame)
            async for raw in ws:
                messages.append(json.loads(raw))
            close_code = ws.close_code
        await asyncio.wait_for(shutting_down, WAIT_S)
    assert close_code == 1001
    assert messages[-1]["type"] == "done"
    finals = " ".join(m["text"] for m in messages if m["type"] == "final")
    words = normalize(finals).split()
    assert len(words) >= 5, finals
    ref_words = normalize(reference(manifest, file)).split()
    assert wer(" ".join(ref_words[: len(words)]), " ".join(words)) <= MAX_WER_CLIP, finals
    with pytest.raises(OSError):
        await http_get(server.http_url + "/healthz")


# --------------------------------------------------------------------------- protocol errors


async def test_malformed_json_and_unknown_type_are_not_fatal(server_url: str) -> None:
    outcome = await asyncio.wait_for(
        stream_frames(stream_url(server_url), ["{not json", '{"type": "bogus"}']), WAIT_S
    )
    errors = outcome.of_type("error")
    assert [e["code"] for e in errors] == ["protocol_error", "protocol_error"]
    assert "invalid JSON" in errors[0]["message"] and "unknown message type" in errors[1]["message"]
    assert not any(e["fatal"] for e in errors)
    assert outcome.messages[-1]["type"] == "done"  # the session went on to a normal end
    assert outcome.close_code == 1000


async def test_config_after_audio_is_an_error_and_the_session_goes_on(server_url: str) -> None:
    frames: list[bytes | str] = [bytes(3200), '{"type": "config", "sample_rate": 8000}']
    outcome = await asyncio.wait_for(stream_frames(stream_url(server_url), frames), WAIT_S)
    [error] = outcome.of_type("error")
    assert error["code"] == "protocol_error" and not error["fatal"]
    assert "before the first audio" in error["message"]
    assert outcome.messages[-1]["type"] == "done" and outcome.close_code == 1000


async def test_config_first_changes_the_format(server_url: str) -> None:
    frames: list[bytes | str] = ['{"type": "config", "sample_rate": 8000}', bytes(1600)]
    outcome = await asyncio.wait_for(stream_frames(stream_url(server_url), frames), WAIT_S)
    assert not outcome.of_type("error")
    assert outcome.messages[-1]["audio_received_s"] == pytest.approx(0.1)


@pytest.mark.parametrize(
    ("frames", "code", "close_code"),
    [
        pytest.param([b"\x00\x01\x02"], "bad_audio", 1003, id="odd-length-frame"),
        pytest.param([bytes((1 << 20) + 2)], "frame_too_large", 1009, id="oversize-frame"),
    ],
)
async def test_fatal_audio_errors_close_with_their_code(
    server_url: str, frames: list[bytes | str], code: str, close_code: int
) -> None:
    outcome = await asyncio.wait_for(
        stream_frames(stream_url(server_url), frames, end=False), WAIT_S
    )
    [error] = outcome.of_type("error")
    assert error["code"] == code and error["fatal"]
    assert outcome.messages[-1] is error  # fatal: the close comes next
    assert outcome.close_code == close_code


async def test_audio_after_end_closes_with_1008(server_url: str, speech_dir: Path) -> None:
    # Speech first, so the session is still decoding its last window when the audio arrives.
    speech = pcm_frames(load_clip(speech_dir / "librispeech_test-clean/1089-134691-0000.wav"))
    frames: list[bytes | str] = [*speech, '{"type": "end"}', bytes(3200)]
    outcome = await asyncio.wait_for(
        stream_frames(stream_url(server_url), frames, end=False), WAIT_S
    )
    [error] = outcome.of_type("error")
    assert error["code"] == "protocol_error" and error["fatal"]
    assert "after end" in error["message"]
    assert outcome.close_code == 1008


async def test_bad_query_parameters_are_refused(server_url: str) -> None:
    url = stream_url(server_url, sample_rate="5")
    async with connect(url) as ws:
        error = json.loads(await ws.recv())
        with pytest.raises(ConnectionClosed):
            await ws.recv()
    assert error["type"] == "error" and error["fatal"] and "sample_rate" in error["message"]
    assert ws.close_code == 1008


async def test_query_parameters_configure_the_session(server_url: str) -> None:
    url = stream_url(server_url, sample_rate="48000", encoding="pcm_f32le", language="en")
    async with connect(url) as ws:
        ready = json.loads(await ws.recv())
    assert (ready["sample_rate"], ready["encoding"], ready["language"]) == (
        48000,
        "pcm_f32le",
        "en",
    )


# --------------------------------------------------------------------------- HTTP


async def test_http_routes(server_url: str) -> None:
    base = http_url(server_url)
    status, _, body = await http_get(base + "/healthz")
    assert status == 200
    status, _, body = await http_get(base + "/readyz")
    assert (status, body) == (200, b"ready\n")
    status, headers, body = await http_get(base + "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain; version=0.0.4")
    page = body.decode()
    for name in (
        "whisperwire_sessions_active",
        "whisperwire_sessions_total",
        "whisperwire_sessions_refused_total",
        "whisperwire_audio_received_seconds_total",
        "whisperwire_decode_latency_seconds_bucket",
        "whisperwire_decode_batch_size_bucket",
        "whisperwire_decode_queue_depth",
        "whisperwire_decode_realtime_factor",
        "whisperwire_errors_total",
    ):
        assert f"\n{name}" in page or f"# TYPE {name}" in page, name
    assert metric_value(page, "whisperwire_ready") == 1
    status, headers, body = await http_get(base + "/")
    assert status == 200 and headers["content-type"] == "text/html; charset=utf-8"
    assert b"<script" in body
    # The page loads its scripts by relative name; both spellings are served.
    for path in ("/app.js", "/audio-worklet.js", "/static/app.js"):
        status, headers, body = await http_get(base + path)
        assert status == 200 and headers["content-type"].startswith("text/javascript"), path
    for path in ("/nope", "/static/../server/app.py", "/.git/config"):
        status, _, _ = await http_get(base + path)
        assert status == 404, path


async def test_readyz_is_503_until_the_model_is_warm() -> None:
    release = threading.Event()
    engine = ScriptedEngine()

    def slow_load() -> SpeechEngine:
        release.wait(WAIT_S)  # runs on the decode thread, like a real model load
        return engine

    config = ServerConfig(host="127.0.0.1", port=0)
    server = WhisperwireServer(slow_load, server=config)
    await server.start()
    try:
        status, _, _ = await http_get(server.http_url + "/readyz")
        assert status == 503
        with pytest.raises(InvalidStatus) as refused:
            async with connect(stream_url(server.url)):
                pass
        assert refused.value.response.status_code == 503
        release.set()
        await asyncio.wait_for(server.wait_ready(), WAIT_S)
        assert engine.warmups == 1
        status, _, _ = await http_get(server.http_url + "/readyz")
        assert status == 200
    finally:
        release.set()
        await server.shutdown()


async def test_a_model_that_cannot_load_is_reported() -> None:
    def no_model() -> SpeechEngine:
        raise ModelNotFoundError("model 'nosuch' not found; tried: nothing")

    server = WhisperwireServer(no_model, server=ServerConfig(host="127.0.0.1", port=0))
    with pytest.raises(ModelNotFoundError):
        async with server:
            pass


async def test_cli_exits_2_with_one_line_when_the_model_cannot_load() -> None:
    # A subprocess, because the CLI owns the process: its logging setup, signals, event loop.
    # (async only to share the module's event-loop mark; the wait runs off the loop)
    process = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "server.cli", "--model", "nosuch", "--port", "0"),
        cwd=REPO,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    _, err = await asyncio.wait_for(process.communicate(), WAIT_S)
    stderr = err.decode()
    assert process.returncode == 2
    problem = [line for line in stderr.splitlines() if line.startswith("whisperwire-server:")]
    assert len(problem) == 1 and "nosuch" in problem[0] and "--model" in problem[0]
    assert "Traceback" not in stderr


# --------------------------------------------------------------------------- limits, security


async def test_api_key_and_origin_are_checked_at_the_handshake() -> None:
    async with scripted_server(api_key="s3cret", allowed_origins=("https://app.example",)) as srv:
        url = stream_url(srv.url)

        async def status_of(target: str, **kwargs: Any) -> int:
            try:
                async with connect(target, **kwargs) as ws:
                    ready = json.loads(await ws.recv())
                    assert ready["type"] == "ready"
                    return 101
            except InvalidStatus as exc:
                return exc.response.status_code

        bearer = {"Authorization": "Bearer s3cret"}
        assert await status_of(url) == 401
        assert await status_of(url, additional_headers={"Authorization": "Bearer nope"}) == 401
        assert await status_of(stream_url(srv.url, token="nope")) == 401
        assert await status_of(url, additional_headers=bearer) == 101
        assert await status_of(stream_url(srv.url, token="s3cret")) == 101
        evil, good = "https://evil.example", "https://app.example"
        assert await status_of(url, additional_headers=bearer, origin=evil) == 403
        assert await status_of(url, additional_headers=bearer, origin=good) == 101
        own = f"http://127.0.0.1:{srv.port}"  # the page the server serves itself
        assert await status_of(url, additional_headers=bearer, origin=own) == 101
        refused = "whisperwire_sessions_refused_total"
        page = srv.metrics.render()
        assert metric_value(page, refused + '{reason="unauthorized"}') == 3
        assert metric_value(page, refused + '{reason="forbidden_origin"}') == 1


async def test_server_full_is_refused_with_1013() -> None:
    async with scripted_server(max_sessions=1) as srv:
        async with connect(stream_url(srv.url)) as first:
            assert json.loads(await first.recv())["type"] == "ready"
            async with connect(stream_url(srv.url)) as second:
                error = json.loads(await second.recv())
                with pytest.raises(ConnectionClosed):
                    await second.recv()
            assert error["code"] == "server_full" and error["fatal"]
            assert second.close_code == 1013
            await first.send('{"type": "end"}')
            assert json.loads(await first.recv())["type"] == "done"
        page = srv.metrics.render()
        assert metric_value(page, 'whisperwire_sessions_refused_total{reason="server_full"}') == 1


async def test_an_idle_client_is_finished() -> None:
    async with scripted_server(idle_timeout_s=0.3) as srv:
        async with connect(stream_url(srv.url)) as ws:
            messages = [json.loads(raw) async for raw in ws]
        assert [m["type"] for m in messages] == ["ready", "error", "done"]
        assert messages[1]["code"] == "idle_timeout"
        assert ws.close_code == 1000


async def test_a_session_past_its_length_is_finished_with_1013() -> None:
    async with scripted_server(max_session_s=0.3) as srv:
        async with connect(stream_url(srv.url)) as ws:
            messages = []
            with contextlib.suppress(ConnectionClosed):
                async for raw in ws:
                    messages.append(json.loads(raw))
        assert [m["type"] for m in messages] == ["ready", "error", "done"]
        assert messages[1]["code"] == "limit" and messages[1]["fatal"]
        assert ws.close_code == 1013


async def test_a_client_that_never_reads_is_dropped_not_the_server() -> None:
    async with scripted_server(
        max_pending_messages=8, write_limit_bytes=1024, close_timeout_s=0.5
    ) as srv:
        # A small receive buffer (set before connecting, so the window is small from the
        # start) and no reading: the server's messages pile up on its side.
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", srv.port))
        async with connect(stream_url(srv.url), sock=sock, max_queue=1) as ws:
            with contextlib.suppress(ConnectionClosed):
                for _ in range(20_000):  # each one earns an error message it never reads
                    await ws.send("x")
            # Now read: what the server managed to send, then the end of the connection.
            with contextlib.suppress(ConnectionClosed):
                async for _ in ws:
                    pass
        assert ws.close_code in (1006, 1008)
        page = srv.metrics.render()
        assert metric_value(page, 'whisperwire_errors_total{code="slow_client"}') == 1
        # The server is fine and serves the next client.
        outcome = await asyncio.wait_for(stream_frames(stream_url(srv.url), []), WAIT_S)
        assert outcome.messages[-1]["type"] == "done"


async def test_a_client_leaving_mid_decode_harms_no_one(speech_dir: Path) -> None:
    engine = ScriptedEngine()
    speech = pcm_frames(load_clip(speech_dir / "librispeech_test-clean/1089-134691-0000.wav"))
    async with scripted_server(engine) as srv:
        engine.release.clear()  # the worker will hold the first window it gets
        engine.entered.clear()
        async with connect(stream_url(srv.url)) as leaving:
            await leaving.recv()  # ready
            for frame in speech:
                await leaving.send(frame)
            assert await asyncio.to_thread(engine.entered.wait, WAIT_S)
        # Gone while its window is in the engine; the decode then completes for nobody.
        engine.release.set()
        outcome = await asyncio.wait_for(stream_frames(stream_url(srv.url), speech), WAIT_S)
        check_message_shapes(outcome)
        assert outcome.text.startswith("w0 w1")
        assert metric_value(srv.metrics.render(), 'whisperwire_errors_total{code="internal"}') == 0


@pytest.mark.skipif(not Path("/usr/bin/openssl").exists(), reason="needs the openssl command")
async def test_tls(tmp_path: Path) -> None:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            *("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"),
            *("-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"),
            *("-keyout", str(key), "-out", str(cert)),
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    async with scripted_server(tls_cert_path=str(cert), tls_key_path=str(key)) as srv:
        assert srv.url.startswith("wss://")
        context = ssl.create_default_context(cafile=str(cert))
        async with connect(stream_url(srv.url), ssl=context) as ws:
            assert json.loads(await ws.recv())["type"] == "ready"
