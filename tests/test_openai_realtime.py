"""OpenAI Realtime transcription on ``/v1/realtime``: the ``openai`` package's own client against
a real server on loopback, and raw WebSocket clients for input no SDK would send.

Recognition uses the real model (the ``server_url`` fixture); the protocol's edges use servers
of their own with the scripted engine, which hears one word per half second of window.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
import numpy as np
import pytest
import soxr
from livekit import rtc
from livekit.agents import stt as lk_stt
from livekit.plugins import openai as lk_openai
from openai import AsyncOpenAI
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from bench.corpus import ManifestRow, load_clip, wer
from bench.http_probe import http_get, metric_value
from bench.phone_line import PHONE_RATE_HZ, phone_line
from server.apis.openai_realtime import DEFAULT_RATE_HZ, REALTIME_PATH, handshake_problem
from server.config import PipelineConfig, ServerConfig, StreamingConfig
from server.core.rules import RulesConfig
from server.core.session import END_OF_SPEECH_MS_RANGE
from server.protocol.audio import pcm_s16le_bytes
from server.protocol.formats import SAMPLE_RATE_HZ
from server.serve.app import WhisperwireServer
from tests.helpers import FixedTurnModel, TimedEngine, scripted_server

if TYPE_CHECKING:
    from server.engine.engine import Engine

WAIT_S = 120.0  # a bound for waits on the real model on a busy 2-core machine
MAX_WER_CLIP = 0.35  # as tests/test_app.py: one short clip, streamed
CLIP = "ljspeech/LJ001-0004.wav"
LONG_CLIP = "ljspeech/long/LJ001-0001_to_0032.concat.wav"
CHUNK_S = 0.1
COMPLETED = "conversation.item.input_audio_transcription.completed"
DELTA = "conversation.item.input_audio_transcription.delta"
# From the decode that made an utterance's final to the arrival of the event that closes it,
# on loopback in this process: the event loop's turns only (a busy 2-core machine included).
ENDPOINT_EVENT_S = 0.25


def http_base(ws_base: str) -> str:
    return "http" + ws_base.removeprefix("ws")


def pcm24(audio_16k: np.ndarray, silence_s: float = 0.0) -> bytes:
    """16 kHz float audio as OpenAI's PCM16 at 24 kHz, with ``silence_s`` of silence after."""
    audio = np.asarray(soxr.resample(audio_16k, SAMPLE_RATE_HZ, DEFAULT_RATE_HZ), np.float32)
    audio = np.concatenate([audio, np.zeros(int(silence_s * DEFAULT_RATE_HZ), np.float32)])
    return (np.clip(audio, -1.0, 32767 / 32768) * 32768).astype("<i2").tobytes()


def chunks(pcm: bytes, chunk_s: float = CHUNK_S) -> list[str]:
    step = int(chunk_s * DEFAULT_RATE_HZ) * 2
    return [base64.b64encode(pcm[i : i + step]).decode() for i in range(0, len(pcm), step)]


def reference(manifest: list[ManifestRow], file: str) -> str:
    return next(row.transcript for row in manifest if row.file == file)


def check_items(events: list[Any]) -> list[str]:
    """Each item's deltas add up to its completed transcript, and its events come in order;
    returns the transcripts."""
    transcripts = []
    for done in [e for e in events if e.type == COMPLETED]:
        deltas = [e for e in events if e.type == DELTA and e.item_id == done.item_id]
        assert "".join(d.delta for d in deltas) == done.transcript
        assert events.index(done) > max((events.index(d) for d in deltas), default=-1)
        committed = [
            e
            for e in events
            if e.type == "input_audio_buffer.committed" and e.item_id == done.item_id
        ]
        assert len(committed) == 1 and events.index(committed[0]) < events.index(done)
        transcripts.append(done.transcript)
    return transcripts


# --------------------------------------------------------------------------- the real SDK


@pytest.mark.asyncio(loop_scope="session")  # the server_url fixture's loop
async def test_the_openai_client_streams_speech_and_gets_deltas_and_transcripts(
    server_url: str, speech_dir: Path, manifest: list[ManifestRow]
) -> None:
    client = AsyncOpenAI(base_url=http_base(server_url) + "/v1", api_key="unused", max_retries=0)
    audio = chunks(pcm24(load_clip(speech_dir / CLIP), silence_s=1.5))
    events: list[Any] = []
    async with client.realtime.connect(extra_query={"intent": "transcription"}) as conn:
        created = await conn.recv()
        assert created.type == "session.created" and created.session.type == "transcription"
        assert created.session.audio.input.format.rate == DEFAULT_RATE_HZ
        await conn.session.update(
            session={
                "type": "transcription",
                "audio": {
                    "input": {
                        "format": {"type": "audio/pcm", "rate": 24000},
                        "transcription": {"model": "gpt-4o-transcribe", "language": "en"},
                        "turn_detection": {"type": "server_vad", "silence_duration_ms": 500},
                    }
                },
            }
        )
        updated = await conn.recv()
        assert updated.type == "session.updated", updated
        assert updated.session.audio.input.transcription.model == "tiny.en"  # what serves it

        async def send() -> None:
            for chunk in audio:
                await conn.input_audio_buffer.append(audio=chunk)

        sender = asyncio.create_task(send())

        async def receive() -> None:
            async for event in conn:
                events.append(event)
                kinds = [e.type for e in events]
                started = kinds.count("input_audio_buffer.speech_started")
                if sender.done() and started and kinds.count(COMPLETED) == started:
                    return

        await asyncio.wait_for(receive(), WAIT_S)
        await sender
    assert not [e for e in events if e.type == "error"], events
    transcripts = check_items(events)
    for started in [e for e in events if e.type == "input_audio_buffer.speech_started"]:
        stopped = [
            e
            for e in events
            if e.type == "input_audio_buffer.speech_stopped" and e.item_id == started.item_id
        ]
        assert len(stopped) == 1 and stopped[0].audio_end_ms > started.audio_start_ms
    assert [e for e in events if e.type == DELTA]
    assert wer(reference(manifest, CLIP), " ".join(transcripts)) <= MAX_WER_CLIP, transcripts


def g711_chunks(line: bytes, chunk_s: float = 0.02) -> list[str]:
    """G.711 bytes at 8 kHz as base64 appends of ``chunk_s`` (a phone leg's 20 ms)."""
    step = int(chunk_s * PHONE_RATE_HZ)
    return [base64.b64encode(line[i : i + step]).decode() for i in range(0, len(line), step)]


@pytest.mark.asyncio(loop_scope="session")  # the server_url fixture's loop
async def test_the_openai_client_streams_a_phone_call_as_audio_pcmu(
    server_url: str, speech_dir: Path, manifest: list[ManifestRow]
) -> None:
    """The GA session shape a Twilio-to-OpenAI bridge sends: ``audio/pcmu`` (no rate: 8 kHz),
    server VAD, and the call's mu-law payloads appended as they come."""
    client = AsyncOpenAI(base_url=http_base(server_url) + "/v1", api_key="unused", max_retries=0)
    clip = load_clip(speech_dir / CLIP)
    line = phone_line(np.concatenate([clip, np.zeros(int(1.5 * SAMPLE_RATE_HZ), np.float32)]))
    events: list[Any] = []
    async with client.realtime.connect(extra_query={"intent": "transcription"}) as conn:
        await conn.recv()  # session.created
        await conn.session.update(
            session={
                "type": "transcription",
                "audio": {"input": {"format": {"type": "audio/pcmu"}}},
            }
        )
        updated = await conn.recv()
        assert updated.type == "session.updated", updated
        assert updated.session.audio.input.format.type == "audio/pcmu"
        for chunk in g711_chunks(line):
            await conn.input_audio_buffer.append(audio=chunk)

        async def receive() -> None:
            async for event in conn:
                events.append(event)
                kinds = [e.type for e in events]
                started = kinds.count("input_audio_buffer.speech_started")
                if started and kinds.count(COMPLETED) == started:
                    return

        await asyncio.wait_for(receive(), WAIT_S)
    assert not [e for e in events if e.type == "error"], events
    transcripts = check_items(events)
    assert wer(reference(manifest, CLIP), " ".join(transcripts)) <= MAX_WER_CLIP, transcripts


@pytest.mark.asyncio(loop_scope="session")
async def test_the_beta_client_sends_g711_alaw_and_commits_by_hand(
    server_url: str, speech_dir: Path, manifest: list[ManifestRow]
) -> None:
    client = AsyncOpenAI(
        base_url=http_base(server_url) + "/v1",
        websocket_base_url=server_url + "/v1",
        api_key="unused",
        max_retries=0,
    )
    line = phone_line(load_clip(speech_dir / CLIP), "alaw")
    async with client.beta.realtime.connect(
        model="whisper-1", extra_query={"intent": "transcription"}
    ) as conn:
        await conn.recv_bytes()  # transcription_session.created
        await conn.send(
            {
                "type": "transcription_session.update",  # type: ignore[misc,typeddict-item]
                "session": {"input_audio_format": "g711_alaw", "turn_detection": None},
            }
        )
        updated = json.loads(await conn.recv_bytes())
        assert updated["session"]["input_audio_format"] == "g711_alaw", updated
        for chunk in g711_chunks(line):
            await conn.input_audio_buffer.append(audio=chunk)
        await conn.input_audio_buffer.commit()
        events: list[Any] = []

        async def receive() -> None:
            async for event in conn:
                events.append(event)
                if event.type == COMPLETED:
                    return

        await asyncio.wait_for(receive(), WAIT_S)
    [transcript] = check_items(events)
    assert wer(reference(manifest, CLIP), transcript) <= MAX_WER_CLIP, transcript


@pytest.mark.asyncio(loop_scope="session")
async def test_the_beta_client_commits_by_hand_without_turn_detection(
    server_url: str, speech_dir: Path, manifest: list[ManifestRow]
) -> None:
    # The beta client builds wss:// from base_url; websocket_base_url points it at ws://.
    client = AsyncOpenAI(
        base_url=http_base(server_url) + "/v1",
        websocket_base_url=server_url + "/v1",
        api_key="unused",
        max_retries=0,
    )
    audio = chunks(pcm24(load_clip(speech_dir / CLIP)))
    events: list[Any] = []
    async with client.beta.realtime.connect(
        model="whisper-1", extra_query={"intent": "transcription"}
    ) as conn:
        created = json.loads(await conn.recv_bytes())
        assert created["type"] == "transcription_session.created", created
        assert created["session"]["input_audio_format"] == "pcm16"
        await conn.send(
            {
                "type": "transcription_session.update",  # type: ignore[misc,typeddict-item]
                "session": {
                    "input_audio_format": "pcm16",
                    "input_audio_transcription": {"model": "whisper-1", "language": "en"},
                    "turn_detection": None,
                },
            }
        )
        updated = await conn.recv()
        assert updated.type == "transcription_session.updated", updated
        assert updated.session.turn_detection is None
        for chunk in audio:
            await conn.input_audio_buffer.append(audio=chunk)
        await conn.input_audio_buffer.commit()

        async def receive() -> None:
            async for event in conn:
                events.append(event)
                if event.type == COMPLETED:
                    return

        await asyncio.wait_for(receive(), WAIT_S)
    kinds = [e.type for e in events]
    assert "input_audio_buffer.speech_started" not in kinds  # turns are the client's commits
    [transcript] = check_items(events)
    assert wer(reference(manifest, CLIP), transcript) <= MAX_WER_CLIP, transcript


# Two sentences, by two readers: each a turn of its own when a pause comes between them.
SENTENCES = ("misc_en/LDC93S1.wav", "misc_en/arctic_a0024.wav")


def two_sentences(speech_dir: Path, gap_s: float, silence_s: float) -> np.ndarray:
    """``SENTENCES``, ``gap_s`` apart, ``silence_s`` of silence after (16 kHz)."""
    first, second = (load_clip(speech_dir / name) for name in SENTENCES)
    gap = np.zeros(round(gap_s * SAMPLE_RATE_HZ), np.float32)
    after = np.zeros(round(silence_s * SAMPLE_RATE_HZ), np.float32)
    return np.concatenate([first, gap, second, after])


def semantic_vad(eagerness: str | None = None) -> dict[str, Any]:
    """A GA transcription session with ``semantic_vad`` (at ``eagerness`` when given)."""
    detection = {"type": "semantic_vad"}
    if eagerness is not None:
        detection["eagerness"] = eagerness
    return {"type": "transcription", "audio": {"input": {"turn_detection": detection}}}


@pytest.mark.asyncio(loop_scope="session")
async def test_the_openai_client_with_semantic_vad_gets_an_item_per_turn(
    server_url: str, speech_dir: Path, manifest: list[ManifestRow]
) -> None:
    """``semantic_vad`` at high eagerness (OpenAI's 2 s at most): a sentence and 3 s of
    silence are a turn, which the turn model (or the 2 s) ends; the client waits for its
    transcript, as a voice agent takes its turn, then says the next. Each turn is an item with
    OpenAI's events and its own transcript."""
    client = AsyncOpenAI(base_url=http_base(server_url) + "/v1", api_key="unused", max_retries=0)
    events: list[Any] = []
    async with client.realtime.connect(extra_query={"intent": "transcription"}) as conn:
        await conn.recv()  # session.created
        await conn.session.update(session=semantic_vad("high"))  # type: ignore[arg-type]
        updated = await conn.recv()
        assert updated.type == "session.updated", updated
        detection = updated.session.audio.input.turn_detection
        assert (detection.type, detection.eagerness) == ("semantic_vad", "high")
        for turn, name in enumerate(SENTENCES, start=1):
            sentence = load_clip(speech_dir / name)
            for chunk in chunks(pcm24(sentence, silence_s=3.0)):
                await conn.input_audio_buffer.append(audio=chunk)

            async def receive(turns: int = turn) -> None:
                async for event in conn:
                    events.append(event)
                    if [e.type for e in events].count(COMPLETED) == turns:
                        return

            await asyncio.wait_for(receive(), WAIT_S)
    assert not [e for e in events if e.type == "error"], events
    transcripts = check_items(events)
    started = [e for e in events if e.type == "input_audio_buffer.speech_started"]
    completed = [e for e in events if e.type == COMPLETED]
    assert [e.item_id for e in started] == [e.item_id for e in completed]
    for event in started:
        [stopped] = [
            e
            for e in events
            if e.type == "input_audio_buffer.speech_stopped" and e.item_id == event.item_id
        ]
        assert stopped.audio_end_ms > event.audio_start_ms
    for name, transcript in zip(SENTENCES, transcripts, strict=True):
        assert wer(reference(manifest, name), transcript) <= MAX_WER_CLIP, transcripts


@pytest.mark.asyncio(loop_scope="session")
async def test_livekits_openai_plugin_transcribes_in_realtime_mode(
    server_url: str, speech_dir: Path, manifest: list[ManifestRow]
) -> None:
    """livekit-plugins-openai's ``STT(use_realtime=True)``, unchanged but for its base URL: a
    turn per utterance the server's VAD hears, a final transcript for each."""
    clip = load_clip(speech_dir / CLIP)
    pcm = np.concatenate([clip, np.zeros(int(1.5 * SAMPLE_RATE_HZ), np.float32)])
    step = SAMPLE_RATE_HZ // 10
    kind = lk_stt.SpeechEventType
    events: list[lk_stt.SpeechEvent] = []
    async with aiohttp.ClientSession() as http:
        plugin = lk_openai.STT(
            model="gpt-4o-transcribe",
            use_realtime=True,
            base_url=http_base(server_url) + "/v1",
            api_key="unused",
        )
        plugin._session = http  # outside a LiveKit job, which would lend its own session
        stream = plugin.stream()
        for k in range(0, pcm.shape[0], step):  # at a microphone's pace
            frame = pcm_s16le_bytes(pcm[k : k + step])
            stream.push_frame(rtc.AudioFrame(frame, SAMPLE_RATE_HZ, 1, len(frame) // 2))
            await asyncio.sleep(0.1)

        async def receive() -> None:
            # The room's audio would go on; here the turns end with the clip's silence.
            async for event in stream:
                events.append(event)
                ends = sum(e.type == kind.END_OF_SPEECH for e in events)
                finals = sum(e.type == kind.FINAL_TRANSCRIPT for e in events)
                if event.type == kind.FINAL_TRANSCRIPT and finals >= ends:
                    return

        await asyncio.wait_for(receive(), WAIT_S)
        await stream.aclose()
        await plugin.aclose()
    kinds = [e.type for e in events]
    assert kinds[0] == kind.START_OF_SPEECH and kind.INTERIM_TRANSCRIPT in kinds, kinds
    text = " ".join(e.alternatives[0].text for e in events if e.type == kind.FINAL_TRANSCRIPT)
    assert wer(reference(manifest, CLIP), text) <= MAX_WER_CLIP, text


@pytest.mark.asyncio(loop_scope="session")
async def test_livekits_openai_plugin_recognizes_an_utterance_by_the_rest_api(
    server_url: str, speech_dir: Path, manifest: list[ManifestRow]
) -> None:
    """livekit-plugins-openai's ``STT()`` as an agent gets it (``use_realtime=False``, the
    default): ``recognize()`` sends the buffered utterance as one WAV to ``POST
    /v1/audio/transcriptions`` through the ``openai`` client, base URL the only change."""
    clip = load_clip(speech_dir / CLIP)
    step = SAMPLE_RATE_HZ // 10
    buffer = []
    for k in range(0, clip.shape[0], step):
        frame = pcm_s16le_bytes(clip[k : k + step])
        buffer.append(rtc.AudioFrame(frame, SAMPLE_RATE_HZ, 1, len(frame) // 2))
    plugin = lk_openai.STT(
        model="gpt-4o-transcribe", base_url=http_base(server_url) + "/v1", api_key="unused"
    )
    event = await asyncio.wait_for(plugin.recognize(buffer, language="en"), WAIT_S)
    await plugin.aclose()
    assert event.type == lk_stt.SpeechEventType.FINAL_TRANSCRIPT
    [alternative] = event.alternatives
    assert alternative.language == "en"
    assert wer(reference(manifest, CLIP), alternative.text) <= MAX_WER_CLIP, alternative.text


# --------------------------------------------------------------------------- at the endpoint


async def test_speech_stopped_comes_at_the_endpoint_and_completed_with_the_final(
    engine: Engine, speech_dir: Path
) -> None:
    """An utterance spoken in real time, 1.5 s of silence, then nothing: ``speech_stopped``
    and ``committed`` go out when the voice activity detector ends the turn, before its
    closing decode returns; ``completed`` right behind the last delta, with the decode that
    made it (no other decode in between, no further input needed).

    The speculative closing decode is off here: with it, the closing decode may return in the
    silence before the endpoint, and which comes first would be a race, not what is tested."""
    timed = TimedEngine(engine)
    clip = load_clip(speech_dir / CLIP)
    config = ServerConfig(host="127.0.0.1", port=0, capacity_limit=False, warmup=False)
    arrived: list[tuple[float, dict[str, Any]]] = []
    async with (
        WhisperwireServer(
            lambda: timed,
            server=config,
            pipeline=PipelineConfig(batch_wait_ms=5.0),
            streaming=StreamingConfig(rules=RulesConfig(disabled=("speculative_closing",))),
        ) as server,
        connect(realtime_url(server)) as ws,
    ):

        async def read_until_completed() -> None:
            while not arrived or arrived[-1][1]["type"] != COMPLETED:
                event = json.loads(await ws.recv())
                arrived.append((time.monotonic(), event))

        reader = asyncio.create_task(read_until_completed())
        for chunk in chunks(pcm24(clip, silence_s=1.5)):
            await send(ws, type="input_audio_buffer.append", audio=chunk)
            await asyncio.sleep(CHUNK_S)
        await asyncio.wait_for(reader, WAIT_S)
        waited_until = time.monotonic()
    kinds = [e["type"] for _, e in arrived]
    assert "error" not in kinds, kinds
    stopped = kinds.index("input_audio_buffer.speech_stopped")
    assert kinds[stopped + 1] == "input_audio_buffer.committed", kinds
    completed_at, completed = arrived[-1]
    last_decode = max(t for t in timed.returned_at if t <= completed_at)
    # The turn ended before its last decode returned: speech_stopped did not wait for it.
    assert arrived[stopped][0] < last_decode
    # completed: right behind the item's last delta, from the same decode, at once, and no
    # decode after it (it was the utterance's last).
    deltas = [k for k, e in enumerate(kinds) if e == DELTA]
    assert deltas and deltas[-1] == len(arrived) - 2, kinds
    assert timed.returned_between(arrived[deltas[-1]][0], completed_at) == 0
    assert completed_at - last_decode < ENDPOINT_EVENT_S, completed_at - last_decode
    assert timed.returned_between(completed_at, waited_until) == 0
    texts = "".join(arrived[k][1]["delta"] for k in deltas)
    assert completed["transcript"] == texts and texts


# --------------------------------------------------------------------------- protocol edges


def realtime_url(server: WhisperwireServer, query: str = "intent=transcription") -> str:
    return f"{server.url}{REALTIME_PATH}?{query}"


async def next_event(ws: ClientConnection, kind: str | None = None) -> dict[str, Any]:
    """The next server event (of ``kind``, skipping others)."""
    while True:
        event: dict[str, Any] = json.loads(await asyncio.wait_for(ws.recv(), 30))
        if kind is None or event["type"] == kind:
            return event


async def send(ws: ClientConnection, **event: Any) -> None:
    await ws.send(json.dumps(event))


MANUAL = {"type": "transcription", "audio": {"input": {"turn_detection": None}}}


async def test_refused_events_get_openai_errors_and_the_session_goes_on(speech_dir: Path) -> None:
    pcm = pcm24(load_clip(speech_dir / CLIP)[: 2 * SAMPLE_RATE_HZ])
    async with scripted_server() as server, connect(realtime_url(server)) as ws:
        assert (await next_event(ws))["type"] == "session.created"
        refused: list[tuple[str | bytes, str, str | None]] = [
            ("{not json", "invalid_json", None),
            ('{"type": "input_audio_buffer.append", "audio": "%%%"}', "invalid_value", "audio"),
            (
                json.dumps(
                    {
                        "type": "session.update",
                        "session": {
                            "type": "transcription",
                            "audio": {"input": {"format": {"type": "audio/opus"}}},
                        },
                    }
                ),
                "invalid_value",
                "session.audio.input.format.type",
            ),
            (
                json.dumps(
                    {
                        "type": "session.update",
                        "session": {
                            "type": "transcription",
                            "audio": {"input": {"format": {"type": "audio/pcmu", "rate": 16000}}},
                        },
                    }
                ),
                "unsupported_value",
                "session.audio.input.format.rate",
            ),
            (
                json.dumps({"type": "session.update", "session": {"type": "realtime"}}),
                "unsupported_value",
                "session.type",
            ),
            (
                json.dumps(
                    {"type": "session.update", "session": {"type": "transcription", "x": 1}}
                ),
                "unknown_parameter",
                "session.x",
            ),
            (
                json.dumps(
                    {
                        "type": "session.update",
                        "session": {
                            "type": "transcription",
                            "audio": {"input": {"transcription": {"language": "de"}}},
                        },
                    }
                ),
                "invalid_value",  # the scripted model, like tiny.en, is English-only
                "session.audio.input.transcription.language",
            ),
            ('{"type": "response.create", "event_id": "evt_1"}', "unsupported_event", "type"),
            ('{"type": "input_audio_buffer.commit"}', "input_audio_buffer_commit_empty", None),
            ('{"type": "no.such.event"}', "invalid_value", "type"),
            (b"\x00\x01", "invalid_request", None),
        ]
        for frame, code, param in refused:
            await ws.send(frame)
            error = await next_event(ws)
            assert error["type"] == "error", (frame, error)
            assert (error["error"]["code"], error["error"]["param"]) == (code, param), error
            assert error["error"]["type"] == "invalid_request_error"
        assert error["error"]["event_id"] is None
        await send(ws, type="response.create", event_id="evt_2")
        assert (await next_event(ws, "error"))["error"]["event_id"] == "evt_2"
        await send(ws, type="session.update", session=MANUAL)
        assert (await next_event(ws))["session"]["audio"]["input"]["turn_detection"] is None
        # Appends split inside a sample lose nothing: the next append completes it.
        pieces = [pcm[:4801], pcm[4801:9999], pcm[9999:]]
        for piece in pieces:
            await send(ws, type="input_audio_buffer.append", audio=base64.b64encode(piece).decode())
        await send(ws, type="input_audio_buffer.commit")
        committed = await next_event(ws)
        assert committed["type"] == "input_audio_buffer.committed", committed
        completed = await next_event(ws, COMPLETED)
        assert completed["item_id"] == committed["item_id"]
        assert completed["transcript"].split()[:2] == ["w0", "w1"]
        _, _, body = await http_get(server.http_url + "/metrics")
        received = metric_value(body.decode(), "whisperwire_audio_received_seconds_total")
        assert received == pytest.approx(len(pcm) / 2 / DEFAULT_RATE_HZ, abs=1e-3)


async def test_g711_appends_of_any_length_are_all_audio_and_a_bad_name_lists_the_others(
    speech_dir: Path,
) -> None:
    line = phone_line(load_clip(speech_dir / CLIP)[: 2 * SAMPLE_RATE_HZ])
    async with scripted_server() as server, connect(realtime_url(server)) as ws:
        await next_event(ws)
        await send(
            ws,
            type="transcription_session.update",
            session={"input_audio_format": "g711_ulaw_8k"},
        )
        error = (await next_event(ws, "error"))["error"]
        assert error["param"] == "session.input_audio_format", error
        assert "'pcm16', 'g711_ulaw', 'g711_alaw'" in error["message"]
        await send(
            ws,
            type="transcription_session.update",
            session={"input_audio_format": "g711_ulaw", "turn_detection": None},
        )
        assert (await next_event(ws))["session"]["input_audio_format"] == "g711_ulaw"
        for piece in (line[:1], line[1:4001], line[4001:]):  # one byte is a whole sample
            await send(ws, type="input_audio_buffer.append", audio=base64.b64encode(piece).decode())
        await send(ws, type="input_audio_buffer.commit")
        await next_event(ws, COMPLETED)
        _, _, body = await http_get(server.http_url + "/metrics")
        received = metric_value(body.decode(), "whisperwire_audio_received_seconds_total")
        assert received == pytest.approx(len(line) / PHONE_RATE_HZ, abs=1e-3)


async def test_the_format_cannot_change_after_audio(speech_dir: Path) -> None:
    pcm = pcm24(load_clip(speech_dir / CLIP)[:SAMPLE_RATE_HZ])
    rate = {
        "type": "transcription",
        "audio": {"input": {"format": {"type": "audio/pcm", "rate": 16000}}},
    }
    async with scripted_server() as server, connect(realtime_url(server)) as ws:
        await next_event(ws)
        await send(ws, type="input_audio_buffer.append", audio=base64.b64encode(pcm).decode())
        await send(ws, type="session.update", session=rate)
        error = await next_event(ws, "error")
        assert error["error"]["param"] == "session.audio.input", error
        # The same settings again are not a change.
        await send(ws, type="session.update", session={"type": "transcription", **MANUAL})
        updated = await next_event(ws)
        assert updated["type"] == "session.updated", updated
        assert updated["session"]["audio"]["input"]["format"]["rate"] == DEFAULT_RATE_HZ


async def test_server_vad_parameters_are_applied_and_reported() -> None:
    def detection(**fields: Any) -> dict[str, Any]:
        turn = {"type": "server_vad", **fields}
        return {"type": "transcription", "audio": {"input": {"turn_detection": turn}}}

    async with scripted_server() as server, connect(realtime_url(server)) as ws:
        created = await next_event(ws)
        default = created["session"]["audio"]["input"]["turn_detection"]
        assert default == {
            "type": "server_vad",
            "threshold": 0.5,
            "prefix_padding_ms": 200,
            "silence_duration_ms": 500,
        }
        asked = detection(silence_duration_ms=300, prefix_padding_ms=5000, threshold=0.9)
        await send(ws, type="session.update", session=asked)
        updated = await next_event(ws, "session.updated")
        # In effect: 300 ms, the padding at the audio kept (1 s), webrtcvad's most eager mode.
        assert updated["session"]["audio"]["input"]["turn_detection"] == {
            "type": "server_vad",
            "threshold": 0.75,
            "prefix_padding_ms": 1000,
            "silence_duration_ms": 300,
        }
        await send(ws, type="session.update", session=detection(silence_duration_ms=10))
        floor = await next_event(ws, "session.updated")
        silence = floor["session"]["audio"]["input"]["turn_detection"]["silence_duration_ms"]
        assert silence == END_OF_SPEECH_MS_RANGE[0]
        for bad in ({"threshold": 2}, {"silence_duration_ms": -5}, {"prefix_padding_ms": "x"}):
            await send(ws, type="session.update", session=detection(**bad))
            error = await next_event(ws, "error")
            assert error["error"]["param"].startswith("session.audio.input.turn_detection."), error


async def items_of(
    server: WhisperwireServer, session: dict[str, Any], parts: list[bytes], items: int
) -> list[dict[str, Any]]:
    """The server events of a stream of ``parts`` (PCM16 at 24 kHz, each ending in a pause
    the client waits out as a speaker would) under ``session``, up to the ``items``-th
    completed transcript."""
    events: list[dict[str, Any]] = []
    async with connect(realtime_url(server)) as ws:
        await next_event(ws)
        await send(ws, type="session.update", session=session)
        assert (await next_event(ws))["type"] == "session.updated"
        for k, part in enumerate(parts):
            if k:
                await asyncio.sleep(PAUSE_S)  # in real time: the server may end the turn
            for chunk in chunks(part):
                await send(ws, type="input_audio_buffer.append", audio=chunk)
        while [e["type"] for e in events].count(COMPLETED) < items:
            events.append(await next_event(ws))
    assert not [e for e in events if e["type"] == "error"], events
    return events


PAUSE_S = 1.2  # longer than the end of speech (500 ms), shorter than high eagerness's 2 s


async def test_with_semantic_vad_an_item_goes_on_across_a_pause_the_turn_model_calls_unfinished(
    speech_dir: Path,
) -> None:
    """Two sentences, a pause between them. server_vad ends an item at the pause (the voice
    activity detector ends speech after 500 ms of silence); with semantic_vad a turn model
    that calls the speaker unfinished keeps one item across it, until high eagerness's 2 s of
    silence. (One that calls every pause finished ends the turn there: two items.)"""
    first, second = (load_clip(speech_dir / name) for name in SENTENCES)
    parts = [pcm24(first, silence_s=PAUSE_S), pcm24(second, silence_s=3.0)]
    first_s = first.size / SAMPLE_RATE_HZ
    unfinished = FixedTurnModel(0.0)
    async with scripted_server() as server:
        server.pipeline.turn_model = unfinished
        by_vad = await items_of(server, {"type": "transcription"}, parts, items=2)
        by_turn = await items_of(server, semantic_vad("high"), parts, items=1)
    first_item = next(e for e in by_vad if e["type"] == COMPLETED)
    assert first_item["usage"]["seconds"] < first_s + PAUSE_S / 2
    assert unfinished.scored >= 1  # the pause was the turn model's to call
    kinds = [e["type"] for e in by_turn]
    ends = ["input_audio_buffer.speech_stopped", "input_audio_buffer.committed", COMPLETED]
    assert [k for k in kinds if k != DELTA] == ["input_audio_buffer.speech_started", *ends]
    assert len({e["item_id"] for e in by_turn}) == 1
    # The item holds both sentences, and its deltas add up to its transcript.
    stopped, item = by_turn[-3], by_turn[-1]
    assert stopped["audio_end_ms"] > (first_s + PAUSE_S) * 1000, stopped
    assert item["usage"]["seconds"] > first_s + PAUSE_S, item
    assert item["transcript"] == "".join(e["delta"] for e in by_turn if e["type"] == DELTA)


async def test_with_semantic_vad_a_commit_ends_the_turn_with_its_item(speech_dir: Path) -> None:
    """A push-to-talk client on semantic_vad: each commit ends the item and the turn, so the
    speech after it is a turn and an item of its own, although the turn model calls neither
    finished."""
    items: list[list[dict[str, Any]]] = []
    async with scripted_server() as server:
        server.pipeline.turn_model = FixedTurnModel(0.0)
        async with connect(realtime_url(server)) as ws:
            await next_event(ws)
            await send(ws, type="session.update", session=semantic_vad("low"))
            await next_event(ws, "session.updated")
            for name in SENTENCES:
                for chunk in chunks(pcm24(load_clip(speech_dir / name), silence_s=0.3)):
                    await send(ws, type="input_audio_buffer.append", audio=chunk)
                await send(ws, type="input_audio_buffer.commit")
                items.append([])
                while not items[-1] or items[-1][-1]["type"] != COMPLETED:
                    items[-1].append(await next_event(ws))
    for events in items:
        kinds = [e["type"] for e in events if e["type"] != DELTA]
        assert kinds == [
            "input_audio_buffer.speech_started",
            "input_audio_buffer.committed",
            COMPLETED,
        ]
        assert len({e["item_id"] for e in events}) == 1 and events[-1]["transcript"]
    assert items[0][0]["item_id"] != items[1][0]["item_id"]


async def test_semantic_vad_is_taken_in_both_shapes_and_refused_in_openais_words() -> None:
    async with scripted_server() as server, connect(realtime_url(server)) as ws:
        await next_event(ws)
        await send(ws, type="session.update", session=semantic_vad())
        updated = await next_event(ws, "session.updated")
        detection = updated["session"]["audio"]["input"]["turn_detection"]
        assert detection == {"type": "semantic_vad", "eagerness": "auto"}
        beta = {"turn_detection": {"type": "semantic_vad", "eagerness": "low"}}
        await send(ws, type="transcription_session.update", session=beta)
        updated = await next_event(ws, "transcription_session.updated")
        assert updated["session"]["turn_detection"] == beta["turn_detection"]
        await send(ws, type="session.update", session=semantic_vad("eager"))
        error = (await next_event(ws, "error"))["error"]
        assert error["type"] == "invalid_request_error" and error["code"] == "invalid_value"
        assert error["param"] == "session.audio.input.turn_detection.eagerness", error
        assert "'low', 'medium', 'high', 'auto'" in error["message"]
        vad_only = semantic_vad("high")
        vad_only["audio"]["input"]["turn_detection"]["silence_duration_ms"] = 300
        await send(ws, type="session.update", session=vad_only)
        error = (await next_event(ws, "error"))["error"]
        assert error["param"] == "session.audio.input.turn_detection.silence_duration_ms", error
        # What was refused changed nothing: the session is still at low eagerness.
        await send(ws, type="session.update", session={"type": "transcription"})
        updated = await next_event(ws, "session.updated")
        detection = updated["session"]["audio"]["input"]["turn_detection"]
        assert detection == {"type": "semantic_vad", "eagerness": "low"}
    async with scripted_server(turn_model=False) as server, connect(realtime_url(server)) as ws:
        await next_event(ws)
        for kind, session, param in (
            ("session.update", semantic_vad("high"), "session.audio.input.turn_detection.type"),
            ("transcription_session.update", beta, "session.turn_detection.type"),
        ):
            await send(ws, type=kind, session=session)
            error = (await next_event(ws, "error"))["error"]
            assert (error["type"], error["param"]) == ("invalid_request_error", param), error
            assert "semantic_vad needs the turn model" in error["message"]
        await send(ws, type="session.update", session=MANUAL)  # the session goes on
        assert (await next_event(ws))["type"] == "session.updated"


async def test_a_cleared_item_is_dropped_and_the_next_one_completes(speech_dir: Path) -> None:
    first, second = (
        pcm24(load_clip(speech_dir / CLIP)[i * SAMPLE_RATE_HZ : (i + 2) * SAMPLE_RATE_HZ])
        for i in (0, 2)
    )
    async with scripted_server() as server, connect(realtime_url(server)) as ws:
        await next_event(ws)
        await send(ws, type="session.update", session=MANUAL)
        await next_event(ws, "session.updated")
        await send(ws, type="input_audio_buffer.append", audio=base64.b64encode(first).decode())
        await send(ws, type="input_audio_buffer.clear")
        await send(ws, type="input_audio_buffer.append", audio=base64.b64encode(second).decode())
        await send(ws, type="input_audio_buffer.commit")
        events = []
        while not events or events[-1]["type"] != COMPLETED:
            events.append(await next_event(ws))
    kinds = [e["type"] for e in events]
    assert kinds.count("input_audio_buffer.cleared") == 1
    [committed] = [e for e in events if e["type"] == "input_audio_buffer.committed"]
    deltas = [e for e in events if e["type"] == DELTA]
    assert deltas and all(d["item_id"] == committed["item_id"] for d in deltas)
    assert events[-1]["item_id"] == committed["item_id"] and events[-1]["transcript"]


async def test_shutdown_completes_the_open_item_then_closes_1001(speech_dir: Path) -> None:
    pcm = pcm24(load_clip(speech_dir / LONG_CLIP)[: 8 * SAMPLE_RATE_HZ])  # no pause in it
    async with scripted_server() as server:
        async with connect(realtime_url(server)) as ws:
            await next_event(ws)
            for chunk in chunks(pcm):
                await send(ws, type="input_audio_buffer.append", audio=chunk)
            started = await next_event(ws, "input_audio_buffer.speech_started")
            shutdown = asyncio.create_task(server.shutdown())
            events = []
            with contextlib.suppress(ConnectionClosed):
                async for raw in ws:
                    events.append(json.loads(raw))
            await shutdown
        # Ending the stream ends its speech: the item is committed, then its text completes.
        kinds = [e["type"] for e in events]
        assert kinds[-1] == COMPLETED and "input_audio_buffer.committed" in kinds
        completed = events[-1]
        assert completed["item_id"] == started["item_id"] and completed["transcript"]
        deltas = [e["delta"] for e in events if e["type"] == DELTA]
        assert "".join(deltas) == completed["transcript"]
        assert ws.close_code == 1001


async def test_too_large_an_append_closes_1009() -> None:
    streaming = StreamingConfig(max_frame_bytes=32 * 1024)
    async with scripted_server(streaming=streaming) as server:
        async with connect(realtime_url(server)) as ws:
            await next_event(ws)
            audio = base64.b64encode(bytes(40 * 1024)).decode()
            await send(ws, type="input_audio_buffer.append", audio=audio)
            error = await next_event(ws, "error")
            with contextlib.suppress(ConnectionClosed):
                await ws.recv()
        assert error["error"]["code"] == "frame_too_large"
        assert ws.close_code == 1009


@pytest.mark.parametrize(
    "query",
    ["", "intent=conversation", "intent=transcription&voice=alloy"],
)
def test_the_handshake_needs_the_transcription_intent(query: str) -> None:
    from websockets.datastructures import Headers
    from websockets.http11 import Request

    assert handshake_problem(Request(f"{REALTIME_PATH}?{query}", Headers())) is not None


async def test_handshakes_are_checked_like_v1_and_for_the_intent() -> None:
    async with scripted_server(api_key="s3cret") as server:
        for query, headers, status in [
            ("intent=transcription", {}, 401),
            ("intent=conversation", {"Authorization": "Bearer s3cret"}, 400),
            (
                "intent=transcription",
                {"Authorization": "Bearer s3cret", "Origin": "https://x.example"},
                403,
            ),
        ]:
            with pytest.raises(InvalidStatus) as refused:
                async with connect(realtime_url(server, query), additional_headers=headers):
                    pass
            assert refused.value.response.status_code == status
        client = AsyncOpenAI(base_url=server.http_url + "/v1", api_key="s3cret", max_retries=0)
        async with client.realtime.connect(extra_query={"intent": "transcription"}) as conn:
            assert (await conn.recv()).type == "session.created"


async def test_a_full_server_refuses_the_sdks_connect_with_503_and_retry_after() -> None:
    """The server carries one stream and the SDK holds it: the next ``realtime.connect``
    raises websockets' ``InvalidStatus`` with the server's answer, 503 (refused before the
    handshake, so a balancer replays it on another instance), its Retry-After and why. Once
    the first has left, the next gets in."""
    async with scripted_server(capacity_streams=1) as server:
        client = AsyncOpenAI(base_url=server.http_url + "/v1", api_key="unused", max_retries=0)
        query = {"intent": "transcription"}
        async with client.realtime.connect(extra_query=query) as first:
            assert (await first.recv()).type == "session.created"
            with pytest.raises(InvalidStatus) as refused:
                async with client.realtime.connect(extra_query=query):
                    pass
        answer = refused.value.response
        assert answer.status_code == 503
        assert answer.headers["Retry-After"] == str(ServerConfig().retry_after_s)
        assert answer.body.startswith(b"the server carries 1 real-time stream(s)"), answer.body
        async with asyncio.timeout(30):  # the first's connection ends on the server's side
            while server.active_sessions:
                await asyncio.sleep(0.01)
        async with client.realtime.connect(extra_query=query) as second:
            assert (await second.recv()).type == "session.created"
        assert server.metrics.sessions_refused.value("capacity") == 1


def test_sessions_label_no_speakers_and_take_the_agent_finals() -> None:
    """OpenAI's transcription events have no speaker field: a server started with
    ``--speakers`` (whose v1 streams are labelled by default) labels none of these streams,
    so no final waits for labels that would never be sent. Their finals are the server's
    ``agent_finals``, not the v1 streams'."""
    from websockets.datastructures import Headers
    from websockets.http11 import Request

    from server.apis.adapters import SessionSettings
    from server.apis.openai_realtime import RealtimeAdapter
    from server.config import VadConfig
    from server.core.session import Session
    from server.core.speakers import SpeakerConfig

    on = StreamingConfig(speakers=SpeakerConfig(enabled=True))
    assert Session("v1", streaming=on).labels_speakers  # what a v1 stream gets
    settings = SessionSettings("s", on, VadConfig(), multilingual=False, model="m")
    request = Request(f"{REALTIME_PATH}?intent=transcription", Headers())
    session = RealtimeAdapter().open_session(settings, request)
    assert not session.labels_speakers and session.settings.speakers is False
    # A turn's transcription completes when its final arrives: the server's agent_finals.
    assert session.streaming.finals == on.agent_finals == "words"
    utterance = dataclasses.replace(on, agent_finals="utterance")
    settings = SessionSettings("s", utterance, VadConfig(), multilingual=False, model="m")
    assert RealtimeAdapter().open_session(settings, request).streaming.finals == "utterance"
