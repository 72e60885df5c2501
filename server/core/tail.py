"""A decode's new words: what it returned after the forced prefix, in stream time, cleaned.

Two rules clean a tail (``rules.py``):
- ``cut_repeat``: a window that starts at a cut can hear the end of the last final word again
  (word end times are estimates), and a decode without a forced prefix then opens with it;
  the longest opening run that repeats the words final just before the cut is dropped.
- ``after_committed``: after a cut, the alignment can squeeze new words onto the window's
  first frame, before the last final word's end: they follow it.
"""

from __future__ import annotations

import dataclasses

from server.core.agreement import Word, normalize_word
from server.core.engine_api import DecodeResult
from server.core.jobs import DecodeJob
from server.core.rules import RuleCounts, RulesConfig
from server.core.utterance import Utterance
from server.protocol.formats import SAMPLE_RATE_HZ


def tail_words(
    job: DecodeJob,
    result: DecodeResult,
    utt: Utterance | None,
    rules: RulesConfig,
    counts: RuleCounts,
) -> list[Word]:
    """``result``'s words after the forced prefix, in stream time, cleaned by the rules."""
    if not result.is_speech:
        return []
    words = list(result.words)
    forced = len(job.request.prefix)
    count = 0
    k = 0
    while k < len(words) and count < forced:
        count += len(words[k].tokens)
        k += 1
    tail = [
        Word(w.word, job.start_s + w.start_s, job.start_s + w.end_s, w.probability, w.tokens)
        for w in words[k:]
        if w.word.strip()
    ]
    if utt is None:
        return tail
    if not job.request.prefix and rules.on("cut_repeat"):
        kept = drop_repeat_of_cut(utt, tail, rules)
        if len(kept) != len(tail):
            counts.fired("cut_repeat")
        tail = kept
    before = (utt.committed or utt.before_cut)[-1:]
    if before and rules.on("after_committed"):
        floor = before[0].end_s
        if any(w.start_s < floor for w in tail):
            counts.fired("after_committed")
            tail = [
                w
                if w.start_s >= floor
                else dataclasses.replace(w, start_s=floor, end_s=max(w.end_s, floor))
                for w in tail
            ]
    return tail


def drop_repeat_of_cut(utt: Utterance, tail: list[Word], rules: RulesConfig) -> list[Word]:
    """``tail`` without its longest opening n-gram that repeats the words committed just
    before the window's cut, when it lies at the cut."""
    c = rules.cut_repeat
    before = utt.before_cut
    if not before or not tail or tail[0].start_s > utt.window_start / SAMPLE_RATE_HZ + c.within_s:
        return tail
    for n in range(min(len(before), len(tail), c.max_words), 0, -1):
        if [normalize_word(w.text) for w in tail[:n]] == [
            normalize_word(w.text) for w in before[-n:]
        ]:
            return tail[n:]
    return tail
