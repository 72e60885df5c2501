"""What a session sends: finals, partials, speech events, ``Settled`` and ``done``, in order.

The emitter numbers segments, drops a partial that repeats the last one, holds a final (and
everything after it) until the speaker tracker can label its words, and accounts for every
speech sample (transcribed or given up) for the ``done`` message. It decides nothing about
which words are final: the session hands it words to send.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

from server.core.agreement import Word
from server.core.speakers import SpeakerLabel, SpeakerTracker
from server.core.turns import TurnEvent
from server.protocol.formats import SAMPLE_RATE_HZ
from server.protocol.messages import (
    DoneMessage,
    FinalMessage,
    PartialMessage,
    ServerMessage,
    WordInfo,
)


@dataclass(frozen=True)
class Settled:
    """Every utterance closed so far (at the end of speech, a flush or the end) is
    finished: all of its words were sent, as finals, before this event. The APIs that speak
    in turns (OpenAI's items, Deepgram's ``speech_final``) close a turn on it."""

    audio_received_s: float


SessionEvent = ServerMessage | Settled | TurnEvent


@dataclass(frozen=True)
class _Unlabelled:
    """A final waiting for its words' speakers (``SpeakerTracker.covered``); it and every
    event after it stay in the emitter until then, so the order is kept."""

    final: FinalMessage


@dataclass
class SampleAccount:
    """Where every speech sample went (``DoneMessage``): each ends up transcribed or failed."""

    speech: int = 0
    transcribed: int = 0
    failed: int = 0


@dataclass(frozen=True)
class Clock:
    """What the messages are stamped with: audio received so far, and the stream's lag."""

    audio_received_s: float
    lag_s: float


class Emitter:
    """The session's outgoing events."""

    def __init__(self) -> None:
        self._events: list[SessionEvent | _Unlabelled] = []
        self.next_segment_id = 0
        self._last_partial: tuple[int, str] | None = None
        self.account = SampleAccount()
        self._created = time.monotonic()

    @property
    def waiting_for_labels(self) -> bool:
        return any(isinstance(e, _Unlabelled) for e in self._events)

    def add(self, event: SessionEvent) -> None:
        self._events.append(event)

    def final(
        self,
        words: list[Word],
        clock: Clock,
        language: tuple[str | None, float | None],
        *,
        labelled: bool,
    ) -> None:
        """Send ``words`` as one final (nothing when they hold no text). ``labelled``: the
        final waits for its words' speakers."""
        text = "".join(w.text for w in words).strip()
        if not text:
            return
        final = FinalMessage(
            segment_id=self.next_segment_id,
            text=text,
            start=words[0].start_s,
            end=words[-1].end_s,
            words=tuple(WordInfo(w.text.strip(), w.start_s, w.end_s, w.probability) for w in words),
            audio_received_s=clock.audio_received_s,
            lag_s=clock.lag_s,
            language=language[0],
            language_probability=language[1],
        )
        self._events.append(_Unlabelled(final) if labelled else final)
        self.next_segment_id += 1
        self._last_partial = None

    def partial(
        self,
        words: list[Word],
        window_start_s: float,
        clock: Clock,
        language: tuple[str | None, float | None],
        *,
        provisional: bool,
    ) -> None:
        """Show ``words`` as the open segment's partial, unless that is what was shown last."""
        text = "".join(w.text for w in words).strip()
        key = (self.next_segment_id, text)
        if key == self._last_partial or (not text and self._last_partial is None):
            return
        self._last_partial = key
        start = words[0].start_s if words else window_start_s
        end = words[-1].end_s if words else start
        self._events.append(
            PartialMessage(
                self.next_segment_id,
                text,
                start,
                end,
                clock.audio_received_s,
                clock.lag_s,
                language[0],
                language[1],
                language_provisional=provisional,
            )
        )

    def clear_partial(self, at_s: float, audio_received_s: float) -> None:
        """An utterance ended with a partial still shown: clear it."""
        if self._last_partial is not None and self._last_partial[1]:
            self._events.append(
                PartialMessage(self.next_segment_id, "", at_s, at_s, audio_received_s)
            )
        self._last_partial = None

    def done(self, audio_received_s: float, received_samples: int) -> None:
        a = self.account
        self._events.append(
            DoneMessage(
                segments=self.next_segment_id,
                audio_received_s=audio_received_s,
                speech_s=a.speech / SAMPLE_RATE_HZ,
                session_s=time.monotonic() - self._created,
                non_speech_s=(received_samples - a.speech) / SAMPLE_RATE_HZ,
                transcribed_s=a.transcribed / SAMPLE_RATE_HZ,
                failed_s=a.failed / SAMPLE_RATE_HZ,
            )
        )

    def take(self, tracker: SpeakerTracker | None, *, all_heard: bool) -> list[SessionEvent]:
        """The events ready to send, in order. With speaker labels, a final waits (and what
        follows it) until its words' speakers are known, or ``all_heard``: nothing more can
        be learnt."""
        ready: list[SessionEvent] = []
        for k, event in enumerate(self._events):
            if isinstance(event, _Unlabelled):
                labelled = _labelled(event.final, tracker, all_heard=all_heard)
                if labelled is None:
                    self._events = self._events[k:]
                    return ready
                event = labelled
            ready.append(event)
        self._events = []
        return ready


def _labelled(
    final: FinalMessage, tracker: SpeakerTracker | None, *, all_heard: bool
) -> FinalMessage | None:
    """``final`` with each word's speaker, or None while a word cannot be labelled yet."""
    if tracker is None:
        return final
    waiting = not all(tracker.covered(round(w.end * SAMPLE_RATE_HZ)) for w in final.words)
    if waiting and not all_heard:
        return None
    labels: list[SpeakerLabel | None] = [
        tracker.label(round((w.start + w.end) / 2 * SAMPLE_RATE_HZ)) for w in final.words
    ]
    words = tuple(
        w
        if label is None
        else dataclasses.replace(
            w, speaker=label.speaker, speaker_confidence=round(label.confidence, 3)
        )
        for w, label in zip(final.words, labels, strict=True)
    )
    spoken: dict[int, float] = {}
    for w, label in zip(final.words, labels, strict=True):
        if label is not None:
            spoken[label.speaker] = spoken.get(label.speaker, 0.0) + max(w.end - w.start, 0.01)
    speaker = max(spoken, key=lambda k: spoken[k]) if spoken else None
    return dataclasses.replace(final, words=words, speaker=speaker)
