"""The rules' registry, their config and switches, and their counters."""

from __future__ import annotations

import pytest

from server.config import StreamingConfig, with_setting
from server.core.rules import RULES, RuleCounts, RulesConfig


def test_every_rule_has_a_one_line_description() -> None:
    assert RULES
    for name, what in RULES.items():
        assert name.isidentifier() and what and "\n" not in what


def test_an_unknown_rule_is_refused_with_the_names_there_are() -> None:
    with pytest.raises(ValueError, match=r"unknown rule.*nonsense.*sentence_cut"):
        RulesConfig(disabled=("nonsense",))


def test_a_disabled_rule_is_off_and_the_others_on() -> None:
    rules = RulesConfig(disabled=("stalled_tail",))
    assert not rules.on("stalled_tail")
    assert all(rules.on(name) for name in RULES if name != "stalled_tail")


@pytest.mark.parametrize(
    "path, value",
    [
        ("rules.stalled_tail.min_voiced_s", -1.0),
        ("rules.unheard_tail.min_tail_s", -0.5),
        ("rules.bare_prompt.min_words", 0),
        ("rules.bare_prompt.max_sentence_words", -1),
    ],
)
def test_a_rules_knob_is_checked(path: str, value: object) -> None:
    with pytest.raises(ValueError, match="rules"):
        with_setting(StreamingConfig(), path, value)


def test_any_streaming_setting_is_reachable_by_its_dotted_name() -> None:
    c = with_setting(StreamingConfig(), "rules.stalled_tail.min_voiced_s", 2.5)
    assert c.rules.stalled_tail.min_voiced_s == 2.5
    c = with_setting(c, "rules.disabled", ["sentence_cut", "unheard_tail"])
    assert c.rules.disabled == ("sentence_cut", "unheard_tail")
    c = with_setting(c, "commit.min_window_s", 3)
    assert c.commit.min_window_s == 3
    with pytest.raises(ValueError, match=r"no setting 'nope' here; there are .*unheard_tail"):
        with_setting(c, "rules.nope", 1)
    with pytest.raises(ValueError, match="has no settings inside"):
        with_setting(c, "finals.x", 1)


def test_counts_name_rules_or_the_path_of_a_final() -> None:
    counts = RuleCounts()
    counts.fired("sentence_cut")
    counts.fired("final:agreement")
    counts.fired("final:agreement")
    assert counts == {"sentence_cut": 1, "final:agreement": 2}
    with pytest.raises(AssertionError):
        counts.fired("no_such_rule")


def test_a_guard_cannot_be_switched_off() -> None:
    with pytest.raises(ValueError, match="window_cap cannot be switched off"):
        RulesConfig(disabled=("window_cap",))
