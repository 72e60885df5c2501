"""The streaming core's rules: each one named, with its own knobs, switchable and counted.

A rule is a decision the core makes beyond "decode the window again and commit what decodes
agree on": when to decode, where to cut a window, which decoded words to distrust. Each is
measured on the dev sets with ``make bench-ablation`` (bench/README.md, "Rule ablation"): a
rule stays only where switching it off costs errors or latency beyond run-to-run noise, or
where it guards a failure those sets lack (a loop, lost audio), which its audio-free test in
tests/test_rules.py shows.

``RULES`` names them; ``RulesConfig.disabled`` switches any of them off (``--set
streaming.rules.disabled=[...]`` on the server and the benchmarks); ``RuleCounts`` counts how
often each fired (the session's ``rule_counts``, summed on ``/metrics``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

# Name -> what the rule does, in one line (the ablation table's rows).
RULES: Mapping[str, str] = {
    # decode planning
    "first_words": "decode at the first-decode cadence until the utterance shows a word",
    "speculative_closing": "start the closing decode when the silence covers the pad",
    "supersede": "per utterance: the closing decode replaces a re-decode in flight",
    "background_search": "per utterance: beam-search the open window on a spare lane",
    # a decode's words
    "after_committed": "words aligned before the last final word are moved after it",
    "loop_prompt_drop": "no prompt for the window after a decode that looped",
    "bare_prompt_drop": "no prompt while its last words hold no mark, or no sentence end",
    "sentence_case": "a final word after a sentence end starts with a capital",
    # where windows are cut
    "sentence_cut": "cut after a final word that ends a sentence (or a clause, long windows)",
    "cut_inside_commit": "per utterance: cut after the last sentence end of a commit",
    "unheard_tail": "after a closing decode that ended early, decode the rest on its own",
    "stalled_tail": "cut where re-decodes stop at the final words with speech after them",
    "window_cap": "a window past its cap is cut at its last final word",
}
# Rules that cannot be switched off: a window never outgrows Whisper's 30 s of context.
GUARDS = frozenset({"window_cap"})


@dataclass(frozen=True)
class FirstWordsConfig:
    # An utterance without words after this much audio decodes at the usual cadence.
    window_s: float = 3.0


@dataclass(frozen=True)
class UnheardTailConfig:
    # Speech left after a closing decode's last word that is decoded again as its own window.
    min_tail_s: float = 1.0


@dataclass(frozen=True)
class StalledTailConfig:
    # Voiced audio after the final words that a re-decode ended its text before.
    min_voiced_s: float = 2.0


@dataclass(frozen=True)
class BarePromptConfig:
    # The prompt's last this many words without a sentence or clause mark mean the text lost
    # its punctuation: Whisper copies the style of its prompt, so that text is not passed on.
    min_words: int = 12
    # ... and this many words without a sentence end, commas or not: the text runs on as one
    # sentence, and Whisper would go on with it, clause after clause. Longer than most read
    # sentences; 0: only the bare run above.
    max_sentence_words: int = 40


@dataclass(frozen=True)
class RulesConfig:
    """The rules' own knobs, and which are off (names from ``RULES``)."""

    disabled: tuple[str, ...] = ()
    first_words: FirstWordsConfig = field(default_factory=FirstWordsConfig)
    unheard_tail: UnheardTailConfig = field(default_factory=UnheardTailConfig)
    stalled_tail: StalledTailConfig = field(default_factory=StalledTailConfig)
    bare_prompt: BarePromptConfig = field(default_factory=BarePromptConfig)

    def __post_init__(self) -> None:
        unknown = [name for name in self.disabled if name not in RULES]
        if unknown:
            raise ValueError(
                f"unknown rule(s) {', '.join(unknown)}; the rules are {', '.join(RULES)}"
            )
        guards = [name for name in self.disabled if name in GUARDS]
        if guards:
            raise ValueError(f"{', '.join(guards)} cannot be switched off")
        checks = (
            ("first_words.window_s", self.first_words.window_s),
            ("unheard_tail.min_tail_s", self.unheard_tail.min_tail_s),
            ("stalled_tail.min_voiced_s", self.stalled_tail.min_voiced_s),
        )
        for name, value in checks:
            if value < 0:
                raise ValueError(f"rules.{name} must be >= 0; got {value}")
        if self.bare_prompt.max_sentence_words < 0:
            raise ValueError(
                "rules.bare_prompt.max_sentence_words must be >= 0; "
                f"got {self.bare_prompt.max_sentence_words}"
            )
        if self.bare_prompt.min_words < 1:
            raise ValueError(
                f"rules.bare_prompt.min_words must be >= 1; got {self.bare_prompt.min_words}"
            )

    def on(self, name: str) -> bool:
        """Whether rule ``name`` applies (it is not disabled)."""
        return name not in self.disabled


class RuleCounts(Counter[str]):
    """How often each rule fired in one session (and, summed, on a server)."""

    def fired(self, name: str, times: int = 1) -> None:
        assert name in RULES or name.startswith("final:"), name
        self[name] += times
