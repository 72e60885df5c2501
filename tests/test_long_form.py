"""The long-form loop as steps (server/core/long_form.py), on scripted window results: where
each window starts, what it is conditioned on, what the transcript keeps."""

from __future__ import annotations

import numpy as np
import pytest

from server.core.engine_api import (
    DecodeOptions,
    DecodeResult,
    StopReason,
    TextSpan,
    WordTiming,
)
from server.core.long_form import (
    WINDOW_SAMPLES,
    LongForm,
    join_transcripts,
    join_word_pieces,
    needs_fallback,
    pause_cuts,
    split_recording,
)
from server.protocol.formats import SAMPLE_RATE_HZ


def _result(
    spans: list[TextSpan], words: tuple[WordTiming, ...] = (), **kw: object
) -> DecodeResult:
    fields: dict[str, object] = {
        "tokens": tuple(t for s in spans for t in s.tokens),
        "text": "".join(s.text for s in spans),
        "spans": tuple(spans),
        "words": words,
        "language": "en",
        "avg_logprob": -0.2,
        "no_speech_prob": 0.01,
        "compression_ratio": 1.2,
        "stop_reason": StopReason.EOT,
        "n_generated": 3,
    }
    fields.update(kw)
    return DecodeResult(**fields)  # type: ignore[arg-type]


def _audio(seconds: float) -> np.ndarray:  # type: ignore[type-arg]
    return np.zeros(round(seconds * SAMPLE_RATE_HZ), dtype=np.float32)


def test_a_short_recording_is_one_window_and_its_spans_the_transcript() -> None:
    loop = LongForm(_audio(12.0), DecodeOptions(word_timestamps=False))
    job = loop.next_window()
    assert job is not None and job.audio.shape[0] == 12 * SAMPLE_RATE_HZ
    assert job.request.audio_s == pytest.approx(12.0) and job.request.prompt == ()
    added = loop.take(
        _result([TextSpan(0.0, 5.0, " Hello", (1,)), TextSpan(5.0, 11.0, " there.", (2,))]), 0.0
    )
    assert [s.span.text for s in added] == [" Hello", " there."]
    assert loop.next_window() is None
    transcript = loop.transcript()
    assert transcript.text == "Hello there."
    assert [s.end_s for s in transcript.spans] == [5.0, 11.0]


def test_the_next_window_starts_at_the_last_complete_span_and_hears_the_text_before() -> None:
    loop = LongForm(_audio(50.0), DecodeOptions(word_timestamps=False), prompt=(7, 8))
    first = loop.next_window()
    assert first is not None and first.audio.shape[0] == WINDOW_SAMPLES
    assert first.request.prompt == (7, 8)  # the user's prompt conditions the first window
    # The last span runs past the window's end (end -1): it is decoded again from 24 s.
    loop.take(_result([TextSpan(0.0, 24.0, " one", (1,)), TextSpan(24.0, -1.0, " two", (2,))]), 0.0)
    second = loop.next_window()
    assert second is not None
    assert loop.seek == 24 * SAMPLE_RATE_HZ
    assert second.audio.shape[0] == 26 * SAMPLE_RATE_HZ
    assert second.request.prompt == (7, 8, 1)
    loop.take(_result([TextSpan(0.0, 20.0, " two three", (2, 3))]), 0.0)
    assert loop.next_window() is None
    spans = loop.transcript().spans
    assert [(s.start_s, s.end_s, s.text) for s in spans] == [
        (0.0, 24.0, " one"),
        (24.0, 44.0, " two three"),
    ]


def test_text_sampled_above_half_temperature_is_no_context_for_the_next_window() -> None:
    loop = LongForm(_audio(45.0), DecodeOptions(word_timestamps=False), (0.0, 0.6))
    loop.take(_result([TextSpan(0.0, 30.0, " noise", (5,))]), 0.6)
    job = loop.next_window()
    assert job is not None and job.request.prompt == ()
    assert loop.transcript().segments[0].temperature == 0.6


def test_silence_moves_a_whole_window_on() -> None:
    loop = LongForm(_audio(40.0), DecodeOptions(word_timestamps=False))
    loop.take(_result([], stop_reason=StopReason.NO_SPEECH, no_speech_prob=0.95), 0.0)
    assert loop.seek == WINDOW_SAMPLES
    assert loop.transcript().text == ""


def test_the_language_detected_on_the_first_window_is_kept() -> None:
    loop = LongForm(_audio(40.0), DecodeOptions(language=None, word_timestamps=False))
    loop.take(_result([TextSpan(0.0, 30.0, " Hola", (1,))], language="es"), 0.0)
    job = loop.next_window()
    assert job is not None and job.request.options.language == "es"
    assert loop.transcript().language == "es"


def test_words_of_the_unfinished_span_come_from_the_next_window_only() -> None:
    loop = LongForm(_audio(40.0), DecodeOptions())
    words = (
        WordTiming(" one", (1,), 1.0, 1.5, 0.9),
        WordTiming(" two", (2,), 25.0, 25.5, 0.8),
    )
    loop.take(
        _result([TextSpan(0.0, 24.0, " one", (1,)), TextSpan(24.0, -1.0, " two", (2,))], words),
        0.0,
    )
    loop.take(
        _result([TextSpan(0.0, 2.0, " two", (2,))], (WordTiming(" two", (2,), 1.0, 1.4, 0.7),)), 0.0
    )
    assert [(w.word, w.start_s) for w in loop.transcript().words] == [(" one", 1.0), (" two", 25.0)]


def test_punctuation_and_word_pieces_join_the_word_before() -> None:
    words = [
        WordTiming(" well", (1,), 0.0, 0.4, 0.8),
        WordTiming(",", (2,), 0.4, 0.4, 0.4),
        WordTiming(" flower", (3,), 0.5, 0.9, 0.9),
        WordTiming("-fed", (4,), 0.9, 1.2, 0.7),
        WordTiming(".", (5,), 1.2, 1.2, 0.5),
    ]
    joined = join_word_pieces(words)
    assert [w.word for w in joined] == [" well,", " flower-fed."]
    assert joined[1].tokens == (3, 4, 5)
    assert (joined[1].start_s, joined[1].end_s) == (0.5, 1.2)
    assert joined[1].probability == pytest.approx((0.9 + 0.7 + 0.5) / 3)


def test_fallback_is_for_loops_and_doubtful_text_never_for_silence() -> None:
    options = DecodeOptions()
    assert not needs_fallback(_result([]), options)
    assert needs_fallback(_result([], avg_logprob=-1.2), options)
    assert needs_fallback(_result([], stop_reason=StopReason.REPETITION), options)
    assert needs_fallback(_result([], stop_reason=StopReason.COMPRESSION), options)
    assert not needs_fallback(
        _result([], stop_reason=StopReason.NO_SPEECH, avg_logprob=-3.0), options
    )
    assert not needs_fallback(_result([], stop_reason=StopReason.REPEAT_AT_END), options)


def test_temperatures_must_rise() -> None:
    with pytest.raises(ValueError, match="rising"):
        LongForm(_audio(1.0), DecodeOptions(), (0.4, 0.0))
    with pytest.raises(ValueError, match="rising"):
        LongForm(_audio(1.0), DecodeOptions(), ())


def test_a_recording_is_cut_in_its_pauses_near_the_even_points() -> None:
    rng = np.random.default_rng(0)
    audio = (0.3 * rng.standard_normal(60 * SAMPLE_RATE_HZ)).astype(np.float32)
    # A pause 1 s before the middle, and one in the last third's search range.
    audio[29 * SAMPLE_RATE_HZ : 29 * SAMPLE_RATE_HZ + 4800] = 0.0
    (middle,) = pause_cuts(audio, 2)
    assert 29 * SAMPLE_RATE_HZ <= middle < 29 * SAMPLE_RATE_HZ + 4800
    cuts = pause_cuts(audio, 3)
    assert len(cuts) == 3 - 1 and cuts == sorted(cuts)
    for cut, even in zip(cuts, (20, 40), strict=True):
        assert even * SAMPLE_RATE_HZ - 2 * SAMPLE_RATE_HZ <= cut <= even * SAMPLE_RATE_HZ


def test_parts_keep_the_recordings_times_and_join_in_order() -> None:
    whole = LongForm(_audio(60.0), DecodeOptions(word_timestamps=False), prompt=(9,))
    first, second = split_recording(whole, 2)
    assert first.start_s == 0.0 and second.start_s == pytest.approx(first.duration_s)
    assert first.prompt == second.prompt == (9,)  # the user's prompt conditions every part
    assert first.duration_s + second.duration_s == pytest.approx(60.0)
    first.take(_result([TextSpan(0.0, 10.0, " one.", (1,))]), 0.0)
    second.take(
        _result(
            [TextSpan(1.0, 4.0, " two.", (2,))],
            (WordTiming(" two.", (2,), 1.0, 1.5, 0.9),),
        ),
        0.0,
    )
    joined = join_transcripts([first.transcript(), second.transcript()])
    assert joined.text == "one. two."
    assert [s.start_s for s in joined.spans] == [0.0, pytest.approx(second.start_s + 1.0)]
    assert joined.words[0].start_s == pytest.approx(second.start_s + 1.0)
    assert split_recording(whole, 1) == [whole]
