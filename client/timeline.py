"""Sessions on one timeline: the messages of a session that began partway into the source,
moved to the source's time, and the words a session heard again at its start dropped.

Pure: no I/O. ``client.reconnect`` uses it to join the sessions of one stream.
"""

from __future__ import annotations

from dataclasses import replace

from server.protocol.messages import (
    DoneMessage,
    FinalMessage,
    PartialMessage,
    ServerMessage,
    SpeechEndedMessage,
    SpeechStartedMessage,
    WordInfo,
)

SEAM_REPEAT_WINDOW_S = 1.0  # a repeat is looked for only this close to the seam


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
    return replace(message, audio_received_s=received_s)  # ready, error


def shift_final(final: FinalMessage, offset_s: float, segments_before: int) -> FinalMessage:
    """``shift_message`` for a final, keeping its type."""
    return replace(
        final,
        segment_id=final.segment_id + segments_before,
        start=final.start + offset_s,
        end=final.end + offset_s,
        words=tuple(
            replace(w, start=w.start + offset_s, end=w.end + offset_s) for w in final.words
        ),
        audio_received_s=final.audio_received_s + offset_s,
    )


def _comparable(word: str) -> str:
    # Close to server.core.agreement.normalize_word, which the client may not import (it stays off
    # the server's modules but the shared wire ones: tests/test_imports.py).
    return "".join(ch for ch in word.casefold() if ch.isalnum())


def drop_seam_repeat(
    final: FinalMessage, seam: tuple[WordInfo, ...], seam_s: float
) -> FinalMessage:
    """``final`` (on the source's timeline) without the opening words that repeat the end of
    ``seam``, the words made final before a session began at ``seam_s``, when they lie at
    the seam. All of it repeated: an empty final, so that segment ids stay in step."""
    words = final.words
    if not seam or not words or words[0].start > seam_s + SEAM_REPEAT_WINDOW_S:
        return final
    for n in range(min(len(seam), len(words)), 0, -1):
        if [_comparable(w.word) for w in words[:n]] == [_comparable(w.word) for w in seam[-n:]]:
            kept = words[n:]
            if not kept:
                return replace(final, text="", words=(), start=final.end)
            text = " ".join(w.word for w in kept)
            return replace(final, text=text, words=kept, start=kept[0].start)
    return final
