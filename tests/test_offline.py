"""Offline transcription (server/engine/offline.py): Whisper's long-form loop, beam search and
the temperature fallback, on the real tiny.en model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.corpus import load_clip, wer
from server.core.engine_api import DecodeOptions, DecodeRequest, DecodeResult
from server.core.long_form import FALLBACK_TEMPERATURES
from server.engine.engine import Engine
from server.engine.offline import transcribe_audio


class CountingEngine:
    """The real engine, recording the temperature of every window it decodes and how many
    windows it encodes."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.temperatures: list[float] = []
        self.encoded = 0

    def features(self, audio: object, frames: int | None = None) -> object:
        return self.engine.features(audio, frames)  # type: ignore[arg-type]

    def encode(self, mels: list[Any]) -> list[Any]:
        self.encoded += len(mels)
        return self.engine.encode(mels)

    def decode_encoded(self, requests: list[DecodeRequest], feats: list[Any]) -> list[DecodeResult]:
        self.temperatures += [r.options.temperature for r in requests]
        return self.engine.decode_encoded(requests, feats)

    # The real fallback loop, over the counting encode and decode above.
    transcribe_window = Engine.transcribe_window


def test_a_confident_window_is_decoded_once(engine: Engine, speech_dir: Path) -> None:
    counting = CountingEngine(engine)
    audio = load_clip(speech_dir / "misc_en/jfk.wav")
    text = transcribe_audio(counting, audio, temperatures=FALLBACK_TEMPERATURES).text  # type: ignore[arg-type]
    assert counting.temperatures == [0.0]
    assert (
        wer(
            "and so my fellow americans ask not what your country can do for you ask what you "
            "can do for your country",
            text,
        )
        <= 0.05
    )


def test_a_doubtful_window_is_sampled_at_each_temperature_in_turn(
    engine: Engine, speech_dir: Path
) -> None:
    """With a log-probability threshold no decode meets, every temperature is tried, and the
    transcript is the last one's: sampled, still speech."""
    counting = CountingEngine(engine)
    audio = load_clip(speech_dir / "misc_en/jfk.wav")
    options = DecodeOptions(word_timestamps=False, logprob_threshold=0.0)
    transcript = transcribe_audio(counting, audio, options, FALLBACK_TEMPERATURES)  # type: ignore[arg-type]
    assert counting.temperatures == list(FALLBACK_TEMPERATURES)
    assert counting.encoded == 1  # one encoder pass serves every temperature
    assert "country" in transcript.text.lower()


def test_beam_search_transcribes_a_long_recording(engine: Engine, speech_dir: Path) -> None:
    """Beam search through the long-form loop: each 30 s window conditioned on the text
    before it, timestamps that go forward, and the whole recording covered."""
    audio = load_clip(speech_dir / "librispeech_test-other/long/367-130732.concat.wav")
    transcript = transcribe_audio(engine, audio, DecodeOptions(word_timestamps=False, beam_size=5))
    starts = [s.start_s for s in transcript.spans]
    assert starts == sorted(starts)
    assert transcript.spans[-1].end_s > audio.shape[0] / 16000 - 5.0
    assert "lobster" in transcript.text.lower() and len(transcript.text.split()) > 150
