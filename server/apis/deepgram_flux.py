"""Deepgram Flux (``/v2/listen``): conversational turns, translated onto the v1 ``Session``.

Message names and fields are those of the ``deepgram-sdk`` package's ``listen/v2`` types.
Options come in the URL query and are checked before the handshake (HTTP 400 for anything we
cannot honour): ``model`` (any name: the server's model serves it), ``encoding=linear16``
(raw 16-bit PCM), ``sample_rate``, ``eot_threshold`` (0.5-0.9, default 0.7),
``eager_eot_threshold`` (0.3-0.9, off unless given), ``eot_timeout_ms`` (500-10000, default
5000), ``keyterm`` (repeatable), ``mip_opt_out``, ``tag`` (repeatable), ``token``.

What the server sends: ``Connected`` first; then ``TurnInfo`` for each turn event of the
session (``server/core/turns.py``): ``StartOfTurn``, ``Update`` when the turn's transcript
changes, ``EagerEndOfTurn`` and ``TurnResumed`` (with ``eager_eot_threshold``), and
``EndOfTurn`` with the turn's final transcript and words and its ``trigger`` (``model``,
``timeout`` or ``manual``); ``ConfigureSuccess`` / ``ConfigureFailure`` for ``Configure``;
``Warning`` for an option taken but not applied; ``Error`` for refused input. The client sends
audio as binary frames and ``Configure``, ``ForceEndTurn``, ``KeepAlive`` or ``CloseStream``.

Each turn's transcript comes from the utterances' finals (a beam search over each utterance,
as v1's ``utterance`` finals), so an ``EndOfTurn`` carries text that never changes.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from dataclasses import dataclass
from typing import Any

from websockets.http11 import Request

from server.apis.adapters import PlainErrors, SessionSettings, StreamApi
from server.apis.deepgram_live import ListenQuery
from server.apis.turn_options import TURN_OPTIONS, query_numbers, turn_config
from server.config import StreamingConfig
from server.core.session import Session, TurnConfig
from server.core.turns import TurnEvent
from server.decode.stream_driver import AdapterEvent, Outgoing, StreamDriver
from server.protocol.errors import ProtocolError
from server.protocol.formats import MAX_SAMPLE_RATE_HZ, MIN_SAMPLE_RATE_HZ, AudioFormat
from server.protocol.messages import ErrorMessage, ReadyMessage

FLUX_PATH = "/v2/listen"
AUTH_SCHEMES = ("token", "bearer")
QUERY_PARAMETERS = (
    "model",
    "encoding",
    "sample_rate",
    "eot_threshold",
    "eager_eot_threshold",
    "eot_timeout_ms",
    "keyterm",
    "mip_opt_out",  # nothing is kept for model improvement: any value is honoured
    "tag",  # usage labels: accepted, as the server keeps no usage reports
    "numerals",  # Whisper writes numbers as digits already
    "token",  # our API key in the URL, as on /v1/listen
)
KEYTERM_WARNING = (
    "keyterm is taken but not applied on live streams here: Whisper's prompt is the "
    "stream's own text"
)


@dataclass(frozen=True)
class FluxOptions:
    sample_rate_hz: int
    turns: TurnConfig
    keyterms: tuple[str, ...] = ()


def parse_options(path: str) -> FluxOptions:
    """The options in a ``/v2/listen`` URL. Raises ``ValueError`` saying what is wrong."""
    query = ListenQuery(path, QUERY_PARAMETERS)
    one = query.one
    if one("encoding") not in (None, "linear16"):
        raise ValueError(
            f"encoding={(one('encoding') or '')[:20]} is not supported: send raw encoding=linear16"
        )
    rate = one("sample_rate") or "16000"
    if not rate.isdigit() or len(rate) > 6:
        raise ValueError(f"sample_rate must be in Hz; got {rate[:20]!r}")
    if not MIN_SAMPLE_RATE_HZ <= int(rate) <= MAX_SAMPLE_RATE_HZ:
        raise ValueError(f"sample_rate must be {MIN_SAMPLE_RATE_HZ} to {MAX_SAMPLE_RATE_HZ} Hz")
    turns = turn_config(query_numbers(one))
    return FluxOptions(int(rate), turns, tuple(k for k in query.every("keyterm") if k))


def handshake_problem(request: Request, streaming: StreamingConfig | None = None) -> str | None:
    """Why this upgrade request is refused with HTTP 400, or None."""
    try:
        parse_options(request.path)
    except ValueError as exc:
        return str(exc)
    return None


@dataclass(frozen=True)
class _Reply(AdapterEvent):
    """A reply to a client message, in its place among the session's events."""

    body: dict[str, Any] = dataclasses.field(default_factory=dict)


class FluxAdapter(PlainErrors):
    """Deepgram Flux on a ``Session`` with turns."""

    def __init__(self) -> None:
        self._request_id = str(uuid.uuid4())
        self._sequence = 0
        self._odd_byte = b""
        self._keyterms: tuple[str, ...] = ()

    def open_session(self, settings: SessionSettings, request: Request | None) -> Session:
        """A session with turn events. Raises ProtocolError (1008, or 1011 without a turn
        model)."""
        if not settings.turn_model:
            raise ProtocolError(
                "turn detection is not installed on this server (onnxruntime and the Smart "
                "Turn model: deploy/install.sh)",
                close_code=1011,
            )
        try:
            options = parse_options(request.path if request is not None else "")
        except ValueError as exc:
            raise ProtocolError(str(exc), close_code=1008) from exc
        self._keyterms = options.keyterms
        session = Session(
            settings.session_id,
            audio_format=AudioFormat(sample_rate_hz=options.sample_rate_hz),
            streaming=settings.streaming,
            vad=settings.vad,
            multilingual=settings.multilingual,
            frame_voicing=settings.frame_voicing,
        )
        session.configure(
            dataclasses.replace(
                session.settings,
                language="en" if not settings.multilingual else None,
                finals=settings.streaming.agent_finals,
                turns=options.turns,
            )
        )
        return session

    # -- client messages -------------------------------------------------------------------
    def receive(self, frame: str | bytes, driver: StreamDriver) -> None:
        """Audio, or one of Configure, ForceEndTurn, KeepAlive and CloseStream."""
        if isinstance(frame, bytes):
            data = self._odd_byte + frame
            whole = len(data) - len(data) % 2
            self._odd_byte = data[whole:]
            driver.feed_audio(data[:whole])
            return
        try:
            message = json.loads(frame)
        except (json.JSONDecodeError, RecursionError):
            raise ProtocolError(
                "text messages must be JSON: Configure, ForceEndTurn, KeepAlive or CloseStream",
                close_code=1008,
            ) from None
        kind = message.get("type") if isinstance(message, dict) else None
        if kind == "KeepAlive":
            return
        if kind == "CloseStream":
            driver.end()
        elif kind == "ForceEndTurn":
            driver.force_end_turn()
        elif kind == "Configure":
            self._configure(message, driver)
        else:
            name = kind[:40] if isinstance(kind, str) else kind
            raise ProtocolError(
                f"unsupported message type {name!r}: send Configure, ForceEndTurn, KeepAlive "
                "or CloseStream",
                close_code=1008,
            )

    def _configure(self, message: dict[str, Any], driver: StreamDriver) -> None:
        now = driver.session.audio_received_s
        thresholds = message.get("thresholds") or {}
        current = driver.session.settings.turns or TurnConfig()
        try:
            if not isinstance(thresholds, dict):
                raise ValueError("thresholds must be an object")
            given = {k: v for k, v in thresholds.items() if k in TURN_OPTIONS}
            if any(not isinstance(v, int | float) or isinstance(v, bool) for v in given.values()):
                raise ValueError("thresholds must be numbers")
            config = turn_config(given, current)
        except (ValueError, TypeError) as exc:
            failure = {
                "type": "ConfigureFailure",
                "code": "INVALID_THRESHOLDS",
                "description": str(exc),
            }
            driver.send(_Reply(body=failure, audio_received_s=now))
            return
        driver.session.configure_turns(config)
        success = {
            "type": "ConfigureSuccess",
            "thresholds": {
                "eot_threshold": config.eot_threshold,
                "eager_eot_threshold": config.eager_eot_threshold,
                "eot_timeout_ms": config.eot_timeout_ms,
            },
            "keyterms": list(self._keyterms),
        }
        driver.send(_Reply(body=success, audio_received_s=now))

    # -- server messages -------------------------------------------------------------------
    def render(self, message: Outgoing) -> list[str]:
        """Flux's messages for one session message: only turns, replies and errors."""
        if isinstance(message, ReadyMessage):
            connected = [self._dumps({"type": "Connected"})]
            if self._keyterms:
                warning = {
                    "type": "Warning",
                    "code": "KEYTERM_NOT_APPLIED",
                    "description": KEYTERM_WARNING,
                }
                connected.append(self._dumps(warning))
            return connected
        if isinstance(message, _Reply):
            return [self._dumps(message.body)]
        if isinstance(message, TurnEvent):
            return [self._dumps(self._turn_info(message))]
        if isinstance(message, ErrorMessage):
            body = {"type": "Error", "code": message.code.upper(), "description": message.message}
            return [self._dumps(body)]
        return []

    def _turn_info(self, event: TurnEvent) -> dict[str, Any]:
        return {
            "type": "TurnInfo",
            "event": str(event.kind),
            "turn_index": event.turn_index,
            "audio_window_start": round(event.start_s, 3),
            "audio_window_end": round(event.end_s, 3),
            "transcript": event.transcript,
            "words": [
                {
                    "word": w.word,
                    "confidence": round(w.probability, 3),
                    "start": w.start,
                    "end": w.end,
                }
                for w in event.words
            ],
            "end_of_turn_confidence": round(event.end_of_turn_confidence, 3),
            **({"trigger": event.trigger} if event.trigger else {}),
        }

    def _dumps(self, body: dict[str, Any]) -> str:
        """``body`` with the stream's request id and the next sequence id."""
        if body.get("type") != "Error":
            body = {"request_id": self._request_id, **body}
        body = {**body, "sequence_id": self._sequence}
        self._sequence += 1
        return json.dumps(body, ensure_ascii=False)


API = StreamApi(
    path=FLUX_PATH,
    auth_schemes=AUTH_SCHEMES,
    adapter=FluxAdapter,
    problem=handshake_problem,
)
