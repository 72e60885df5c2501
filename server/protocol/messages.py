"""The wire schema of protocol v1: every message type, its JSON encoding and decoding.

Client to server, as WebSocket text frames: ``config``, ``flush`` and ``end``
(``parse_client_message``; binary frames are audio and are not parsed here). Server to client:
``ready``, ``speech_started``, ``speech_ended``, ``partial``, ``final``, ``error`` and ``done``,
and ``turn`` to a client that asked for conversational turns (each dataclass has ``to_json``;
``parse_server_message`` rebuilds them on the client side).

Every server message carries ``audio_received_s``: seconds of audio the server has received so
far, in stream time. ``partial`` and ``final`` also carry ``lag_s`` (how far the text is behind
the audio) and ``done`` accounts for every second received (speech transcribed or given up,
and non-speech); parsed from an older v1 server, those fields are None. Times (``start``,
``end``) are stream seconds too. Decoding is strict for client messages (unknown fields are
errors) and lenient for server messages (unknown fields are ignored, so a v1 server may add
fields without breaking v1 clients). Every decoding failure is a ``ProtocolError`` whose
message is safe to send back to the peer.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TypeAlias

from server.protocol.errors import ProtocolError
from server.protocol.formats import (
    ENCODINGS,
    FINALS,
    MAX_SAMPLE_RATE_HZ,
    MIN_SAMPLE_RATE_HZ,
    TASKS,
)

PROTOCOL_VERSION = "v1"
MAX_TEXT_MESSAGE_BYTES = 64 * 1024  # checked before json.loads so a huge text costs no parsing
AUTO_LANGUAGE = "auto"  # ConfigMessage.language when the client asks for language detection

# Whisper's language codes are two letters, or three for a few ("haw", "yue"); the engine checks
# that the model knows the code, this only checks its shape.
_LANGUAGE_RE = re.compile(r"[a-z]{2,3}")
_MAX_INT_DIGITS = 20  # more than any count or rate could need
_MS_DIGITS = 3  # server floats are rounded to milliseconds on the wire
# A ``turn`` message's events, in the order a turn may send them: "eager_end" and "resumed"
# only for a stream with ``eager_eot_threshold``.
TURN_EVENTS = ("start", "eager_end", "resumed", "end")


# --------------------------------------------------------------------------- client -> server


@dataclass(frozen=True)
class ConfigMessage:
    """``{"type": "config", ...}``: stream settings, each optional; ``None`` means not given.

    ``language`` is a code such as ``"en"``, or ``AUTO_LANGUAGE`` when the client sent
    ``"auto"`` or JSON ``null`` (detect the language).
    """

    sample_rate_hz: int | None = None
    encoding: str | None = None
    language: str | None = None
    task: str | None = None
    end_of_speech_ms: int | None = None  # the silence that ends an utterance, for this stream
    speakers: bool | None = None  # speaker labels on finals and words (servers with --speakers)
    finals: str | None = None  # "words" or "utterance": when words become final (FINALS)
    # Conversational turns (``turn`` messages) on or off, and when a pause ends a turn: the
    # turn model's probability (0.5-0.9; the eager one 0.3-0.9) or the silence (500-10000 ms).
    # The ranges are checked where the stream's settings are made.
    turns: bool | None = None
    eot_threshold: float | None = None
    eager_eot_threshold: float | None = None
    eot_timeout_ms: int | None = None

    def to_json(self) -> str:
        """Compact JSON with only the fields that were given."""
        obj: dict[str, object] = {"type": "config"}
        if self.turns is not None:
            obj["turns"] = self.turns
        for name in ("eot_threshold", "eager_eot_threshold", "eot_timeout_ms"):
            value = getattr(self, name)
            if value is not None:
                obj[name] = value
        if self.finals is not None:
            obj["finals"] = self.finals
        if self.speakers is not None:
            obj["speakers"] = self.speakers
        if self.end_of_speech_ms is not None:
            obj["end_of_speech_ms"] = self.end_of_speech_ms
        if self.sample_rate_hz is not None:
            obj["sample_rate"] = self.sample_rate_hz
        if self.encoding is not None:
            obj["encoding"] = self.encoding
        if self.language is not None:
            obj["language"] = self.language
        if self.task is not None:
            obj["task"] = self.task
        return _dumps(obj)


@dataclass(frozen=True)
class FlushMessage:
    """``{"type": "flush"}``: finalise everything buffered; the session stays open."""

    def to_json(self) -> str:
        """Compact JSON."""
        return _dumps({"type": "flush"})


@dataclass(frozen=True)
class EndMessage:
    """``{"type": "end"}``: no more audio; finalise, send ``done`` and close normally."""

    def to_json(self) -> str:
        """Compact JSON."""
        return _dumps({"type": "end"})


ClientMessage: TypeAlias = ConfigMessage | FlushMessage | EndMessage


# --------------------------------------------------------------------------- server -> client


@dataclass(frozen=True)
class ReadyMessage:
    """The server's first message: the session exists and audio may flow."""

    session_id: str
    model: str
    sample_rate: int  # the client's audio rate the server expects, Hz
    encoding: str  # the client's PCM encoding, one of ENCODINGS
    language: str | None  # None: the server detects the language
    task: str
    audio_received_s: float = 0.0
    end_of_speech_ms: int | None = None  # the silence that ends an utterance, in effect
    # Speaker labels on this stream's finals and words (a ``config`` may still turn them
    # off); False from servers that predate the field.
    speakers: bool = False
    # When words become final on this stream: "words" (as agreed, ~2 s) or "utterance" (at
    # its end, beam-searched); "words" from servers that predate the field.
    finals: str = "words"

    def to_json(self) -> str:
        """Compact JSON, with ``"protocol": "v1"``."""
        return _dumps(
            {
                "type": "ready",
                "session_id": self.session_id,
                "model": self.model,
                "sample_rate": self.sample_rate,
                "encoding": self.encoding,
                "language": self.language,
                "task": self.task,
                "protocol": PROTOCOL_VERSION,
                "audio_received_s": _ms(self.audio_received_s),
                **(
                    {"end_of_speech_ms": self.end_of_speech_ms}
                    if self.end_of_speech_ms is not None
                    else {}
                ),
                "speakers": self.speakers,
                "finals": self.finals,
            }
        )


@dataclass(frozen=True)
class SpeechStartedMessage:
    """Voice activity began at ``start`` (stream seconds)."""

    start: float
    audio_received_s: float

    def to_json(self) -> str:
        """Compact JSON, floats rounded to milliseconds."""
        return _dumps(
            {
                "type": "speech_started",
                "start": _ms(self.start),
                "audio_received_s": _ms(self.audio_received_s),
            }
        )


@dataclass(frozen=True)
class SpeechEndedMessage:
    """Voice activity ended at ``end`` (stream seconds)."""

    end: float
    audio_received_s: float

    def to_json(self) -> str:
        """Compact JSON, floats rounded to milliseconds."""
        return _dumps(
            {
                "type": "speech_ended",
                "end": _ms(self.end),
                "audio_received_s": _ms(self.audio_received_s),
            }
        )


@dataclass(frozen=True)
class PartialMessage:
    """The current hypothesis of an open segment: committed words plus a tentative tail.

    A later partial or the segment's final replaces it.
    """

    segment_id: int
    text: str
    start: float
    end: float
    audio_received_s: float
    lag_s: float | None = None  # speech received that no finished decode covered; see final
    # Sessions that detect their language: the one this text is in and the detector's
    # probability of it; ``language_provisional`` while the segment's language is not decided
    # (the text is decoded in the best guess so far, and no word of it is final).
    language: str | None = None
    language_probability: float | None = None
    language_provisional: bool = False

    def to_json(self) -> str:
        """Compact JSON, floats rounded to milliseconds."""
        return _dumps(
            _with_language(
                _with_optional(
                    {
                        "type": "partial",
                        "segment_id": self.segment_id,
                        "text": self.text,
                        "start": _ms(self.start),
                        "end": _ms(self.end),
                        "audio_received_s": _ms(self.audio_received_s),
                    },
                    lag_s=self.lag_s,
                ),
                self.language,
                self.language_probability,
                provisional=self.language_provisional,
            )
        )


@dataclass(frozen=True)
class WordInfo:
    """One word of a final with its stream times and the model's probability."""

    word: str
    start: float
    end: float
    probability: float
    # Sessions with speaker labels: who said it (0, 1, ... in order of appearance) and the
    # cosine similarity of that stretch's voice to the speaker's, in [0, 1].
    speaker: int | None = None
    speaker_confidence: float | None = None

    def to_obj(self) -> dict[str, object]:
        """The JSON object of this word (floats rounded to milliseconds)."""
        obj: dict[str, object] = {
            "word": self.word,
            "start": _ms(self.start),
            "end": _ms(self.end),
            "probability": _ms(self.probability),
        }
        if self.speaker is not None:
            obj["speaker"] = self.speaker
        if self.speaker_confidence is not None:
            obj["speaker_confidence"] = _ms(self.speaker_confidence)
        return obj


@dataclass(frozen=True)
class FinalMessage:
    """The settled text of a segment. Never retracted; ``segment_id`` only grows."""

    segment_id: int
    text: str
    start: float
    end: float
    words: tuple[WordInfo, ...]
    audio_received_s: float
    # Seconds of speech the server had received but not yet decoded when this was sent: how
    # far the text is behind the audio. Under overload it grows (audio waits, none is dropped).
    lag_s: float | None = None
    # Sessions that detect their language: the decided language of this text, and the
    # detector's probability of it. A final whose language differs from the previous one's
    # says the speaker switched.
    language: str | None = None
    language_probability: float | None = None
    # Sessions with speaker labels: the speaker of most of its words (each word has its own).
    speaker: int | None = None

    def to_json(self) -> str:
        """Compact JSON, floats rounded to milliseconds."""
        return _dumps(
            _with_speaker(
                _with_language(
                    _with_optional(
                        {
                            "type": "final",
                            "segment_id": self.segment_id,
                            "text": self.text,
                            "start": _ms(self.start),
                            "end": _ms(self.end),
                            "words": [w.to_obj() for w in self.words],
                            "audio_received_s": _ms(self.audio_received_s),
                        },
                        lag_s=self.lag_s,
                    ),
                    self.language,
                    self.language_probability,
                ),
                self.speaker,
            )
        )


@dataclass(frozen=True)
class TurnMessage:
    """A conversational turn's event (a stream with ``turns``): it started, its end is likely
    (``eager_end``), the speaker went on after that (``resumed``), or it ended. An ``end``
    comes after the turn's last ``final``; its text is the turn's finals, joined by spaces."""

    event: str  # one of TURN_EVENTS
    turn_index: int  # 0, 1, ... in the stream
    start: float  # the turn's first speech
    end: float  # the end of its last word so far (``start`` while it has none)
    # The turn's words so far: on ``end`` its finals; before, also the open segment's partial,
    # whose words carry the partial's span and probability 0.
    text: str
    words: tuple[WordInfo, ...]
    end_of_turn_confidence: float  # the turn model's last probability in this turn (0 before)
    audio_received_s: float
    trigger: str | None = None  # on ``end``: "model", "timeout" or "manual"

    def to_json(self) -> str:
        """Compact JSON, floats rounded to milliseconds."""
        obj: dict[str, object] = {
            "type": "turn",
            "event": self.event,
            "turn_index": self.turn_index,
            "start": _ms(self.start),
            "end": _ms(self.end),
            "text": self.text,
            "words": [w.to_obj() for w in self.words],
            "end_of_turn_confidence": _ms(self.end_of_turn_confidence),
            "audio_received_s": _ms(self.audio_received_s),
        }
        if self.trigger is not None:
            obj["trigger"] = self.trigger
        return _dumps(obj)


@dataclass(frozen=True)
class ErrorMessage:
    """Something went wrong; ``fatal`` says the server is about to close the connection."""

    code: str  # a StreamError.code such as "protocol_error", "bad_audio", "limit"
    message: str
    fatal: bool
    audio_received_s: float

    def to_json(self) -> str:
        """Compact JSON, floats rounded to milliseconds."""
        return _dumps(
            {
                "type": "error",
                "code": self.code,
                "message": self.message,
                "fatal": self.fatal,
                "audio_received_s": _ms(self.audio_received_s),
            }
        )


@dataclass(frozen=True)
class DoneMessage:
    """The closing summary after the client's ``end``, just before a normal close.

    It accounts for every second received: ``speech_s + non_speech_s == audio_received_s`` and
    ``transcribed_s + failed_s == speech_s`` (each to the millisecond rounding; to a few
    milliseconds more for audio the server resampled). The last three are None when parsed
    from a server that predates them.
    """

    segments: int  # finals sent in this session
    audio_received_s: float
    speech_s: float  # seconds of audio the voice activity detector called speech
    session_s: float  # wall-clock seconds the session lasted
    non_speech_s: float | None = None  # audio the detector called silence or noise: no text
    transcribed_s: float | None = None  # speech the engine decoded; its words are in the finals
    failed_s: float | None = None  # speech given up after repeated decode failures

    def to_json(self) -> str:
        """Compact JSON, floats rounded to milliseconds."""
        return _dumps(
            _with_optional(
                {
                    "type": "done",
                    "segments": self.segments,
                    "audio_received_s": _ms(self.audio_received_s),
                    "speech_s": _ms(self.speech_s),
                    "session_s": _ms(self.session_s),
                },
                non_speech_s=self.non_speech_s,
                transcribed_s=self.transcribed_s,
                failed_s=self.failed_s,
            )
        )


ServerMessage: TypeAlias = (
    ReadyMessage
    | SpeechStartedMessage
    | SpeechEndedMessage
    | PartialMessage
    | FinalMessage
    | TurnMessage
    | ErrorMessage
    | DoneMessage
)


# --------------------------------------------------------------------------- decoding


def parse_client_message(text: str) -> ClientMessage:
    """Decode one text frame from a client.

    Raises:
        ProtocolError: the text is too long, not JSON, not an object, has no or an unknown
            ``type``, or has unknown fields or fields of the wrong type or value.
    """
    obj = _loads(text)
    kind = _message_type(obj)
    fields = _Fields(obj, kind)
    message: ClientMessage
    if kind == "config":
        message = ConfigMessage(
            sample_rate_hz=_check_sample_rate(fields.opt_int("sample_rate")),
            encoding=_check_choice(fields.opt_str("encoding"), "encoding", ENCODINGS),
            language=_parse_language(fields),
            task=_check_choice(fields.opt_str("task"), "task", TASKS),
            end_of_speech_ms=fields.opt_int("end_of_speech_ms"),
            speakers=fields.opt_bool("speakers") if "speakers" in obj else None,
            finals=_check_choice(fields.opt_str("finals"), "finals", FINALS),
            turns=fields.opt_bool("turns") if "turns" in obj else None,
            eot_threshold=fields.opt_float("eot_threshold"),
            eager_eot_threshold=fields.opt_float("eager_eot_threshold"),
            eot_timeout_ms=fields.opt_int("eot_timeout_ms"),
        )
    elif kind == "flush":
        message = FlushMessage()
    elif kind == "end":
        message = EndMessage()
    else:
        raise ProtocolError(
            f"unknown message type {kind[:40]!r}; expected one of "
            f"{', '.join(repr(k) for k in _CLIENT_TYPES)}"
        )
    fields.reject_unknown()
    return message


def parse_server_message(text: str) -> ServerMessage:
    """Decode one text frame from the server (the client side of the protocol).

    Fields this version does not know are ignored.

    Raises:
        ProtocolError: the text is not a valid v1 server message.
    """
    obj = _loads(text)
    kind = _message_type(obj)
    parse = _SERVER_PARSERS.get(kind)
    if parse is None:
        raise ProtocolError(
            f"unknown server message type {kind[:40]!r}; expected one of "
            f"{', '.join(repr(k) for k in _SERVER_PARSERS)}"
        )
    return parse(_Fields(obj, kind))


_CLIENT_TYPES = ("config", "flush", "end")


def _parse_ready(f: _Fields) -> ReadyMessage:
    protocol = f.str_("protocol")
    if protocol != PROTOCOL_VERSION:
        raise ProtocolError(
            f"server speaks protocol {protocol!r}; this client speaks {PROTOCOL_VERSION!r}"
        )
    return ReadyMessage(
        session_id=f.str_("session_id"),
        model=f.str_("model"),
        sample_rate=f.int_("sample_rate"),
        encoding=f.str_("encoding"),
        language=f.opt_str("language"),
        task=f.str_("task"),
        audio_received_s=f.float_("audio_received_s"),
        end_of_speech_ms=f.opt_int("end_of_speech_ms"),
        speakers=f.opt_bool("speakers"),
        finals=f.opt_str("finals") or "words",
    )


def _parse_speech_started(f: _Fields) -> SpeechStartedMessage:
    return SpeechStartedMessage(
        start=f.float_("start"), audio_received_s=f.float_("audio_received_s")
    )


def _parse_speech_ended(f: _Fields) -> SpeechEndedMessage:
    return SpeechEndedMessage(end=f.float_("end"), audio_received_s=f.float_("audio_received_s"))


def _parse_partial(f: _Fields) -> PartialMessage:
    return PartialMessage(
        segment_id=f.int_("segment_id"),
        text=f.str_("text"),
        start=f.float_("start"),
        end=f.float_("end"),
        audio_received_s=f.float_("audio_received_s"),
        lag_s=f.opt_float("lag_s"),
        language=f.opt_str("language"),
        language_probability=f.opt_float("language_probability"),
        language_provisional=f.opt_bool("language_provisional"),
    )


def _parse_words(f: _Fields, kind: str) -> tuple[WordInfo, ...]:
    raw_words = f.get("words")
    if not isinstance(raw_words, list):
        raise ProtocolError(f"{kind!r} field 'words' must be a list, got {_json_type(raw_words)}")
    words = []
    for i, raw in enumerate(raw_words):
        if not isinstance(raw, dict):
            raise ProtocolError(f"{kind!r} words[{i}] must be an object, got {_json_type(raw)}")
        w = _Fields(raw, f"{kind} words[{i}]")
        words.append(
            WordInfo(
                word=w.str_("word"),
                start=w.float_("start"),
                end=w.float_("end"),
                probability=w.float_("probability"),
                speaker=w.opt_int("speaker"),
                speaker_confidence=w.opt_float("speaker_confidence"),
            )
        )
    return tuple(words)


def _parse_final(f: _Fields) -> FinalMessage:
    return FinalMessage(
        segment_id=f.int_("segment_id"),
        text=f.str_("text"),
        start=f.float_("start"),
        end=f.float_("end"),
        words=_parse_words(f, "final"),
        audio_received_s=f.float_("audio_received_s"),
        lag_s=f.opt_float("lag_s"),
        language=f.opt_str("language"),
        language_probability=f.opt_float("language_probability"),
        speaker=f.opt_int("speaker"),
    )


def _parse_turn(f: _Fields) -> TurnMessage:
    return TurnMessage(
        event=f.str_("event"),
        turn_index=f.int_("turn_index"),
        start=f.float_("start"),
        end=f.float_("end"),
        text=f.str_("text"),
        words=_parse_words(f, "turn"),
        end_of_turn_confidence=f.float_("end_of_turn_confidence"),
        audio_received_s=f.float_("audio_received_s"),
        trigger=f.opt_str("trigger"),
    )


def _parse_error(f: _Fields) -> ErrorMessage:
    return ErrorMessage(
        code=f.str_("code"),
        message=f.str_("message"),
        fatal=f.bool_("fatal"),
        audio_received_s=f.float_("audio_received_s"),
    )


def _parse_done(f: _Fields) -> DoneMessage:
    return DoneMessage(
        segments=f.int_("segments"),
        audio_received_s=f.float_("audio_received_s"),
        speech_s=f.float_("speech_s"),
        session_s=f.float_("session_s"),
        non_speech_s=f.opt_float("non_speech_s"),
        transcribed_s=f.opt_float("transcribed_s"),
        failed_s=f.opt_float("failed_s"),
    )


_SERVER_PARSERS: Mapping[str, Callable[[_Fields], ServerMessage]] = {
    "ready": _parse_ready,
    "speech_started": _parse_speech_started,
    "speech_ended": _parse_speech_ended,
    "partial": _parse_partial,
    "final": _parse_final,
    "turn": _parse_turn,
    "error": _parse_error,
    "done": _parse_done,
}


def _parse_language(fields: _Fields) -> str | None:
    if "language" not in fields:
        return None
    value = fields.get("language")
    if value is None or value == AUTO_LANGUAGE:
        return AUTO_LANGUAGE
    if not isinstance(value, str):
        raise ProtocolError(
            f"'config' field 'language' must be a string or null, got {_json_type(value)}"
        )
    if not _LANGUAGE_RE.fullmatch(value):
        raise ProtocolError(
            f"'config' field 'language' must be a lowercase language code such as 'en', "
            f"or 'auto' or null to detect it; got {value[:40]!r}"
        )
    return value


def _check_sample_rate(value: int | None) -> int | None:
    if value is not None and not MIN_SAMPLE_RATE_HZ <= value <= MAX_SAMPLE_RATE_HZ:
        raise ProtocolError(
            f"'config' field 'sample_rate' must be between {MIN_SAMPLE_RATE_HZ} and "
            f"{MAX_SAMPLE_RATE_HZ} Hz; got {value}"
        )
    return value


def _check_choice(value: str | None, name: str, allowed: tuple[str, ...]) -> str | None:
    if value is not None and value not in allowed:
        raise ProtocolError(
            f"'config' field {name!r} must be one of {', '.join(allowed)}; got {value[:40]!r}"
        )
    return value


class _Fields:
    """Typed, checked access to one decoded JSON object, remembering which keys were read."""

    def __init__(self, obj: dict[str, object], where: str) -> None:
        self._obj = obj
        self._where = where
        self._seen = {"type"}

    def __contains__(self, key: str) -> bool:
        return key in self._obj

    def get(self, key: str) -> object:
        self._seen.add(key)
        if key not in self._obj:
            raise ProtocolError(f"{self._where!r} message is missing field {key!r}")
        return self._obj[key]

    def _wrong(self, key: str, expected: str, value: object) -> ProtocolError:
        return ProtocolError(
            f"{self._where!r} field {key!r} must be {expected}, got {_json_type(value)}"
        )

    def str_(self, key: str) -> str:
        value = self.get(key)
        if not isinstance(value, str):
            raise self._wrong(key, "a string", value)
        return value

    def int_(self, key: str) -> int:
        value = self.get(key)
        # bool is an int subclass in Python, but true is not a number on the wire.
        if not isinstance(value, int) or isinstance(value, bool):
            raise self._wrong(key, "an integer", value)
        return value

    def float_(self, key: str) -> float:
        value = self.get(key)
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise self._wrong(key, "a number", value)
        return float(value)

    def bool_(self, key: str) -> bool:
        value = self.get(key)
        if not isinstance(value, bool):
            raise self._wrong(key, "true or false", value)
        return value

    def opt_str(self, key: str) -> str | None:
        """A string, or None when absent or null."""
        if key not in self._obj:
            self._seen.add(key)
            return None
        value = self.get(key)
        if value is None:
            return None
        if not isinstance(value, str):
            raise self._wrong(key, "a string", value)
        return value

    def opt_float(self, key: str) -> float | None:
        """A number, or None when absent or null (fields newer servers add)."""
        if key not in self._obj or self._obj[key] is None:
            self._seen.add(key)
            return None
        return self.float_(key)

    def opt_bool(self, key: str) -> bool:
        """A boolean; False when absent (flags newer servers add)."""
        if key not in self._obj:
            self._seen.add(key)
            return False
        return self.bool_(key)

    def opt_int(self, key: str) -> int | None:
        """An integer, or None when absent."""
        if key not in self._obj:
            self._seen.add(key)
            return None
        return self.int_(key)

    def reject_unknown(self) -> None:
        unknown = sorted(set(self._obj) - self._seen)
        if unknown:
            names = ", ".join(repr(k[:40]) for k in unknown[:5])
            raise ProtocolError(f"{self._where!r} message has unknown field(s): {names}")


def _loads(text: str) -> dict[str, object]:
    # The code-point count is checked first so a huge text is refused without encoding it.
    if (
        len(text) > MAX_TEXT_MESSAGE_BYTES
        or len(text.encode("utf-8", "surrogatepass")) > MAX_TEXT_MESSAGE_BYTES
    ):
        raise ProtocolError(f"text message over {MAX_TEXT_MESSAGE_BYTES} bytes")
    try:
        obj = json.loads(
            text,
            object_pairs_hook=_no_duplicate_keys,
            parse_constant=_no_constant,
            parse_int=_bounded_int,
            parse_float=_finite_float,
        )
    except json.JSONDecodeError as exc:
        raise ProtocolError(
            f"invalid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
        ) from exc
    except RecursionError:
        # json recurses once per nesting level; 64 KiB of "[" is far past the stack limit.
        raise ProtocolError("invalid JSON: nested too deeply") from None
    if not isinstance(obj, dict):
        raise ProtocolError(f"a message must be a JSON object, got {_json_type(obj)}")
    return obj


def _no_duplicate_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    obj: dict[str, object] = {}
    for key, value in pairs:
        if key in obj:
            raise ProtocolError(f"invalid JSON: duplicate key {key[:40]!r}")
        obj[key] = value
    return obj


def _no_constant(name: str) -> object:
    # Python's json accepts NaN and Infinity; JSON does not, and they are never valid values.
    raise ProtocolError(f"invalid JSON: {name} is not a JSON value")


def _bounded_int(digits: str) -> int:
    # int() refuses more than 4300 digits with a bare ValueError (CVE-2020-10735); no field of
    # ours needs more than a few, so refuse long ones early with a clear message.
    if len(digits) > _MAX_INT_DIGITS:
        raise ProtocolError(f"invalid JSON: integer of {len(digits)} digits is too long")
    return int(digits)


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e999 parses to inf, which no time or probability can be
        raise ProtocolError(f"invalid JSON: number {text[:40]} is out of range")
    return value


def _message_type(obj: dict[str, object]) -> str:
    if "type" not in obj:
        raise ProtocolError("message has no 'type' field")
    kind = obj["type"]
    if not isinstance(kind, str):
        raise ProtocolError(f"message field 'type' must be a string, got {_json_type(kind)}")
    return kind


def _json_type(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


def _ms(seconds: float) -> float:
    return round(seconds, _MS_DIGITS)


def _with_optional(obj: dict[str, object], **seconds: float | None) -> dict[str, object]:
    """``obj`` with the fields of ``seconds`` that are set, rounded to milliseconds."""
    obj.update({name: _ms(value) for name, value in seconds.items() if value is not None})
    return obj


def _with_speaker(obj: dict[str, object], speaker: int | None) -> dict[str, object]:
    if speaker is not None:
        obj["speaker"] = speaker
    return obj


def _with_language(
    obj: dict[str, object],
    language: str | None,
    probability: float | None,
    *,
    provisional: bool = False,
) -> dict[str, object]:
    if language is not None:
        obj["language"] = language
    if probability is not None:
        obj["language_probability"] = _ms(probability)
    if provisional:
        obj["language_provisional"] = True
    return obj


def _dumps(obj: Mapping[str, object]) -> str:
    # allow_nan=False: a NaN time is a bug upstream, and NaN is not JSON a browser can parse.
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
