"""The streaming rules on recorded cases: real runs replayed with no model and no audio
(``tests/recorded_cases.py``). Each case is speech on which a rule fired: replayed, the core
must make the same decodes and the same finals; with that rule off, it must not (the rule
changes what happens there)."""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

import pytest

from bench.simulate import SimulationResult
from server.config import UTTERANCE_WINDOW_S
from server.core.rules import RULES, RulesConfig
from server.protocol.messages import DoneMessage, FinalMessage
from tests.recorded_cases import Case, Diverged, replay


@dataclass(frozen=True)
class Pin:
    """What a case pins: a rule of ``RULES`` (switched off through ``RulesConfig``), or a
    setting, with the StreamingConfig fields that turn it off."""

    name: str
    off: dict[str, Any] = field(default_factory=dict)

    def overrides(self) -> dict[str, Any]:
        if self.name in RULES:
            return {"rules": RulesConfig(disabled=(self.name,))}
        return self.off


# case -> what it pins (what fired on that speech, and why the rule exists):
CASES = {
    # Whisper stopped at the forced prefix again and again as the window grew, with seconds
    # of speech after it: the window is cut there.
    "stalled-tail": Pin("stalled_tail"),
    # A closing decode ended its text a second and more before the utterance did: the rest is
    # decoded as a window of its own instead of being lost.
    "unheard-tail": Pin("unheard_tail"),
    # A long utterance's first commit held a sentence end before its last word: the window
    # is cut after it, so the word-by-word decodes after it hear seconds, not the utterance.
    "cut-inside-commit": Pin("cut_inside_commit"),
    # Two background searches agreed on the first words of a long utterance: they are held,
    # and the closing decode hears the tail.
    "held-search-words": Pin("background_search"),
    # After cuts the alignment put new words before the last final word's end.
    "words-after-final": Pin("after_committed"),
    # Decodes that looped: the windows after them were decoded without the prompt.
    "looped-decode": Pin("loop_prompt_drop"),
    # LJ Speech read on without a pause, word finals: after a window cut at its cap the
    # captions ran on without a mark for 12 words and more; the windows after that were
    # decoded without that prompt, and the finals got their commas and full stops back.
    "bare-prompt": Pin("bare_prompt_drop"),
    # Per utterance, a 21.5 s utterance whose decodes read a word differently early on: past
    # half the window, the words with ``utterance_settled_context_s`` of audio after them are
    # final although two decodes differ there, instead of every word after that difference
    # waiting (the first two finals came 15 and 13 s after their words without it).
    "settled-context": Pin("utterance_settled_context_s", {"utterance_settled_context_s": 0.0}),
    # Long read sentences at a 4 s window cap, word finals: every cut lands inside speech, and
    # each carries the last two final words into the next window as its forced prefix. Cut at
    # the last word's end instead, words at the cuts were lost (5 errors against 1 in 58 words
    # on these two sentences).
    "carried-words": Pin("cut_carry_words", {"cut_carry_words": 0}),
    "carried-words-2": Pin("cut_carry_words", {"cut_carry_words": 0}),
}
# All 75 s of a long recording arrive before the first decode ends (``--pace 0``, or a
# stream far behind): every window is cut at its cap. Two faults skipped whole windows while
# ``done`` counted them transcribed: a cut behind the carried prefix when nothing new was
# committed, and a cut past a window whose decode ended at the prefix.
ALL_AT_ONCE = ("all-at-once", "all-at-once-words")


@pytest.mark.parametrize("name", sorted(CASES) + list(ALL_AT_ONCE))
def test_a_recorded_case_replays_to_the_same_decodes_and_finals(name: str) -> None:
    case = Case.load(name)
    result, fired = replay(case)
    assert [[f.text, round(f.start, 3), round(f.end, 3)] for f in result.finals] == case.finals_seen
    assert fired == case.rules_fired
    if CASES.get(name, Pin("")).name in RULES:
        assert fired.get(CASES[name].name, 0) >= 1


@pytest.mark.parametrize("name", sorted(CASES))
def test_with_its_rule_off_a_recorded_case_goes_another_way(name: str) -> None:
    case = Case.load(name)
    pin = CASES[name]
    try:
        result, fired = replay(case, **pin.overrides())
    except Diverged:
        return  # the session asked for a decode the real run never made
    finals = [[f.text, round(f.start, 3), round(f.end, 3)] for f in result.finals]
    assert finals != case.finals_seen or fired != case.rules_fired
    assert pin.name not in fired


def _timed_finals(result: SimulationResult) -> list[tuple[float, FinalMessage]]:
    return [(e.at_s, e.message) for e in result.events if isinstance(e.message, FinalMessage)]


def test_a_long_utterances_finals_come_seconds_after_their_words_not_at_its_end() -> None:
    """``settled-context``: no final before the window holds half its 30 s, then word by word,
    each within 4 s of its last word (2.0-3.2 s when recorded)."""
    result, _ = replay(Case.load("settled-context"))
    timed = _timed_finals(result)
    assert len(timed) >= 3  # word by word past 15 s, then the closing decode
    assert min(at for at, _ in timed) >= UTTERANCE_WINDOW_S / 2
    assert max(at - final.end for at, final in timed) < 4.0, [
        (round(at - final.end, 2), final.text) for at, final in timed
    ]


@pytest.mark.parametrize("name", ALL_AT_ONCE)
def test_a_recording_sent_all_at_once_loses_no_window(name: str) -> None:
    """Continuous speech, so no final follows the one before by 3 s; ``done`` counts every
    second of speech transcribed and none failed."""
    case = Case.load(name)
    result, fired = replay(case)
    assert fired.get("window_cap", 0) >= 1
    finals = result.finals
    assert [f.segment_id for f in finals] == list(range(len(finals)))
    assert [(a.end, b.start) for a, b in pairwise(finals) if b.start - a.end > 3.0] == []
    (done,) = [e.message for e in result.events if isinstance(e.message, DoneMessage)]
    assert done.transcribed_s == pytest.approx(done.speech_s, abs=0.01)
    assert done.failed_s == 0
