"""Agreement between successive decodes: which words they confirm, and which are tentative.

LocalAgreement-n (whisper_streaming; Macháček, Dabre and Bojar, 2023), which the commit policy
(``policy.py``) builds on: the window is decoded again as audio arrives, and a word becomes
final once n consecutive decodes agree on it and on everything before it. The decoder is
forced with the words already committed in the window, so each hypothesis handed in here is
only the new tail after them.
"""

from __future__ import annotations

import collections
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Word:
    """One decoded word with its times in seconds.

    ``text`` keeps Whisper's leading space (``" hello"``) so words join back into text by
    plain concatenation.
    """

    text: str
    start_s: float
    end_s: float
    probability: float = 1.0
    tokens: tuple[int, ...] = ()  # its decoder tokens: a committed word is forced as these


def normalize_word(text: str) -> str:
    """The form two words are compared in: casefolded, without punctuation or spaces.

    ``" Hello,"`` and ``"hello"`` both become ``"hello"``; Whisper often changes only
    punctuation or case of a word between two decodes of the same audio.
    """
    return "".join(
        ch
        for ch in text.casefold()
        if not ch.isspace() and not unicodedata.category(ch).startswith("P")
    )


def read_alike(newer: Sequence[Word], older: Sequence[Word]) -> list[Word]:
    """The opening words of ``newer`` that ``older`` reads alike (``normalize_word``), up to
    the last spoken one of them. Words that are only punctuation are passed over on both
    sides: two beam searches that differ only in a comma ("well, and" against "well and") would
    otherwise agree, word by word, on the words before it alone."""
    spoken = [text for text in (normalize_word(w.text) for w in older) if text]
    matched = agreed = 0
    for k, word in enumerate(newer):
        text = normalize_word(word.text)
        if not text:
            continue
        if matched == len(spoken) or spoken[matched] != text:
            break
        matched += 1
        agreed = k + 1
    return list(newer[:agreed])


class LocalAgreement:
    """LocalAgreement-n over successive tails of one window.

    ``update`` returns the words that became final; ``tentative`` is the rest of the newest
    tail. A word is returned at most once, by ``update`` or ``finalize``, and never retracted.
    """

    def __init__(self, n: int = 2, *, marks_wait: bool = False) -> None:
        if n < 1:
            raise ValueError(f"n must be >= 1; got {n}")
        self._n = n
        self._marks_wait = marks_wait
        # The last n tails, each already trimmed of the words committed after it arrived.
        self._tails: collections.deque[list[Word]] = collections.deque(maxlen=n)

    @property
    def n(self) -> int:
        """How many consecutive tails must agree before a word is committed."""
        return self._n

    @property
    def tentative(self) -> list[Word]:
        """The newest tail without the words committed from it: shown, but may still change."""
        return list(self._tails[-1]) if self._tails else []

    def update(self, tail: Sequence[Word], *, hold: int = 0, at_least: int = 0) -> list[Word]:
        """Take the newest hypothesis (the words after the committed ones) and commit.

        Returns the newly committed words: the longest prefix on which the last n tails agree
        (compared with ``normalize_word``), with the text and times of the newest tail.
        The newest tail's last ``hold`` words are never committed here: the word at the very
        end of the audio is often cut off, and Whisper punctuates it as if the speaker stopped.
        Its first ``at_least`` words commit whether or not the earlier tails agree (still
        never the held ones), once n tails have arrived. With ``marks_wait``, a word the
        newest tail puts a punctuation mark after commits with the mark or not at all: a
        final that begins with the comma of the one before reads "to me , and" where finals
        are joined.
        """
        if hold < 0 or at_least < 0:
            raise ValueError(f"hold and at_least must be >= 0; got {hold}, {at_least}")
        agreed = max(self.agreed(tail), at_least)
        self._tails.append(list(tail))
        if len(self._tails) < self._n:
            return []
        newest = self._tails[-1]
        agreed = min(agreed, max(0, len(newest) - hold))
        while (
            self._marks_wait
            and 0 < agreed < len(newest)
            and not normalize_word(newest[agreed].text)
        ):
            agreed -= 1
        if agreed == 0:
            return []
        committed = newest[:agreed]
        # The next tail starts after these words, so the remembered tails must too.
        for i, old in enumerate(self._tails):
            self._tails[i] = old[agreed:]
        return committed

    def agreed(self, tail: Sequence[Word]) -> int:
        """How many leading words of ``tail`` the last n - 1 tails agree on (compared with
        ``normalize_word``): what ``update(tail)`` would commit with no words held."""
        if len(self._tails) < self._n - 1:
            return 0
        earlier = list(self._tails)[len(self._tails) - (self._n - 1) :]
        agreed = 0
        # Tails differ in length; agreement cannot reach past the shortest one.
        for column in zip(*earlier, tail, strict=False):
            first = normalize_word(column[0].text)
            if any(normalize_word(word.text) != first for word in column[1:]):
                break
            agreed += 1
        return agreed

    def finalize(self) -> list[Word]:
        """Commit and return the tentative words (end of speech or a flush), then clear."""
        remainder = self.tentative
        self._tails.clear()
        return remainder

    def reset(self) -> None:
        """Forget every tail without committing anything (e.g. a new window after a cut)."""
        self._tails.clear()
