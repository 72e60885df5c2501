"""Sessions on one timeline: the messages of a session that began partway into the source,
moved to the source's time, and the words a session heard again at its start dropped.

Pure: no I/O. ``client.reconnect`` uses it to join the sessions of one stream.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from server.protocol.messages import (
    DoneMessage,
    FinalMessage,
    PartialMessage,
    ServerMessage,
    SpeechEndedMessage,
    SpeechStartedMessage,
    TurnMessage,
    WordInfo,
)

SEAM_REPEAT_WINDOW_S = 1.0  # a repeat is looked for only this close to the seam
# A next session starts this long before the first seam word. That word's start is an
# estimate (cross-attention), sometimes a syllable late: a session started inside the word
# heard its tail as another one ("similar" as "or") and showed it. From further back it hears
# the whole word, and what it hears before the seam's end is dropped by time.
RESUME_BEFORE_SEAM_S = 0.25
# A new session's opening word that ends by the seam's last word's end, give or take this,
# lies inside the seam: heard before, whatever it was heard as.
SEAM_END_TOLERANCE_S = 0.05


def shift_message(message: ServerMessage, offset_s: float, segments_before: int) -> ServerMessage:
    """``message`` of a session that began ``offset_s`` into the source, whose earlier
    sessions sent ``segments_before`` finals, on the source's timeline."""
    received_s = message.audio_received_s + offset_s
    if isinstance(message, FinalMessage):
        return shift_final(message, offset_s, segments_before)
    if isinstance(message, PartialMessage):
        return replace(
            message,
            segment_id=message.segment_id + segments_before,
            start=message.start + offset_s,
            end=message.end + offset_s,
            audio_received_s=received_s,
        )
    if isinstance(message, SpeechStartedMessage):
        return replace(message, start=message.start + offset_s, audio_received_s=received_s)
    if isinstance(message, SpeechEndedMessage):
        return replace(message, end=message.end + offset_s, audio_received_s=received_s)
    if isinstance(message, DoneMessage):
        return replace(
            message, segments=message.segments + segments_before, audio_received_s=received_s
        )
    if isinstance(message, TurnMessage):
        return replace(
            message,
            start=message.start + offset_s,
            end=message.end + offset_s,
            words=_shift_words(message.words, offset_s),
            audio_received_s=received_s,
        )
    return replace(message, audio_received_s=received_s)  # ready, error


def shift_final(final: FinalMessage, offset_s: float, segments_before: int) -> FinalMessage:
    """``shift_message`` for a final, keeping its type."""
    return replace(
        final,
        segment_id=final.segment_id + segments_before,
        start=final.start + offset_s,
        end=final.end + offset_s,
        words=_shift_words(final.words, offset_s),
        audio_received_s=final.audio_received_s + offset_s,
    )


def _shift_words(words: tuple[WordInfo, ...], offset_s: float) -> tuple[WordInfo, ...]:
    return tuple(replace(w, start=w.start + offset_s, end=w.end + offset_s) for w in words)


def _comparable(word: str) -> str:
    # Close to server.core.agreement.normalize_word, which the client may not import (it stays off
    # the server's modules but the shared wire ones: tests/test_imports.py).
    return "".join(ch for ch in word.casefold() if ch.isalnum())


def _reads_as(key: str, seam_key: str) -> bool:
    """Whether a word (``_comparable``) reads as a seam word: the same, or the same stem with
    up to two letters more or fewer ("book" for "books"): two sessions' decodes of one word
    differ so, and its time differs too, so the seam's time alone does not catch it."""
    short, long = sorted((key, seam_key), key=len)
    return key == seam_key or (
        len(short) >= 3 and long.startswith(short) and len(long) - len(short) <= 2
    )


def seam_repeat_count(words: Sequence[WordInfo], seam: Sequence[WordInfo]) -> int:
    """How many opening ``words`` of a session's first final repeat ``seam``, the final words
    it began at (both on the source's timeline): the leading run of words that each either
    read as a seam word (``_reads_as``), in the seam's order (one it did not hear may be
    skipped), or end within the seam's time (a seam word heard as another, a tail of the word
    before it)."""
    keys = [_comparable(w.word) for w in seam]
    seam_end_s = seam[-1].end + SEAM_END_TOLERANCE_S if seam else 0.0
    matched = 0  # seam words read so far
    count = 0
    for word in words:
        key = _comparable(word.word)
        at = next((k for k in range(matched, len(keys)) if _reads_as(key, keys[k])), None)
        if at is not None:
            matched = at + 1
        elif word.end > seam_end_s:
            break
        count += 1
    return count


def drop_seam_repeat(
    final: FinalMessage, seam: tuple[WordInfo, ...], seam_s: float
) -> FinalMessage:
    """``final`` (on the source's timeline) without the opening words that repeat ``seam``
    (``seam_repeat_count``), the words made final before a session began at ``seam_s``,
    when they lie at the seam. All of it repeated: an empty final, so that segment ids stay
    in step."""
    words = final.words
    if not seam or not words or words[0].start > seam_s + SEAM_REPEAT_WINDOW_S:
        return final
    n = seam_repeat_count(words, seam)
    if n == 0:
        return final
    kept = words[n:]
    if not kept:
        return replace(final, text="", words=(), start=final.end)
    text = " ".join(w.word for w in kept)
    return replace(final, text=text, words=kept, start=kept[0].start)
