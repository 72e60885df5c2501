"""Protocol v1's adapter: its messages parsed into the session's typed calls, and back."""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from websockets.asyncio.client import connect
from websockets.datastructures import Headers
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request

from bench.corpus import ManifestRow, load_clip, wer
from bench.phone_line import PHONE_RATE_HZ, phone_line
from server.apis.adapters import SessionSettings
from server.apis.registry import STREAM_APIS
from server.apis.v1_stream import (
    STREAM_PATH,
    V1Adapter,
    apply_text,
    settings_from_config,
    turn_message,
)
from server.config import StreamingConfig, VadConfig
from server.core.session import Session, Settled, StreamSettings
from server.core.turns import TurnConfig, TurnEvent, TurnKind
from server.protocol.errors import ProtocolError
from server.protocol.formats import SAMPLE_RATE_HZ, AudioFormat
from server.protocol.messages import (
    ConfigMessage,
    FinalMessage,
    TurnMessage,
    WordInfo,
    parse_server_message,
)
from tests.helpers import pcm_frames, scripted_server, stream_frames


def _settings(multilingual: bool = False, *, turn_model: bool = False) -> SessionSettings:
    return SessionSettings(
        "v1", StreamingConfig(language=None), VadConfig(), multilingual, "m", turn_model
    )


def test_config_sets_only_the_fields_it_gives() -> None:
    current = StreamSettings(AudioFormat(8000, "pcm_f32le"), "de", "translate")
    assert settings_from_config(ConfigMessage(), current) == current
    assert settings_from_config(ConfigMessage(sample_rate_hz=24000), current) == StreamSettings(
        AudioFormat(24000, "pcm_f32le"), "de", "translate"
    )
    assert settings_from_config(ConfigMessage(language="auto"), current).language is None
    assert settings_from_config(ConfigMessage(task="transcribe"), current).task == "transcribe"


def test_messages_become_the_sessions_calls() -> None:
    session = Session("calls", multilingual=True)
    apply_text('{"type": "config", "sample_rate": 8000, "language": "auto"}', session)
    assert session.settings == StreamSettings(AudioFormat(8000, "pcm_s16le"), None, "transcribe")
    apply_text('{"type": "flush"}', session)
    assert session.events_to_send() == [Settled(0.0)]
    apply_text('{"type": "end"}', session)
    assert session.ended and session.done
    with pytest.raises(ProtocolError, match="end sent twice"):
        apply_text('{"type": "end"}', session)
    with pytest.raises(ProtocolError):
        apply_text("{not json", session)


def test_the_query_is_checked_as_config_is() -> None:
    adapter = V1Adapter()
    path = f"{STREAM_PATH}?sample_rate=8000&language=auto"
    session = adapter.open_session(_settings(multilingual=True), Request(path, Headers()))
    assert session.settings.audio_format.sample_rate_hz == 8000
    assert session.language is None
    english = adapter.open_session(_settings(), Request(path, Headers()))
    assert english.language == "en"  # an English-only model has nothing to detect
    g711 = adapter.open_session(
        _settings(), Request(f"{STREAM_PATH}?encoding=alaw&sample_rate=8000", Headers())
    )
    assert g711.settings.audio_format == AudioFormat(8000, "alaw")
    for bad in ("sample_rate=fast", "language=de", "encoding=mp3"):
        with pytest.raises(ProtocolError) as info:
            adapter.open_session(_settings(), Request(f"{STREAM_PATH}?{bad}", Headers()))
        assert info.value.close_code == 1008 and "query" in str(info.value)


def test_settled_has_no_v1_message() -> None:
    adapter = V1Adapter()
    assert adapter.render(Settled(1.0)) == []
    final = FinalMessage(0, "hi", 0.0, 0.5, (), 1.0)
    assert adapter.render(final) == [final.to_json()]


def test_every_api_is_one_registry_entry() -> None:
    assert set(STREAM_APIS) == {"/v1/stream", "/v1/realtime", "/v1/listen", "/v2/listen"}
    for path, api in STREAM_APIS.items():
        assert api.path == path and api.auth_schemes
        assert callable(api.adapter().render)
    assert STREAM_APIS[STREAM_PATH].adapter().__class__ is V1Adapter


def test_the_end_of_speech_silence_is_the_streams_own() -> None:
    session = Session("quick")
    apply_text('{"type": "config", "end_of_speech_ms": 300}', session)
    assert session.vad_config.speech_end_silence_ms == 300
    assert session.settings.end_of_speech_ms == 300
    for bad in (50, 60_000):
        with pytest.raises(ProtocolError, match="end_of_speech_ms must be"):
            apply_text(f'{{"type": "config", "end_of_speech_ms": {bad}}}', Session("bad"))
    queried = V1Adapter().open_session(
        _settings(), Request(f"{STREAM_PATH}?end_of_speech_ms=800", Headers())
    )
    assert queried.vad_config.speech_end_silence_ms == 800
    assert Session("default").vad_config == VadConfig()


def test_finals_are_the_streams_own_choice() -> None:
    assert Session("default").streaming.finals == "utterance"
    session = Session("fast")
    apply_text('{"type": "config", "finals": "words"}', session)
    assert session.settings.finals == "words" and session.streaming.finals == "words"
    apply_text('{"type": "config", "end_of_speech_ms": 300}', session)  # kept by a later config
    assert session.streaming.finals == "words"
    queried = V1Adapter().open_session(
        _settings(), Request(f"{STREAM_PATH}?finals=words", Headers())
    )
    assert queried.streaming.finals == "words"
    with pytest.raises(ProtocolError, match=r"in the URL query.*finals"):
        V1Adapter().open_session(_settings(), Request(f"{STREAM_PATH}?finals=all", Headers()))


def _queried(query: str, *, turn_model: bool = True) -> Session:
    settings = _settings(turn_model=turn_model)
    return V1Adapter().open_session(settings, Request(f"{STREAM_PATH}?{query}", Headers()))


def test_turns_are_asked_for_in_the_query_or_config_with_fluxs_options() -> None:
    queried = _queried("turns=true&eot_threshold=0.8&eot_timeout_ms=3000.0")
    assert queried.settings.turns == TurnConfig(eot_threshold=0.8, eot_timeout_ms=3000)
    assert _queried("turns=false").settings.turns is None
    session = Session("configured")
    apply_text('{"type": "config", "turns": true}', session)
    assert session.settings.turns == TurnConfig()
    apply_text('{"type": "config", "eager_eot_threshold": 0.4}', session)  # turns kept
    apply_text('{"type": "config", "end_of_speech_ms": 300}', session)  # and by other fields
    assert session.settings.turns == TurnConfig(eager_eot_threshold=0.4)
    apply_text('{"type": "config", "turns": false}', session)
    assert session.settings.turns is None


@pytest.mark.parametrize(
    ("query", "problem"),
    [
        ("turns=true&eot_threshold=2", "eot_threshold must be 0.5 to 0.9; got 2.0"),
        ("turns=true&eot_timeout_ms=soon", "eot_timeout_ms must be a number"),
        ("turns=true&eager_eot_threshold=0.8&eot_threshold=0.6", "at most eot_threshold"),
        ("eot_threshold=0.8", "eot_threshold apply to turns: ask for them with turns=true"),
        ("turns=yes", "'turns' must be true or false"),
    ],
)
def test_turn_options_flux_would_refuse_are_refused_in_the_query(query: str, problem: str) -> None:
    with pytest.raises(ProtocolError, match=problem) as refused:
        _queried(query)
    assert refused.value.close_code == 1008


def test_turns_without_a_turn_model_are_refused_in_the_query_and_in_config() -> None:
    with pytest.raises(ProtocolError, match="turn detection is not installed") as refused:
        _queried("turns=true", turn_model=False)
    assert refused.value.close_code == 1008
    assert _queried("turns=false", turn_model=False).settings.turns is None
    session = Session("no-model")
    with pytest.raises(ProtocolError, match="turn detection is not installed"):
        apply_text('{"type": "config", "turns": true}', session, turn_model=False)
    assert session.settings.turns is None


def test_turn_events_are_turn_messages_but_updates() -> None:
    words = (WordInfo("Ask", 1.0, 1.3, 0.9), WordInfo("not.", 1.3, 1.8, 0.8))
    end = TurnEvent(TurnKind.END, 2, 1.0, 1.8, "Ask not.", words, 0.93, 2.6, "model")
    [rendered] = V1Adapter().render(end)
    assert parse_server_message(rendered) == TurnMessage(
        "end", 2, 1.0, 1.8, "Ask not.", words, 0.93, 2.6, "model"
    )
    assert json.loads(rendered)["type"] == "turn"
    update = TurnEvent(TurnKind.UPDATE, 2, 1.0, 1.8, "Ask not.", words, 0.0, 2.0)
    assert turn_message(update) is None and V1Adapter().render(update) == []


# --------------------------------------------------------------------------- G.711, served

WAIT_S = 120.0  # a bound for waits on the real model on a busy 2-core machine
MAX_WER_CLIP = 0.35  # as tests/test_app.py: one short clip, streamed
PHONE_CLIP = "librispeech_test-clean/1089-134686-0000.wav"


def _g711_frames(line: bytes, frame_bytes: int = 160) -> list[bytes]:
    """A phone leg's 20 ms frames at 8 kHz (160 one-byte samples)."""
    return [line[i : i + frame_bytes] for i in range(0, len(line), frame_bytes)]


@pytest.mark.asyncio(loop_scope="session")  # the server_url fixture's loop
@pytest.mark.parametrize("law", ["mulaw", "alaw"])
async def test_a_phone_line_in_g711_streams_end_to_end(
    law: str, server_url: str, speech_dir: Path, manifest: list[ManifestRow]
) -> None:
    """mu-law named in the URL query, A-law in a ``config`` message: both at 8 kHz, 20 ms
    frames, speech through a telephone channel; ``ready`` and ``done`` count every byte."""
    clip = load_clip(speech_dir / PHONE_CLIP)
    line = phone_line(np.concatenate([clip, np.zeros(SAMPLE_RATE_HZ // 2, np.float32)]), law)
    url = f"{server_url}{STREAM_PATH}"
    frames: list[bytes | str] = list(_g711_frames(line))
    if law == "mulaw":
        url += "?encoding=mulaw&sample_rate=8000"
    else:
        frames.insert(0, json.dumps({"type": "config", "encoding": law, "sample_rate": 8000}))
    outcome = await asyncio.wait_for(stream_frames(url, frames), WAIT_S)
    assert not outcome.of_type("error"), outcome.of_type("error")
    if law == "mulaw":
        ready = outcome.messages[0]
        assert (ready["encoding"], ready["sample_rate"]) == ("mulaw", PHONE_RATE_HZ)
    done = outcome.messages[-1]
    assert done["audio_received_s"] == pytest.approx(len(line) / PHONE_RATE_HZ, abs=1e-3)
    reference = next(row.transcript for row in manifest if row.file == PHONE_CLIP)
    assert wer(reference, outcome.text) <= MAX_WER_CLIP, outcome.text


@pytest.mark.asyncio(loop_scope="session")  # the server_url fixture's loop
async def test_an_unknown_encoding_gets_v1s_error_listing_the_ones_taken(server_url: str) -> None:
    url = f"{server_url}{STREAM_PATH}"
    outcome = await asyncio.wait_for(
        stream_frames(url, ['{"type": "config", "encoding": "ulaw"}']), WAIT_S
    )
    [error] = outcome.of_type("error")
    assert error["code"] == "protocol_error"
    assert "pcm_s16le, pcm_f32le, mulaw, alaw; got 'ulaw'" in error["message"]
    assert outcome.messages[-1]["type"] == "done"


# --------------------------------------------------------------------------- turns, served

TURN_CLIP = "misc_en/jfk.wav"  # 11 s: "And so my fellow Americans, ask not ..."


@pytest.mark.asyncio(loop_scope="session")  # the server_url fixture's loop
async def test_a_stream_with_turns_gets_each_turns_end_after_its_finals(
    server_url: str, speech_dir: Path, manifest: list[ManifestRow]
) -> None:
    clip = load_clip(speech_dir / TURN_CLIP)
    audio = np.concatenate([clip, np.zeros(2 * SAMPLE_RATE_HZ, np.float32)])
    url = f"{server_url}{STREAM_PATH}?turns=true&eot_timeout_ms=2000"
    outcome = await asyncio.wait_for(stream_frames(url, pcm_frames(audio)), WAIT_S)
    assert not outcome.of_type("error"), outcome.of_type("error")
    turns = outcome.of_type("turn")
    assert turns and turns[0]["event"] == "start" and turns[-1]["event"] == "end", turns
    assert outcome.messages[-1]["type"] == "done"
    # Each turn's finals come between its start and its end, and make up the end's text.
    open_turn: dict[str, Any] | None = None
    finals: list[dict[str, Any]] = []
    for message in outcome.messages:
        if message["type"] == "final":
            assert open_turn is not None, "a final outside any turn"
            finals.append(message)
        elif message["type"] == "turn" and message["event"] == "start":
            assert open_turn is None, "a turn started inside another"
            open_turn, finals = message, []
        elif message["type"] == "turn" and message["event"] == "end":
            assert open_turn is not None and message["turn_index"] == open_turn["turn_index"]
            assert message["text"] == " ".join(f["text"] for f in finals if f["text"])
            assert message["words"] == [w for f in finals for w in f["words"]]
            assert message["trigger"] in ("model", "timeout", "manual")
            assert message["start"] == open_turn["start"] <= message["end"]
            open_turn = None
    assert open_turn is None
    ends = [t for t in turns if t["event"] == "end"]
    assert [t["turn_index"] for t in ends] == list(range(len(ends)))
    reference = next(row.transcript for row in manifest if row.file == TURN_CLIP)
    assert wer(reference, " ".join(t["text"] for t in ends)) <= MAX_WER_CLIP, ends


@pytest.mark.asyncio
async def test_a_server_without_the_turn_model_refuses_turns_as_v1_refuses_bad_values() -> None:
    async def refused(query: str) -> tuple[dict[str, Any], int | None]:
        async with connect(f"{server.url}{STREAM_PATH}?{query}") as ws:
            error = json.loads(await ws.recv())
            with contextlib.suppress(ConnectionClosed):
                await ws.recv()
        return error, ws.close_code

    async with scripted_server(turn_model=False) as server:
        error, close_code = await refused("turns=true")
        assert (error["type"], error["code"], error["fatal"]) == ("error", "protocol_error", True)
        assert "turn detection is not installed" in error["message"]
        assert close_code == 1008
        url = f"{server.url}{STREAM_PATH}"
        outcome = await stream_frames(url, ['{"type": "config", "turns": true}'])
        [error] = outcome.of_type("error")  # a config error: the stream goes on without turns
        assert not error["fatal"] and "turn detection is not installed" in error["message"]
        assert outcome.messages[-1]["type"] == "done" and outcome.close_code == 1000
    async with scripted_server() as server:
        error, close_code = await refused("turns=true&eot_threshold=2")
        assert "eot_threshold must be 0.5 to 0.9" in error["message"] and close_code == 1008
