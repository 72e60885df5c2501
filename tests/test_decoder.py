"""The decoder's pure helpers (loop detection, compression ratio, DTW, median filter), its
loop guards on a real decode that loops, and speculative re-decoding: a draft changes the
number of steps, never the output."""

from __future__ import annotations

import itertools
import zlib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from bench.corpus import ManifestRow, load_clip, normalize, wer
from server.core.engine_api import (
    DecodeOptions,
    DecodeRequest,
    DecodeResult,
    StopReason,
    Window,
    WordTiming,
)
from server.engine.decoder import (
    compression_ratio,
    crammed_copy_start,
    draft_continuation,
    repeat_start,
    repeated_tail,
)
from server.engine.engine import Engine, EngineConfig, pad_to_full
from server.engine.words import align_words, dtw, median_filter
from server.protocol.formats import SAMPLE_RATE_HZ
from tests.helpers import Float32Array

LOOP_CLIP = "pocketsphinx_testdata/goforward.wav"  # "go forward ten meters", 2.8 s


# --- repeated_tail -----------------------------------------------------------------------------


def test_no_repeat_is_none() -> None:
    assert repeated_tail(list(range(40)), 12, 3) is None
    assert repeated_tail([], 12, 3) is None


def test_single_token_loop_keeps_the_first_occurrence() -> None:
    tokens = [5, 6, *[1] * 8]
    assert repeated_tail(tokens, 12, 3) == 3  # [5, 6, 1] survives


def test_short_ngrams_need_more_repeats() -> None:
    # "no, no, no" is speech: a 1-gram needs 8 copies, a 2-gram 4, a 3-gram 3.
    assert repeated_tail([9, *[1] * 7], 12, 3) is None
    assert repeated_tail([9, *[1, 2] * 3], 12, 3) is None
    assert repeated_tail([9, *[1, 2] * 4], 12, 3) == 3
    assert repeated_tail([9, *[1, 2, 3] * 3], 12, 3) == 4


def test_all_repeats_are_walked_back_to_the_first() -> None:
    assert repeated_tail([7, *[1, 2, 3, 4] * 6], 12, 3) == 5


def test_ngram_length_and_repeat_count_limits() -> None:
    gram = list(range(100, 113))  # 13 tokens
    assert repeated_tail(gram * 3, 12, 3) is None
    assert repeated_tail(gram * 3, 13, 3) == 13
    five = [1, 2, 3, 4, 5]
    assert repeated_tail(five * 3, 12, 4) is None
    assert repeated_tail(five * 4, 12, 4) == 5


def test_the_kept_copy_starts_where_the_repetition_starts() -> None:
    # The tail's 3-gram is "8 9 7"; keeping its first copy would leave "1 2 7 8 9 7".
    tokens = [1, 2, *[7, 8, 9] * 3, 7]
    assert repeated_tail(tokens, 12, 3) == 5


def test_a_repeat_that_is_not_at_the_tail_is_not_cut() -> None:
    assert repeated_tail([*[1, 2, 3] * 4, 4, 5, 6, 7], 12, 3) is None


def test_a_phrase_said_twice_is_cut_at_its_second_copy() -> None:
    phrase = list(range(100, 106))  # 6 tokens: a sentence, not "no, no"
    assert repeated_tail([1, *phrase, *phrase], 64, 3, phrase_tokens=6) == 7
    assert repeated_tail([1, *phrase, *phrase], 64, 3) is None  # without the rule: 3 copies
    assert repeated_tail([1, *phrase[:5], *phrase[:5]], 64, 3, phrase_tokens=6) is None


# --- repeat_start ------------------------------------------------------------------------------


def _words(text: str) -> list[str]:
    return text.split()


def test_an_ending_read_twice_is_found_where_the_second_copy_starts() -> None:
    words = _words("for centuries by a similar process by a similar process")
    assert repeat_start(words, 3) == 6


def test_a_trailing_partial_copy_belongs_to_the_repeat() -> None:
    words = _words("formal review in this regard in this regard in")
    assert repeat_start(words, 3) == 5


def test_a_sentence_read_again_with_a_new_first_word_is_a_repeat() -> None:
    words = _words(
        "this is the recipe that was followed when it was prepared in the domonica"
        " it was followed when it was prepared in the domonica"
    )
    assert words[repeat_start(words, 3) or 0 :] == _words(
        "it was followed when it was prepared in the domonica"
    )


@pytest.mark.parametrize(
    ("text", "copy"),
    [
        (
            "and the later traditions tend to extend the period"
            " the latter traditions tend to extend the period",
            "the latter traditions tend to extend the period",
        ),
        (
            "the biblical narratives apparently disagree regarding the derates of the sojourn"
            " in egypt the biblical narratives apparently disagreeing the derates of the"
            " sojourn in egypt",
            "the biblical narratives apparently disagreeing the derates of the sojourn in egypt",
        ),
    ],
)
def test_a_sentence_read_again_with_a_word_or_two_changed_is_a_repeat(text: str, copy: str) -> None:
    # Two ends of closing beam searches over an utterance (test-other 2609 long).
    words = _words(text)
    assert words[repeat_start(words, 3) or 0 :] == _words(copy)


def test_a_sentence_said_again_with_more_changed_is_speech() -> None:
    words = _words(
        "the old man walked slowly down to the river the young man ran quickly down to the river"
    )
    assert repeat_start(words, 3) is None


def test_a_short_phrase_said_again_with_a_new_first_word_is_speech() -> None:
    # Six words of the copy agree: under 2 * 3 + 1, so nothing is cut.
    words = _words("we went to the park at noon and they went to the park at noon")
    assert repeat_start(words, 3) is None


def test_short_repeats_and_new_endings_are_left_alone() -> None:
    assert repeat_start(_words("i think i think"), 3) is None  # people repeat a word or two
    assert repeat_start(_words("a b c a b c then more"), 3) is None  # not at the end
    assert repeat_start(_words("one two three four"), 3) is None
    assert repeat_start([], 3) is None


def _timed(words: list[tuple[str, float, float]]) -> tuple[WordTiming, ...]:
    return tuple(
        WordTiming(
            word=w if w == "." else f" {w}", tokens=(k,), start_s=s, end_s=e, probability=0.9
        )
        for k, (w, s, e) in enumerate(words)
    )


def test_a_phrase_read_again_in_no_time_is_a_repeat() -> None:
    # The alignment of a beam search over a stream's last 1.4 s (test-other 2609-156975-0004):
    # the second copy has 0.34 s, the first 1.04 s.
    words = _timed(
        [
            ("Gives", 0.0, 0.74),
            ("as", 0.74, 0.88),
            ("a", 0.88, 1.04),
            ("period", 1.04, 1.04),
            (".", 1.04, 1.04),
            ("Give", 1.04, 1.04),
            ("as", 1.04, 1.04),
            ("a", 1.04, 1.14),
            ("period", 1.14, 1.38),
            (".", 1.38, 1.38),
        ]
    )
    assert crammed_copy_start(words, 3) == 5


def test_a_phrase_said_again_at_its_own_pace_is_speech() -> None:
    spoken = ["the", "dog", "sat", "down", "and", "the", "cat", "sat", "down"]
    words = _timed([(w, 0.3 * k, 0.3 * k + 0.28) for k, w in enumerate(spoken)])
    assert crammed_copy_start(words, 3) is None
    # Faster the second time, but not crammed: people speed up.
    faster = _timed(
        [(w, 0.3 * k, 0.3 * k + 0.28) for k, w in enumerate(spoken[:5])]
        + [(w, 1.5 + 0.2 * k, 1.5 + 0.2 * k + 0.18) for k, w in enumerate(spoken[5:])]
    )
    assert crammed_copy_start(faster, 3) is None


def test_a_crammed_copy_needs_three_words_and_the_ending() -> None:
    assert crammed_copy_start(_timed([("yes", 0.0, 0.5), ("yes", 0.5, 0.55)]), 3) is None
    copy_then_more = [("go", 0.0, 0.3), ("on", 0.3, 0.6), ("now", 0.6, 0.9)] * 2
    copy_then_more[3:] = [
        (w, 0.9 + 0.01 * k, 0.91 + 0.01 * k) for k, (w, _, _) in enumerate(copy_then_more[3:])
    ]
    assert crammed_copy_start(_timed(copy_then_more), 3) == 3
    assert crammed_copy_start(_timed([*copy_then_more, ("then", 1.0, 1.3)]), 3) is None
    assert crammed_copy_start((), 3) is None


# --- compression_ratio -------------------------------------------------------------------------


def test_compression_ratio() -> None:
    assert compression_ratio("") == 0.0
    text = "He could wait no longer."
    assert compression_ratio(text) == len(text) / len(zlib.compress(text.encode()))
    assert compression_ratio(text) < 2.4
    assert compression_ratio(" go far," * 30) > 2.4  # what a loop looks like
    assert compression_ratio("ünïcödé " * 3) > 0


# --- dtw ---------------------------------------------------------------------------------------


def _steps_ok(tokens: np.ndarray, frames: np.ndarray, n: int, m: int) -> None:
    assert (tokens[0], frames[0]) == (0, 0)
    assert (tokens[-1], frames[-1]) == (n - 1, m - 1)
    dt, df = np.diff(tokens), np.diff(frames)
    assert set(dt) <= {0, 1} and set(df) <= {0, 1}
    assert ((dt + df) >= 1).all()  # every step moves


def _naive_dtw_cost(cost: np.ndarray) -> float:
    n, m = cost.shape
    acc = np.full((n + 1, m + 1), np.inf)
    acc[0, 0] = 0.0
    for i in range(1, n + 1):
        for j in range(1, m + 1):
            acc[i, j] = cost[i - 1, j - 1] + min(acc[i - 1, j - 1], acc[i - 1, j], acc[i, j - 1])
    return float(acc[n, m])


def test_dtw_follows_a_diagonal() -> None:
    cost = np.ones((6, 6), dtype=np.float32)
    np.fill_diagonal(cost, 0.0)
    tokens, frames = dtw(cost)
    np.testing.assert_array_equal(tokens, np.arange(6))
    np.testing.assert_array_equal(frames, np.arange(6))


def test_dtw_follows_a_staircase() -> None:
    # Token i is cheap on frames 3i .. 3i+2: each token holds three frames.
    cost = np.ones((4, 12), dtype=np.float32)
    for i in range(4):
        cost[i, 3 * i : 3 * i + 3] = 0.0
    tokens, frames = dtw(cost)
    _steps_ok(tokens, frames, 4, 12)
    np.testing.assert_array_equal(tokens, np.repeat(np.arange(4), 3))
    np.testing.assert_array_equal(frames, np.arange(12))


@pytest.mark.parametrize("shape", [(1, 1), (1, 7), (7, 1), (5, 9), (9, 5), (12, 30)])
def test_dtw_path_is_optimal_on_random_costs(shape: tuple[int, int]) -> None:
    rng = np.random.default_rng(sum(shape))
    cost = rng.random(shape).astype(np.float32)
    tokens, frames = dtw(cost)
    _steps_ok(tokens, frames, *shape)
    path_cost = float(cost[tokens, frames].astype(np.float64).sum())
    assert path_cost == pytest.approx(_naive_dtw_cost(cost.astype(np.float64)), rel=1e-9)


# --- median_filter -----------------------------------------------------------------------------


def test_median_filter_reflects_at_the_edges() -> None:
    x = np.array([1, 9, 2, 8, 3], dtype=np.float32)
    # reflect padding gives [9, 1, 9, 2, 8, 3, 8]
    np.testing.assert_array_equal(median_filter(x, 3), [9, 2, 8, 3, 8])


def test_median_filter_removes_a_spike_along_the_last_axis() -> None:
    x = np.zeros((2, 3, 20), dtype=np.float32)
    x[1, 2, 10] = 50.0
    out = median_filter(x, 7)
    assert out.shape == x.shape and out.dtype == np.float32
    assert not out.any()
    ramp = np.arange(20, dtype=np.float32)[None, :]
    np.testing.assert_array_equal(median_filter(ramp, 7)[:, 3:-3], ramp[:, 3:-3])


def test_median_filter_leaves_too_short_rows_alone() -> None:
    x = np.array([[3.0, 1.0, 2.0]], dtype=np.float32)
    np.testing.assert_array_equal(median_filter(x, 7), x)


# --- align_words -------------------------------------------------------------------------------


def test_align_words_on_attention_that_walks_the_audio() -> None:
    # 3 words of 1, 2 and 1 tokens (+ end-of-text) over 40 audio positions (0.8 s):
    # token k attends to positions 8k .. 8k+7.
    weights = np.zeros((2, 5, 40), dtype=np.float32)
    for k in range(5):
        weights[:, k, 8 * k : 8 * k + 8] = 1.0
    words = [(" a", [1]), (" bc", [2, 3]), (" d", [4])]
    out = align_words(weights, words, [0.9, 0.8, 0.6, 0.5], n_frames=40)
    assert [w.word for w in out] == [" a", " bc", " d"]
    assert [w.tokens for w in out] == [(1,), (2, 3), (4,)]
    assert [w.probability for w in out] == pytest.approx([0.9, 0.7, 0.5])
    starts = [w.start_s for w in out]
    assert starts == sorted(starts) and starts[0] == 0.0
    for prev, cur in itertools.pairwise(out):
        assert prev.end_s <= cur.start_s + 1e-9
    assert out[1].end_s - out[1].start_s > out[0].end_s - out[0].start_s  # two tokens, longer
    assert all(w.end_s <= 0.8 for w in out)


# --- a decode that loops -----------------------------------------------------------------------


def _one_second_context(engine: Engine, speech_dir: Path) -> tuple[np.ndarray, float]:
    # One second of audio in a one-second encoder context: far below the ~4 s where tiny.en
    # starts to repeat itself instead of emitting end-of-text.
    audio = load_clip(speech_dir / LOOP_CLIP)[:SAMPLE_RATE_HZ]
    return engine.features(audio, frames=100), 1.0


def _decode_without_fallback(engine: Engine, window: Window) -> DecodeResult:
    """The decoder alone: ``Engine.decode_windows`` would retry a guarded row at full context."""
    return engine.decoder.decode([window.request], engine.encode([window.mel]))[0]


def test_a_looping_decode_is_cut_by_the_repetition_guard(engine: Engine, speech_dir: Path) -> None:
    mel, audio_s = _one_second_context(engine, speech_dir)
    options = DecodeOptions(word_timestamps=False)
    result = _decode_without_fallback(engine, Window(mel, DecodeRequest(audio_s, options)))
    assert result.stop_reason == StopReason.REPETITION
    assert result.text.strip()
    assert repeated_tail(list(result.tokens), 12, 2) is None  # not even two copies left
    assert len(result.tokens) < result.n_generated  # the repeats were dropped
    assert result.n_generated < 8 + options.max_tokens_per_audio_s * audio_s


def test_without_the_ngram_check_the_compression_guard_drops_the_loop(
    engine: Engine, speech_dir: Path
) -> None:
    mel, audio_s = _one_second_context(engine, speech_dir)
    options = DecodeOptions(
        timestamps=False,
        word_timestamps=False,
        repetition_max_ngram=0,  # no n-gram check
        max_tokens_per_audio_s=30,  # room for the loop to show
    )
    result = _decode_without_fallback(engine, Window(mel, DecodeRequest(audio_s, options)))
    assert result.stop_reason == StopReason.COMPRESSION
    assert result.compression_ratio > options.compression_ratio_threshold
    assert result.text == "" and result.tokens == ()
    assert not result.is_speech


def test_a_repeated_forced_prefix_is_cut_not_continued(engine: Engine, speech_dir: Path) -> None:
    # Forcing a phrase three times invites the decoder to go on repeating it.
    audio = load_clip(speech_dir / LOOP_CLIP)
    audio_s = audio.shape[0] / SAMPLE_RATE_HZ
    prefix = engine.encode_text(" Go forward. Go forward. Go forward.")
    options = DecodeOptions(word_timestamps=False)
    result = _decode_without_fallback(
        engine, Window(engine.features(audio), DecodeRequest(audio_s, options, prefix=prefix))
    )
    assert result.stop_reason in (StopReason.REPETITION, StopReason.COMPRESSION)
    assert repeated_tail(list(result.tokens), 12, 3) is None
    assert result.n_generated < 8 + options.max_tokens_per_audio_s * audio_s


def test_the_engine_redecodes_a_guarded_window_with_a_longer_context(
    engine: Engine, speech_dir: Path
) -> None:
    mel, audio_s = _one_second_context(engine, speech_dir)
    options = DecodeOptions(word_timestamps=False)
    looped = _decode_without_fallback(engine, Window(mel, DecodeRequest(audio_s, options)))
    assert looped.stop_reason == StopReason.REPETITION
    result = engine.decode_windows([Window(mel, DecodeRequest(audio_s, options))])[0]
    assert result.stop_reason not in (StopReason.REPETITION, StopReason.COMPRESSION)
    assert result.text.strip() and result.tokens != looped.tokens
    assert repeated_tail(list(result.tokens), 12, 2) is None


def test_a_guarded_window_falls_back_to_the_first_longer_context(engine: Engine) -> None:
    """3-4 s of context are decoded again at 5 s, 5-9 s at 10 s, 10 s and more never: the
    5 s retry halves the encoder of the usual short-context loop, and the 5-9 s windows keep
    their 10 s retry (with 5 s alone, a long recording doubled a word at a final's edge)."""
    assert engine.config.fallback_contexts_s == (5.0, 10.0)
    assert engine.fallback_frames(300) == 500
    assert engine.fallback_frames(400) == 500
    assert engine.fallback_frames(500) == 1000
    assert engine.fallback_frames(900) == 1000
    assert engine.fallback_frames(1000) is None
    assert engine.fallback_frames(3000) is None
    with pytest.raises(ValueError, match="increasing"):
        EngineConfig(fallback_contexts_s=(10.0, 5.0))
    with pytest.raises(ValueError, match="increasing"):
        EngineConfig(fallback_contexts_s=(5.0, 40.0))


def test_padding_a_policy_mel_to_full_context_equals_computing_it(
    engine: Engine, speech_dir: Path
) -> None:
    audio = load_clip(speech_dir / LOOP_CLIP)[: 3 * SAMPLE_RATE_HZ]
    policy = engine.features(audio)
    assert policy.shape[0] < 3000
    np.testing.assert_allclose(pad_to_full(policy), engine.features(audio, 3000), atol=1e-5)


REREAD_CLIP = "ljspeech/LJ001-0003.wav"  # 9.7 s; its policy context reads the ending twice


def test_an_ending_read_twice_is_trimmed_without_a_full_context_redecode(
    engine: Engine, speech_dir: Path, manifest: list[ManifestRow]
) -> None:
    reference = next(r.transcript for r in manifest if r.file == REREAD_CLIP)
    audio = load_clip(speech_dir / REREAD_CLIP)
    audio_s = audio.shape[0] / SAMPLE_RATE_HZ
    options = DecodeOptions(word_timestamps=False)
    result = _decode_without_fallback(
        engine, Window(engine.features(audio), DecodeRequest(audio_s, options))
    )
    assert result.stop_reason == StopReason.REPEAT_AT_END
    assert result.is_speech
    assert normalize(result.text).count("similar process") == 1
    assert wer(reference, result.text) < 0.15


COPY_CLIP = "librispeech_test-other/2609-156975-0004.wav"
# What a served stream had final before the last 1.4 s of COPY_CLIP ("give of the period").
COPY_PROMPT = (
    " Everyone who's turbulent has been found by human path. The testimony of the oldest"
    " biblical narrative regarding the subjourn of the Hebrews in Egypt is also in perfect"
    " accord with the picture with contemporary Egyptian"
)


def test_a_short_window_read_twice_in_no_time_keeps_one_reading(
    engine: Engine, speech_dir: Path
) -> None:
    """Served, the closing beam search of that stream's last utterance read "Gives as a
    period. Give as a period.", the second copy aligned to its last 0.34 s."""
    audio = load_clip(speech_dir / COPY_CLIP)[
        round(16.72 * SAMPLE_RATE_HZ) : round(18.11 * SAMPLE_RATE_HZ)
    ]
    audio_s = audio.shape[0] / SAMPLE_RATE_HZ
    request = DecodeRequest(
        audio_s, DecodeOptions(beam_size=5), prompt=engine.encode_text(COPY_PROMPT)
    )
    mel = engine.features(audio, engine.context_frames(audio_s))
    result = engine.decode_windows([Window(mel, request)])[0]
    assert result.stop_reason == StopReason.REPEAT_AT_END
    assert normalize(result.text).split().count("period") == 1, result.text
    assert [w.word for w in result.words][-2:] == [" period", "."]
    assert result.text == engine.decode_text(result.tokens)
    # Without word times nothing tells the copy from speech: both readings stay.
    untimed = replace(request, options=replace(request.options, word_timestamps=False))
    doubled = engine.decode_windows([Window(mel, untimed)])[0]
    assert normalize(doubled.text).split().count("period") == 2, doubled.text


def test_a_transcript_started_over_is_whole_and_not_decoded_again(
    engine: Engine, speech_dir: Path
) -> None:
    # Without timestamps, 1 s of "go forward" in a 1 s context is read again from the start.
    mel, audio_s = _one_second_context(engine, speech_dir)
    options = DecodeOptions(timestamps=False, word_timestamps=False)
    alone = _decode_without_fallback(engine, Window(mel, DecodeRequest(audio_s, options)))
    assert alone.stop_reason == StopReason.REPEAT_AT_END
    assert alone.text.strip() and len(alone.tokens) < alone.n_generated
    assert repeated_tail(list(alone.tokens), 12, 2) is None
    served = engine.decode_windows([Window(mel, DecodeRequest(audio_s, options))])[0]
    assert served.tokens == alone.tokens  # no fallback decode replaced it


# --- speculative re-decoding -------------------------------------------------------------------

STREAM_CLIPS = (
    "misc_en/jfk.wav",
    "librispeech_test-clean/1089-134691-0001.wav",  # 5.4 s
    "ljspeech/LJ001-0011.wav",  # 4.5 s
)


@dataclass(frozen=True)
class _Encoded:
    """A request with its encoder output, decoded by the decoder alone (no fallback)."""

    request: DecodeRequest
    features: Any  # mx.array

    def decode(self, engine: Engine, **changes: Any) -> DecodeResult:
        return engine.decoder.decode([replace(self.request, **changes)], [self.features])[0]


def _request(engine: Engine, audio: Float32Array, seconds: float, **kw: Any) -> _Encoded:
    """The first ``seconds`` of ``audio``, encoded with the engine's context policy."""
    clip = audio[: round(seconds * SAMPLE_RATE_HZ)]
    features = engine.encode([engine.features(clip)])[0]
    return _Encoded(DecodeRequest(clip.shape[0] / SAMPLE_RATE_HZ, **kw), features)


def _assert_same_decode(spec: DecodeResult, plain: DecodeResult) -> None:
    assert spec.tokens == plain.tokens
    assert spec.sequence == plain.sequence
    assert spec.stop_reason == plain.stop_reason
    assert spec.text == plain.text
    assert spec.spans == plain.spans
    assert spec.n_generated == plain.n_generated
    assert [(w.word, w.tokens) for w in spec.words] == [(w.word, w.tokens) for w in plain.words]
    for a, b in zip(spec.words, plain.words, strict=True):
        assert (a.start_s, a.end_s) == pytest.approx((b.start_s, b.end_s), abs=1e-6)
        assert a.probability == pytest.approx(b.probability, abs=1e-4)
    assert spec.avg_logprob == pytest.approx(plain.avg_logprob, abs=1e-4)
    assert spec.no_speech_prob == pytest.approx(plain.no_speech_prob, abs=1e-4)


def test_the_draft_continues_after_the_forced_prefix() -> None:
    eot, ts = 100, 200  # text tokens are below eot, timestamps above
    draft = (ts, 1, 2, ts + 5, ts + 5, 3, 4, ts + 9)
    assert draft_continuation(draft, 0, eot) == draft  # nothing forced: all of it is a guess
    assert draft_continuation(draft, 2, eot) == (ts + 5, ts + 5, 3, 4, ts + 9)
    assert draft_continuation(draft, 3, eot) == (4, ts + 9)  # timestamps inside are skipped
    assert draft_continuation(draft, 4, eot) == (ts + 9,)
    assert draft_continuation(draft, 5, eot) == ()  # the prefix is longer than the draft
    assert draft_continuation((), 2, eot) == ()


@pytest.mark.parametrize("timestamps", [True, False], ids=["timestamps", "no-timestamps"])
@pytest.mark.parametrize("clip", STREAM_CLIPS)
def test_its_own_output_as_draft_decodes_the_same_in_few_steps(
    engine: Engine, speech_dir: Path, clip: str, timestamps: bool
) -> None:
    options = DecodeOptions(timestamps=timestamps)
    request = _request(engine, load_clip(speech_dir / clip), 4.0, options=options)
    plain = request.decode(engine)
    assert plain.n_steps > 0 and plain.sequence
    spec = request.decode(engine, draft=plain.sequence)
    _assert_same_decode(spec, plain)
    assert spec.n_steps < plain.n_steps
    if plain.stop_reason == StopReason.EOT:  # nothing was cut: the whole output was in the draft
        assert spec.n_steps == 0


@pytest.mark.parametrize("clip", STREAM_CLIPS)
def test_a_growing_window_drafted_by_the_previous_decode_decodes_the_same(
    engine: Engine, speech_dir: Path, clip: str
) -> None:
    # The streaming case: the window grows by 0.6 s and the previous output is the draft.
    audio = load_clip(speech_dir / clip)
    seconds = [s for s in np.arange(2.0, 6.01, 0.6) if s * SAMPLE_RATE_HZ <= audio.shape[0]]
    draft: tuple[int, ...] = ()
    plain_steps = spec_steps = 0
    for s in seconds:
        request = _request(engine, audio, s, options=DecodeOptions(word_timestamps=s > 5))
        plain = request.decode(engine)
        spec = request.decode(engine, draft=draft)
        _assert_same_decode(spec, plain)
        plain_steps += plain.n_steps
        spec_steps += spec.n_steps
        draft = plain.sequence
    assert spec_steps < 0.8 * plain_steps


def test_wrong_drafts_decode_the_same(engine: Engine, speech_dir: Path) -> None:
    request = _request(engine, load_clip(speech_dir / STREAM_CLIPS[0]), 3.0)
    plain = request.decode(engine)
    other = _request(engine, load_clip(speech_dir / LOOP_CLIP), 2.8).decode(engine)
    assert other.tokens != plain.tokens
    rng = np.random.default_rng(3)
    noise = tuple(int(t) for t in rng.integers(0, engine.dims.n_vocab, 40))
    drafts = {
        "another clip": other.sequence,
        "random tokens": noise,
        "right, then random": (*plain.sequence[:4], *noise),
        # Ids outside the vocabulary, end-of-text and control tokens end or fail the draft.
        "invalid ids": (*plain.sequence[:3], engine.dims.n_vocab + 7, *plain.sequence[3:]),
        "end-of-text": (*plain.sequence[:3], engine.vocab.eot, *plain.sequence[3:]),
        "control tokens": (engine.vocab.sot, engine.vocab.no_timestamps, *plain.sequence),
        "far too long": plain.sequence * 40,
    }
    for name, draft in drafts.items():
        spec = request.decode(engine, draft=draft)
        assert (spec.sequence, spec.stop_reason) == (plain.sequence, plain.stop_reason), name
        _assert_same_decode(spec, plain)


def test_a_draft_aligns_with_the_forced_prefix(engine: Engine, speech_dir: Path) -> None:
    audio = load_clip(speech_dir / STREAM_CLIPS[0])
    earlier = _request(engine, audio, 4.4).decode(engine)
    committed = earlier.tokens[:4]  # " And so my fellow"
    request = _request(engine, audio, 5.0, prefix=committed)
    plain = request.decode(engine)
    assert plain.tokens[:4] == committed
    assert plain.sequence[0] == engine.vocab.timestamp_begin  # the forced part, as fed
    drafts = {"earlier": earlier.sequence, "own": plain.sequence, "short": committed[:2]}
    specs = {k: request.decode(engine, draft=d) for k, d in drafts.items()}
    for spec in specs.values():
        _assert_same_decode(spec, plain)
    assert specs["own"].n_steps < plain.n_steps


def test_batched_rows_with_and_without_drafts_decode_as_without(
    engine: Engine, speech_dir: Path
) -> None:
    audio = [load_clip(speech_dir / c) for c in STREAM_CLIPS]
    prompt = engine.encode_text(" We spoke about printing and old books.")
    windows = [
        Window(engine.features(a[: round(s * SAMPLE_RATE_HZ)]), DecodeRequest(s, prompt=p))
        for a, s, p in zip(audio, (5.5, 3.0, 4.2), ((), prompt, prompt[:3]), strict=True)
    ]
    assert len({w.mel.shape[0] for w in windows}) > 1  # rows with different audio contexts
    plain = engine.decode_windows(windows)
    # Row 0's draft is the output of a shorter window of its audio, row 1 has none, row 2's
    # starts like row 1's output.
    shorter = _request(engine, audio[0], 4.3).decode(engine)
    drafts = [shorter.sequence, (), plain[1].sequence[:5] + plain[2].sequence]
    spec = engine.decode_windows(
        [
            replace(w, request=replace(w.request, draft=d))
            for w, d in zip(windows, drafts, strict=True)
        ]
    )
    for one, many in zip(plain, spec, strict=True):
        _assert_same_decode(many, one)
    assert spec[0].n_steps < plain[0].n_steps
    singles = [engine.decode_windows([w])[0] for w in windows]
    assert [r.tokens for r in spec] == [r.tokens for r in singles]
    # Word times too: each row's alignment reads its own audio, not the batch's padding.
    for one, many in zip(singles, plain, strict=True):
        assert [w.word for w in many.words] == [w.word for w in one.words]
        for a, b in zip(many.words, one.words, strict=True):
            assert (a.start_s, a.end_s) == pytest.approx((b.start_s, b.end_s), abs=1e-6)
    # The rows of one batch in swapped order, each with its own output as the draft.
    swapped = [
        replace(w, request=replace(w.request, draft=r.sequence))
        for w, r in zip(windows, plain, strict=True)
    ][::-1]
    for one, many in zip(plain[::-1], engine.decode_windows(swapped), strict=True):
        _assert_same_decode(many, one)


def test_a_draft_never_pushes_the_decode_past_the_text_context(
    engine: Engine, speech_dir: Path
) -> None:
    # A long prompt and a loop that runs to the token cap: the decode needs all but one
    # column of the text context, so only two draft tokens fit before the steps begin.
    mel, audio_s = _one_second_context(engine, speech_dir)
    options = DecodeOptions(
        timestamps=False,
        word_timestamps=False,
        repetition_max_ngram=0,
        max_tokens_per_audio_s=400,
    )
    prompt = engine.encode_text(" Go forward, go forward," * 40)[:200]
    request = _Encoded(DecodeRequest(audio_s, options, prompt=prompt), engine.encode([mel])[0])
    plain = request.decode(engine)
    start_tokens = 3  # <|startofprev|>, <|startoftranscript|>, <|notimestamps|>
    assert plain.n_generated == engine.dims.n_text_ctx - len(prompt) - start_tokens - 1
    spec = request.decode(engine, draft=plain.sequence)
    _assert_same_decode(spec, plain)
    assert spec.n_steps == plain.n_steps - 2


def test_detection_beside_a_given_language_reports_it_and_changes_nothing_else(
    base_engine: Engine, speech_dir: Path
) -> None:
    """``detect_language`` measures the language of a window decoded in a given one (how a
    session notices a speaker who switched); the decode itself is the same."""
    audio = load_clip(speech_dir / "picovoice/test_de.wav")
    mel = base_engine.features(audio)

    def decode(language: str | None, detect: bool) -> DecodeResult:
        options = DecodeOptions(language=language, detect_language=detect)
        request = DecodeRequest(audio.shape[0] / SAMPLE_RATE_HZ, options)
        return base_engine.decode_windows([Window(mel, request)])[0]

    plain, measured = decode("de", False), decode("de", True)
    assert plain.detected is None
    assert measured.tokens == plain.tokens and measured.language == "de"
    assert measured.detected is not None and measured.detected[0] == "de"
    assert measured.detected[1] > 0.9
    detected = decode(None, False)  # no language: detected and decoded in it
    assert detected.language == "de" and detected.detected == measured.detected
    in_english = decode("en", True)  # decoded as asked, the detector still says German
    assert in_english.language == "en" and in_english.detected == measured.detected
