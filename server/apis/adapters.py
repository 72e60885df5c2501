"""The seam where another vendor's streaming API plugs into the v1 machinery.

A ``Connection`` (``connection.py``) serves every API the same way: one ``Session``, one
``StreamDriver``, the same limits, timeouts, metrics, drain and shutdown. What differs per API
is the translation, and an ``Adapter`` holds all of it:

- ``open_session``: the session, configured from the upgrade request (a ``StreamError``
  refuses the stream);
- ``receive``: one client frame, parsed and turned into the session's typed calls through
  the driver (``feed_audio``, ``configure``, ``flush``, ``end``);
- ``render``: one event of the session (a v1 server message, or ``Settled`` when all speech
  closed so far is final), or one of the adapter's own, turned into zero or more of the API's
  text frames;
- ``error_message``: the error an API's client is told (``render`` gives it its shape).

An adapter's replies to client requests travel as ``AdapterEvent`` subclasses sent through the
driver, so they keep their place among the session's events and count against the same bound
on unsent messages.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from websockets.http11 import Request

from server.config import StreamingConfig, VadConfig
from server.core.session import Session
from server.core.vad import FrameVoicing
from server.decode.stream_driver import Outgoing, StreamDriver
from server.protocol.errors import StreamError
from server.protocol.messages import ErrorMessage


@dataclass(frozen=True)
class SessionSettings:
    """What a new session starts from: the server's configuration and model."""

    session_id: str
    streaming: StreamingConfig
    vad: VadConfig
    multilingual: bool
    model: str  # the engine's name, which the APIs report as their model
    # Whether the server can score turns (Smart Turn is installed): streams that ask for
    # conversational turns are refused without it.
    turn_model: bool = False
    # Makes the stream's voice activity detector (``Pipeline.frame_voicing``); None: webrtcvad.
    frame_voicing: Callable[[], FrameVoicing] | None = None


class Adapter(Protocol):
    """One API's translation onto a ``Session``; one instance per connection."""

    def open_session(self, settings: SessionSettings, request: Request | None) -> Session:
        """The session for this upgrade request. Raises ``StreamError`` to refuse it."""
        ...

    def receive(self, frame: str | bytes, driver: StreamDriver) -> None:
        """Act on one client frame. Raises ``StreamError`` (fatal when it has a close code)."""
        ...

    def render(self, message: Outgoing) -> list[str]:
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


class PlainErrors:
    """``Adapter.error_message`` for the APIs whose ``render`` gives v1's error their own
    shape: the error as v1 has it."""

    def error_message(
        self,
        code: str,
        message: str,
        *,
        fatal: bool,
        audio_received_s: float,
        cause: StreamError | None = None,
    ) -> ErrorMessage:
        """v1's error; ``render`` gives it this API's shape."""
        return ErrorMessage(code, message, fatal, audio_received_s)


@dataclass(frozen=True)
class StreamApi:
    """One streaming API as the server serves it: its registry entry (``server.apis.registry``)."""

    path: str  # the WebSocket path it is served on
    auth_schemes: tuple[str, ...]  # Authorization schemes that carry the API key
    adapter: Callable[[], Adapter]  # a new adapter for each connection
    # Why an upgrade request is refused with HTTP 400 before the handshake by a server
    # configured so, or None (the API's own query checks); None: nothing to check before the
    # session opens.
    problem: Callable[[Request, StreamingConfig], str | None] | None = None
