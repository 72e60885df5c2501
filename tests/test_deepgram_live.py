"""Deepgram live on ``/v1/listen``: the ``deepgram-sdk`` package's own client against a real
server on loopback, and raw WebSocket clients for input no SDK would send.

Recognition uses the real model (the ``server_url`` fixture); the protocol's edges use servers
of their own with the scripted engine, which hears one word per half second of window.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
import numpy as np
import pytest
from deepgram import AsyncDeepgramClient
from deepgram.core.api_error import ApiError
from deepgram.environment import DeepgramClientEnvironment
from livekit import rtc
from livekit.agents import stt as lk_stt
from livekit.plugins import deepgram as lk_deepgram
from websockets.asyncio.client import ClientConnection, connect
from websockets.datastructures import Headers
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.http11 import Request

from bench.corpus import ManifestRow, load_clip, wer
from bench.phone_line import PHONE_RATE_HZ, phone_line
from server.apis.adapters import SessionSettings
from server.apis.deepgram_live import LISTEN_PATH, DeepgramAdapter, handshake_problem, parse_options
from server.config import PipelineConfig, ServerConfig, StreamingConfig, VadConfig
from server.core.session import END_OF_SPEECH_MS_RANGE
from server.core.speakers import SpeakerConfig
from server.protocol.formats import SAMPLE_RATE_HZ
from server.protocol.messages import FinalMessage, WordInfo
from server.serve.app import WhisperwireServer
from tests.helpers import ScriptedEngine, TimedEngine, pcm_frames, two_readers

if TYPE_CHECKING:
    from server.engine.engine import Engine

WAIT_S = 120.0  # a bound for waits on the real model on a busy 2-core machine
MAX_WER_CLIP = 0.35  # as tests/test_app.py: one short clip, streamed
CLIP = "ljspeech/LJ001-0004.wav"
FRAME_S = 0.1  # pcm_frames' frame length
LONG_CLIP = "ljspeech/long/LJ001-0001_to_0032.concat.wav"
LINEAR16 = "encoding=linear16&sample_rate=16000&channels=1"
# From the decode that made an utterance's final to the arrival of the event that closes it,
# on loopback in this process: the event loop's turns only (a busy 2-core machine included).
ENDPOINT_EVENT_S = 0.25


def environment(ws_base: str) -> DeepgramClientEnvironment:
    """The SDK's endpoints, all on our server (its default is Deepgram's hosts)."""
    http = "http" + ws_base.removeprefix("ws")
    return DeepgramClientEnvironment(base=http, production=ws_base, agent=ws_base, agent_rest=http)


def reference(manifest: list[ManifestRow], file: str) -> str:
    return next(row.transcript for row in manifest if row.file == file)


# --------------------------------------------------------------------------- the real SDK


@pytest.mark.asyncio(loop_scope="session")  # the server_url fixture's loop
async def test_the_deepgram_client_streams_speech_and_gets_interim_and_final_results(
    server_url: str, speech_dir: Path, manifest: list[ManifestRow]
) -> None:
    client = AsyncDeepgramClient(api_key="unused", environment=environment(server_url))
    clip = load_clip(speech_dir / CLIP)
    silence = np.zeros(int(1.5 * SAMPLE_RATE_HZ), np.float32)  # for UtteranceEnd's gap
    frames = pcm_frames(np.concatenate([clip, silence]))
    messages: list[Any] = []
    async with client.listen.v1.connect(
        model="nova-3",
        encoding="linear16",
        sample_rate="16000",
        channels="1",
        language="en-US",
        interim_results="true",
        punctuate="true",
        endpointing="300",
        utterance_end_ms="1000",
        vad_events="true",
    ) as socket:

        async def send() -> None:
            # At a live microphone's pace: interim results are for live audio. Sent all at
            # once, the utterance is in before the first decode reaches a lane, and that
            # decode (bound to the audio when the lane takes it) is already its final one.
            for frame in frames:
                await socket.send_media(frame)
                await asyncio.sleep(FRAME_S)
            await socket.send_keep_alive()
            await socket.send_close_stream()

        sender = asyncio.create_task(send())

        async def receive() -> None:
            async for message in socket:
                messages.append(message)

        await asyncio.wait_for(receive(), WAIT_S)
        await sender
    kinds = [m.type for m in messages]
    assert kinds[0] == "SpeechStarted" and kinds[-1] == "Metadata", kinds
    assert "Error" not in kinds and "UtteranceEnd" in kinds
    results = [m for m in messages if m.type == "Results"]
    interim = [r for r in results if not r.is_final]
    finals = [r for r in results if r.is_final]
    assert interim and finals and any(r.speech_final for r in finals)
    assert all(r.channel.alternatives[0].transcript for r in interim)
    words = [w for r in finals for w in r.channel.alternatives[0].words]
    assert words and all(w.start <= w.end and 0 < w.confidence <= 1 for w in words)
    assert all(a.end <= b.start + 1e-3 for a, b in itertools.pairwise(words))
    utterance_end = messages[kinds.index("UtteranceEnd")]
    assert utterance_end.last_word_end == pytest.approx(words[-1].end, abs=1e-3)
    metadata = messages[-1]
    assert metadata.duration == pytest.approx(len(frames) * 0.1, abs=0.11)
    assert metadata.sha256 == hashlib.sha256(b"".join(frames)).hexdigest()
    text = " ".join(r.channel.alternatives[0].transcript for r in finals)
    assert wer(reference(manifest, CLIP), text) <= MAX_WER_CLIP, text
    assert socket._websocket.close_code == 1000  # clean close after CloseStream


@pytest.mark.asyncio(loop_scope="session")  # the server_url fixture's loop
async def test_the_deepgram_client_streams_a_phone_call_in_mulaw_at_8k(
    server_url: str, speech_dir: Path, manifest: list[ManifestRow]
) -> None:
    """What every Twilio-to-Deepgram tutorial does: the call's mu-law bytes, 8 kHz, forwarded
    with ``encoding=mulaw&sample_rate=8000``, in 20 ms frames (160 bytes) as a phone leg sends
    them; the speech went through a telephone channel (300-3400 Hz) first."""
    client = AsyncDeepgramClient(api_key="unused", environment=environment(server_url))
    clip = load_clip(speech_dir / CLIP)
    line = phone_line(np.concatenate([clip, np.zeros(SAMPLE_RATE_HZ, np.float32)]))
    frame_bytes = PHONE_RATE_HZ // 50
    async with client.listen.v1.connect(
        model="nova-3", encoding="mulaw", sample_rate="8000", punctuate="true"
    ) as socket:
        for start in range(0, len(line), frame_bytes):
            await socket.send_media(line[start : start + frame_bytes])
        await socket.send_close_stream()
        messages = await asyncio.wait_for(_all(socket), WAIT_S)
    assert messages[-1].type == "Metadata" and "Error" not in [m.type for m in messages]
    # One byte a sample: the duration is the byte count at 8 kHz, every byte accepted.
    assert messages[-1].duration == pytest.approx(len(line) / PHONE_RATE_HZ, abs=0.01)
    finals = [m for m in messages if m.type == "Results" and m.is_final]
    text = " ".join(r.channel.alternatives[0].transcript for r in finals)
    assert wer(reference(manifest, CLIP), text) <= MAX_WER_CLIP, text


@pytest.mark.asyncio(loop_scope="session")  # the server_url fixture's loop
async def test_livekits_deepgram_plugin_streams_speech_with_only_its_base_url_changed(
    server_url: str, speech_dir: Path, manifest: list[ManifestRow]
) -> None:
    """livekit-plugins-deepgram's ``STT().stream()``, its defaults as a LiveKit agent has them
    (``LIVEKIT_QUERY``): speech events, interim and final transcripts, the end of speech."""
    clip = load_clip(speech_dir / CLIP)
    frames = pcm_frames(np.concatenate([clip, np.zeros(SAMPLE_RATE_HZ, np.float32)]))
    events: list[lk_stt.SpeechEvent] = []
    async with aiohttp.ClientSession() as http:
        plugin = lk_deepgram.STT(
            api_key="unused", base_url=f"{server_url}{LISTEN_PATH}", http_session=http
        )
        stream = plugin.stream()

        async def send() -> None:
            for frame in frames:  # at a microphone's pace, as an agent's room track comes
                stream.push_frame(rtc.AudioFrame(frame, SAMPLE_RATE_HZ, 1, len(frame) // 2))
                await asyncio.sleep(FRAME_S)
            stream.end_input()

        async def receive() -> None:
            async for event in stream:
                events.append(event)

        sender = asyncio.create_task(send())
        await asyncio.wait_for(receive(), WAIT_S)
        await sender
        await plugin.aclose()
    kinds = [e.type for e in events]
    kind = lk_stt.SpeechEventType
    assert kinds[0] == kind.START_OF_SPEECH and kind.END_OF_SPEECH in kinds, kinds
    assert kind.INTERIM_TRANSCRIPT in kinds
    finals = [e.alternatives[0].text for e in events if e.type == kind.FINAL_TRANSCRIPT]
    text = " ".join(finals)
    assert wer(reference(manifest, CLIP), text) <= MAX_WER_CLIP, text


@pytest.mark.asyncio(loop_scope="session")  # the server_url fixture's loop
async def test_livekits_deepgram_plugin_recognizes_an_utterance_by_the_prerecorded_api(
    server_url: str, speech_dir: Path, manifest: list[ManifestRow]
) -> None:
    """livekit-plugins-deepgram's ``STT().recognize()``, what an agent calls on a buffered
    utterance: the frames as one WAV in a ``POST /v1/listen`` with its pre-recorded options
    (``punctuate``, ``smart_format``, ``keywords``, ...), read by the plugin's own parser of
    Deepgram's pre-recorded response."""
    clip = load_clip(speech_dir / CLIP)
    buffer = [
        rtc.AudioFrame(frame, SAMPLE_RATE_HZ, 1, len(frame) // 2) for frame in pcm_frames(clip)
    ]
    async with aiohttp.ClientSession() as http:
        plugin = lk_deepgram.STT(
            api_key="unused", base_url=f"{server_url}{LISTEN_PATH}", http_session=http
        )
        event = await asyncio.wait_for(plugin.recognize(buffer), WAIT_S)
        await plugin.aclose()
    assert event.type == lk_stt.SpeechEventType.FINAL_TRANSCRIPT and event.request_id
    [alternative] = event.alternatives
    assert wer(reference(manifest, CLIP), alternative.text) <= MAX_WER_CLIP, alternative.text
    words = alternative.words or []
    assert words and " ".join(str(w) for w in words) == alternative.text  # punctuated words
    assert all(0 <= w.start_time <= w.end_time <= len(clip) / SAMPLE_RATE_HZ for w in words)
    assert all(a.end_time <= b.start_time + 1e-3 for a, b in itertools.pairwise(words))
    assert 0 < alternative.confidence <= 1


@pytest.mark.asyncio(loop_scope="session")  # the speakers_server_url fixture's loop
async def test_diarize_labels_each_word_with_its_readers_speaker(
    speakers_server_url: str, speech_dir: Path
) -> None:
    """The deepgram-sdk's client with ``diarize=true`` on a server with ``--speakers``: two
    readers, a second apart; every final word has ``speaker`` (the first reader's 0, the
    second's 1) and ``speaker_confidence``. Without ``diarize``, on the same server, no word
    has a speaker (and the finals come: they do not wait for labels nobody sends)."""
    client = AsyncDeepgramClient(api_key="unused", environment=environment(speakers_server_url))
    talk = two_readers(speech_dir)

    async def final_words(audio: np.ndarray, **options: str) -> list[Any]:
        async with client.listen.v1.connect(
            model="nova-3", encoding="linear16", sample_rate="16000", **options
        ) as socket:
            for frame in pcm_frames(audio):
                await socket.send_media(frame)
            await socket.send_close_stream()
            messages = await asyncio.wait_for(_all(socket), WAIT_S)
        assert messages[-1].type == "Metadata"
        finals = [m for m in messages if m.type == "Results" and m.is_final]
        return [w for r in finals for w in r.channel.alternatives[0].words]

    words = await final_words(talk.audio, diarize="true", punctuate="true")
    assert len(words) > 20
    for w in words:
        assert w.speaker == (0 if w.start < talk.boundary_s else 1), (w, talk.boundary_s)
        assert 0 <= w.speaker_confidence <= 1  # an extra field to the SDK's live word type
    plain = await final_words(load_clip(speech_dir / CLIP))
    assert plain and all(w.speaker is None for w in plain)
    assert all("speaker_confidence" not in (w.model_extra or {}) for w in plain)


async def _all(socket: Any) -> list[Any]:
    return [message async for message in socket]


# --------------------------------------------------------------------------- the options


def test_options_are_read_from_the_query() -> None:
    options = parse_options(
        f"{LISTEN_PATH}?{LINEAR16}&language=en-GB&interim_results=true&utterance_end_ms=1500"
        "&endpointing=false&vad_events=true&model=nova-3&smart_format=false"
    )
    assert (options.sample_rate_hz, options.language) == (16000, "en")
    assert options.interim_results and options.vad_events and not options.endpointing
    assert options.utterance_end_ms == 1500
    assert parse_options(f"{LISTEN_PATH}?{LINEAR16}&language=multi").language is None


# What livekit-plugins-deepgram's STT().stream() (1.2 and 1.8.9) puts in every URL, its
# defaults (read from its source): refused with HTTP 400 before (no_delay, filler_words, ...).
LIVEKIT_QUERY = (
    "model=nova-3&punctuate=true&smart_format=false&no_delay=true&interim_results=true"
    "&encoding=linear16&vad_events=true&sample_rate=16000&channels=1&endpointing=25"
    "&filler_words=true&profanity_filter=false&numerals=false&mip_opt_out=false&language=en-US"
)


@pytest.mark.parametrize(("name", "ours"), [("mulaw", "mulaw"), ("alaw", "alaw")])
def test_g711_is_taken_at_any_rate(name: str, ours: str) -> None:
    for rate in (8000, 16000):
        options = parse_options(f"{LISTEN_PATH}?encoding={name}&sample_rate={rate}")
        assert (options.encoding, options.sample_rate_hz) == (ours, rate)


def test_the_query_livekit_sends_is_taken() -> None:
    assert handshake_problem(Request(f"{LISTEN_PATH}?{LIVEKIT_QUERY}", Headers())) is None
    options = parse_options(f"{LISTEN_PATH}?{LIVEKIT_QUERY}&tag=a&tag=b")
    assert options.punctuate and options.filler_words and options.interim_results
    assert parse_options(f"{LISTEN_PATH}?{LINEAR16}&smart_format=true").punctuate


def _final_results(query: str, text: str) -> dict[str, Any]:
    """The ``Results`` a stream opened with ``query`` gets for one final of ``text``."""
    settings = SessionSettings("s", StreamingConfig(), VadConfig(), multilingual=False, model="m")
    adapter = DeepgramAdapter()
    adapter.open_session(settings, Request(f"{LISTEN_PATH}?{query}", Headers()))
    words = tuple(WordInfo(w, k * 0.5, k * 0.5 + 0.4, 0.9) for k, w in enumerate(text.split()))
    [frame] = adapter.render(FinalMessage(0, text, 0.0, len(words) * 0.5, words, 2.0))
    result: dict[str, Any] = json.loads(frame)
    return result


def test_filler_words_are_left_out_unless_asked_for() -> None:
    text = "Um, I think, uh, it works."
    plain = _final_results(f"{LINEAR16}&punctuate=true", text)["channel"]["alternatives"][0]
    assert plain["transcript"] == "I think, it works."
    assert [w["punctuated_word"] for w in plain["words"]] == ["I", "think,", "it", "works."]
    kept = _final_results(f"{LINEAR16}&smart_format=true&filler_words=true", text)
    assert kept["channel"]["alternatives"][0]["transcript"] == text
    bare = _final_results(LINEAR16, text)["channel"]["alternatives"][0]
    assert bare["transcript"] == "i think it works"


@pytest.mark.parametrize(
    ("query", "says"),
    [
        ("encoding=opus&sample_rate=16000", "encoding=linear16, mulaw, alaw"),
        ("encoding=mulaw", "sample_rate (Hz) is required with encoding=mulaw"),
        ("sample_rate=16000", "encoding="),
        ("encoding=linear16", "sample_rate"),
        ("encoding=linear16&sample_rate=96000", "sample_rate"),
        (f"{LINEAR16.replace('channels=1', 'channels=2')}", "channels=1"),
        (f"{LINEAR16}&diarize=true", "--speakers"),  # a server without speaker labels
        (f"{LINEAR16}&keywords=foo", "keywords"),
        (f"{LINEAR16}&utterance_end_ms=1000", "interim_results"),
        (f"{LINEAR16}&interim_results=true&utterance_end_ms=500", "at least 1000"),
        (f"{LINEAR16}&interim_results=yes", "true or false"),
        (f"{LINEAR16}&endpointing=soon", "endpointing"),
        (f"{LINEAR16}&language=english!", "language"),
    ],
)
def test_options_we_cannot_honour_are_refused(query: str, says: str) -> None:
    problem = handshake_problem(Request(f"{LISTEN_PATH}?{query}", Headers()))
    assert problem is not None and says in problem, problem


def test_diarize_is_the_streams_speaker_option_and_needs_a_server_with_speakers() -> None:
    on = StreamingConfig(speakers=SpeakerConfig(enabled=True))
    settings = SessionSettings("s", on, VadConfig(), multilingual=False, model="m")
    labelled = {}
    for diarize in ("true", "false", None):
        query = LINEAR16 if diarize is None else f"{LINEAR16}&diarize={diarize}"
        request = Request(f"{LISTEN_PATH}?{query}", Headers())
        assert handshake_problem(request, on) is None
        session = DeepgramAdapter().open_session(settings, request)
        labelled[diarize] = session.labels_speakers
    # Absent or false: no labels, though the server labels v1 streams by default.
    assert labelled == {"true": True, "false": False, None: False}
    refused = handshake_problem(
        Request(f"{LISTEN_PATH}?{LINEAR16}&diarize=true", Headers()), StreamingConfig()
    )
    assert refused is not None and "--speakers" in refused


@pytest.mark.parametrize("agent_finals", ["words", "utterance"])
def test_a_stream_takes_the_servers_voice_agent_finals(agent_finals: str) -> None:
    """An agent answers when a turn's final arrives: these streams take the server's
    ``agent_finals`` (word by word unless it chose), not the v1 streams' finals."""
    server = StreamingConfig(finals="utterance", agent_finals=agent_finals)
    settings = SessionSettings("s", server, VadConfig(), multilingual=False, model="m")
    request = Request(f"{LISTEN_PATH}?{LINEAR16}", Headers())
    session = DeepgramAdapter().open_session(settings, request)
    assert session.streaming.finals == agent_finals


def test_words_carry_their_speaker_as_deepgram_renders_it() -> None:
    adapter = DeepgramAdapter()
    on = StreamingConfig(speakers=SpeakerConfig(enabled=True))
    settings = SessionSettings("s", on, VadConfig(), multilingual=False, model="m")
    adapter.open_session(settings, Request(f"{LISTEN_PATH}?{LINEAR16}&diarize=true", Headers()))
    words = (WordInfo("Hello.", 0.0, 0.4, 0.9, 0, 0.875), WordInfo("Hi.", 0.6, 0.9, 0.8, 1, 0.5))
    [frame] = adapter.render(FinalMessage(0, "Hello. Hi.", 0.0, 0.9, words, 2.0, speaker=0))
    rendered = json.loads(frame)["channel"]["alternatives"][0]["words"]
    assert [(w["word"], w["speaker"], w["speaker_confidence"]) for w in rendered] == [
        ("hello", 0, 0.875),
        ("hi", 1, 0.5),
    ]


def test_endpointing_sets_the_streams_end_of_speech_silence() -> None:
    vad = VadConfig()
    settings = SessionSettings("s", StreamingConfig(), vad, multilingual=False, model="m")
    silences = []
    for endpointing in ("10", "300", "2000", "99999", "false", None):
        query = LINEAR16 if endpointing is None else f"{LINEAR16}&endpointing={endpointing}"
        session = DeepgramAdapter().open_session(
            settings, Request(f"{LISTEN_PATH}?{query}", Headers())
        )
        silences.append(session.vad_config.speech_end_silence_ms)
    low, high = END_OF_SPEECH_MS_RANGE
    default = vad.speech_end_silence_ms
    assert silences == [low, 300, 2000, high, default, default]


# --------------------------------------------------------------------------- at the endpoint


async def test_speech_final_and_utterance_end_go_out_with_the_closing_decode(
    engine: Engine, speech_dir: Path
) -> None:
    """An utterance and 1.5 s of silence sent at once, then nothing: the endpoint and
    ``utterance_end_ms``'s gap are both in the audio before the first decode returns (as
    for a stream whose closing decode waited for a lane). ``speech_final`` must come with
    the final of the utterance's last decode, and ``UtteranceEnd`` right behind it: neither
    may wait for another decode, nor for audio or a message the client has no reason to
    send (before the fix, UtteranceEnd waited for the next audio frame)."""
    timed = TimedEngine(engine)
    clip = load_clip(speech_dir / CLIP)
    audio = np.concatenate([clip, np.zeros(int(1.5 * SAMPLE_RATE_HZ), np.float32)])
    query = f"{LINEAR16}&interim_results=true&endpointing=300&utterance_end_ms=1000"
    config = ServerConfig(host="127.0.0.1", port=0, capacity_limit=False, warmup=False)
    arrived: list[tuple[float, dict[str, Any]]] = []
    async with (
        WhisperwireServer(
            lambda: timed, server=config, pipeline=PipelineConfig(batch_wait_ms=5.0)
        ) as server,
        connect(listen_url(server, query)) as ws,
    ):

        async def read_until_utterance_end() -> None:
            while not arrived or arrived[-1][1]["type"] != "UtteranceEnd":
                message = json.loads(await ws.recv())
                arrived.append((time.monotonic(), message))

        reader = asyncio.create_task(read_until_utterance_end())
        for frame in pcm_frames(audio):
            await ws.send(frame)
        await asyncio.wait_for(reader, WAIT_S)
        waited_until = time.monotonic()
        await ws.send('{"type": "CloseStream"}')
        rest = await read_until_closed(ws)
    kinds = [m["type"] for _, m in arrived]
    assert "Error" not in kinds, [m for _, m in arrived if m["type"] == "Error"]
    [at] = [k for k, (_, m) in enumerate(arrived) if m["type"] == "Results" and m["speech_final"]]
    final_at = arrived[at][0]
    end_at, utterance_end = arrived[-1]
    # Right behind speech_final: the gap was in the audio when the final was made.
    assert at == len(arrived) - 2, kinds
    assert timed.returned_between(final_at, end_at) == 0
    finals = [m for _, m in arrived if m["type"] == "Results" and m["is_final"]]
    words = [w for m in finals for w in m["channel"]["alternatives"][0]["words"]]
    assert words and utterance_end["last_word_end"] == pytest.approx(words[-1]["end"], abs=1e-3)
    # speech_final came with the utterance's last decode (none returned after it), at once.
    assert timed.returned_between(final_at, waited_until) == 0
    last_decode = max(t for t in timed.returned_at if t <= final_at)
    assert final_at - last_decode < ENDPOINT_EVENT_S, final_at - last_decode
    assert [m["type"] for m in rest] == ["Metadata"]


# --------------------------------------------------------------------------- protocol edges


@contextlib.asynccontextmanager
async def scripted_server(
    engine: ScriptedEngine | None = None, **overrides: Any
) -> AsyncIterator[WhisperwireServer]:
    config = ServerConfig(host="127.0.0.1", port=0, **overrides)
    engine = engine or ScriptedEngine()
    async with WhisperwireServer(lambda: engine, server=config) as server:
        yield server


def listen_url(server: WhisperwireServer, query: str = LINEAR16) -> str:
    return f"{server.url}{LISTEN_PATH}?{query}"


async def read_until_closed(ws: ClientConnection) -> list[dict[str, Any]]:
    messages = []
    with contextlib.suppress(ConnectionClosed):
        async for raw in ws:
            messages.append(json.loads(raw))
    return messages


async def test_bad_messages_get_deepgram_errors_and_the_stream_goes_on(speech_dir: Path) -> None:
    frames = pcm_frames(load_clip(speech_dir / LONG_CLIP)[: 4 * SAMPLE_RATE_HZ])
    audio = b"".join(frames)
    async with scripted_server() as server, connect(listen_url(server)) as ws:
        for bad in ("{oops", '{"type": "Configure", "keyterms": ["x"]}', "[1, 2]"):
            await ws.send(bad)
            error = json.loads(await ws.recv())
            assert error["type"] == "Error" and error["variant"] == "protocol_error", error
            assert error["description"]
        # Frames split inside a sample lose nothing: the next frame completes it.
        for piece in (audio[:3201], audio[3201:70001], audio[70001:]):
            await ws.send(piece)
        await ws.send('{"type": "KeepAlive"}')
        await ws.send('{"type": "Finalize"}')
        await ws.send('{"type": "CloseStream"}')
        messages = await read_until_closed(ws)
    assert ws.close_code == 1000
    assert messages[-1]["type"] == "Metadata"
    assert messages[-1]["duration"] == pytest.approx(4.0, abs=1e-3)
    finals = [m for m in messages if m["type"] == "Results" and m["is_final"]]
    assert [m["from_finalize"] for m in finals][-1:] == [True]
    text = " ".join(m["channel"]["alternatives"][0]["transcript"] for m in finals)
    assert text.split()[:2] == ["w0", "w1"]


async def results_until_speech_final(ws: ClientConnection) -> list[dict[str, Any]]:
    """The ``Results`` up to and including the next one with ``speech_final: true``."""
    results: list[dict[str, Any]] = []
    while not (results and results[-1]["speech_final"]):
        message = json.loads(await asyncio.wait_for(ws.recv(), 30))
        if message["type"] == "Results":
            results.append(message)
    return results


async def test_a_finalize_after_the_speech_settled_leaves_the_next_utterance_as_it_was(
    speech_dir: Path,
) -> None:
    speech = load_clip(speech_dir / CLIP)
    utterance = pcm_frames(np.concatenate([speech, np.zeros(2 * SAMPLE_RATE_HZ, np.float32)]))
    async with scripted_server() as server, connect(listen_url(server)) as ws:
        for frame in utterance:
            await ws.send(frame)
        first = await results_until_speech_final(ws)  # settled: every word sent
        await ws.send('{"type": "Finalize"}')  # nothing left to finalize
        for frame in utterance:
            await ws.send(frame)
        second = await results_until_speech_final(ws)
    assert not any(r["from_finalize"] for r in first)
    # Deepgram may answer such a Finalize with an empty from_finalize result, or not at all.
    answer = [r for r in second if r["from_finalize"]]
    assert all(not r["channel"]["alternatives"][0]["transcript"] for r in answer), answer
    assert second[-1]["channel"]["alternatives"][0]["transcript"] or any(
        r["is_final"] and r["channel"]["alternatives"][0]["transcript"] for r in second
    )


async def test_audio_after_close_stream_closes_1008(speech_dir: Path) -> None:
    frames = pcm_frames(load_clip(speech_dir / CLIP))[:10]
    engine = ScriptedEngine()
    async with scripted_server(engine) as server, connect(listen_url(server)) as ws:
        engine.release.clear()  # the session cannot finish before the late frame arrives
        try:
            for frame in frames:
                await ws.send(frame)
            await ws.send('{"type": "CloseStream"}')
            await ws.send(frames[0])
            messages = await read_until_closed(ws)
        finally:
            engine.release.set()
    errors = [m for m in messages if m["type"] == "Error"]
    assert errors and "after end" in errors[0]["description"]
    assert ws.close_code == 1008


async def test_a_language_the_model_lacks_is_an_error_then_1008() -> None:
    async with scripted_server() as server:  # English-only, like tiny.en
        async with connect(listen_url(server, LINEAR16 + "&language=de")) as ws:
            messages = await read_until_closed(ws)
        assert [m["type"] for m in messages] == ["Error"]
        assert "English-only" in messages[0]["description"]
        assert ws.close_code == 1008


async def test_keep_alive_holds_off_the_idle_timeout() -> None:
    async with scripted_server(idle_timeout_s=0.5) as server:
        async with connect(listen_url(server)) as ws:
            for _ in range(6):  # 1.2 s, more than twice the idle timeout
                await ws.send('{"type": "KeepAlive"}')
                with pytest.raises(asyncio.TimeoutError):
                    await asyncio.wait_for(ws.recv(), 0.2)
            messages = await asyncio.wait_for(read_until_closed(ws), 5)
        assert [m["type"] for m in messages] == ["Error", "Metadata"]
        assert messages[0]["variant"] == "idle_timeout"
        assert ws.close_code == 1000


async def test_alaw_frames_of_any_byte_count_are_all_accepted(speech_dir: Path) -> None:
    """G.711 has no half samples: frames of odd byte counts (as a phone gateway may cut
    them) are all audio, and Metadata's duration counts every byte at 8 kHz."""
    line = phone_line(load_clip(speech_dir / CLIP)[: 3 * SAMPLE_RATE_HZ], "alaw")
    sizes = itertools.cycle([161, 1, 79, 3])
    frames, pos = [], 0
    while pos < len(line):
        size = next(sizes)
        frames.append(line[pos : pos + size])
        pos += size
    query = "encoding=alaw&sample_rate=8000"
    async with scripted_server() as server, connect(listen_url(server, query)) as ws:
        for frame in frames:
            await ws.send(frame)
        await ws.send('{"type": "CloseStream"}')
        messages = await asyncio.wait_for(read_until_closed(ws), 30)
    assert messages[-1]["type"] == "Metadata", messages
    assert "Error" not in [m["type"] for m in messages]
    assert messages[-1]["duration"] == pytest.approx(len(line) / PHONE_RATE_HZ, abs=1e-3)
    assert messages[-1]["sha256"] == hashlib.sha256(line).hexdigest()


async def test_handshakes_take_a_token_key_and_refuse_bad_options_with_400() -> None:
    async with scripted_server(api_key="s3cret") as server:
        key = {"Authorization": "Token s3cret"}
        for query, headers, status, says in [
            (LINEAR16, {}, 401, b""),
            (LINEAR16, {"Authorization": "Token nope"}, 401, b""),
            ("encoding=speex&sample_rate=8000", key, 400, b"encoding=speex is not supported"),
            # This server labels no speakers (no --speakers).
            (f"{LINEAR16}&diarize=true", key, 400, b"started without --speakers"),
            (LINEAR16, {"Authorization": "Token s3cret", "Origin": "https://x.example"}, 403, b""),
        ]:
            with pytest.raises(InvalidStatus) as refused:
                async with connect(listen_url(server, query), additional_headers=headers):
                    pass
            assert refused.value.response.status_code == status, query
            assert says in refused.value.response.body  # the reason is in the body
        client = AsyncDeepgramClient(api_key="s3cret", environment=environment(server.url))
        async with client.listen.v1.connect(
            model="nova-3", encoding="linear16", sample_rate="16000"
        ) as socket:
            await socket.send_close_stream()
            assert [m.type async for m in socket] == ["Metadata"]
        with pytest.raises(ApiError) as failed:
            async with client.listen.v1.connect(model="nova-3", encoding="opus"):
                pass
        assert failed.value.status_code == 400


async def test_a_full_server_refuses_the_sdks_connect_with_503_and_retry_after() -> None:
    """The server carries one stream and the SDK holds it: the next ``listen.v1.connect``
    raises the SDK's ``ApiError`` with status 503 (refused before the handshake, so a
    balancer replays it on another instance); the websockets error it wraps holds the
    server's Retry-After (the SDK's legacy client keeps no body). Once the first leaves, the
    next gets in."""
    async with scripted_server(capacity_streams=1) as server:
        client = AsyncDeepgramClient(api_key="unused", environment=environment(server.url))
        options = {"model": "nova-3", "encoding": "linear16", "sample_rate": "16000"}
        async with client.listen.v1.connect(**options) as first:
            with pytest.raises(ApiError) as refused:
                async with client.listen.v1.connect(**options):
                    pass
            await first.send_close_stream()
            assert [m.type async for m in first] == ["Metadata"]
        assert refused.value.status_code == 503
        answer = refused.value.__context__  # what the SDK caught: the server's answer
        assert answer is not None and getattr(answer, "status_code", None) == 503, answer
        assert answer.headers["Retry-After"] == str(ServerConfig().retry_after_s)  # type: ignore[attr-defined]
        async with client.listen.v1.connect(**options) as second:
            await second.send_close_stream()
            assert [m.type async for m in second] == ["Metadata"]
        assert server.metrics.sessions_refused.value("capacity") == 1
