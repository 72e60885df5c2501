"""Home Assistant's Wyoming protocol, speech-to-text side: framing, audio and events, no I/O.

``server/serve/wyoming.py`` serves it on a TCP port of its own; this module only turns bytes
into events (``EventDecoder``), events into bytes (``encode_event``), a client's declared
audio into what the ``Session`` takes (``AudioConverter``) and the session's events into
Wyoming's (``TranscriptStream``). The event shapes are those of the ``wyoming`` package
(OHF-Voice/wyoming, 1.10), whose dataclasses build and read them.

Framing, as ``wyoming.event`` writes it: one JSON header line ``{"type": ..., "data": {...},
"data_length": N, "payload_length": M, "version": ...}`` ending in a newline, then N bytes of
a JSON object merged into ``data``, then M bytes of binary payload (the PCM of an
``audio-chunk``). Every length is bounded here: the ``wyoming`` package's own reader trusts
them, and a server must not.

What a transcription looks like on the wire (Home Assistant's ``components/wyoming/stt.py``
sends the first four; ``describe`` comes on a connection of its own when the integration is
set up)::

    -> describe                      <- info (asr: this program, the loaded model, languages)
    -> transcribe {language}
    -> audio-start {rate, width, channels}
                                     <- transcript-start {language}
    -> audio-chunk ... (payload)     <- transcript-chunk {text}, as finals arrive
    -> audio-stop                    <- transcript {text, language}, transcript-stop

The chunks' texts, joined as they are, give the transcript (a chunk after the first starts
with a space, unless it starts with a closing mark such as a comma), which is how streaming
clients put them together.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import metadata
from typing import Any

import numpy as np
import numpy.typing as npt
import soxr
from wyoming.asr import Transcript, TranscriptChunk, TranscriptStart, TranscriptStop
from wyoming.error import Error
from wyoming.event import Event
from wyoming.info import AsrModel, AsrProgram, Attribution, Info

from server.decode.stream_driver import AdapterEvent, Outgoing
from server.protocol.errors import AudioFormatError, FrameTooLargeError, ProtocolError
from server.protocol.formats import MAX_SAMPLE_RATE_HZ, MIN_SAMPLE_RATE_HZ, SAMPLE_RATE_HZ
from server.protocol.messages import DoneMessage, ErrorMessage, FinalMessage

Float32Array = npt.NDArray[np.float32]

PROGRAM_NAME = "whisperwire"
DEFAULT_PORT = 10300  # Wyoming's speech-to-text port by convention (wyoming-faster-whisper)
# The protocol version written into each header: the ``wyoming`` release this module follows.
PROTOCOL_VERSION = "1.10.2"
# A client's header line or data block is a few hundred bytes (the ``info`` Home Assistant
# reads is the server's); far larger ones are garbage or an attack on memory.
MAX_HEADER_BYTES = 64 * 1024
MAX_DATA_BYTES = 64 * 1024
MAX_TYPE_CHARS = 64
SAMPLE_WIDTHS = (1, 2, 3, 4)  # bytes; 1 is unsigned as in WAV (wyoming's converter biases it)
MAX_CHANNELS = 16
# Rates the session takes as they are sit in [MIN_SAMPLE_RATE_HZ, MAX_SAMPLE_RATE_HZ]; others
# within these bounds are resampled to 16 kHz here first.
MIN_DECLARED_RATE_HZ = 1_000
MAX_DECLARED_RATE_HZ = 384_000
_RESAMPLE_QUALITY = "HQ"  # as server/protocol/audio.py
# A final that starts with one of these (a cut fell before a comma) joins the text before it
# without a space.
_CLOSING_MARKS = tuple(",.;:!?)]}%…。，、？！")


class WyomingFramingError(ProtocolError):
    """Bytes that are not a Wyoming event: the stream cannot be read on after them."""

    code = "bad_event"
    close_code: int | None = 1008


def server_version() -> str:
    """This server's version, as installed."""
    try:
        return metadata.version("whisperwire")
    except metadata.PackageNotFoundError:
        return "unknown"


# --------------------------------------------------------------------------- framing


@dataclass(frozen=True)
class _Header:
    type: str
    data: dict[str, Any]
    data_length: int
    payload_length: int


class EventDecoder:
    """Wyoming events out of a byte stream: ``receive_data`` with whatever arrived, then
    ``next_event`` until it returns None. Raises ``WyomingFramingError`` (after which nothing
    more can be read) for a header that is not one, or a length over its bound."""

    def __init__(self, *, max_payload_bytes: int) -> None:
        if max_payload_bytes <= 0:
            raise ValueError(f"max_payload_bytes must be > 0; got {max_payload_bytes}")
        self.max_payload_bytes = max_payload_bytes
        self._buffer = bytearray()
        self._header: _Header | None = None  # read, its data and payload not all here yet

    def receive_data(self, data: bytes) -> None:
        self._buffer += data

    @property
    def buffered_bytes(self) -> int:
        """Bytes received and not yet handed out as events."""
        return len(self._buffer)

    def next_event(self) -> Event | None:
        """The next whole event, or None until more bytes arrive."""
        if self._header is None:
            end = self._buffer.find(b"\n", 0, MAX_HEADER_BYTES + 1)
            if end < 0:
                if len(self._buffer) > MAX_HEADER_BYTES:
                    raise WyomingFramingError(
                        f"no header line within {MAX_HEADER_BYTES} bytes: not a Wyoming event"
                    )
                return None
            line = bytes(self._buffer[:end])
            del self._buffer[: end + 1]
            self._header = self._parse_header(line)
        header = self._header
        size = header.data_length + header.payload_length
        if len(self._buffer) < size:
            return None
        data_bytes = bytes(self._buffer[: header.data_length])
        payload = bytes(self._buffer[header.data_length : size])
        del self._buffer[:size]
        self._header = None
        data = dict(header.data)
        if data_bytes:
            data.update(_json_object(data_bytes, "the data block"))
        return Event(type=header.type, data=data, payload=payload or None)

    def _parse_header(self, line: bytes) -> _Header:
        header = _json_object(line, "the header line")
        kind = header.get("type")
        if not isinstance(kind, str) or not 0 < len(kind) <= MAX_TYPE_CHARS:
            raise WyomingFramingError("the header line has no event type")
        data = header.get("data")
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise WyomingFramingError(f"{kind[:40]}: data must be a JSON object")
        return _Header(
            type=kind,
            data=data,
            data_length=_length(header, "data_length", MAX_DATA_BYTES),
            payload_length=_length(header, "payload_length", self.max_payload_bytes),
        )


def _json_object(raw: bytes, what: str) -> dict[str, Any]:
    try:
        value = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        raise WyomingFramingError(
            f"{what} is not JSON: this port speaks the Wyoming protocol"
        ) from None
    if not isinstance(value, dict):
        raise WyomingFramingError(f"{what} is not a JSON object")
    return value


def _length(header: dict[str, Any], name: str, limit: int) -> int:
    value = header.get(name)
    if value is None:
        return 0
    # bool is an int to Python, not to JSON
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise WyomingFramingError(f"{name} must be a byte count; got {str(value)[:20]!r}")
    if value > limit:
        error = FrameTooLargeError if name == "payload_length" else WyomingFramingError
        raise error(f"{name} of {value} bytes exceeds the limit of {limit} bytes")
    return value


def encode_event(event: Event) -> bytes:
    """``event`` framed as ``wyoming.event.async_write_event`` frames it."""
    header: dict[str, Any] = {"type": event.type, "version": PROTOCOL_VERSION}
    data = b""
    if event.data:
        data = json.dumps(event.data, ensure_ascii=False, allow_nan=False).encode("utf-8")
        header["data_length"] = len(data)
    if event.payload:
        header["payload_length"] = len(event.payload)
    line = json.dumps(header, ensure_ascii=False).encode("utf-8")
    return b"".join((line, b"\n", data, event.payload or b""))


# --------------------------------------------------------------------------- audio


@dataclass(frozen=True)
class WyomingAudioFormat:
    """What an ``audio-start`` declares: interleaved little-endian PCM."""

    rate: int  # Hz
    width: int  # bytes per sample
    channels: int

    def __post_init__(self) -> None:
        if not MIN_DECLARED_RATE_HZ <= self.rate <= MAX_DECLARED_RATE_HZ:
            raise ValueError(
                f"rate must be {MIN_DECLARED_RATE_HZ} to {MAX_DECLARED_RATE_HZ} Hz; got {self.rate}"
            )
        if self.width not in SAMPLE_WIDTHS:
            raise ValueError(f"width must be one of {SAMPLE_WIDTHS} bytes; got {self.width}")
        if not 1 <= self.channels <= MAX_CHANNELS:
            raise ValueError(f"channels must be 1 to {MAX_CHANNELS}; got {self.channels}")

    @property
    def frame_bytes(self) -> int:
        """Bytes of one sample of every channel."""
        return self.width * self.channels

    @staticmethod
    def from_data(kind: str, data: dict[str, Any]) -> WyomingAudioFormat:
        """The format in an ``audio-start`` or ``audio-chunk``'s data. Raises ProtocolError."""
        values: list[int] = []
        for name in ("rate", "width", "channels"):
            value = data.get(name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ProtocolError(
                    f"{kind} needs integer rate (Hz), width (bytes) and channels",
                    close_code=1003,
                )
            values.append(value)
        rate, width, channels = values
        try:
            return WyomingAudioFormat(rate, width, channels)
        except ValueError as exc:
            raise AudioFormatError(f"{kind}: {exc}") from None


class AudioConverter:
    """One transcription's audio, from the format its client declared to what the session
    takes: 16-bit mono at 8 to 48 kHz is passed as it is (``pcm_s16le``); other widths and
    channel counts become float mono (channels averaged; ``pcm_f32le``), and rates outside the
    session's range are resampled to 16 kHz here, with soxr's stream as the session's own
    decoder (``server.protocol.audio.PcmDecoder``) does for the rest."""

    def __init__(self, fmt: WyomingAudioFormat) -> None:
        self.format = fmt
        in_range = MIN_SAMPLE_RATE_HZ <= fmt.rate <= MAX_SAMPLE_RATE_HZ
        self.sample_rate_hz = fmt.rate if in_range else SAMPLE_RATE_HZ
        self.passthrough = fmt.width == 2 and fmt.channels == 1 and in_range
        self.encoding = "pcm_s16le" if self.passthrough else "pcm_f32le"
        self._resampler: soxr.ResampleStream | None = None
        if not in_range:
            self._resampler = soxr.ResampleStream(
                fmt.rate, SAMPLE_RATE_HZ, 1, dtype="float32", quality=_RESAMPLE_QUALITY
            )

    def convert(self, payload: bytes) -> bytes:
        """One chunk's payload in the session's encoding. Raises AudioFormatError for a chunk
        that is not whole frames (every channel's sample): the client's byte stream is
        misaligned, and guessing would turn the rest into noise."""
        fmt = self.format
        if len(payload) % fmt.frame_bytes:
            raise AudioFormatError(
                f"audio-chunk of {len(payload)} bytes is not whole frames of {fmt.channels} "
                f"channel(s) x {fmt.width} byte(s)"
            )
        if self.passthrough:
            return payload
        samples = _mono_float(payload, fmt)
        if self._resampler is not None:
            samples = np.asarray(self._resampler.resample_chunk(samples), dtype=np.float32)
        return samples.astype("<f4").tobytes()

    def flush(self) -> bytes:
        """What the resampler still holds, at ``audio-stop``."""
        if self._resampler is None:
            return b""
        tail = self._resampler.resample_chunk(np.zeros(0, np.float32), last=True)
        return np.asarray(tail, dtype="<f4").tobytes()


def _mono_float(payload: bytes, fmt: WyomingAudioFormat) -> Float32Array:
    """Interleaved little-endian PCM of ``fmt`` as float mono in [-1, 1)."""
    width = fmt.width
    if width == 1:  # unsigned, centred on 128
        samples = (np.frombuffer(payload, np.uint8).astype(np.float32) - 128.0) / 128.0
    elif width == 2:
        samples = np.frombuffer(payload, "<i2").astype(np.float32) / 32768.0
    elif width == 3:
        # The three bytes go into the top of an int32, so the sign comes along.
        triples = np.frombuffer(payload, np.uint8).reshape(-1, 3)
        wide = np.zeros((triples.shape[0], 4), np.uint8)
        wide[:, 1:] = triples
        samples = (wide.view("<i4").ravel().astype(np.float64) / 2.0**31).astype(np.float32)
    else:
        samples = (np.frombuffer(payload, "<i4").astype(np.float64) / 2.0**31).astype(np.float32)
    if fmt.channels > 1:
        samples = samples.reshape(-1, fmt.channels).mean(axis=1, dtype=np.float32)
    return np.asarray(samples, dtype=np.float32)


# --------------------------------------------------------------------------- events


def info_event(model: str, languages: list[str]) -> Event:
    """The ``info`` answer to ``describe``: one ASR program, the loaded model."""
    version = server_version()
    program = AsrProgram(
        name=PROGRAM_NAME,
        attribution=Attribution(name="Whisperwire", url=""),  # no public home yet
        installed=True,
        description="Whisperwire: streaming Whisper speech-to-text",
        version=version,
        models=[
            AsrModel(
                name=model,
                attribution=Attribution(name="OpenAI", url="https://github.com/openai/whisper"),
                installed=True,
                description=f"Whisper {model}",
                version=None,
                languages=languages,
            )
        ],
        supports_transcript_streaming=True,
        # The session's own VAD cuts utterances, but a transcription ends at audio-stop:
        # Home Assistant's VAD decides when the command is over.
        requires_external_vad=True,
    )
    return Info(asr=[program]).event()


def error_event(code: str, text: str) -> Event:
    return Error(text=text, code=code).event()


def language_code(tag: object) -> str | None:
    """``transcribe``'s language as a Whisper code (``en-US`` -> ``en``); None when not
    given. Raises ProtocolError for something that is not a language tag."""
    if tag is None or tag == "":
        return None
    if not isinstance(tag, str):
        raise ProtocolError("transcribe: language must be a language tag such as en")
    code = tag.replace("_", "-").split("-", 1)[0].lower()
    if not code.isalpha() or not 2 <= len(code) <= 3:
        raise ProtocolError(
            f"transcribe: language must be a language tag such as en or en-US; got {tag[:20]!r}"
        )
    return code


@dataclass(frozen=True)
class Started(AdapterEvent):
    """The transcription is open: ``transcript-start`` goes out."""

    language: str | None = None


@dataclass(frozen=True)
class Reply(AdapterEvent):
    """A reply to a client's request made during a transcription (``info``, ``pong``), in
    its place among the transcription's events."""

    event: Event | None = None


class TranscriptStream:
    """One transcription's session events as Wyoming events: finals stream as
    ``transcript-chunk``; ``done`` brings the whole ``transcript`` and ``transcript-stop``."""

    def __init__(self, language: str | None) -> None:
        self.language = language  # None: detected; the finals say which
        self._chunks: list[str] = []

    @property
    def text(self) -> str:
        """The transcript so far: the chunks sent, joined."""
        return "".join(self._chunks)

    def render(self, message: Outgoing) -> list[Event]:
        if isinstance(message, Started):
            return [TranscriptStart(language=message.language).event()]
        if isinstance(message, Reply):
            return [message.event] if message.event is not None else []
        if isinstance(message, FinalMessage):
            text = message.text.strip()
            if message.language is not None:
                self.language = message.language
            if not text:
                return []
            chunk = text if not self._chunks or text.startswith(_CLOSING_MARKS) else " " + text
            self._chunks.append(chunk)
            return [TranscriptChunk(text=chunk).event()]
        if isinstance(message, ErrorMessage):
            return [error_event(message.code, message.message)]
        if isinstance(message, DoneMessage):
            return [
                Transcript(text=self.text, language=self.language).event(),
                TranscriptStop().event(),
            ]
        return []  # partials, speech events, Settled: Wyoming streams only final text
