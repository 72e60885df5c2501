"""A decode's new words: what it returned after the forced prefix, in stream time, cleaned.

One rule cleans a tail (``rules.py``), ``after_committed``: after a cut, the alignment can
squeeze new words onto the window's first frame, before the last final word's end: they
follow it.
"""

from __future__ import annotations

import dataclasses

from server.core.agreement import Word
from server.core.engine_api import DecodeResult
from server.core.jobs import DecodeJob
from server.core.rules import RuleCounts, RulesConfig
from server.core.utterance import Utterance


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
