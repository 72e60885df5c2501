"""A stream's audio on its way in, with the real webrtcvad: bytes to samples to speech."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from bench.corpus import load_clip
from server.config import VadConfig
from server.core.ingest import AudioIngest
from server.core.vad import SpeechEnded, SpeechStarted
from server.protocol.audio import pcm_s16le_bytes
from server.protocol.formats import SAMPLE_RATE_HZ, AudioFormat

CLIP = "misc_en/jfk.wav"


def test_real_speech_opens_and_silence_closes_an_utterance(speech_dir: Path) -> None:
    audio = AudioIngest(AudioFormat(), VadConfig(), max_frame_bytes=1 << 20)
    speech = load_clip(speech_dir / CLIP)[: 3 * SAMPLE_RATE_HZ]
    silence = np.zeros(SAMPLE_RATE_HZ, dtype=np.float32)
    events = audio.receive(pcm_s16le_bytes(np.concatenate([silence, speech, silence, silence])))
    assert isinstance(events[0], SpeechStarted) and events[0].start_sample >= 0.8 * SAMPLE_RATE_HZ
    assert any(isinstance(e, SpeechEnded) for e in events)
    assert audio.seconds_in == 6.0 and audio.end == 6 * SAMPLE_RATE_HZ


def test_speech_going_on_at_the_end_is_closed_by_finishing(speech_dir: Path) -> None:
    audio = AudioIngest(AudioFormat(), VadConfig(), max_frame_bytes=1 << 20)
    silence = np.zeros(SAMPLE_RATE_HZ, dtype=np.float32)
    speech = load_clip(speech_dir / CLIP)[: 2 * SAMPLE_RATE_HZ]
    audio.receive(pcm_s16le_bytes(np.concatenate([silence, speech])))
    assert audio.vad.in_speech
    assert audio.finish_decoding() == []
    [ended] = audio.finish_speech(at_pause=False)
    assert isinstance(ended, SpeechEnded) and ended.end_sample <= audio.end


def test_trimming_keeps_the_vads_look_back_while_nobody_needs_audio() -> None:
    audio = AudioIngest(AudioFormat(sample_rate_hz=8000), VadConfig(), max_frame_bytes=1 << 20)
    audio.receive(pcm_s16le_bytes(np.zeros(8000 * 3, dtype=np.float32)))
    audio.finish_decoding()  # the resampler's last samples
    assert audio.end == 3 * SAMPLE_RATE_HZ  # resampled to 16 kHz
    audio.trim(audio.idle_keep_from)
    assert audio.buffer.start == 2 * SAMPLE_RATE_HZ
