"""The seam where another vendor's streaming API plugs into the v1 machinery.

A ``Connection`` (``connection.py``) serves every API the same way: one ``Session``, one
``StreamDriver``, the same limits, timeouts, metrics, drain and shutdown. What differs per API
is the translation, and an ``Adapter`` holds all of it:

- ``open_session``: the session, configured from the upgrade request (a ``StreamError``
  refuses the stream);
- ``receive``: one client frame, turned into the driver's calls (audio, ``flush``, ``end``);
- ``render``: one server message, turned into zero or more of the API's text frames;
- ``error_message``: the error an API's client is told (``render`` gives it its shape).

APIs that speak in turns (OpenAI's transcription items, Deepgram's ``speech_final``) must know
when the words of the speech closed so far are all final. v1 has no message for that, so
``TurnSession`` adds one, ``Settled``, in order with the session's own messages. An adapter's
replies to client events travel the same way, as ``AdapterEvent`` subclasses sent through the
driver, so they keep their place among the session's messages and count against the same
bound on unsent messages.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from websockets.http11 import Request

from .config import StreamingConfig, VadConfig
from .errors import StreamError
from .formats import AudioFormat
from .messages import ErrorMessage, PartialMessage, ServerMessage, SpeechEndedMessage
from .pipeline import StreamDriver
from .session import DecodeJob, Session


@dataclass(frozen=True)
class SessionSettings:
    """What a new session starts from: the server's configuration and model."""

    session_id: str
    streaming: StreamingConfig
    vad: VadConfig
    multilingual: bool
    model: str  # the engine's name, which the APIs report as their model


class Adapter(Protocol):
    """One API's translation onto a ``Session``; one instance per connection."""

    def open_session(self, settings: SessionSettings, request: Request | None) -> Session:
        """The session for this upgrade request. Raises ``StreamError`` to refuse it."""
        ...

    def receive(self, frame: str | bytes, driver: StreamDriver) -> None:
        """Act on one client frame. Raises ``StreamError`` (fatal when it has a close code)."""
        ...

    def render(self, message: ServerMessage) -> list[str]:
        """The text frames that carry ``message`` to this API's client, in order."""
        ...

    def error_message(
        self,
        code: str,
        message: str,
        *,
        fatal: bool,
        audio_received_s: float,
        cause: StreamError | None = None,
    ) -> ErrorMessage:
        """The error to send; ``cause`` is set when a client frame raised it."""
        ...


@dataclass(frozen=True)
class AdapterEvent(PartialMessage):
    """Base of an adapter's own events, which ride the session's outbox to ``render``.

    The outbox carries server messages (``pipeline.StreamDriver``), so this is one: to anything
    that encoded it as v1 it would be an empty partial, "nothing tentative is left", but only
    adapters create and render these and no v1 client ever receives one.
    """

    segment_id: int = -1
    text: str = ""
    start: float = 0.0
    end: float = 0.0
    audio_received_s: float = 0.0


@dataclass(frozen=True)
class Settled(AdapterEvent):
    """Every speech segment closed before this message is finished: its words are all final
    and came before this message."""


class TurnSession(Session):
    """A ``Session`` that also emits ``Settled`` once the speech it closed is all final.

    A segment closes at the end of speech (``speech_ended``) or on ``flush``; its closing
    decodes follow, and segments are decoded strictly in order. So when the driver asks for
    the next job and it is not for a closed segment, every closed segment is finished. A job
    is for a closed segment when it is a closing decode, or when it is capped at the longest
    window (a stream far behind decodes a long closed segment in capped pieces): such a job
    may belong to either, and the marker waits for the next one rather than come too early.
    """

    def __init__(
        self,
        session_id: str,
        *,
        audio_format: AudioFormat | None = None,
        streaming: StreamingConfig | None = None,
        vad: VadConfig | None = None,
        multilingual: bool = False,
    ) -> None:
        super().__init__(
            session_id,
            audio_format=audio_format,
            streaming=streaming,
            vad=vad,
            multilingual=multilingual,
        )
        self._unsettled = False  # a segment closed since the last Settled
        self._choosing = False  # inside next_job (it recurses over empty segments)
        self._held: list[ServerMessage] = []  # events taken early to keep Settled in place

    def receive_text(self, text: str) -> None:
        super().receive_text(text)
        self._unsettled = True  # a flush or end closed the open segment, if there was one

    def events_to_send(self) -> list[ServerMessage]:
        events = [*self._held, *super().events_to_send()]
        self._held = []
        if any(isinstance(event, SpeechEndedMessage) for event in events):
            self._unsettled = True
        return events

    def next_job(self, *, min_hop_s: float = 0.0, crowded: bool = False) -> DecodeJob | None:
        if self.busy or self._choosing:
            return super().next_job(min_hop_s=min_hop_s, crowded=crowded)
        self._choosing = True
        try:
            before = self.events_to_send()
            job = super().next_job(min_hop_s=min_hop_s, crowded=crowded)
        finally:
            self._choosing = False
        # What choosing the job emitted (the finals of a forced cut, done) comes after the
        # marker: it belongs to the segment being decoded now, or ends the session.
        during = super().events_to_send()
        marker: list[ServerMessage] = []
        if self._unsettled and not self._for_closed_segment(job, crowded=crowded):
            self._unsettled = False
            marker.append(Settled(audio_received_s=self.audio_received_s))
        self._held = [*before, *marker, *during]
        return job

    def _for_closed_segment(self, job: DecodeJob | None, *, crowded: bool) -> bool:
        if job is None:
            return False
        if job.closing:
            return True
        c = self.streaming
        cap_s = min(c.max_window_s, c.crowded_max_window_s) if crowded else c.max_window_s
        return job.audio_s >= cap_s - 1e-6
