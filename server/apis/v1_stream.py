"""Protocol v1 (``docs/protocol.md``) on ``/v1/stream``: the adapter that parses its messages.

v1's client messages are parsed here and nowhere else: ``config`` (or the same fields in the
URL query) becomes ``Session.configure``, ``flush`` and ``end`` the session's calls, binary
frames its audio. The session's events are v1's server messages already, so rendering them is
their own JSON; ``Settled`` has no v1 message (a v1 client sees its finals and ``done``). A
stream that asked for conversational turns (``turns=true``) also gets the session's turn
events as ``turn`` messages, but for ``Update``: its partials and finals carry that text.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Protocol
from urllib.parse import parse_qs, urlsplit

from websockets.http11 import Request

from server.apis.adapters import PlainErrors, SessionSettings, StreamApi
from server.apis.turn_options import TURN_OPTIONS, query_numbers, turn_config
from server.core.session import Session, Settled, StreamSettings
from server.core.turns import TurnConfig, TurnEvent, TurnKind
from server.decode.stream_driver import AdapterEvent, Outgoing, StreamDriver
from server.protocol.errors import ProtocolError
from server.protocol.formats import AudioFormat
from server.protocol.messages import (
    AUTO_LANGUAGE,
    ConfigMessage,
    EndMessage,
    FlushMessage,
    TurnMessage,
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
    "turns",
)  # and the turn options (TURN_OPTIONS), read as numbers
# The session's turn events as v1 names them; ``Update`` has none (partials and finals carry
# its text).
TURN_EVENT_NAMES = {
    TurnKind.START: "start",
    TurnKind.EAGER_END: "eager_end",
    TurnKind.RESUMED: "resumed",
    TurnKind.END: "end",
}
NO_TURN_MODEL = (
    "turn detection is not installed on this server (onnxruntime and the Smart Turn model: "
    "deploy/install.sh); connect without turns=true"
)


class StreamControls(Protocol):
    """The calls a v1 client's messages become: a ``Session``'s, or a driver's over one."""

    @property
    def settings(self) -> StreamSettings: ...

    def configure(self, settings: StreamSettings) -> None: ...

    def flush(self) -> None: ...

    def end(self) -> None: ...


def settings_from_config(
    message: ConfigMessage, current: StreamSettings, *, turn_model: bool = True
) -> StreamSettings:
    """``current`` with the fields a ``config`` message gave (``"auto"``: detect). Raises
    ProtocolError for turn options out of range, or given to a stream without turns, and for
    turns on a server without a turn model (``turn_model`` False)."""
    language = current.language
    if message.language is not None:
        language = None if message.language == AUTO_LANGUAGE else message.language
    return dataclasses.replace(
        current,
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
        turns=_turns_from_config(message, current.turns, turn_model=turn_model),
    )


def _turns_from_config(
    message: ConfigMessage, current: TurnConfig | None, *, turn_model: bool
) -> TurnConfig | None:
    turns = current
    if message.turns is not None:
        turns = (current or TurnConfig()) if message.turns else None
    given = {name: value for name in TURN_OPTIONS if (value := getattr(message, name)) is not None}
    if turns is None:
        if given:
            raise ProtocolError(f"{', '.join(given)} apply to turns: ask for them with turns=true")
        return None
    if not turn_model:
        raise ProtocolError(NO_TURN_MODEL)
    try:
        return turn_config(given, turns)
    except ValueError as exc:
        raise ProtocolError(str(exc)) from None


def apply_text(text: str, stream: StreamControls, *, turn_model: bool = True) -> None:
    """One v1 text frame (``config``, ``flush`` or ``end``) as ``stream``'s call. Raises
    ProtocolError for a message that is not v1 or not allowed now. ``turn_model``: whether
    the server can score turns (the adapter says; a session driven alone takes them as
    asked), else a config that asks for turns is refused."""
    message = parse_client_message(text)
    if isinstance(message, ConfigMessage):
        stream.configure(settings_from_config(message, stream.settings, turn_model=turn_model))
    elif isinstance(message, FlushMessage):
        stream.flush()
    elif isinstance(message, EndMessage):
        stream.end()


def turn_message(event: TurnEvent) -> TurnMessage | None:
    """The v1 ``turn`` message of one of the session's turn events (None for ``Update``)."""
    name = TURN_EVENT_NAMES.get(event.kind)
    if name is None:
        return None
    return TurnMessage(
        event=name,
        turn_index=event.turn_index,
        start=event.start_s,
        end=event.end_s,
        text=event.transcript,
        words=event.words,
        end_of_turn_confidence=event.end_of_turn_confidence,
        audio_received_s=event.audio_received_s,
        trigger=event.trigger,
    )


class V1Adapter(PlainErrors):
    """Protocol v1: the session's own messages, as they are."""

    def __init__(self) -> None:
        self._turn_model = False  # whether the server can score turns (``open_session``)

    def open_session(self, settings: SessionSettings, request: Request | None) -> Session:
        """A session configured from the URL query; raises ProtocolError (1008) for bad
        values. The query takes the same fields, and gets the same checks, as ``config``."""
        session = Session(
            settings.session_id,
            audio_format=AudioFormat(),
            streaming=settings.streaming,
            vad=settings.vad,
            multilingual=settings.multilingual,
            frame_voicing=settings.frame_voicing,
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
            elif key in ("speakers", "turns"):
                if value not in ("true", "false"):
                    raise ProtocolError(
                        f"query parameter {key!r} must be true or false; got {value[:20]!r}",
                        close_code=1008,
                    )
                fields[key] = value == "true"
            else:
                fields[key] = value
        try:
            fields.update(query_numbers(lambda name: params[name][-1] if name in params else None))
        except ValueError as exc:
            raise ProtocolError(f"in the URL query: {exc}", close_code=1008) from exc
        if "eot_timeout_ms" in fields:
            # An integer in ``config``; the query takes Flux's "500.0" too.
            fields["eot_timeout_ms"] = round(fields["eot_timeout_ms"])
        self._turn_model = settings.turn_model
        if fields:
            try:
                apply_text(
                    json.dumps({"type": "config", **fields}),
                    session,
                    turn_model=settings.turn_model,
                )
            except ProtocolError as exc:
                raise ProtocolError(f"in the URL query: {exc}", close_code=1008) from exc
        return session

    def receive(self, frame: str | bytes, driver: StreamDriver) -> None:
        """Text frames are messages, binary frames audio."""
        if isinstance(frame, str):
            apply_text(frame, driver, turn_model=self._turn_model)
        else:
            driver.feed_audio(frame)

    def render(self, message: Outgoing) -> list[str]:
        """The message's own JSON; a turn event's ``turn`` message."""
        if isinstance(message, TurnEvent):
            turn = turn_message(message)
            return [] if turn is None else [turn.to_json()]
        if isinstance(message, (Settled, AdapterEvent)):
            return []
        return [message.to_json()]


API = StreamApi(path=STREAM_PATH, auth_schemes=("bearer",), adapter=V1Adapter)
