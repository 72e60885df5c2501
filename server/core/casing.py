"""Sentence case across finals (rule ``sentence_case``): a sentence starts with a capital.

Whisper capitalises after its own full stops, but a stream's text is many decodes joined: a
window decoded without its prompt, or a final that begins after the previous window's last
word, may start a sentence in lower case ("... in niggarding. pity the world"). Offline text
never shows a reader that seam. The rule writes the first letter of a word that follows a
sentence end in upper case, in finals and in the partials that will become them, so a
partial does not change case when it turns final. Only the case of one letter changes: the
words, their tokens and so the decodes are the same, and no word error rate can see it
(every normaliser folds case).

The stream's first word keeps the decoder's case: Whisper writes it in lower case where the
audio begins mid-sentence ("in being comparatively modern."), as offline decoding of the same
audio does. A full stop after an abbreviation or an initial ("etc.", "i.e.", "Mr.", "J."),
and an ellipsis, where the speaker trails off and goes on ("the... that"), do not end a
sentence here: the word after them keeps the decoder's case.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

from server.core.agreement import Word
from server.core.cuts import SENTENCE_END

# Closing quotes and brackets after a sentence's mark ("... die.'") still end it.
CLOSERS = "\"')]”’»"
# Words whose full stop is an abbreviation's, not a sentence's end.
ABBREVIATIONS = frozenset(
    {"mr.", "mrs.", "ms.", "dr.", "st.", "jr.", "sr.", "prof.", "etc.", "vs.", "viz.", "cf."}
)
# Letters each followed by a full stop: initials and "i.e.", "e.g.", "U.S." (also ".e." when
# a word final split "i .e.").
_INITIALS = re.compile(r"^\.?(?:[^\W\d_]\.)+$")


def ends_sentence(word: str) -> bool:
    """Whether ``word`` (the last word of the text so far) ends a sentence."""
    bare = word.strip().rstrip(CLOSERS)
    if not bare.endswith(SENTENCE_END) or bare.endswith(("..", "…")):
        return False
    return bare.casefold() not in ABBREVIATIONS and not _INITIALS.match(bare)


def capitalised(text: str) -> str | None:
    """``text`` with the first letter of its word in upper case; None when that letter is
    upper case already, has no case, or a digit comes before it ("2nd")."""
    for k, ch in enumerate(text):
        if ch.isdigit():
            return None
        if ch.isalpha():
            upper = ch.upper()
            # "ß".upper() is "SS": a letter without a single-letter capital is left alone.
            if upper == ch or len(upper) != 1:
                return None
            return text[:k] + upper + text[k + 1 :]
    return None


class SentenceCase:
    """The stream's place in its text: whether the next word begins a sentence."""

    def __init__(self) -> None:
        self._last_word = ""  # the last final word (with a mark of its own after it)

    def apply(self, words: Sequence[Word], *, advance: bool) -> tuple[list[Word], int]:
        """``words`` with the first letter of every word after a sentence end in upper case,
        and how many were changed. ``advance``: they are final (the text goes on
        after them); partials leave the place where it was."""
        last = self._last_word
        out: list[Word] = []
        changed = 0
        for word in words:
            text = word.text.strip()
            if not text:
                out.append(word)
                continue
            if any(ch.isalnum() for ch in text):
                new = capitalised(word.text) if ends_sentence(last) else None
                if new is not None:
                    word = dataclasses.replace(word, text=new)
                    changed += 1
                last = text
            else:
                # A mark decoded as a word of its own ("concerned" "," "differs") belongs to
                # the word before it.
                last += text
            out.append(word)
        if advance:
            self._last_word = last
        return out, changed
