"""Where a window is cut: the cut rules, each a function that returns a decision or None.

A cut starts a new window: the final words before it become the prompt, and short windows
keep every re-decode cheap. A cut carries the last ``cut_carry_words`` final words into the
new window as its forced prefix (``cut_point``): a word's end is only the alignment's
estimate, and a cut at the last one lands in the next word often enough to lose it.

The rules (``rules.py``):
- ``sentence_cut``: after a final word that ends a sentence once the window holds
  ``sentence_cut_s``, or a clause once it holds ``clause_cut_s``: punctuation is where no
  word straddles. With ``cut_inside_commit`` (per utterance) the cut goes after the last such
  end among the words a commit made final, not only its last word: a long utterance's
  word-by-word re-decodes then hear seconds, not 15-30 s.
- ``unheard_tail``: Whisper can end a long window's text at a sentence end although speech
  follows; after a closing decode whose words end well before the utterance, the rest is
  decoded as a window of its own instead of being lost.
- ``stalled_tail``: Whisper can stop at a forced prefix again and again as the window grows;
  after a re-decode that ended at the final words with seconds of speech after them, the next
  decode hears a window of its own after them.

Cutting in the pauses the VAD heard was measured and dropped (bench/README.md): Whisper needs
the context.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from server.config import StreamingConfig
from server.core.agreement import Word, normalize_word
from server.core.jobs import DecodeJob
from server.core.utterance import Utterance
from server.protocol.formats import SAMPLE_RATE_HZ

SENTENCE_END = (".", "?", "!", "。", "？", "！")
CLAUSE_END = (",", ";", ":", "，", "；", "：")

# Voiced seconds between two stream samples (``VadSegmenter.voiced_s``).
VoicedS = Callable[[int, int], float]


@dataclass(frozen=True)
class Cut:
    """A decision to start the window at ``at``, carrying the last ``carry`` final words."""

    at: int
    carry: int
    rule: str


def cut_point(
    utt: Utterance, limit: int, carry_words: int, upto: int | None = None
) -> tuple[int, int]:
    """Where a cut after the committed words goes, and how many words it carries.

    At the start of the ``carry_words``-th last committed word with letters; the new window
    keeps the words from there as its forced prefix. Fewer words when that start is not inside
    the window; none, at the end of the last word, when no word's start is. ``upto``: the cut
    follows the committed word of that index instead of the last one, and the words after it
    are carried as well."""
    words = utt.committed
    last = len(words) - 1 if upto is None else upto
    end = min(round(words[last].end_s * SAMPLE_RATE_HZ), limit) if words else limit
    spoken = [i for i, w in enumerate(words[: last + 1]) if normalize_word(w.text)]
    for k in spoken[max(0, len(spoken) - carry_words) :] if carry_words else []:
        start = round(words[k].start_s * SAMPLE_RATE_HZ)
        if utt.window_start < start <= limit and all(w.tokens for w in words[k:]):
            return start, len(words) - k
    if all(w.tokens for w in words[last + 1 :]):
        return end, len(words) - last - 1
    return utt.window_start, 0


def sentence_cut(utt: Utterance, c: StreamingConfig, *, inside_commit: bool) -> Cut | None:
    """Rule ``sentence_cut`` (and ``cut_inside_commit`` when ``inside_commit``)."""
    if not utt.committed:
        return None
    last = len(utt.committed) - 1
    for k in range(last, -1 if inside_commit else last - 1, -1):
        word = utt.committed[k]
        at = round(word.end_s * SAMPLE_RATE_HZ)
        window_s = (at - utt.window_start) / SAMPLE_RATE_HZ
        text = word.text.rstrip()
        if (text.endswith(SENTENCE_END) and window_s >= c.sentence_cut_s) or (
            text.endswith(CLAUSE_END) and window_s >= c.clause_cut_s
        ):
            break
    else:
        return None
    at, carry = cut_point(utt, max(at, utt.heard_to), c.cut_carry_words, upto=k)
    if at <= utt.window_start:
        return None
    return Cut(at, carry, "sentence_cut" if k == last else "cut_inside_commit")


def unheard_tail_cut(utt: Utterance, c: StreamingConfig) -> Cut | None:
    """Rule ``unheard_tail``, after a closing decode: a cut at the last final word when the
    words end ``min_tail_s`` or more before the utterance does. Each cut moves the window
    forward, so the closing decodes end. None: the utterance can be finished."""
    if utt.end is None or not utt.committed:
        return None
    last = utt.committed[-1]
    if (
        utt.end - round(last.end_s * SAMPLE_RATE_HZ)
        < c.rules.unheard_tail.min_tail_s * SAMPLE_RATE_HZ
    ):
        return None
    # At the start of the last word, not its end: a word before an early end of text tends to
    # be given the time of the silence or speech after it, and the words under that time would
    # be skipped.
    at, carry = cut_point(utt, utt.end, c.cut_carry_words)
    return Cut(at, carry, "unheard_tail") if carry else None


def stalled_tail_cut(
    utt: Utterance, job: DecodeJob, tail: list[Word], voiced_s: VoicedS, c: StreamingConfig
) -> Cut | None:
    """Rule ``stalled_tail``, after a re-decode of the open utterance that ended its text at
    the final words although ``min_voiced_s`` of speech follows them: a cut at the last of
    them."""
    if (
        utt.end is not None
        or not job.request.prefix
        or not utt.committed
        or any(normalize_word(w.text) for w in tail)
    ):
        return None
    last_end = round(utt.committed[-1].end_s * SAMPLE_RATE_HZ)
    if voiced_s(last_end, job.end_sample) < c.rules.stalled_tail.min_voiced_s:
        return None
    at, carry = cut_point(utt, min(utt.heard_to, job.end_sample), c.cut_carry_words)
    return Cut(at, carry, "stalled_tail") if at > utt.window_start else None
