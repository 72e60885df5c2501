"""A decode's tail, cleaned: the words after the forced prefix, in stream time."""

from __future__ import annotations

from server.core.engine_api import DecodeResult, StopReason, WordTiming
from server.core.rules import RuleCounts, RulesConfig
from server.core.tail import tail_words
from tests.core_doubles import commit, job, spoken, utterance


def result(
    *spec: tuple[str, float, float, tuple[int, ...]], stop: StopReason = StopReason.EOT
) -> DecodeResult:
    """A decode's words, times relative to its window."""
    words = tuple(WordTiming(f" {t}", tokens, a, b, 0.9) for t, a, b, tokens in spec)
    return DecodeResult(
        tokens=tuple(t for x in words for t in x.tokens),
        text="".join(x.word for x in words),
        spans=(),
        words=words,
        language="en",
        avg_logprob=-0.2,
        no_speech_prob=0.01,
        compression_ratio=1.2,
        stop_reason=stop,
        n_generated=len(words),
    )


def test_the_forced_prefix_is_skipped_and_times_move_to_the_stream() -> None:
    utt = utterance(window_start_s=10.0)
    commit(utt, spoken(("carried", 10.1, 10.5)), carried=True)
    decode = job(10.0, 13.0, prefix=(100,))
    got = tail_words(
        decode,
        result(("carried", 0.1, 0.5, (100,)), ("new", 0.6, 0.9, (7,))),
        utt,
        RulesConfig(),
        RuleCounts(),
    )
    assert [(x.text, x.start_s) for x in got] == [(" new", 10.6)]


def test_a_decode_without_speech_has_no_tail() -> None:
    decode = job(0.0, 2.0)
    silent = result(("thank", 0.1, 0.5, (7,)), stop=StopReason.NO_SPEECH)
    assert tail_words(decode, silent, utterance(), RulesConfig(), RuleCounts()) == []


def test_words_squeezed_before_the_last_final_word_follow_it() -> None:
    utt = utterance(window_start_s=5.0)
    commit(utt, spoken(("printing", 5.0, 5.6)), carried=True)
    decode = job(5.0, 9.0, prefix=(100,))
    heard = result(
        ("printing", 0.0, 0.6, (100,)), ("then", 0.2, 0.4, (7,)), ("for", 0.7, 0.9, (8,))
    )
    counts = RuleCounts()
    got = tail_words(decode, heard, utt, RulesConfig(), counts)
    assert [(x.text, x.start_s, x.end_s) for x in got] == [(" then", 5.6, 5.6), (" for", 5.7, 5.9)]
    assert counts["after_committed"] == 1
    off = tail_words(decode, heard, utt, RulesConfig(disabled=("after_committed",)), RuleCounts())
    assert off[0].start_s == 5.2
