"""A client's stream settings, checked against the model and mapped onto the configs."""

from __future__ import annotations

import pytest

from server.config import StreamingConfig, VadConfig
from server.core.settings import (
    StreamSettings,
    nearest_end_of_speech_ms,
    resolve,
    stream_configs,
)
from server.protocol.errors import ProtocolError


@pytest.mark.parametrize(
    "settings, message",
    [
        (StreamSettings(end_of_speech_ms=100), "end_of_speech_ms must be 200 to 5000"),
        (StreamSettings(speech_pad_ms=2000), "speech_pad_ms must be 0 to 1000"),
        (StreamSettings(vad_aggressiveness=4), "vad_aggressiveness must be 0, 1, 2 or 3"),
        (StreamSettings(finals="sometimes"), "finals must be one of words, utterance"),
        (StreamSettings(speakers=True), "speaker labels are off"),
        (StreamSettings(language="de"), "English-only; language 'de'"),
        (StreamSettings(task="translate"), "English-only; task 'translate'"),
    ],
)
def test_settings_the_model_or_server_cannot_serve_are_refused_in_words(
    settings: StreamSettings, message: str
) -> None:
    with pytest.raises(ProtocolError, match=message):
        resolve(settings, multilingual=False, speakers_enabled=False)


def test_an_english_only_model_transcribes_english_and_a_multilingual_one_may_detect() -> None:
    assert (
        resolve(StreamSettings(language=None), multilingual=False, speakers_enabled=False).language
        == "en"
    )
    assert (
        resolve(StreamSettings(language=None), multilingual=True, speakers_enabled=False).language
        is None
    )


def test_a_streams_settings_override_the_servers_vad_and_finals() -> None:
    streaming, vad = stream_configs(
        StreamSettings(end_of_speech_ms=800, vad_aggressiveness=3, finals="words"),
        StreamingConfig(finals="utterance"),
        VadConfig(),
    )
    assert (vad.speech_end_silence_ms, vad.aggressiveness, vad.speech_pad_ms) == (800, 3, 200)
    assert streaming.finals == "words"
    streaming, vad = stream_configs(StreamSettings(), StreamingConfig(), VadConfig())
    assert vad == VadConfig() and streaming == StreamingConfig().with_finals("utterance")


def test_a_vendor_apis_endpointing_is_served_at_the_nearest_allowed_silence() -> None:
    assert nearest_end_of_speech_ms(10) == 200
    assert nearest_end_of_speech_ms(700) == 700
    assert nearest_end_of_speech_ms(10_000) == 5000
