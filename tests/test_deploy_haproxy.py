"""``deploy/haproxy/haproxy.cfg`` as shipped, in front of real servers, in a real HAProxy.

Only the addresses are replaced (``tests/instances.haproxy_config``). The quick tests run
in-process servers with the scripted engine: what reaches an instance through HAProxy (API
key, Origin, query), and which instance a new session lands on while one drains or warms
up. The slow one runs two real ``whisperwire-server`` processes with tiny.en on real speech:
sessions spread by leastconn, SIGTERM on an instance mid-stream (it drains: its session
finishes with every final and ``done``, new sessions go to the other), a restarted instance
that gets nothing while it warms up, and a session finished by a drain that ends (1001)
resumed by the client on the other instance. The browser page, served through HAProxy, does
the same in real headless Chromium (``tests/test_web_page.py`` drives it).

Admission (#32): a full instance's 503 is replayed by HAProxy on the other, and a client sees
a 503 with ``Retry-After`` only when every instance is full (scripted engines, capacities
pinned); as many sessions as two fresh real instances with the capacity estimate on say they
carry (four on our CPUs), opened at once, are all served.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import signal
import subprocess
import threading
import time
import wave
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import jiwer
import numpy as np
import pytest
from playwright.async_api import async_playwright
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus
from websockets.http11 import Response

from bench.corpus import ManifestRow, load_clip, normalize, read_manifest, wer
from bench.http_probe import http_get, metric_value
from client.reconnect import SEAM_WORDS, RetryPolicy, stream_with_reconnect
from client.sources import FileSource
from client.stream import ConnectError, StreamResult, stream_audio
from client.timeline import RESUME_BEFORE_SEAM_S
from server.config import ServerConfig
from server.protocol.formats import SAMPLE_RATE_HZ
from server.serve.app import WhisperwireServer
from tests.helpers import ScriptedEngine, pcm_frames, stream_frames
from tests.instances import (
    HAPROXY_CFG,
    Haproxy,
    ServerInstance,
    free_port,
    haproxy_binary,
    haproxy_config,
    wait_until,
)
from tests.test_web_page import (
    CHROMIUM,
    FINAL_TEXT_JS,
    STATE_WAIT_MS,
    WORDS_WAIT_MS,
    check_page_seams,
    check_resumed_at_seam_words,
    launch,
    seams_lined_up,
)
from tests.test_web_page import wait_until as wait_on_page

on_session_loop = pytest.mark.asyncio(loop_scope="session")

API_KEY = "deploy-test-key"
SESSIONS = "whisperwire_sessions_total"
ACTIVE = "whisperwire_sessions_active"
REFUSED = "whisperwire_sessions_refused_total"
CAPACITY = "whisperwire_capacity_streams"
MAX_WER_CLIP = 0.35  # as in test_app: one short clip streamed, a word or two wrong
# The four clips of the spread check, 4 to 11 s each; all different, so a mix-up shows.
SPREAD_CLIPS = (
    "misc_en/jfk.wav",
    "librispeech_test-clean/1089-134686-0000.wav",
    "ljspeech/LJ001-0014.wav",
    "librispeech_test-clean/1089-134691-0001.wav",
)
DRAIN_CLIP = "librispeech_dev-clean/2412-153948-0000.wav"  # 11.7 s: SIGTERM 4 s in
RESUME_CLIPS = ("ljspeech/LJ001-0001.wav", "ljspeech/LJ001-0003.wav")  # joined: 20 s
DRAIN_S = 30  # the real instances' --drain-s: longer than what DRAIN_CLIP has left
SHORT_DRAIN_S = 2  # the restarted instance's: shorter than what the resumed stream has left
PAGE_CLIP = "ljspeech/long/LJ001-0001_to_0032.concat.wav"  # 222 s: never loops within the test
MIN_HIT_RATIO = 0.8  # words on the page found, in order, in the clip's reference
SURVIVOR_WORDS = 15  # final words awaited from the instance the page resumed on
# One lane each: two instances share this machine's two cores. The capacity estimate
# of one lane is under three streams; these tests transcripts and draining, not admission.
SPREAD_STAGGER_S = 0.25  # between the spread clients' connections
REAL_INSTANCE_ARGS = (
    *("--model", "tiny.en", "--api-key", API_KEY, "--log-level", "info"),
    *("--decode-lanes", "1", "--no-capacity-limit", "--max-sessions", "8"),
)


# --------------------------------------------------------------------------- the file itself


def shipped() -> str:
    return HAPROXY_CFG.read_text()


def directives(section: str) -> list[str]:
    """The lines of one section (``backend whisperwire``), stripped, comments dropped."""
    lines: list[str] = []
    inside = False
    for line in shipped().splitlines():
        if line and not line[0].isspace() and not line.startswith("#"):
            inside = line.strip() == section
            continue
        text = line.split("#", 1)[0].strip()
        if inside and text:
            lines.append(text)
    return lines


def seconds(value: str) -> float:
    """An HAProxy time (``30s``, ``1h``, ``500ms``; bare numbers are milliseconds)."""
    number, unit = re.fullmatch(r"(\d+)(us|ms|s|m|h|d)?", value).groups()  # type: ignore[union-attr]
    scale = {"us": 1e-6, "ms": 1e-3, "s": 1, "m": 60, "h": 3600, "d": 86400, None: 1e-3}
    return int(number) * scale[unit]


def test_the_shipped_file_and_the_tested_one_pass_haproxys_check(tmp_path: Path) -> None:
    binary = haproxy_binary()
    rendered = tmp_path / "haproxy.cfg"
    rendered.write_text(
        haproxy_config(shipped(), frontend_port=18765, stats_port=18404, servers=[1, 2, 3])
    )
    for path in (HAPROXY_CFG, rendered):
        check = subprocess.run(
            [binary, "-c", "-f", str(path)], capture_output=True, text=True, timeout=30
        )
        assert check.returncode == 0, check.stdout + check.stderr


def test_the_tested_file_differs_from_the_shipped_one_only_in_addresses() -> None:
    rendered = haproxy_config(shipped(), frontend_port=1, stats_port=2, servers=[3, 4, 5])
    kept = [line for line in shipped().splitlines() if not re.match(r"\s+(bind|server) ", line)]
    assert [
        line for line in rendered.splitlines() if not re.match(r"\s+(bind|server) ", line)
    ] == kept
    assert re.findall(r"(?m)^\s+server (\S+) (\S+)$", rendered) == [
        ("ww1", "127.0.0.1:3"),
        ("ww2", "127.0.0.1:4"),
        ("ww3", "127.0.0.1:5"),
    ]
    assert "bind 127.0.0.1:1" in rendered and "bind 127.0.0.1:2" in rendered


def test_the_config_holds_what_long_lived_sessions_need() -> None:
    backend = directives("backend whisperwire")
    defaults = directives("defaults")
    assert "balance leastconn" in backend
    assert "option httpchk GET /readyz HTTP/1.1" in backend
    assert "http-check expect status 200" in backend
    for sticky in ("stick", "cookie", "balance source", "hash-type"):
        assert not any(line.startswith(sticky) for line in backend + defaults), sticky
    # A session must outlive an instance turning not-ready (full, draining).
    assert not any("shutdown-sessions" in line for line in backend + defaults)
    server = ServerConfig()
    assert server.ping_interval_s is not None and server.ping_timeout_s is not None
    tunnel_s = seconds(
        next(line.split()[2] for line in defaults if line.startswith("timeout tunnel"))
    )
    quiet_s = max(server.idle_timeout_s, server.ping_interval_s + server.ping_timeout_s)
    assert tunnel_s > quiet_s  # the longest a healthy session goes without a frame
    retry = next(line for line in defaults if line.startswith("retry-on"))
    assert "503" in retry.split() and not {"401", "403"} & set(retry.split())
    assert "option redispatch 1" in defaults


# --------------------------------------------------------------------------- in-process servers


@dataclass
class Balanced:
    """HAProxy from the shipped config in front of ``servers``."""

    haproxy: Haproxy
    port: int

    @property
    def stream_url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/v1/stream"

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@contextlib.asynccontextmanager
async def haproxy_in_front(ports: list[int], tmp_path: Path) -> AsyncIterator[Balanced]:
    haproxy_binary()
    frontend, stats = free_port(), free_port()
    config = tmp_path / "haproxy.cfg"
    config.write_text(
        haproxy_config(shipped(), frontend_port=frontend, stats_port=stats, servers=ports)
    )
    haproxy = Haproxy(config, tmp_path / "haproxy.log", stats)
    try:
        await haproxy.start()
        yield Balanced(haproxy, frontend)
    finally:
        await haproxy.stop()


@contextlib.asynccontextmanager
async def two_scripted_behind_haproxy(
    config: ServerConfig, tmp_path: Path
) -> AsyncIterator[tuple[WhisperwireServer, WhisperwireServer, Balanced]]:
    """Two in-process servers with the stand-in engine behind HAProxy, both checked up."""
    async with (
        WhisperwireServer(ScriptedEngine, server=config) as one,
        WhisperwireServer(ScriptedEngine, server=config) as two,
        haproxy_in_front([one.port, two.port], tmp_path) as lb,
    ):
        await lb.haproxy.wait_for("ww1", "UP")
        await lb.haproxy.wait_for("ww2", "UP")
        yield one, two, lb


def scripted_config(**overrides: object) -> ServerConfig:
    return ServerConfig(host="127.0.0.1", port=0, warmup=False, **overrides)  # type: ignore[arg-type]


def sessions_of(server: WhisperwireServer) -> float:
    return server.metrics.sessions_total.value()


@on_session_loop
async def test_authorization_origin_and_query_reach_the_instances(
    speech_dir: Path, tmp_path: Path
) -> None:
    frames = pcm_frames(load_clip(speech_dir / "ljspeech/LJ001-0004.wav"))
    config = scripted_config(api_key=API_KEY, allowed_origins=("https://app.example",))
    async with two_scripted_behind_haproxy(config, tmp_path) as (one, two, lb):
        bearer = {"Authorization": f"Bearer {API_KEY}"}
        outcome = await stream_frames(lb.stream_url, frames, additional_headers=bearer)
        assert outcome.messages[-1]["type"] == "done" and outcome.close_code == 1000
        # The query string: the token in it, and the session's format set by it.
        url = f"{lb.stream_url}?token={API_KEY}&sample_rate=8000&encoding=pcm_s16le"
        async with connect(url) as ws:
            ready = json.loads(await ws.recv())
        assert (ready["type"], ready["sample_rate"]) == ("ready", 8000)
        # The Origin header: the page's own origin through the balancer, a listed one, and
        # one that is refused (403: never retried on the other instance).
        for origin in (lb.http_url, "https://app.example"):
            async with connect(lb.stream_url, additional_headers={**bearer, "Origin": origin}):
                pass
        with pytest.raises(InvalidStatus) as forbidden:
            async with connect(
                lb.stream_url, additional_headers={**bearer, "Origin": "https://evil.example"}
            ):
                pass
        with pytest.raises(InvalidStatus) as unauthorized:
            async with connect(lb.stream_url):
                pass
        assert forbidden.value.response.status_code == 403
        assert unauthorized.value.response.status_code == 401
        # Each instance is scraped on its own address; the balancer keeps /metrics to itself.
        assert (await http_get(lb.http_url + "/metrics"))[0] == 404
        assert (await http_get(lb.http_url + "/readyz"))[0] == 200
        refused = [
            (
                s.metrics.sessions_refused.value("forbidden_origin"),
                s.metrics.sessions_refused.value("unauthorized"),
            )
            for s in (one, two)
        ]
        assert sessions_of(one) + sessions_of(two) == 4
    assert [sum(r) for r in zip(*refused, strict=True)] == [1, 1]  # each refused once, by one


@on_session_loop
async def test_a_draining_instance_gets_no_new_session_even_before_the_checks_see_it(
    tmp_path: Path,
) -> None:
    """Right after an instance starts draining HAProxy still thinks it is up; the handshakes
    it answers with 503 are sent on to the other instance (retry-on 503, redispatch)."""
    config = scripted_config(drain_s=60.0)
    async with two_scripted_behind_haproxy(config, tmp_path) as (draining, other, lb):
        async with connect(draining.url + "/v1/stream") as held:  # keeps the drain open
            await held.recv()
            drain = asyncio.create_task(draining.drain())
            await asyncio.sleep(0)  # the drain has begun: it set the flag before awaiting
            assert (await http_get(draining.http_url + "/readyz"))[2] == b"not ready: draining\n"
            unseen = (await lb.haproxy.states())["ww1"] == "UP"
            for _ in range(6):
                async with connect(lb.stream_url) as ws:
                    assert json.loads(await ws.recv())["type"] == "ready"
            if unseen and (await lb.haproxy.states())["ww1"] == "UP":
                # leastconn sent some of the six to it; it said 503 and HAProxy went on.
                assert draining.metrics.sessions_refused.value("draining") >= 1
            assert sessions_of(draining) == 1  # only the held session, made directly
            assert sessions_of(other) == 6
            await held.send('{"type": "end"}')
            async for _ in held:
                pass
            assert held.close_code == 1000  # served to its end while draining
        assert await asyncio.wait_for(drain, 10.0) < 10.0  # ended with its last session
        await lb.haproxy.wait_for("ww1", "DOWN")


@on_session_loop
async def test_an_instance_that_is_warming_up_gets_no_session(tmp_path: Path) -> None:
    release = threading.Event()

    def slow_load() -> ScriptedEngine:
        release.wait(60.0)  # the decode thread, loading a model
        return ScriptedEngine()

    warming = WhisperwireServer(slow_load, server=scripted_config())
    await warming.start()
    try:
        async with (
            WhisperwireServer(ScriptedEngine, server=scripted_config()) as ready,
            haproxy_in_front([warming.port, ready.port], tmp_path) as lb,
        ):
            for _ in range(4):
                async with connect(lb.stream_url) as ws:
                    assert json.loads(await ws.recv())["type"] == "ready"
            await lb.haproxy.wait_for("ww1", "DOWN")
            assert sessions_of(ready) == 4
            assert warming.metrics.sessions_total.value() == 0
            release.set()
            await warming.wait_ready()
            await lb.haproxy.wait_for("ww1", "UP")
            async with connect(lb.stream_url) as a, connect(lb.stream_url) as b:
                await a.recv()
                await b.recv()
                assert sessions_of(warming) == 1  # leastconn: one each, now that it is up
    finally:
        release.set()
        await warming.shutdown()


@contextlib.asynccontextmanager
async def opened_at_once(url: str, count: int) -> AsyncIterator[list[object]]:
    """``count`` handshakes at the same moment; yields once each has its answer, with the
    sessions served still open, and closes them on exit. Each outcome is ``"ready"`` or
    the refused handshake's ``Response``."""
    outcomes: list[object] = []
    answered, close = asyncio.Event(), asyncio.Event()

    def outcome(what: object) -> None:
        outcomes.append(what)
        if len(outcomes) == count:
            answered.set()

    async def one() -> None:
        try:
            async with connect(url) as ws:
                outcome(json.loads(await ws.recv())["type"])
                await close.wait()
        except InvalidStatus as refused:
            outcome(refused.response)

    clients = asyncio.gather(*(one() for _ in range(count)))
    try:
        await asyncio.wait_for(answered.wait(), 30)
        yield outcomes
    finally:
        close.set()
        await clients


@on_session_loop
async def test_a_full_instance_s_503_is_replayed_on_the_other_and_no_client_sees_it(
    tmp_path: Path,
) -> None:
    """Four handshakes at once, two to each instance (leastconn); one instance carries one
    stream (``--capacity 1``): it refuses its second with 503, and HAProxy replays that
    handshake on the other instance (``retry-on 503``, ``option redispatch 1``)."""
    async with (
        WhisperwireServer(ScriptedEngine, server=scripted_config(capacity_streams=1)) as small,
        WhisperwireServer(ScriptedEngine, server=scripted_config(capacity_streams=3)) as big,
        haproxy_in_front([small.port, big.port], tmp_path) as lb,
    ):
        await lb.haproxy.wait_for("ww1", "UP")
        await lb.haproxy.wait_for("ww2", "UP")
        async with opened_at_once(lb.stream_url, 4) as outcomes:
            assert outcomes == ["ready"] * 4
        assert (sessions_of(small), sessions_of(big)) == (1, 3)


@on_session_loop
async def test_when_every_instance_is_full_the_client_gets_503_with_retry_after(
    tmp_path: Path,
) -> None:
    """Two instances of one stream each, four handshakes at once: two are served; the other
    two get 503 with the instances' Retry-After once HAProxy's retries ran out. Once the
    checks have taken both out of rotation HAProxy answers 503 itself, with the same hint,
    to a stream and to ``/readyz``: what the CLI and the page wait out."""
    retry_after = str(ServerConfig().retry_after_s)
    config = scripted_config(capacity_streams=1)
    async with (
        WhisperwireServer(ScriptedEngine, server=config) as one,
        WhisperwireServer(ScriptedEngine, server=config) as two,
        haproxy_in_front([one.port, two.port], tmp_path) as lb,
    ):
        await lb.haproxy.wait_for("ww1", "UP")
        await lb.haproxy.wait_for("ww2", "UP")
        async with opened_at_once(lb.stream_url, 4) as outcomes:
            await lb.haproxy.wait_for("ww1", "DOWN")
            await lb.haproxy.wait_for("ww2", "DOWN")
            with pytest.raises(InvalidStatus) as no_instance:
                async with connect(lb.stream_url):
                    pass
            readyz = await http_get(lb.http_url + "/readyz")
    assert outcomes.count("ready") == 2, outcomes
    for refused in outcomes:
        if refused != "ready":
            assert isinstance(refused, Response), refused
            assert (refused.status_code, refused.headers.get("Retry-After")) == (503, retry_after)
            assert refused.body.startswith(b"the server carries 1 real-time stream(s)")
    # The balancer's own 503, with the hint added by the shipped config.
    assert no_instance.value.response.status_code == 503
    assert no_instance.value.response.headers.get("Retry-After") == retry_after
    assert b"No server is available" in no_instance.value.response.body
    assert (readyz[0], readyz[1].get("retry-after")) == (503, retry_after)


# --------------------------------------------------------------------------- real instances


def joined_clip(speech_dir: Path, files: tuple[str, ...], out: Path, pause_s: float = 1.0) -> Path:
    """The clips one after the other with ``pause_s`` of silence between, as one WAV."""
    silence = np.zeros(int(pause_s * SAMPLE_RATE_HZ), dtype=np.float32)
    parts: list[np.ndarray] = []
    for file in files:
        parts += [load_clip(speech_dir / file), silence]
    audio = np.concatenate(parts[:-1])
    with wave.open(str(out), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(SAMPLE_RATE_HZ)
        w.writeframes((np.clip(audio, -1, 32767 / 32768) * 32768).astype("<i2").tobytes())
    return out


def reference(manifest: list[ManifestRow], *files: str) -> str:
    return " ".join(next(r.transcript for r in manifest if r.file == f) for f in files)


def clip_s(speech_dir: Path, file: str) -> float:
    return float(load_clip(speech_dir / file).shape[0]) / SAMPLE_RATE_HZ


def check_complete(result: StreamResult, sent_s: float) -> None:
    """``done`` accounts for all the audio, and all its speech reached the finals."""
    done = result.done
    assert done.audio_received_s == pytest.approx(sent_s, abs=0.11), done
    assert done.transcribed_s == pytest.approx(done.speech_s, abs=0.003), done
    assert done.failed_s == 0, done


async def instance_metric(instance: ServerInstance, sample: str) -> float:
    status, page = await instance.get("/metrics")
    assert status == 200
    return metric_value(page, sample)


async def sessions_total(instance: ServerInstance) -> float:
    return await instance_metric(instance, SESSIONS)


def when_audio_reached(seconds_in: float) -> tuple[asyncio.Event, Callable[[object], None]]:
    """An event set once a message says the server has ``seconds_in`` of audio."""
    reached = asyncio.Event()

    def on_message(message: object) -> None:
        if getattr(message, "audio_received_s", 0.0) >= seconds_in:
            reached.set()

    return reached, on_message


async def hold_a_session(url: str, opened: asyncio.Event, stop: asyncio.Event) -> None:
    """One session that stays open, sending 0.1 s of silence a second, until ``stop``."""
    silence = bytes(int(0.1 * SAMPLE_RATE_HZ) * 2)
    async with connect(url) as ws:
        assert json.loads(await ws.recv())["type"] == "ready"
        opened.set()
        while not stop.is_set():
            await ws.send(silence)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), 1.0)
        await ws.send('{"type": "end"}')
        async for _ in ws:
            pass


async def stop_all(instances: list[ServerInstance]) -> None:
    """End what still runs of ``instances`` (a test that failed midway) and read their logs."""
    for instance in instances:
        if instance.process is not None and instance.process.returncode is None:
            instance.signal(signal.SIGINT)  # finish at once, no drain
            with contextlib.suppress(asyncio.TimeoutError):
                await instance.wait_exit(30)
        await instance.stop()


async def exited_at(instance: ServerInstance) -> float:
    """When ``instance`` exited (``time.monotonic``), after checking it exited with 0."""
    code = await instance.wait_exit()
    assert code == 0, instance.log_tail()
    return time.monotonic()


@pytest.mark.slow
@on_session_loop
async def test_two_real_instances_behind_haproxy_drain_without_losing_a_word(
    speech_dir: Path, manifest: list[ManifestRow], tmp_path: Path
) -> None:
    haproxy_binary()
    ports = [free_port(), free_port()]
    common = list(REAL_INSTANCE_ARGS)
    instances = [
        ServerInstance(
            f"ww{i}", port, [*common, "--drain-s", str(DRAIN_S)], tmp_path / f"ww{i}.log"
        )
        for i, port in enumerate(ports, 1)
    ]
    figures: dict[str, object] = {}
    lb: Balanced | None = None
    try:
        await asyncio.gather(*(i.start() for i in instances))
        await asyncio.gather(*(i.wait_ready() for i in instances))
        figures["ready_after_s"] = [round(i.ready_after_s, 1) for i in instances]
        async with haproxy_in_front(ports, tmp_path) as lb:
            await lb.haproxy.wait_for("ww1", "UP")
            await lb.haproxy.wait_for("ww2", "UP")

            # -- four sessions spread by leastconn, two on each instance ---------------------
            before = [await sessions_total(i) for i in instances]

            async def spread_client(k: int, file: str) -> StreamResult:
                source = FileSource(speech_dir / file)
                # leastconn counts the connections a server has open: four handshakes in the
                # same instant can each see the other server's count before any is open (3 to
                # 1). A quarter second apart, each sees the ones before it.
                await asyncio.sleep(k * SPREAD_STAGGER_S)
                if k == 0:  # the key in the query string instead of the header
                    url = f"{lb.stream_url}?token={API_KEY}&language=en"
                    return await stream_audio(url, source, pace=1.0)
                return await stream_audio(lb.stream_url, source, pace=1.0, token=API_KEY)

            started = time.monotonic()
            results = await asyncio.wait_for(
                asyncio.gather(*(spread_client(k, f) for k, f in enumerate(SPREAD_CLIPS))), 240
            )
            figures["four_sessions_wall_s"] = round(time.monotonic() - started, 1)
            after = [await sessions_total(i) for i in instances]
            per_instance = [int(a - b) for a, b in zip(after, before, strict=True)]
            figures["sessions_per_instance"] = per_instance
            assert per_instance == [2, 2]
            for file, result in zip(SPREAD_CLIPS, results, strict=True):
                check_complete(result, clip_s(speech_dir, file))
                assert wer(reference(manifest, file), result.text) <= MAX_WER_CLIP, (
                    file,
                    result.text,
                )
            with pytest.raises(ConnectError) as refused:
                await stream_audio(lb.stream_url, FileSource(speech_dir / SPREAD_CLIPS[0]), pace=0)
            assert refused.value.status == 401  # no key: refused by the instance, not retried

            # -- SIGTERM mid-stream: the instance drains ----------------------------------
            direct = await stream_audio(
                instances[1].stream_url,
                FileSource(speech_dir / DRAIN_CLIP),
                pace=1.0,
                token=API_KEY,
            )
            reached, on_message = when_audio_reached(4.0)
            counts = [await sessions_total(i) for i in instances]
            drained_stream = asyncio.create_task(
                stream_with_reconnect(
                    lb.stream_url,
                    FileSource(speech_dir / DRAIN_CLIP),
                    pace=1.0,
                    token=API_KEY,
                    on_message=on_message,
                )
            )
            await asyncio.wait_for(reached.wait(), 60)
            now = [await sessions_total(i) for i in instances]
            (d,) = [k for k in (0, 1) if now[k] > counts[k]]
            draining, other = instances[d], instances[1 - d]
            sigterm_at = time.monotonic()
            draining.signal(signal.SIGTERM)
            draining_exit = asyncio.create_task(exited_at(draining))

            async def says_draining() -> bool:
                return await draining.get("/readyz") == (503, "not ready: draining\n")

            await wait_until(
                f"{draining.name} /readyz to say draining", says_draining, timeout_s=10
            )
            figures["readyz_503_after_sigterm_s"] = round(time.monotonic() - sigterm_at, 2)
            newcomers = [
                await stream_audio(
                    lb.stream_url,
                    FileSource(speech_dir / "ljspeech/LJ001-0004.wav"),
                    pace=0,
                    token=API_KEY,
                )
                for _ in range(2)
            ]
            assert all(r.done.audio_received_s > 0 for r in newcomers)
            await lb.haproxy.wait_for(draining.name, "DOWN", timeout_s=10)
            drained = await asyncio.wait_for(drained_stream, 120)
            figures["drain_sigterm_to_exit_s"] = round(await draining_exit - sigterm_at, 1)
            assert await sessions_total(other) == now[1 - d] + 2  # the newcomers
            assert len(drained.sessions) == 1  # served to its end on the draining instance
            check_complete(drained.result, clip_s(speech_dir, DRAIN_CLIP))
            assert wer(reference(manifest, DRAIN_CLIP), drained.text) <= MAX_WER_CLIP, drained.text
            figures["drained_vs_direct_wer"] = round(wer(direct.text, drained.text), 3)
            assert wer(direct.text, drained.text) <= 0.15, (direct.text, drained.text)
            aligned = jiwer.process_words(normalize(direct.text), normalize(drained.text))
            assert aligned.deletions == 0, (direct.text, drained.text)  # no word lost
            log = draining.log_path.read_text()
            assert "drained: every session ended" in log and "Traceback" not in log
            assert figures["drain_sigterm_to_exit_s"] < DRAIN_S  # type: ignore[operator]

            # -- restarted: no session while it warms up ----------------------------------
            restarted = ServerInstance(
                draining.name,
                draining.port,
                [*common, "--drain-s", str(SHORT_DRAIN_S)],
                tmp_path / f"{draining.name}-restarted.log",
            )
            instances[d] = restarted
            await restarted.start()
            held, stop_holding = asyncio.Event(), asyncio.Event()
            other_before = await sessions_total(other)
            holder = asyncio.create_task(
                hold_a_session(f"{lb.stream_url}?token={API_KEY}", held, stop_holding)
            )
            await asyncio.wait_for(held.wait(), 30)
            with contextlib.suppress(ConnectionRefusedError):  # not even listening yet
                assert (await restarted.get("/readyz"))[0] == 503  # still warming up
            assert await sessions_total(other) == other_before + 1  # the held session
            await restarted.wait_ready()
            await lb.haproxy.wait_for(restarted.name, "UP", timeout_s=30)
            assert await sessions_total(restarted) == 0

            # -- a drain shorter than the session: finished (1001), resumed on the other ----
            joined = joined_clip(speech_dir, RESUME_CLIPS, tmp_path / "joined.wav")
            joined_s = float(load_clip(joined).shape[0]) / SAMPLE_RATE_HZ
            reached, on_message = when_audio_reached(5.0)
            reconnects: list[str] = []
            resumed_stream = asyncio.create_task(
                stream_with_reconnect(
                    lb.stream_url,
                    FileSource(joined),
                    pace=1.0,
                    token=API_KEY,
                    on_message=on_message,
                    on_reconnect=lambda why, _delay: reconnects.append(why),
                    retry=RetryPolicy(backoff_first_s=0.2),
                )
            )
            await asyncio.wait_for(reached.wait(), 60)
            assert await sessions_total(restarted) == 1  # leastconn: the other holds one
            other_before = await sessions_total(other)
            sigterm_at = time.monotonic()
            restarted.signal(signal.SIGTERM)
            restarted_exit = asyncio.create_task(exited_at(restarted))
            resumed = await asyncio.wait_for(resumed_stream, 120)
            exit_s = await restarted_exit - sigterm_at
            figures["short_drain_sigterm_to_exit_s"] = round(exit_s, 1)
            assert exit_s < SHORT_DRAIN_S + ServerConfig().shutdown_timeout_s
            assert f"drained for {SHORT_DRAIN_S} s; 1 session(s) still open" in (
                restarted.log_path.read_text()
            )
            stop_holding.set()
            await asyncio.wait_for(holder, 60)
            assert len(resumed.sessions) == 2 and len(reconnects) == 1, reconnects
            assert await sessions_total(other) == other_before + 1  # the reconnect landed there
            first, second = resumed.sessions
            cut_s = first.done.audio_received_s
            # The second session goes on from just before the first one's last final words.
            seam = [w for f in first.finals for w in f.words][-SEAM_WORDS:]
            resume_s = seam[0].start - RESUME_BEFORE_SEAM_S
            figures["cut_at_s"] = round(cut_s, 2)
            figures["resumed_from_s"] = round(resume_s, 2)
            assert 5.0 <= cut_s < joined_s - 2.0  # finished mid-stream, by the drain's end
            assert cut_s - 3.0 < resume_s <= cut_s
            check_complete(first, cut_s)
            check_complete(second, joined_s - resume_s)
            assert resumed.result.done.audio_received_s == pytest.approx(joined_s, abs=0.11)
            finals = resumed.result.finals
            assert [f.segment_id for f in finals] == list(range(len(finals)))
            assert all(f.start >= resume_s - 0.01 for f in finals[len(first.finals) :])
            ref = reference(manifest, *RESUME_CLIPS)
            assert wer(ref, resumed.text) <= MAX_WER_CLIP, resumed.text
            figures["resumed_wer"] = round(wer(ref, resumed.text), 3)
            figures["resumed_text"] = resumed.text
            # Nothing lost at the seam: the words cut there are heard whole by the second
            # session (tiny.en drops none of these two clips' words streamed directly).
            aligned = jiwer.process_words(normalize(ref), normalize(resumed.text))
            assert aligned.deletions == 0, (resumed.text, [r.text for r in resumed.sessions])
    finally:
        await stop_all(instances)
        artifacts = Path(__file__).parent / "artifacts"
        artifacts.mkdir(exist_ok=True)
        (artifacts / "deploy-haproxy.json").write_text(json.dumps(figures, indent=1) + "\n")


# Two fresh instances as deploy/README.md runs them on one 2-core host (one lane each, the
# admission on its defaults: the capacity estimate and --max-sessions).
ADMISSION_INSTANCE_ARGS = (
    *("--model", "tiny.en", "--api-key", API_KEY, "--log-level", "info"),
    *("--decode-lanes", "1"),
)
BURST_CLIPS = SPREAD_CLIPS  # 4 to 11 s each, all different


async def all_at_once(
    lb: Balanced, speech_dir: Path, pace: float, files: Sequence[str]
) -> list[StreamResult]:
    """``files`` opened through HAProxy at the same moment, each its own v1 session, without
    the client's retries: a refusal is an error here, not a wait."""

    async def one(file: str) -> StreamResult:
        source = FileSource(speech_dir / file)
        return await stream_audio(lb.stream_url, source, pace=pace, token=API_KEY)

    outcomes = await asyncio.wait_for(
        asyncio.gather(*(one(f) for f in files), return_exceptions=True), 240
    )
    refused = [repr(o) for o in outcomes if isinstance(o, BaseException)]
    assert not refused, refused
    return [o for o in outcomes if isinstance(o, StreamResult)]


@pytest.mark.slow
@on_session_loop
async def test_as_many_sessions_at_once_as_two_fresh_instances_carry_are_all_served(
    speech_dir: Path, manifest: list[ManifestRow], tmp_path: Path
) -> None:
    """#32: two fresh instances with the admission on, and as many v1 sessions as they say
    they carry together (up to four: each one-lane instance says four on our CPUs since the
    admission budget passed the hop, two before, one on a machine three times slower) opened
    at once
    through the shipped HAProxy config, first as fast as they go (the burst that used to take
    the estimate down), then in real time: none refused, each transcribes its own clip. What
    a machine carries is bench-capacity's to measure; this holds the balancer and the
    admission to what the instances announce.

    The instances start one after the other: on these two cores, two startup calibrations
    at the same moment time each other (a 4 s window 0.37-0.51 s on CPU time, against
    0.21-0.25 s alone), and each one-lane instance then holds one stream for its life where
    it carries two (deploy/README.md says so for operators)."""
    haproxy_binary()
    ports = [free_port(), free_port()]
    instances = [
        ServerInstance(f"ww{i}", port, list(ADMISSION_INSTANCE_ARGS), tmp_path / f"ww{i}.log")
        for i, port in enumerate(ports, 1)
    ]
    figures: dict[str, object] = {}
    try:
        for instance in instances:
            await instance.start()
            await instance.wait_ready()
        carried = [int(await instance_metric(i, CAPACITY)) for i in instances]
        figures["capacity_streams"] = carried
        assert min(carried) >= 1, carried
        files = BURST_CLIPS[: min(len(BURST_CLIPS), sum(carried))]
        async with haproxy_in_front(ports, tmp_path) as lb:
            for pace, name in ((0.0, "burst"), (1.0, "real_time")):
                await lb.haproxy.wait_for("ww1", "UP")
                await lb.haproxy.wait_for("ww2", "UP")
                figures[f"{name}_readyz"] = [(await i.get("/readyz"))[1] for i in instances]
                before = [await sessions_total(i) for i in instances]
                results = await all_at_once(lb, speech_dir, pace, files)
                after = [await sessions_total(i) for i in instances]
                figures[f"{name}_sessions_per_instance"] = [
                    int(a - b) for a, b in zip(after, before, strict=True)
                ]
                figures[f"{name}_refused_by_instances"] = [
                    await instance_metric(i, REFUSED + '{reason="capacity"}') for i in instances
                ]
                assert sum(after) - sum(before) == len(files)
                for file, result in zip(files, results, strict=True):
                    check_complete(result, clip_s(speech_dir, file))
                    error = wer(reference(manifest, file), result.text)
                    assert error <= MAX_WER_CLIP, (file, result.text)
                figures[f"{name}_wer"] = [
                    round(wer(reference(manifest, f), r.text), 3)
                    for f, r in zip(files, results, strict=True)
                ]
                if name == "burst":  # it did not take the estimate down (the bug behind #32)
                    now = [int(await instance_metric(i, CAPACITY)) for i in instances]
                    assert now == carried, (now, carried)
            figures["after_readyz"] = [(await i.get("/readyz"))[1] for i in instances]
    finally:
        await stop_all(instances)
        figures["logs"] = [i.log_tail(8) for i in instances]
        artifacts = Path(__file__).parent / "artifacts"
        artifacts.mkdir(exist_ok=True)
        (artifacts / "deploy-haproxy-admission.json").write_text(
            json.dumps(figures, indent=1) + "\n"
        )


# From now on, when the page first shows its connection lost and then back, and the first
# final of a session other than the current one; the page's clock now is returned. A
# MutationObserver runs right after the handler that changed the page, so the times are
# those of the messages' arrival, not of a poll.
RECORD_RESUME_JS = """() => {
  const ww = window.whisperwire;
  const oldOffsets = new Set(ww.finalLog.map((f) => f.offsetS));
  const connection = document.getElementById('connection');
  const marks = { reconnectingMs: null, connectedMs: null, firstFinalMs: null };
  window.resumeMarks = marks;
  new MutationObserver(() => {
    const now = performance.now();
    const shown = connection.dataset.state;
    if (marks.reconnectingMs === null && shown === 'reconnecting') {
      marks.reconnectingMs = now;
      marks.reconnectingStatus = document.getElementById('status').textContent;
    }
    if (marks.reconnectingMs !== null && marks.connectedMs === null && shown === 'connected') {
      marks.connectedMs = now;
    }
    if (marks.firstFinalMs === null && ww.finalLog.some((f) => !oldOffsets.has(f.offsetS))) {
      marks.firstFinalMs = now;
    }
  }).observe(document.body, { subtree: true, childList: true, characterData: true,
    attributes: true });
  return performance.now();
}"""

# Finals of the sessions after the first, whose offsets on the page's timeline are later.
LATER_FINALS_JS = (
    "() => window.whisperwire.finalLog"
    ".filter((f) => f.offsetS > window.whisperwire.finalLog[0].offsetS)"
    ".map((f) => f.message.text)"
)


def lined_up(reference_text: str, text: str) -> tuple[float, int]:
    """How ``text`` lines up with a longer reference: the share of its words matched in
    order, and how many reference words it skips between its first and its last."""
    words = normalize(text).split()
    assert words, text
    aligned = jiwer.process_words(normalize(reference_text), " ".join(words))
    chunks = aligned.alignments[0]
    while chunks and chunks[0].type == "delete":
        chunks = chunks[1:]
    while chunks and chunks[-1].type == "delete":
        chunks = chunks[:-1]
    skipped = sum(c.ref_end_idx - c.ref_start_idx for c in chunks if c.type == "delete")
    return aligned.hits / len(words), skipped


@pytest.mark.browser
@pytest.mark.skipif(
    not Path(CHROMIUM).is_file(),
    reason="Debian's Chromium is not at /usr/bin/chromium (`make browser` installs it)",
)
@on_session_loop
async def test_the_browser_page_goes_on_on_the_other_instance_when_its_instance_drains(
    speech_dir: Path, tmp_path: Path
) -> None:
    """The page, served through HAProxy, its fake microphone reading a long recording: SIGTERM
    on the instance serving it, whose drain ends the session (its last finals, ``done``). The
    page keeps the old session's finals, reconnects through HAProxy, and the new session, on
    the other instance, goes on with finals of the same recording: it starts at the old
    session's last two final words, sent the audio the page kept from there, so the word the
    drain cut is heard whole, and the words it hears again are shown once."""
    haproxy_binary()
    (row,) = [r for r in read_manifest(speech_dir / "manifest_long.tsv") if r.file == PAGE_CLIP]
    ports = [free_port(), free_port()]
    instances = [
        ServerInstance(
            f"ww{i}",
            port,
            [*REAL_INSTANCE_ARGS, "--drain-s", str(SHORT_DRAIN_S)],
            tmp_path / f"ww{i}.log",
        )
        for i, port in enumerate(ports, 1)
    ]
    errors: list[str] = []
    figures: dict[str, object] = {}
    try:
        await asyncio.gather(*(i.start() for i in instances))
        await asyncio.gather(*(i.wait_ready() for i in instances))
        async with haproxy_in_front(ports, tmp_path) as lb, async_playwright() as pw:
            await lb.haproxy.wait_for("ww1", "UP")
            await lb.haproxy.wait_for("ww2", "UP")
            browser = await launch(
                pw,
                "--use-fake-ui-for-media-stream",
                f"--use-file-for-fake-audio-capture={speech_dir / PAGE_CLIP}",
            )
            try:
                page = await browser.new_page()
                page.on("pageerror", lambda exc: errors.append(str(exc)))
                await page.goto(f"{lb.http_url}/?token={API_KEY}")
                await wait_on_page(page, "document.body.dataset.state === 'idle'", STATE_WAIT_MS)
                await page.click("#start")
                await wait_on_page(page, "window.whisperwire.finals.length >= 2", WORDS_WAIT_MS)

                active = [await instance_metric(i, ACTIVE) for i in instances]
                assert sorted(active) == [0, 1], active
                serving, survivor = instances[active.index(1)], instances[active.index(0)]
                survivor_total = await sessions_total(survivor)
                first_id = await page.evaluate("window.whisperwire.sessionId")
                finals_before = await page.evaluate("window.whisperwire.finals.slice()")
                shown_before = await page.evaluate(FINAL_TEXT_JS)
                sigterm_ms = await page.evaluate(RECORD_RESUME_JS)
                sigterm_at = time.monotonic()
                serving.signal(signal.SIGTERM)
                serving_exit = asyncio.create_task(exited_at(serving))

                await wait_on_page(page, "window.resumeMarks.firstFinalMs !== null", WORDS_WAIT_MS)
                marks = await page.evaluate("window.resumeMarks")
                for name, mark in (
                    ("reconnecting", "reconnectingMs"),
                    ("connected", "connectedMs"),
                    ("first_final", "firstFinalMs"),
                ):
                    figures[f"sigterm_to_{name}_s"] = round((marks[mark] - sigterm_ms) / 1000, 2)
                assert await instance_metric(survivor, ACTIVE) == 1  # was 0: it took the page
                assert await sessions_total(survivor) == survivor_total + 1
                figures["sigterm_to_exit_s"] = round(await serving_exit - sigterm_at, 2)
                assert f"drained for {SHORT_DRAIN_S} s; 1 session(s) still open" in (
                    serving.log_path.read_text()
                )
                exposed = await page.evaluate("window.whisperwire")
                assert exposed["reconnects"] == 1, exposed
                # The drain's end: "done", then the server's close 1001, unless the page's own
                # close (1000, sent on "done") reached the server first and was echoed.
                assert exposed["lastClose"]["code"] in (1000, 1001), exposed
                figures["close_code"] = exposed["lastClose"]["code"]
                figures["status_while_reconnecting"] = marks["reconnectingStatus"]
                assert exposed["sessionId"] not in (None, first_id), exposed
                assert await page.text_content("#connection") == "connected"
                # The old session's finals are all still there, first, in the page's text.
                assert exposed["finals"][: len(finals_before)] == finals_before
                assert (await page.evaluate(FINAL_TEXT_JS)).startswith(shown_before)

                later_words = f"(n) => ({LATER_FINALS_JS})().join(' ').split(/\\s+/).length >= n"
                await wait_on_page(page, later_words, WORDS_WAIT_MS, SURVIVOR_WORDS)
                status = await page.text_content("#status")
                assert status is not None and status.startswith("Listening"), status
                assert not await page.evaluate(
                    "document.getElementById('status').classList.contains('error')"
                )
                later = await page.evaluate(LATER_FINALS_JS)
                exposed = await page.evaluate("window.whisperwire")
                offsets = [f["offsetS"] for f in exposed["finalLog"]]
                assert offsets == sorted(offsets) and offsets[0] == 0 < offsets[-1], offsets
                figures["resumed_at_s"] = round(offsets[-1], 2)
                assert await page.locator("#transcript .final").count() == len(exposed["finals"])
                page_text, survivor_text = " ".join(exposed["finals"]), " ".join(later)
                page_hits, page_skipped = lined_up(row.transcript, page_text)
                survivor_hits, _ = lined_up(row.transcript, survivor_text)
                figures.update(
                    page_hit_ratio=round(page_hits, 3),
                    page_words_skipped=page_skipped,
                    survivor_hit_ratio=round(survivor_hits, 3),
                    page_text=page_text,
                    survivor_text=survivor_text,
                )
                assert page_hits >= MIN_HIT_RATIO, page_text
                assert survivor_hits >= MIN_HIT_RATIO, survivor_text
                # At the seam: the word the drain cut is heard whole by the new session, and
                # the final words it hears again are shown once.
                (seam,) = seams_lined_up(row.transcript, exposed["finalLog"])
                figures.update(
                    seam_words_lost=seam.lost,
                    seam_words_repeated=seam.repeated,
                    page_text_at_seam=seam.text,
                    page_seams=exposed.get("seams"),
                )
                assert seam.lost == 0, seam
                assert seam.repeated == 0, seam
                check_resumed_at_seam_words(exposed["finalLog"])
                check_page_seams(exposed)

                await page.click("#start")
                await wait_on_page(page, "document.body.dataset.state === 'idle'", STATE_WAIT_MS)
                assert await page.text_content("#status") == "Stopped."
                assert (await page.evaluate("window.whisperwire.lastClose"))["code"] == 1000

                async def survivor_idle() -> bool:
                    return await instance_metric(survivor, ACTIVE) == 0

                await wait_until(f"{survivor.name} to end the page's session", survivor_idle)
            finally:
                await browser.close()
    finally:
        await stop_all(instances)
        artifacts = Path(__file__).parent / "artifacts"
        artifacts.mkdir(exist_ok=True)
        (artifacts / "deploy-haproxy-page.json").write_text(json.dumps(figures, indent=1) + "\n")
    assert not errors, errors
