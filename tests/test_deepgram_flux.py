"""Deepgram Flux on ``/v2/listen``: the ``deepgram-sdk`` package's v2 client and LiveKit's
``deepgram.STTv2``, unchanged but for the URL, against a real server with the real model and
the real turn model; raw WebSocket clients for the protocol's edges."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
from deepgram import AsyncDeepgramClient
from livekit import rtc
from livekit.agents import stt as lk_stt
from livekit.plugins import deepgram as lk_deepgram
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from bench.corpus import ManifestRow, load_clip, wer
from server.apis.deepgram_flux import FLUX_PATH, parse_options
from server.protocol.formats import SAMPLE_RATE_HZ
from tests.helpers import pcm_frames, scripted_server
from tests.test_deepgram_live import environment, reference

WAIT_S = 120.0  # a bound for waits on the real model on a busy 2-core machine
MAX_WER_CLIP = 0.35
CLIP = "ljspeech/LJ001-0005.wav"  # 8.1 s read, ending a sentence
FRAME_S = 0.1
QUERY = "model=flux-general-en&encoding=linear16&sample_rate=16000"


def speech_then_silence(speech_dir: Path, silence_s: float = 2.5) -> list[bytes]:
    clip = load_clip(speech_dir / CLIP)
    return pcm_frames(np.concatenate([clip, np.zeros(int(silence_s * SAMPLE_RATE_HZ), np.float32)]))


# --------------------------------------------------------------------------- real clients


@pytest.mark.asyncio(loop_scope="session")  # the server_url fixture's loop
async def test_the_deepgram_v2_client_gets_a_turn_that_ends_with_its_final_transcript(
    server_url: str, speech_dir: Path, manifest: list[ManifestRow]
) -> None:
    client = AsyncDeepgramClient(api_key="unused", environment=environment(server_url))
    frames = speech_then_silence(speech_dir)
    messages: list[Any] = []
    async with client.listen.v2.connect(
        model="flux-general-en", encoding="linear16", sample_rate="16000"
    ) as socket:

        async def send() -> None:
            for frame in frames:  # at a microphone's pace
                await socket.send_media(frame)
                await asyncio.sleep(FRAME_S)
            await socket.send_close_stream()

        sender = asyncio.create_task(send())

        async def receive() -> None:
            async for message in socket:
                messages.append(message)

        await asyncio.wait_for(receive(), WAIT_S)
        await sender
    assert messages[0].type == "Connected"
    turns = [m for m in messages if m.type == "TurnInfo"]
    events = [t.event for t in turns]
    assert events[0] == "StartOfTurn" and "Update" in events and events[-1] == "EndOfTurn", events
    assert [m.sequence_id for m in messages] == list(range(len(messages)))
    end = turns[-1]
    # A read sentence that ends in a full stop: the turn model calls the pause complete.
    assert end.trigger == "model" and end.end_of_turn_confidence >= 0.7
    assert wer(reference(manifest, CLIP), end.transcript) <= MAX_WER_CLIP, end.transcript
    assert end.words and all(w.start <= w.end for w in end.words)
    assert all(a.end <= b.start + 1e-3 for a, b in itertools.pairwise(end.words))
    assert {t.turn_index for t in turns} == {0}
    # The turn ended within the silence, long before its 5 s timeout.
    assert end.audio_window_end <= len(frames) * FRAME_S


@pytest.mark.asyncio(loop_scope="session")  # the server_url fixture's loop
async def test_livekits_deepgram_stt_v2_streams_turns_with_only_its_base_url_changed(
    server_url: str, speech_dir: Path, manifest: list[ManifestRow]
) -> None:
    """livekit-plugins-deepgram's ``STTv2().stream()``: start of speech, the final transcript
    and the end of speech, from the turn's events."""
    frames = speech_then_silence(speech_dir)
    events: list[lk_stt.SpeechEvent] = []
    async with aiohttp.ClientSession() as http:
        plugin = lk_deepgram.STTv2(
            api_key="unused", base_url=f"{server_url}{FLUX_PATH}", http_session=http
        )
        stream = plugin.stream()

        async def send() -> None:
            for frame in frames:
                stream.push_frame(rtc.AudioFrame(frame, SAMPLE_RATE_HZ, 1, len(frame) // 2))
                await asyncio.sleep(FRAME_S)
            stream.end_input()

        async def receive() -> None:
            async for event in stream:
                events.append(event)
                if event.type == lk_stt.SpeechEventType.END_OF_SPEECH:
                    return

        sender = asyncio.create_task(send())
        await asyncio.wait_for(receive(), WAIT_S)
        await sender
        await stream.aclose()
        await plugin.aclose()
    kind = lk_stt.SpeechEventType
    kinds = [e.type for e in events]
    assert kinds[0] == kind.START_OF_SPEECH and kinds[-1] == kind.END_OF_SPEECH, kinds
    finals = [e.alternatives[0].text for e in events if e.type == kind.FINAL_TRANSCRIPT]
    assert finals, kinds
    assert wer(reference(manifest, CLIP), " ".join(finals)) <= MAX_WER_CLIP, finals


@pytest.mark.asyncio(loop_scope="session")  # the server_url fixture's loop
async def test_force_end_turn_ends_the_turn_at_once_and_configure_is_answered(
    server_url: str, speech_dir: Path
) -> None:
    clip = load_clip(speech_dir / CLIP)[: 2 * SAMPLE_RATE_HZ]  # mid-sentence
    async with connect(f"{server_url}{FLUX_PATH}?{QUERY}&eot_timeout_ms=9000") as ws:
        connected = json.loads(await ws.recv())
        assert connected["type"] == "Connected" and connected["sequence_id"] == 0
        await ws.send(json.dumps({"type": "Configure", "thresholds": {"eot_threshold": 0.9}}))
        for frame in pcm_frames(clip):
            await ws.send(frame)
        await ws.send(json.dumps({"type": "ForceEndTurn"}))
        seen: list[dict[str, Any]] = []
        while not (seen and seen[-1].get("event") == "EndOfTurn"):
            seen.append(json.loads(await asyncio.wait_for(ws.recv(), WAIT_S)))
        await ws.send(json.dumps({"type": "Configure", "thresholds": {"eot_threshold": 2}}))
        failure = json.loads(await asyncio.wait_for(ws.recv(), WAIT_S))
        await ws.send(json.dumps({"type": "CloseStream"}))
        with contextlib.suppress(ConnectionClosed):
            async for _ in ws:
                pass
        assert ws.close_code == 1000
    success = next(m for m in seen if m["type"] == "ConfigureSuccess")
    assert success["thresholds"]["eot_threshold"] == 0.9
    end = seen[-1]
    assert end["trigger"] == "manual" and end["transcript"]
    assert failure["type"] == "ConfigureFailure" and "eot_threshold" in failure["description"]


# --------------------------------------------------------------------------- the edges


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "query, problem",
    [
        ("encoding=ogg-opus", "encoding=ogg-opus is not supported"),
        ("sample_rate=4000", "sample_rate must be 8000 to 48000"),
        ("eot_threshold=0.2", "eot_threshold must be 0.5 to 0.9"),
        ("eager_eot_threshold=0.8&eot_threshold=0.6", "must be at most eot_threshold"),
        ("eot_timeout_ms=soon", "eot_timeout_ms must be a number"),
        ("eot_timeout_ms=inf", "eot_timeout_ms must be a number"),
        ("diarize=true", "unsupported option(s): diarize"),
    ],
)
async def test_options_flux_cannot_honour_are_refused_before_the_handshake(
    query: str, problem: str
) -> None:
    async with scripted_server() as server:
        with pytest.raises(InvalidStatus) as refused:
            async with connect(f"{server.url}{FLUX_PATH}?{query}"):
                pass
    assert refused.value.response.status_code == 400
    assert problem in refused.value.response.body.decode()


@pytest.mark.asyncio
async def test_a_server_without_the_turn_model_says_so_and_closes() -> None:
    async with (
        scripted_server(turn_model=False) as server,
        connect(f"{server.url}{FLUX_PATH}?{QUERY}") as ws,
    ):
        message = json.loads(await ws.recv())
        with contextlib.suppress(ConnectionClosed):
            await ws.recv()
    assert (
        message["type"] == "Error" and "turn detection is not installed" in message["description"]
    )
    assert ws.close_code == 1011


@pytest.mark.asyncio
async def test_an_unknown_message_is_an_error_and_the_server_goes_on() -> None:
    async with scripted_server() as server:
        async with connect(f"{server.url}{FLUX_PATH}?{QUERY}") as ws:
            assert json.loads(await ws.recv())["type"] == "Connected"
            await ws.send(json.dumps({"type": "Finalize"}))
            error = json.loads(await ws.recv())
            with contextlib.suppress(ConnectionClosed):
                await ws.recv()
        assert error["type"] == "Error" and "ForceEndTurn" in error["description"]
        async with connect(f"{server.url}{FLUX_PATH}?{QUERY}") as again:
            assert json.loads(await again.recv())["type"] == "Connected"


def test_the_query_livekit_and_pipecat_send_is_taken() -> None:
    options = parse_options(
        f"{FLUX_PATH}?model=flux-general-en&sample_rate=16000&encoding=linear16"
        "&eager_eot_threshold=0.5&eot_threshold=0.8&eot_timeout_ms=3000&keyterm=Whisperwire"
        "&tag=agent&mip_opt_out=true"
    )
    assert options.sample_rate_hz == 16000 and options.keyterms == ("Whisperwire",)
    turns = options.turns
    assert (turns.eager_eot_threshold, turns.eot_threshold, turns.eot_timeout_ms) == (
        0.5,
        0.8,
        3000,
    )
