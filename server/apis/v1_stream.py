"""Protocol v1 (``docs/protocol.md``) on ``/v1/stream``: the adapter that parses its messages.

v1's client messages are parsed here and nowhere else: ``config`` (or the same fields in the
URL query) becomes ``Session.configure``, ``flush`` and ``end`` the session's calls, binary
frames its audio. The session's events are v1's server messages already, so rendering them is
their own JSON; ``Settled`` has no v1 message (a v1 client sees its finals and ``done``).
"""

from __future__ import annotations

import json
from typing import Any, Protocol
from urllib.parse import parse_qs, urlsplit

from websockets.http11 import Request

from server.apis.adapters import SessionSettings, StreamApi
from server.core.session import Session, Settled, StreamSettings
from server.core.turns import TurnEvent
from server.decode.stream_driver import AdapterEvent, Outgoing, StreamDriver
from server.protocol.errors import ProtocolError, StreamError
from server.protocol.formats import AudioFormat
from server.protocol.messages import (
    AUTO_LANGUAGE,
    ConfigMessage,
    EndMessage,
    ErrorMessage,
    FlushMessage,
    parse_client_message,
)

STREAM_PATH = "/v1/stream"
QUERY_FIELDS = (
    "sample_rate",
    "encoding",
    "language",
    "task",
    "end_of_speech_ms",
    "speakers",
    "finals",
)


class StreamControls(Protocol):
    """The calls a v1 client's messages become: a ``Session``'s, or a driver's over one."""

    @property
    def settings(self) -> StreamSettings: ...

    def configure(self, settings: StreamSettings) -> None: ...

    def flush(self) -> None: ...

    def end(self) -> None: ...


def settings_from_config(message: ConfigMessage, current: StreamSettings) -> StreamSettings:
    """``current`` with the fields a ``config`` message gave (``"auto"``: detect)."""
    language = current.language
    if message.language is not None:
        language = None if message.language == AUTO_LANGUAGE else message.language
    return StreamSettings(
        audio_format=AudioFormat(
            sample_rate_hz=message.sample_rate_hz or current.audio_format.sample_rate_hz,
            encoding=message.encoding or current.audio_format.encoding,
        ),
        language=language,
        task=message.task or current.task,
        end_of_speech_ms=current.end_of_speech_ms
        if message.end_of_speech_ms is None
        else message.end_of_speech_ms,
        speakers=current.speakers if message.speakers is None else message.speakers,
        finals=message.finals or current.finals,
    )


def apply_text(text: str, stream: StreamControls) -> None:
    """One v1 text frame (``config``, ``flush`` or ``end``) as ``stream``'s call. Raises
    ProtocolError for a message that is not v1 or not allowed now."""
    message = parse_client_message(text)
    if isinstance(message, ConfigMessage):
        stream.configure(settings_from_config(message, stream.settings))
    elif isinstance(message, FlushMessage):
        stream.flush()
    elif isinstance(message, EndMessage):
        stream.end()


class V1Adapter:
    """Protocol v1: the session's own messages, as they are."""

    def open_session(self, settings: SessionSettings, request: Request | None) -> Session:
        """A session configured from the URL query; raises ProtocolError (1008) for bad
        values. The query takes the same fields, and gets the same checks, as ``config``."""
        session = Session(
            settings.session_id,
            audio_format=AudioFormat(),
            streaming=settings.streaming,
            vad=settings.vad,
            multilingual=settings.multilingual,
        )
        params = parse_qs(urlsplit(request.path if request else "").query)
        fields: dict[str, Any] = {}
        for key in QUERY_FIELDS:
            values = params.get(key)
            if not values:
                continue
            value = values[-1]
            if key in ("sample_rate", "end_of_speech_ms"):
                if not value.isdigit() or len(value) > 6:
                    raise ProtocolError(
                        f"query parameter {key!r} must be an integer; got {value[:20]!r}",
                        close_code=1008,
                    )
                fields[key] = int(value)
            elif key == "speakers":
                if value not in ("true", "false"):
                    raise ProtocolError(
                        f"query parameter 'speakers' must be true or false; got {value[:20]!r}",
                        close_code=1008,
                    )
                fields[key] = value == "true"
            else:
                fields[key] = value
        if fields:
            try:
                apply_text(json.dumps({"type": "config", **fields}), session)
            except ProtocolError as exc:
                raise ProtocolError(f"in the URL query: {exc}", close_code=1008) from exc
        return session

    def receive(self, frame: str | bytes, driver: StreamDriver) -> None:
        """Text frames are messages, binary frames audio."""
        if isinstance(frame, str):
            apply_text(frame, driver)
        else:
            driver.feed_audio(frame)

    def render(self, message: Outgoing) -> list[str]:
        """The message's own JSON."""
        if isinstance(message, (Settled, TurnEvent, AdapterEvent)):
            return []
        return [message.to_json()]

    def error_message(
        self,
        code: str,
        message: str,
        *,
        fatal: bool,
        audio_received_s: float,
        cause: StreamError | None = None,
    ) -> ErrorMessage:
        """v1's ``error``."""
        return ErrorMessage(code, message, fatal, audio_received_s)


API = StreamApi(path=STREAM_PATH, auth_schemes=("bearer",), adapter=V1Adapter)
