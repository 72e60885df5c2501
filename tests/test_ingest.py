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


class Loudness:
    """A detector of our own: 40 ms frames, speech where the frame is loud; each stream gets
    a fresh one and its frames are recorded."""

    frame_samples = 640

    def __init__(self) -> None:
        self.frames = 0

    def voiced(self, frame: np.ndarray, in_speech: bool) -> tuple[bool, bool]:
        self.frames += 1
        return bool(np.abs(frame).max() > 0.1), True


def test_another_detector_takes_webrtcvads_place_for_each_configuration() -> None:
    made: list[Loudness] = []

    def voicing() -> Loudness:
        made.append(Loudness())
        return made[-1]

    audio = AudioIngest(AudioFormat(), VadConfig(), max_frame_bytes=1 << 20, voicing=voicing)
    audio.configure(AudioFormat(), VadConfig(), max_frame_bytes=1 << 20)  # a fresh detector
    tone = 0.5 * np.sin(np.arange(SAMPLE_RATE_HZ) * 2 * np.pi * 440 / SAMPLE_RATE_HZ)
    silence = np.zeros(SAMPLE_RATE_HZ, dtype=np.float32)
    events = audio.receive(pcm_s16le_bytes(np.concatenate([silence, tone, silence])))
    # Whole 40 ms frames: the tone's start at 1.0 s is frame 25's, less the 200 ms pad.
    assert events == [SpeechStarted(SAMPLE_RATE_HZ - 3200), SpeechEnded(2 * SAMPLE_RATE_HZ + 3200)]
    assert len(made) == 2 and made[0].frames == 0 and made[1].frames == 75
