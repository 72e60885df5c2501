"""The streaming rules on recorded cases: real runs replayed with no model and no audio
(``tests/recorded_cases.py``). Each case is speech on which a rule fired: replayed, the core
must make the same decodes and the same finals; with that rule off, it must not (the rule
changes what happens there)."""

from __future__ import annotations

import pytest

from server.core.rules import RulesConfig
from tests.recorded_cases import Case, Diverged, replay

# case -> the rule it pins (what fired on that speech, and why the rule exists):
CASES = {
    # Whisper stopped at the forced prefix again and again as the window grew, with seconds
    # of speech after it: the window is cut there.
    "stalled-tail": "stalled_tail",
    # A closing decode ended its text a second and more before the utterance did: the rest is
    # decoded as a window of its own instead of being lost.
    "unheard-tail": "unheard_tail",
    # A long utterance's first commit held a sentence end before its last word: the window
    # is cut after it, so the word-by-word decodes after it hear seconds, not the utterance.
    "cut-inside-commit": "cut_inside_commit",
    # Two background searches agreed on the first words of a long utterance: they are held,
    # and the closing decode hears the tail.
    "held-search-words": "background_search",
    # After cuts the alignment put new words before the last final word's end.
    "words-after-final": "after_committed",
    # Decodes that looped: the windows after them were decoded without the prompt.
    "looped-decode": "loop_prompt_drop",
    # LJ Speech read on without a pause, word finals: after a window cut at its cap the
    # captions ran on without a mark for 24 words; the windows after that were decoded without
    # that prompt, and the finals got their commas and full stops back.
    "bare-prompt": "bare_prompt_drop",
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_recorded_case_replays_to_the_same_decodes_and_finals(name: str) -> None:
    case = Case.load(name)
    result, fired = replay(case)
    assert [[f.text, round(f.start, 3), round(f.end, 3)] for f in result.finals] == case.finals_seen
    assert fired == case.rules_fired
    assert fired.get(CASES[name], 0) >= 1


@pytest.mark.parametrize("name", sorted(CASES))
def test_with_its_rule_off_a_recorded_case_goes_another_way(name: str) -> None:
    case = Case.load(name)
    off = RulesConfig(disabled=(CASES[name],))
    try:
        result, fired = replay(case, rules=off)
    except Diverged:
        return  # the session asked for a decode the real run never made
    finals = [[f.text, round(f.start, 3), round(f.end, 3)] for f in result.finals]
    assert finals != case.finals_seen or fired != case.rules_fired
    assert CASES[name] not in fired
