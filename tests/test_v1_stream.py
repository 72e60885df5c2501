"""Protocol v1's adapter: its messages parsed into the session's typed calls, and back."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest
from websockets.datastructures import Headers
from websockets.http11 import Request

from bench.corpus import ManifestRow, load_clip, wer
from bench.phone_line import PHONE_RATE_HZ, phone_line
from server.apis.adapters import SessionSettings
from server.apis.registry import STREAM_APIS
from server.apis.v1_stream import STREAM_PATH, V1Adapter, apply_text, settings_from_config
from server.config import StreamingConfig, VadConfig
from server.core.session import Session, Settled, StreamSettings
from server.protocol.errors import ProtocolError
from server.protocol.formats import SAMPLE_RATE_HZ, AudioFormat
from server.protocol.messages import ConfigMessage, FinalMessage
from tests.helpers import stream_frames


def _settings(multilingual: bool = False) -> SessionSettings:
    return SessionSettings("v1", StreamingConfig(language=None), VadConfig(), multilingual, "m")


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
