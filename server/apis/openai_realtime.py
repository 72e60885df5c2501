"""OpenAI's Realtime API, transcription sessions, served on ``/v1/realtime?intent=transcription``.

A translation onto the v1 ``Session`` (``adapters.py``); the event names and shapes are those
of the ``openai`` package's ``types/realtime`` (the GA API) and, for clients that send
``OpenAI-Beta: realtime=v1``, of ``types/beta/realtime`` (``transcription_session.*``).

Client events: ``session.update`` (or the beta ``transcription_session.update``),
``input_audio_buffer.append`` (base64 PCM16, 24 kHz unless the session says otherwise; or
G.711 at 8 kHz: ``audio/pcmu`` / ``audio/pcma``, the beta's ``g711_ulaw`` / ``g711_alaw``),
``.commit`` and ``.clear``. Every other client event gets an ``error`` event, as does any
session field we cannot honour (see ``docs/compat.md``).

Server events: ``session.created`` / ``session.updated`` (beta: ``transcription_session.*``),
``input_audio_buffer.speech_started`` / ``speech_stopped`` / ``committed`` / ``cleared``,
``conversation.item.input_audio_transcription.delta`` and ``.completed``, ``error``.

Items are turns: with ``server_vad`` (the default) a turn is one utterance of our voice
activity detector; with ``semantic_vad`` a conversational turn of the turn model
(``server/core/turns.py``: it goes on across the detector's pauses until Smart Turn calls the
speaker finished, or a silence of the eagerness's timeout); with ``turn_detection: null`` it
is the audio between two commits. Deltas
carry our finals only, never a partial: a delta cannot be taken back, and a partial may be
revised. So the deltas of an item always add up to its ``completed`` transcript, and the first
delta comes when the first words are final (about a second after they were spoken).
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import json
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, urlsplit

from websockets.http11 import Request

from server.apis.adapters import SessionSettings, StreamApi
from server.config import StreamingConfig, VadConfig
from server.core.session import (
    MAX_SPEECH_PAD_MS,
    Session,
    Settled,
    nearest_end_of_speech_ms,
)
from server.core.turns import TurnConfig, TurnEvent, TurnKind
from server.decode.stream_driver import AdapterEvent, Outgoing, StreamDriver
from server.protocol.errors import ProtocolError, StreamError
from server.protocol.formats import MAX_SAMPLE_RATE_HZ, MIN_SAMPLE_RATE_HZ, AudioFormat
from server.protocol.messages import (
    DoneMessage,
    ErrorMessage,
    FinalMessage,
    ReadyMessage,
    SpeechEndedMessage,
    SpeechStartedMessage,
)

REALTIME_PATH = "/v1/realtime"
DEFAULT_RATE_HZ = 24_000  # OpenAI's PCM16 is 24 kHz; the session resamples it to 16 kHz
G711_RATE_HZ = 8_000  # OpenAI's G.711 formats carry no rate: a phone line's 8 kHz
# Each input audio format by its GA type and its beta name, as our encoding.
GA_FORMATS = {"audio/pcm": "pcm_s16le", "audio/pcmu": "mulaw", "audio/pcma": "alaw"}
BETA_FORMATS = {"pcm16": "pcm_s16le", "g711_ulaw": "mulaw", "g711_alaw": "alaw"}
BETA_HEADER = "OpenAI-Beta"
BETA_VALUE = "realtime=v1"  # what the openai package's beta client sends
QUERY_PARAMETERS = ("intent", "model", "token")  # model: the beta client always sends one
UNSUPPORTED_EVENTS = (
    "conversation.item.create",
    "conversation.item.delete",
    "conversation.item.retrieve",
    "conversation.item.truncate",
    "output_audio_buffer.clear",
    "response.cancel",
    "response.create",
)
_TRANSCRIPTION_OPTIONS = ("model", "language", "prompt")
_VAD_OPTIONS = ("type", "threshold", "prefix_padding_ms", "silence_duration_ms")
_VAD_FLAGS = ("create_response", "interrupt_response")  # not for transcription sessions
# semantic_vad's eagerness as the turn model's settings. OpenAI documents the longest each
# waits for the speaker to go on (low 8 s, medium 4 s, high 2 s): that is the silence that ends
# the turn whatever the model says. Sooner, a pause ends the turn where Smart Turn's
# probability that the speaker finished reaches the threshold: an eager session takes a lean
# towards finished (0.5, the lowest Flux allows), a patient one only near certainty (0.9, the
# highest); medium is Flux's default (0.7). "auto" is medium, as OpenAI has it.
_MEDIUM = TurnConfig(eot_threshold=0.7, eot_timeout_ms=4000)
EAGERNESS = {
    "low": TurnConfig(eot_threshold=0.9, eot_timeout_ms=8000),
    "medium": _MEDIUM,
    "high": TurnConfig(eot_threshold=0.5, eot_timeout_ms=2000),
    "auto": _MEDIUM,
}
NO_TURN_MODEL = (
    "semantic_vad needs the turn model, which is not installed on this server (onnxruntime "
    "and Smart Turn: deploy/install.sh); use server_vad"
)
# A commit or clear closes the session's utterance where its resampled audio ends, which is up
# to the resampler's delay (a few ms) before the client's count of seconds appended.
_BOUNDARY_SLACK_S = 0.05


def handshake_problem(request: Request, streaming: StreamingConfig | None = None) -> str | None:
    """Why this upgrade request is refused with HTTP 400, or None (the server's
    configuration makes no difference here)."""
    query = parse_qs(urlsplit(request.path).query, keep_blank_values=True)
    if query.get("intent") != ["transcription"]:
        return "this server serves transcription sessions only: connect with ?intent=transcription"
    unknown = sorted(set(query) - set(QUERY_PARAMETERS))
    if unknown:
        return f"unsupported query parameter(s): {', '.join(k[:40] for k in unknown[:5])}"
    return None


class RealtimeRequestError(ProtocolError):
    """A client event we refuse; ``code`` and ``param`` are OpenAI's error fields."""

    def __init__(
        self,
        message: str,
        *,
        code: str = "invalid_value",
        param: str | None = None,
        close_code: int | None = None,
    ) -> None:
        super().__init__(message, close_code=close_code)
        self.code = code
        self.param = param


@dataclass(frozen=True)
class RealtimeErrorMessage(ErrorMessage):
    """An error with the fields OpenAI's error event has beyond v1's."""

    event_id: str | None = None  # the client event that caused it
    param: str | None = None
    from_client: bool = False  # a client event was refused (else the server failed)


@dataclass(frozen=True)
class _Updated(AdapterEvent):
    """The reply to a session update: the effective configuration, in the update's dialect."""

    beta: bool = False
    config: _Config | None = None


@dataclass(frozen=True)
class _Commit(AdapterEvent):
    """The client committed the audio buffer: the open item ends here."""


@dataclass(frozen=True)
class _Clear(AdapterEvent):
    """The client cleared the audio buffer: the open item is dropped, and with ``flushed``
    the text still to come for the audio before the clear."""

    flushed: bool = False


@dataclass(frozen=True)
class _Config:
    """A transcription session's settings, as its client sees them."""

    rate_hz: int = DEFAULT_RATE_HZ
    encoding: str = "pcm_s16le"  # ours (``AudioFormat.encoding``): PCM16 or G.711
    language: str | None = "en"
    server_vad: bool = True
    # server_vad's parameters as asked; None: the server's own
    silence_ms: int | None = None
    padding_ms: int | None = None
    threshold: float | None = None
    # semantic_vad's eagerness as asked (a key of EAGERNESS); None: not semantic_vad
    eagerness: str | None = None


@dataclass
class _Turn:
    """One conversation item: a turn of speech and the text sent for it."""

    item_id: str
    start_s: float
    end_s: float | None = None  # set when the turn was committed
    discarded: bool = False  # cleared: its text is not sent
    text: list[str] = field(default_factory=list)


class RealtimeAdapter:
    """OpenAI Realtime transcription on a ``Session``."""

    def __init__(self) -> None:
        self._settings: SessionSettings | None = None
        self._beta = False
        self._config = _Config()
        self._vad = VadConfig()  # the session's VAD as its settings make it
        self._event_id: str | None = None  # of the client event being handled
        self._partial_sample = b""  # the start of a sample, completed by the next append
        self._uncommitted = False  # audio appended since the last commit or clear
        self._appended = False
        self._events = 0
        self._items = 0
        self._turns: deque[_Turn] = deque()  # not yet completed, oldest first
        self._previous_item_id: str | None = None
        self._boundary_s = 0.0  # stream time of the last commit or clear
        self._created = False

    # -- opening ---------------------------------------------------------------------------
    def open_session(self, settings: SessionSettings, request: Request | None) -> Session:
        """A session for 24 kHz PCM16 with the server's language; no options in the URL."""
        self._settings = settings
        headers = request.headers if request is not None else None
        self._beta = headers is not None and BETA_VALUE in headers.get(BETA_HEADER, "")
        self._vad = settings.vad
        session = Session(
            settings.session_id,
            audio_format=AudioFormat(sample_rate_hz=DEFAULT_RATE_HZ),
            streaming=settings.streaming,
            vad=settings.vad,
            multilingual=settings.multilingual,
            frame_voicing=settings.frame_voicing,
        )
        # OpenAI's transcription events have no speaker field: labels a server with
        # --speakers would compute here would never be sent, and finals would wait for them.
        session.configure(
            dataclasses.replace(
                session.settings, speakers=False, finals=settings.streaming.agent_finals
            )
        )
        self._config = _Config(language=session.language)
        return session

    # -- client events ---------------------------------------------------------------------
    def receive(self, frame: str | bytes, driver: StreamDriver) -> None:
        """Handle one client event; raises ``RealtimeRequestError`` for a refused one."""
        self._event_id = None
        if not isinstance(frame, str):
            raise RealtimeRequestError(
                "binary frames are not part of the Realtime API; send audio as "
                "input_audio_buffer.append events",
                code="invalid_request",
            )
        event = _parse_event(frame)
        event_id = event.get("event_id")
        self._event_id = event_id if isinstance(event_id, str) else None
        kind = event["type"]
        if kind == "input_audio_buffer.append":
            self._append(event, driver)
        elif kind in ("session.update", "transcription_session.update"):
            self._update(event, driver, beta=kind == "transcription_session.update")
        elif kind == "input_audio_buffer.commit":
            _reject_unknown(event, ("type", "event_id"), "")
            if not self._uncommitted:
                raise RealtimeRequestError(
                    "the input audio buffer is empty: append audio before committing it",
                    code="input_audio_buffer_commit_empty",
                )
            self._uncommitted = False
            if self._config.eagerness is not None:
                # semantic_vad: the client's commit ends the turn too. The item is committed
                # first, so the finals of its speech go to it, then the turn's end.
                driver.send(_Commit(audio_received_s=driver.session.audio_received_s))
                driver.force_end_turn()
            else:
                driver.flush()
                driver.send(_Commit(audio_received_s=driver.session.audio_received_s))
        elif kind == "input_audio_buffer.clear":
            _reject_unknown(event, ("type", "event_id"), "")
            flushed = self._uncommitted
            self._uncommitted = False
            cleared = _Clear(audio_received_s=driver.session.audio_received_s, flushed=flushed)
            if flushed and self._config.eagerness is not None:
                # semantic_vad: the cleared speech ends its turn (dropped, as below), and the
                # speech after the clear starts a turn of its own.
                driver.send(cleared)
                driver.force_end_turn()
                return
            if flushed:
                # The audio cannot be taken back from the stream; its utterance is closed here
                # and its text dropped when it comes.
                driver.flush()
            driver.send(cleared)
        elif kind in UNSUPPORTED_EVENTS:
            raise RealtimeRequestError(
                f"{kind!r} is not available in a transcription session",
                code="unsupported_event",
                param="type",
            )
        else:
            raise RealtimeRequestError(
                f"Invalid value: {kind[:60]!r}. Supported values are: 'session.update', "
                "'input_audio_buffer.append', 'input_audio_buffer.commit' and "
                "'input_audio_buffer.clear'",
                param="type",
            )

    def _append(self, event: dict[str, Any], driver: StreamDriver) -> None:
        _reject_unknown(event, ("type", "event_id", "audio"), "")
        audio = event.get("audio")
        if not isinstance(audio, str):
            raise RealtimeRequestError(
                "'audio' must be a base64 string", code="invalid_type", param="audio"
            )
        try:
            data = base64.b64decode(audio, validate=True)
        except (binascii.Error, ValueError):
            raise RealtimeRequestError(
                "'audio' is not valid base64", code="invalid_value", param="audio"
            ) from None
        # The buffer is a byte stream: an append may end inside a sample, the next completes it.
        data = self._partial_sample + data
        whole = len(data) - len(data) % driver.settings.audio_format.bytes_per_sample
        self._partial_sample = data[whole:]
        if whole:
            driver.feed_audio(data[:whole])
            self._uncommitted = True
            self._appended = True

    def _update(self, event: dict[str, Any], driver: StreamDriver, *, beta: bool) -> None:
        _reject_unknown(event, ("type", "event_id", "session"), "")
        session = event.get("session")
        if not isinstance(session, dict):
            raise RealtimeRequestError(
                "'session' must be an object", code="invalid_type", param="session"
            )
        wanted = _beta_config(session, self._config) if beta else _ga_config(session, self._config)
        assert self._settings is not None
        if wanted.eagerness is not None and not self._settings.turn_model:
            where = "session" if beta else "session.audio.input"
            raise _refuse(f"{where}.turn_detection.type", NO_TURN_MODEL)
        self._apply(wanted, driver)
        driver.send(
            _Updated(audio_received_s=driver.session.audio_received_s, beta=beta, config=wanted)
        )

    def _apply(self, wanted: _Config, driver: StreamDriver) -> None:
        current = driver.settings
        try:
            settings = driver.session.resolve(
                dataclasses.replace(
                    current,
                    audio_format=AudioFormat(
                        sample_rate_hz=wanted.rate_hz, encoding=wanted.encoding
                    ),
                    language=wanted.language,
                    end_of_speech_ms=None
                    if wanted.silence_ms is None
                    else nearest_end_of_speech_ms(wanted.silence_ms),
                    speech_pad_ms=None
                    if wanted.padding_ms is None
                    else min(wanted.padding_ms, MAX_SPEECH_PAD_MS),
                    # webrtcvad's four modes over OpenAI's threshold: 0.5 is mode 2
                    vad_aggressiveness=None
                    if wanted.threshold is None
                    else min(3, int(wanted.threshold * 4)),
                    turns=None if wanted.eagerness is None else EAGERNESS[wanted.eagerness],
                )
            )
        except ProtocolError as exc:
            raise RealtimeRequestError(
                str(exc), param="session.audio.input.transcription.language"
            ) from exc
        if settings != current:
            if self._appended:
                raise RealtimeRequestError(
                    "the audio format and language cannot change after audio was appended",
                    param="session.audio.input",
                )
            driver.configure(settings)
        self._config = dataclasses.replace(wanted, language=settings.language)
        self._vad = driver.session.vad_config

    # -- server events ---------------------------------------------------------------------
    def render(self, message: Outgoing) -> list[str]:
        """OpenAI's server events for one session message."""
        if isinstance(message, ReadyMessage):
            if self._created:
                return []
            self._created = True
            kind = "transcription_session.created" if self._beta else "session.created"
            return [self._event(kind, session=self._session_object(self._config, self._beta))]
        if isinstance(message, _Updated):
            config = message.config or self._config
            kind = "transcription_session.updated" if message.beta else "session.updated"
            return [self._event(kind, session=self._session_object(config, message.beta))]
        if isinstance(message, Settled):
            return self._complete()
        if isinstance(message, _Commit):
            turn = self._open_turn(self._boundary_s)
            self._boundary_s = message.audio_received_s
            return self._commit(turn, message.audio_received_s)
        if isinstance(message, _Clear):
            if message.flushed or (self._turns and self._turns[-1].end_s is None):
                # A closed, discarded turn takes the finals of the cleared audio still to come.
                turn = self._open_turn(self._boundary_s)
                turn.discarded = True
                turn.end_s = message.audio_received_s
            self._boundary_s = message.audio_received_s
            return [self._event("input_audio_buffer.cleared")]
        if isinstance(message, SpeechStartedMessage):
            if not self._config.server_vad:
                return []
            turn = self._open_turn(message.start)
            return [
                self._event(
                    "input_audio_buffer.speech_started",
                    audio_start_ms=round(message.start * 1000),
                    item_id=turn.item_id,
                )
            ]
        if isinstance(message, SpeechEndedMessage):
            if not self._config.server_vad or not self._turns or self._turns[-1].end_s is not None:
                return []
            turn = self._turns[-1]
            stopped = self._event(
                "input_audio_buffer.speech_stopped",
                audio_end_ms=round(message.end * 1000),
                item_id=turn.item_id,
            )
            return [stopped, *self._commit(turn, message.end)]
        if isinstance(message, TurnEvent):
            return self._turn_event(message)
        if isinstance(message, FinalMessage):
            return self._delta(message)
        if isinstance(message, ErrorMessage):
            return [self._error(message)]
        if isinstance(message, DoneMessage):
            out = []
            if self._turns and self._turns[-1].end_s is None and self._turns[-1].text:
                out += self._commit(self._turns[-1], message.audio_received_s)
            return out + self._complete(everything=True)
        return []  # partials and v1 messages without an OpenAI counterpart

    def _turn_event(self, event: TurnEvent) -> list[str]:
        """semantic_vad: an item is the turn model's turn. It starts with the turn's first
        speech, and its end (which follows the turn's last final) stops, commits and completes
        it at once."""
        if event.kind is TurnKind.START:
            turn = self._open_turn(event.start_s)
            started = self._event(
                "input_audio_buffer.speech_started",
                audio_start_ms=round(event.start_s * 1000),
                item_id=turn.item_id,
            )
            return [started]
        if event.kind is not TurnKind.END:
            return []
        out = []
        if self._turns and self._turns[-1].end_s is None:  # else the client committed it
            turn = self._turns[-1]
            out.append(
                self._event(
                    "input_audio_buffer.speech_stopped",
                    audio_end_ms=round(max(event.end_s, turn.start_s) * 1000),
                    item_id=turn.item_id,
                )
            )
            out += self._commit(turn, event.end_s)
        return out + self._complete()

    def _open_turn(self, start_s: float) -> _Turn:
        """The open turn, or a new one starting at ``start_s``."""
        if self._turns and self._turns[-1].end_s is None:
            return self._turns[-1]
        self._items += 1
        assert self._settings is not None
        turn = _Turn(f"item_{self._settings.session_id}_{self._items}", start_s)
        self._turns.append(turn)
        return turn

    def _commit(self, turn: _Turn, end_s: float) -> list[str]:
        turn.end_s = max(end_s, turn.start_s)
        committed = self._event(
            "input_audio_buffer.committed",
            item_id=turn.item_id,
            previous_item_id=self._previous_item_id,
        )
        self._previous_item_id = turn.item_id
        return [committed]

    def _delta(self, final: FinalMessage) -> list[str]:
        # Segments are decoded in order, so until a committed turn is completed (Settled) the
        # finals are its own; of several committed turns, the last that began by the final.
        committed = [t for t in self._turns if t.end_s is not None]
        if committed:
            turn = committed[0]
            for later in committed[1:]:
                if later.start_s <= final.start + _BOUNDARY_SLACK_S:
                    turn = later
        else:
            turn = self._open_turn(final.start)
        if turn.discarded:
            return []
        delta = final.text if not turn.text else " " + final.text
        turn.text.append(delta)
        return [
            self._event(
                "conversation.item.input_audio_transcription.delta",
                item_id=turn.item_id,
                content_index=0,
                delta=delta,
            )
        ]

    def _complete(self, *, everything: bool = False) -> list[str]:
        """``completed`` for the committed turns (``everything``: all turns) at the head."""
        out = []
        while self._turns and (everything or self._turns[0].end_s is not None):
            turn = self._turns.popleft()
            if turn.discarded:
                continue
            end_s = turn.end_s if turn.end_s is not None else turn.start_s
            out.append(
                self._event(
                    "conversation.item.input_audio_transcription.completed",
                    item_id=turn.item_id,
                    content_index=0,
                    transcript="".join(turn.text),
                    usage={"type": "duration", "seconds": round(end_s - turn.start_s, 3)},
                )
            )
        return out

    def _session_object(self, config: _Config, beta: bool) -> dict[str, Any]:
        assert self._settings is not None
        transcription = {"model": self._settings.model, "language": config.language, "prompt": ""}
        turn_detection: dict[str, Any] | None = None
        if config.server_vad:
            turn_detection = {
                "type": "server_vad",
                "threshold": self._vad.aggressiveness / 4,  # webrtcvad's mode, as a threshold
                "prefix_padding_ms": self._vad.speech_pad_ms,
                "silence_duration_ms": self._vad.speech_end_silence_ms,
            }
        elif config.eagerness is not None:
            turn_detection = {"type": "semantic_vad", "eagerness": config.eagerness}
        session_id = f"sess_{self._settings.session_id}"
        if beta:
            return {
                "id": session_id,
                "object": "realtime.transcription_session",
                "input_audio_format": _name_of(config.encoding, BETA_FORMATS),
                "input_audio_transcription": transcription,
                "turn_detection": turn_detection,
                "input_audio_noise_reduction": None,
                "modalities": ["text"],
                "include": None,
            }
        return {
            "type": "transcription",
            "id": session_id,
            "object": "realtime.transcription_session",
            "audio": {
                "input": {
                    "format": _ga_format(config),
                    "transcription": transcription,
                    "turn_detection": turn_detection,
                    "noise_reduction": None,
                }
            },
            "include": None,
        }

    # -- errors ----------------------------------------------------------------------------
    def error_message(
        self,
        code: str,
        message: str,
        *,
        fatal: bool,
        audio_received_s: float,
        cause: StreamError | None = None,
    ) -> ErrorMessage:
        """An error carrying the offending event's id and the parameter at fault."""
        return RealtimeErrorMessage(
            code,
            message,
            fatal,
            audio_received_s,
            event_id=self._event_id if cause is not None else None,
            param=cause.param if isinstance(cause, RealtimeRequestError) else None,
            from_client=cause is not None,
        )

    def _error(self, error: ErrorMessage) -> str:
        ours = error if isinstance(error, RealtimeErrorMessage) else None
        details: dict[str, Any] = {
            "type": "invalid_request_error" if ours and ours.from_client else "server_error",
            "code": error.code,
            "message": error.message,
            "param": ours.param if ours else None,
            "event_id": ours.event_id if ours else None,
        }
        return self._event("error", error=details)

    def _event(self, kind: str, **fields: Any) -> str:
        self._events += 1
        assert self._settings is not None or kind == "error"
        prefix = self._settings.session_id if self._settings is not None else "refused"
        obj = {"type": kind, "event_id": f"event_{prefix}_{self._events}", **fields}
        return json.dumps(obj, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


# --------------------------------------------------------------------------- parsing


API = StreamApi(
    path=REALTIME_PATH,
    auth_schemes=("bearer",),
    adapter=RealtimeAdapter,
    problem=handshake_problem,
)


def _parse_event(text: str) -> dict[str, Any]:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise RealtimeRequestError(
            f"invalid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}",
            code="invalid_json",
        ) from exc
    except RecursionError:
        raise RealtimeRequestError("invalid JSON: nested too deeply", code="invalid_json") from None
    if not isinstance(obj, dict):
        raise RealtimeRequestError("an event must be a JSON object", code="invalid_json")
    if not isinstance(obj.get("type"), str):
        raise RealtimeRequestError(
            "an event needs a string 'type'", code="missing_required_parameter", param="type"
        )
    return obj


def _reject_unknown(obj: Mapping[str, Any], known: tuple[str, ...], where: str) -> None:
    for key in obj:
        if key not in known:
            param = f"{where}.{key}" if where else key
            raise RealtimeRequestError(
                f"Unknown parameter: {param[:80]!r}", code="unknown_parameter", param=param
            )


def _object(obj: Mapping[str, Any], key: str, where: str) -> dict[str, Any] | None:
    """``obj[key]`` as an object; None when absent or null."""
    value = obj.get(key)
    if value is None:
        return None
    if not isinstance(value, dict):
        raise RealtimeRequestError(
            f"'{where}.{key}' must be an object or null",
            code="invalid_type",
            param=f"{where}.{key}",
        )
    return value


def _refuse(param: str, why: str) -> RealtimeRequestError:
    return RealtimeRequestError(f"{param}: {why}", code="unsupported_value", param=param)


def _ga_config(session: Mapping[str, Any], current: _Config) -> _Config:
    """The settings a GA ``session.update`` asks for (``types/realtime``)."""
    where = "session"
    _reject_unknown(session, ("type", "audio", "include"), where)
    if session.get("type") != "transcription":
        raise _refuse("session.type", "this endpoint serves 'transcription' sessions only")
    _check_include(session)
    audio = _object(session, "audio", where)
    if audio is None:
        return current
    _reject_unknown(audio, ("input",), f"{where}.audio")
    audio_input = _object(audio, "input", f"{where}.audio")
    if audio_input is None:
        return current
    where = "session.audio.input"
    _reject_unknown(
        audio_input, ("format", "transcription", "turn_detection", "noise_reduction"), where
    )
    rate_hz, encoding = current.rate_hz, current.encoding
    audio_format = _object(audio_input, "format", where)
    if audio_format is not None:
        _reject_unknown(audio_format, ("type", "rate"), f"{where}.format")
        kind = audio_format.get("type", "audio/pcm")
        encoding = _choice(kind, GA_FORMATS, f"{where}.format.type")
        if encoding == "pcm_s16le":
            rate_hz = _rate(audio_format.get("rate", DEFAULT_RATE_HZ), f"{where}.format.rate")
        elif audio_format.get("rate", G711_RATE_HZ) != G711_RATE_HZ:
            raise _refuse(f"{where}.format.rate", f"{kind} has no rate: it is 8 kHz")
        else:
            rate_hz = G711_RATE_HZ
    if audio_input.get("noise_reduction") is not None:
        raise _refuse(f"{where}.noise_reduction", "noise reduction is not available; send null")
    language = _transcription(audio_input, where, current.language)
    wanted = dataclasses.replace(current, rate_hz=rate_hz, encoding=encoding, language=language)
    return _turn_detection(audio_input, where, wanted)


def _beta_config(session: Mapping[str, Any], current: _Config) -> _Config:
    """The settings a beta ``transcription_session.update`` asks for."""
    where = "session"
    _reject_unknown(
        session,
        (
            "input_audio_format",
            "input_audio_transcription",
            "turn_detection",
            "input_audio_noise_reduction",
            "include",
            "modalities",
        ),
        where,
    )
    encoding = _choice(
        session.get("input_audio_format", "pcm16"), BETA_FORMATS, f"{where}.input_audio_format"
    )
    # The beta's PCM16 is always 24 kHz, its G.711 8 kHz.
    rate_hz = DEFAULT_RATE_HZ if encoding == "pcm_s16le" else G711_RATE_HZ
    if session.get("input_audio_noise_reduction") is not None:
        raise _refuse(
            f"{where}.input_audio_noise_reduction", "noise reduction is not available; send null"
        )
    modalities = session.get("modalities", ["text"])
    if modalities != ["text"]:
        raise _refuse(f"{where}.modalities", "a transcription session outputs ['text'] only")
    _check_include(session)
    renamed = {"transcription": session.get("input_audio_transcription")}
    if "turn_detection" in session:
        renamed["turn_detection"] = session["turn_detection"]
    language = _transcription(renamed, where, current.language, key="input_audio_transcription")
    wanted = dataclasses.replace(current, rate_hz=rate_hz, encoding=encoding, language=language)
    return _turn_detection(renamed, where, wanted)


def _check_include(session: Mapping[str, Any]) -> None:
    if session.get("include") not in (None, []):
        raise _refuse("session.include", "logprobs are not available")


def _choice(value: Any, names: Mapping[str, str], param: str) -> str:
    """Our encoding for an audio format's name; an error listing the names taken."""
    if not isinstance(value, str) or value not in names:
        shown = value[:40] if isinstance(value, str) else value
        raise RealtimeRequestError(
            f"Invalid value: {shown!r}. Supported values are: {', '.join(repr(n) for n in names)}",
            code="invalid_value",
            param=param,
        )
    return names[value]


def _name_of(encoding: str, names: Mapping[str, str]) -> str:
    return next(name for name, ours in names.items() if ours == encoding)


def _ga_format(config: _Config) -> dict[str, Any]:
    """The GA session's ``format`` object: PCM16 has a rate, G.711's types have none."""
    kind = _name_of(config.encoding, GA_FORMATS)
    if config.encoding == "pcm_s16le":
        return {"type": kind, "rate": config.rate_hz}
    return {"type": kind}


def _rate(value: Any, param: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise RealtimeRequestError(f"{param} must be an integer", code="invalid_type", param=param)
    if not MIN_SAMPLE_RATE_HZ <= value <= MAX_SAMPLE_RATE_HZ:
        raise _refuse(param, f"must be between {MIN_SAMPLE_RATE_HZ} and {MAX_SAMPLE_RATE_HZ} Hz")
    return value


def _transcription(
    audio_input: Mapping[str, Any],
    where: str,
    language: str | None,
    *,
    key: str = "transcription",
) -> str | None:
    """The language asked for; the model name is free (ours serves every name)."""
    transcription = _object(audio_input, "transcription", where)
    if transcription is None:
        return language
    where = f"{where}.{key}"
    _reject_unknown(transcription, _TRANSCRIPTION_OPTIONS, where)
    model = transcription.get("model")
    if model is not None and not isinstance(model, str):
        raise RealtimeRequestError(
            f"{where}.model must be a string", code="invalid_type", param=f"{where}.model"
        )
    if transcription.get("prompt") not in (None, ""):
        raise _refuse(f"{where}.prompt", "prompts are not available; send '' or null")
    value = transcription.get("language")
    if value is not None and not isinstance(value, str):
        raise RealtimeRequestError(
            f"{where}.language must be a string or null",
            code="invalid_type",
            param=f"{where}.language",
        )
    return value or None if "language" in transcription else language


def _turn_detection(audio_input: Mapping[str, Any], where: str, current: _Config) -> _Config:
    """``current`` with the turn detection asked for: ``server_vad`` and its parameters,
    ``semantic_vad`` and its eagerness, or null (turns are the client's commits)."""
    if "turn_detection" not in audio_input:
        return current
    detection = _object(audio_input, "turn_detection", where)
    if detection is None:
        return dataclasses.replace(current, server_vad=False, eagerness=None)
    where = f"{where}.turn_detection"
    _reject_unknown(detection, (*_VAD_OPTIONS, *_VAD_FLAGS, "idle_timeout_ms", "eagerness"), where)
    kind = detection.get("type", "server_vad")
    if kind not in ("server_vad", "semantic_vad"):
        raise _refuse(f"{where}.type", "only 'server_vad', 'semantic_vad' or null is supported")
    for name in _VAD_FLAGS:
        if detection.get(name):
            raise _refuse(f"{where}.{name}", "transcription sessions create no responses")
    if kind == "semantic_vad":
        return _semantic_vad(detection, where, current)
    for name in ("idle_timeout_ms", "eagerness"):
        if detection.get(name) is not None:
            raise _refuse(f"{where}.{name}", "not available with server_vad transcription")
    threshold = detection.get("threshold")
    if threshold is not None and (
        not isinstance(threshold, (int, float))
        or isinstance(threshold, bool)
        or not 0.0 <= threshold <= 1.0
    ):
        raise RealtimeRequestError(
            f"{where}.threshold must be a number from 0 to 1",
            code="invalid_value",
            param=f"{where}.threshold",
        )
    return dataclasses.replace(
        current,
        server_vad=True,
        silence_ms=_milliseconds(detection, "silence_duration_ms", where),
        padding_ms=_milliseconds(detection, "prefix_padding_ms", where),
        threshold=None if threshold is None else float(threshold),
        eagerness=None,
    )


def _semantic_vad(detection: Mapping[str, Any], where: str, current: _Config) -> _Config:
    """``current`` with ``semantic_vad`` at the eagerness asked for ("auto" when none); the
    voice activity detector runs with the server's settings."""
    for name in ("threshold", "prefix_padding_ms", "silence_duration_ms", "idle_timeout_ms"):
        if detection.get(name) is not None:
            raise _refuse(f"{where}.{name}", "only for server_vad; semantic_vad takes eagerness")
    eagerness = detection.get("eagerness")
    if eagerness is None:
        eagerness = "auto"
    _choice(eagerness, {name: name for name in EAGERNESS}, f"{where}.eagerness")
    return dataclasses.replace(
        current,
        server_vad=False,
        silence_ms=None,
        padding_ms=None,
        threshold=None,
        eagerness=eagerness,
    )


def _milliseconds(detection: Mapping[str, Any], name: str, where: str) -> int | None:
    value = detection.get(name)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise RealtimeRequestError(
            f"{where}.{name} must be a whole number of milliseconds",
            code="invalid_value",
            param=f"{where}.{name}",
        )
    return value
