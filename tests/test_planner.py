"""The decode planner's rules on scripted utterances: cadence, first words, speculative
closing, the window cap, decode options."""

from __future__ import annotations

import dataclasses

import numpy as np

from server.config import StreamingConfig
from server.core.planner import DecodePlanner, Load
from server.core.rules import RuleCounts, RulesConfig
from tests.core_doubles import SR, commit, job, spoken, utterance


def planner(**kwargs: object) -> DecodePlanner:
    return DecodePlanner(StreamingConfig(**kwargs), RuleCounts())  # type: ignore[arg-type]


def test_an_open_utterance_is_decoded_again_after_min_new_audio_ms() -> None:
    p = planner()
    utt = utterance()
    commit(utt, spoken(("hello", 0.2, 0.6)))
    utt.decoded_to = round(2.0 * SR)
    assert not p.due(utt, round(2.25 * SR), Load())
    assert p.due(utt, round(2.3 * SR), Load())


def test_under_load_the_schedulers_hop_spaces_redecodes() -> None:
    p = planner()
    utt = utterance()
    commit(utt, spoken(("hello", 0.2, 0.6)))
    utt.decoded_to = round(2.0 * SR)
    assert not p.due(utt, round(2.5 * SR), Load(min_hop_s=0.7))
    assert p.due(utt, round(2.7 * SR), Load(min_hop_s=0.7))


def test_until_the_first_word_the_first_decode_cadence_applies_whatever_the_load() -> None:
    counts = RuleCounts()
    p = DecodePlanner(StreamingConfig(), counts)
    utt = utterance()
    assert p.due(utt, round(0.2 * SR), Load(min_hop_s=1.0))
    assert counts["first_words"] == 1
    off = DecodePlanner(StreamingConfig(rules=RulesConfig(disabled=("first_words",))), counts)
    assert not off.due(utt, round(0.2 * SR), Load())
    # Past its first seconds an utterance without words goes at the usual pace.
    utt.decoded_to = round(2.9 * SR)
    assert not p.due(utt, round(3.15 * SR), Load())
    assert p.due(utt, round(3.2 * SR), Load())


def test_first_word_decodes_are_urgent_for_the_scheduler() -> None:
    p = planner()
    utt = utterance()
    audio = np.zeros(round(0.4 * SR), dtype=np.float32)
    options = p.options(utt, None, "transcribe", closing=False)
    first = p.job(utt, audio, options, (), session_id="s", job_id=0, closing=False)
    assert first.urgent and not first.closing
    commit(utt, spoken(("hi", 0.1, 0.3)))
    later = p.job(utt, audio, options, (), session_id="s", job_id=1, closing=False)
    assert not later.urgent and later.request.prefix == tuple(utt.committed_tokens)


def test_the_closing_decode_starts_in_the_pause_once_the_silence_covers_the_pad() -> None:
    p = planner()
    utt = utterance()
    pause = round(3.0 * SR)
    assert p.speculative_end(utt, pause, open_utterances=1, crowded=False) == pause
    assert p.speculative_end(utt, None, open_utterances=1, crowded=False) is None
    assert p.speculative_end(utt, pause, open_utterances=2, crowded=False) is None
    utt.speculated_to = pause  # guessed there already
    assert p.speculative_end(utt, pause, open_utterances=1, crowded=False) is None
    off = planner(rules=RulesConfig(disabled=("speculative_closing",)))
    assert off.speculative_end(utterance(), pause, open_utterances=1, crowded=False) is None
    ruled_off = planner(rules=RulesConfig(disabled=("speculative_closing",)))
    assert ruled_off.speculative_end(utterance(), pause, open_utterances=1, crowded=False) is None


def test_no_speculative_closing_past_the_window_cap() -> None:
    p = planner(max_window_s=10.0, crowded_max_window_s=6.0, clause_cut_s=10.0)
    utt = utterance()
    assert p.speculative_end(utt, round(8.0 * SR), open_utterances=1, crowded=False) is not None
    assert p.speculative_end(utt, round(8.0 * SR), open_utterances=1, crowded=True) is None
    assert p.window_cap(utt, crowded=True) == round(6.0 * SR)


def test_a_closing_decode_asks_for_the_closing_beam_and_a_redecode_is_greedy() -> None:
    p = DecodePlanner(StreamingConfig().with_finals("utterance"), RuleCounts())
    utt = utterance()
    assert p.options(utt, None, "transcribe", closing=True).beam_size == 5
    assert p.options(utt, None, "transcribe", closing=False).beam_size == 1


def test_past_the_comfortable_estimate_words_settle_with_less_context() -> None:
    p = DecodePlanner(StreamingConfig().with_finals("utterance"), RuleCounts())
    assert p.settled_context_s(job(0.0, 3.0)) is None
    busy = dataclasses.replace(job(0.0, 3.0), past_comfort=True)
    assert p.settled_context_s(busy) == 0.8
