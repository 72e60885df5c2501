"""Background searches (rule ``background_search``, per utterance): the open window
beam-searched on a spare decode lane, so the closing decode hears only the tail.

In "utterance" finals the closing decode is a beam search over the whole utterance, which
takes 1-2.5 s after a 10-23 s utterance on a 2-core CPU. A stream with a lane to spare
searches its open window once it holds ``utterance_search_s`` of audio, and again after each
``utterance_search_step_s``. Words that two searches of the same window read alike, with
``commit.settled_context_s`` of audio after them, are *held*: final with the rest of the
utterance at its end. The window is then cut before their last ``utterance_search_context_s``
(those words stay as its forced prefix, context for the tail), and the closing decode hears
seconds instead of the whole utterance.

A search changes nothing until two agree, and a result for a window that moved on meanwhile
is dropped.
"""

from __future__ import annotations

from server.config import StreamingConfig
from server.core.agreement import Word, normalize_word, read_alike
from server.core.cuts import cut_point
from server.core.jobs import DecodeJob
from server.core.utterance import SearchedWords, Utterance
from server.protocol.formats import SAMPLE_RATE_HZ


def search_due(
    utt: Utterance, buffer_end: int, tentative_end: int | None, c: StreamingConfig
) -> bool:
    """Whether the open ``utt`` (the stream's only utterance) is due a background search up
    to ``buffer_end``."""
    return not (
        utt.end is not None
        or utt.language is None
        or utt.speculation is not None
        # silence after speech: the speculative closing decode is due, not this
        or tentative_end is not None
        or buffer_end - utt.start < c.utterance_search_s * SAMPLE_RATE_HZ
        or buffer_end - max(utt.window_start, utt.searched_to)
        < c.utterance_search_step_s * SAMPLE_RATE_HZ
    )


def settle(utt: Utterance, job: DecodeJob, tail: list[Word], c: StreamingConfig) -> None:
    """Fold in a search's words (``tail``) for ``utt``'s current window: its words with
    ``commit.settled_context_s`` of audio after them are its settled words, and those that the
    search before it of the same window read alike become ``utt.agreed``."""
    limit_s = job.start_s + job.audio_s - c.commit.settled_context_s
    settled: list[Word] = []
    for word in tail:
        if word.end_s > limit_s:
            break
        settled.append(word)
    before = utt.search_words
    utt.search_words = SearchedWords(utt.basis, job.end_sample, settled)
    if before is None or before.basis != utt.basis:
        return
    agreed = read_alike(settled, before.words)
    if agreed:
        utt.agreed = SearchedWords(utt.basis, job.end_sample, agreed)


def holdable(utt: Utterance, agreed: SearchedWords, carry_words: int) -> bool:
    """Whether the agreed words may be held now: the window is still the one they heard, and
    they are more than a cut would carry anyway."""
    spoken = [w for w in agreed.words if normalize_word(w.text)]
    return agreed.basis == utt.basis and utt.speculation is None and len(spoken) > carry_words


def held_cut_point(utt: Utterance, c: StreamingConfig) -> tuple[int, int]:
    """Where the window is cut after held words, and how many it carries: at the start of the
    first spoken word within ``utterance_search_context_s`` of the last one's end (at least
    ``cut_carry_words``, as any cut carries). A closing decode after a cut that carried only
    two words heard too little before the tail."""
    at, carry = cut_point(utt, utt.heard_to, c.cut_carry_words)
    words = utt.committed
    floor = words[-1].end_s - c.utterance_search_context_s
    for k in range(len(words) - carry):
        if (
            words[k].start_s >= floor
            and normalize_word(words[k].text)
            and all(w.tokens for w in words[k:])
        ):
            start = round(words[k].start_s * SAMPLE_RATE_HZ)
            return max(utt.window_start, start), len(words) - k
    return at, carry


def rest_after_held(
    latest: SearchedWords | None, agreed: SearchedWords, basis: tuple[int, int]
) -> SearchedWords | None:
    """The latest search's words after the held ones: what the next search of the new window
    is checked against."""
    if latest is None or latest.basis != agreed.basis:
        return None
    return SearchedWords(basis, latest.end_sample, latest.words[len(agreed.words) :])
