"""Deepgram's live streaming API (``/v1/listen``), translated onto the v1 ``Session``.

The message names and fields are those of the ``deepgram-sdk`` package's ``listen/v1`` types.
Options come in the URL query and are checked before the handshake (``handshake_problem``:
HTTP 400 for anything we cannot honour). Audio is binary frames of raw ``linear16``, or of
G.711 ``mulaw`` / ``alaw`` (telephone audio, one byte per sample), at ``sample_rate``; text
frames are ``KeepAlive``, ``Finalize`` and ``CloseStream``.

What the server sends:

- ``Results`` with ``is_final: false`` (``interim_results=true``): our partial, the words not
  yet final; without word times (v1's partials carry none).
- ``Results`` with ``is_final: true``: our finals, with word times and confidences. The finals
  of speech that has ended (or was finalised) are held until all of it is final, then sent as
  one ``Results`` with ``speech_final: true`` (or ``from_finalize: true``): holding costs
  nothing, as that moment comes with the last decode of the utterance.
- ``SpeechStarted`` (``vad_events=true``), ``UtteranceEnd`` (``utterance_end_ms``: sent once
  the audio has run that long past the last final word with no new words: right behind the
  ``speech_final`` when the audio had run that far by then, else with the frame that takes
  it there), ``Metadata`` after ``CloseStream``, then close 1000; ``Error`` for refused input.

``endpointing`` (ms of silence before ``speech_final``) sets this stream's end-of-speech
silence, within ``END_OF_SPEECH_MS_RANGE`` (LiveKit's 25 ms is served at the floor, 200 ms);
not given, or ``false`` (which also sends no ``speech_final``), the server's own silence.

``diarize=true`` turns the stream's speaker labels on (``StreamSettings.speakers``): each word
of a final carries ``speaker`` (0, 1, ... in order of appearance) and ``speaker_confidence``.
A server started without ``--speakers`` refuses it with HTTP 400; ``false`` or absent, the
stream has no labels (and its finals never wait for them), whatever the server's default.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import unicodedata
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, urlsplit

from websockets.http11 import Request

from server.apis.adapters import PlainErrors, SessionSettings, StreamApi
from server.config import StreamingConfig
from server.core.session import Session, Settled, nearest_end_of_speech_ms
from server.decode.stream_driver import AdapterEvent, Outgoing, StreamDriver
from server.protocol.errors import ProtocolError
from server.protocol.formats import MAX_SAMPLE_RATE_HZ, MIN_SAMPLE_RATE_HZ, AudioFormat
from server.protocol.messages import (
    DoneMessage,
    ErrorMessage,
    FinalMessage,
    PartialMessage,
    SpeechEndedMessage,
    SpeechStartedMessage,
    WordInfo,
)

LISTEN_PATH = "/v1/listen"
AUTH_SCHEMES = ("token", "bearer")  # Deepgram's API keys, and its temporary tokens
MIN_UTTERANCE_END_MS = 1000  # Deepgram's own floor for utterance_end_ms
# Options whose "false" is what we do anyway; "true" would ask for something we do not have.
OFF_ONLY = (
    "detect_entities",
    "dictation",
    "measurements",
    "multichannel",
    "numerals",
    "profanity_filter",
)
# Deepgram's filler words, and Whisper's spellings of them: removed unless filler_words=true.
FILLER_WORDS = frozenset(
    {"uh", "um", "mhm", "mm-mm", "uh-uh", "uh-huh", "nuh-uh", "umm", "uhh", "hmm", "mm"}
)
QUERY_PARAMETERS = (
    "encoding",
    "sample_rate",
    "channels",
    "language",
    "interim_results",
    "punctuate",
    "endpointing",
    "utterance_end_ms",
    "vad_events",
    "smart_format",  # Whisper's text is formatted (punctuation, capitals, digits) already
    "filler_words",
    "no_delay",  # smart_format never waits for more audio here
    "mip_opt_out",  # nothing is kept for model improvement: any value is honoured
    "tag",  # usage labels: accepted, as the server keeps no usage reports
    "model",  # any name: the server's model serves it, and Metadata names it
    "token",  # our API key in the URL, as on /v1/stream
    "diarize",  # speaker labels, on servers started with --speakers
    *OFF_ONLY,
)
CHANNEL = [0, 1]  # channel index, of channel count: the one channel there is
# Deepgram's names of the raw encodings we decode, and ours (``AudioFormat.encoding``).
ENCODINGS = {"linear16": "pcm_s16le", "mulaw": "mulaw", "alaw": "alaw"}


def audio_encoding(name: str | None) -> str:
    """Our encoding for Deepgram's ``encoding`` option; ``ValueError`` lists the ones taken."""
    if name not in ENCODINGS:
        raise ValueError(
            f"encoding={(name or '')[:20]} is not supported: send raw audio with encoding="
            f"{', '.join(ENCODINGS)} and its sample_rate (containerized audio is not decoded)"
        )
    return ENCODINGS[name]


@dataclass(frozen=True)
class ListenOptions:
    """The query options of one stream, checked."""

    sample_rate_hz: int
    encoding: str = "pcm_s16le"  # ours (``AudioFormat.encoding``), from Deepgram's name
    language: str | None = "en"  # a Whisper code; None: detect
    interim_results: bool = False
    punctuate: bool = False  # also with smart_format=true, as on Deepgram
    filler_words: bool = False  # False: uh, um and the like are left out, as on Deepgram
    endpointing: bool = True  # False: never speech_final
    endpointing_ms: int | None = None  # None: not given, the server's own silence
    utterance_end_ms: int | None = None
    vad_events: bool = False
    diarize: bool = False  # words carry speaker and speaker_confidence


class ListenQuery:
    """A ``/v1/listen`` URL's query (live or pre-recorded), checked against the options an
    API takes; ``ValueError`` says what is wrong."""

    def __init__(self, target: str, allowed: Sequence[str]) -> None:
        self.values = parse_qs(urlsplit(target).query, keep_blank_values=True)
        unknown = sorted(set(self.values) - set(allowed))
        if unknown:
            raise ValueError(
                f"unsupported option(s): {', '.join(k[:40] for k in unknown[:5])}; this "
                f"server takes {', '.join(allowed)}"
            )

    def one(self, name: str) -> str | None:
        """The option's last value, or None."""
        values = self.values.get(name)
        return values[-1] if values else None

    def every(self, name: str) -> list[str]:
        """All the option's values, in order (Deepgram repeats ``keyterm``)."""
        return list(self.values.get(name, []))

    def flag(self, name: str, default: bool = False) -> bool:
        value = self.one(name)
        if value is None:
            return default
        if value not in ("true", "false"):
            raise ValueError(f"{name} must be true or false; got {value[:20]!r}")
        return value == "true"


def parse_options(path: str) -> ListenOptions:
    """The options in a ``/v1/listen`` URL. Raises ``ValueError`` saying what is wrong."""
    query = ListenQuery(path, QUERY_PARAMETERS)
    one, flag = query.one, query.flag

    for name in OFF_ONLY:
        if flag(name, False):
            raise ValueError(f"{name}=true is not available on this server")
    encoding = audio_encoding(one("encoding"))
    if one("channels") not in (None, "1"):
        raise ValueError("only channels=1 is supported")
    rate = one("sample_rate")
    if rate is None or not rate.isdigit() or len(rate) > 6:
        raise ValueError(f"sample_rate (Hz) is required with encoding={one('encoding')}")
    if not MIN_SAMPLE_RATE_HZ <= int(rate) <= MAX_SAMPLE_RATE_HZ:
        raise ValueError(f"sample_rate must be {MIN_SAMPLE_RATE_HZ} to {MAX_SAMPLE_RATE_HZ} Hz")
    language = language_code(one("language") or "en")
    endpointing = one("endpointing")
    endpointing_ms = None
    if endpointing not in (None, "false", "true"):
        if not endpointing.isdigit() or len(endpointing) > 6:
            raise ValueError(f"endpointing must be false or milliseconds; got {endpointing[:20]!r}")
        endpointing_ms = int(endpointing)
    interim = flag("interim_results", False)
    utterance_end = one("utterance_end_ms")
    utterance_end_ms = None
    if utterance_end is not None:
        if not utterance_end.isdigit() or len(utterance_end) > 6:
            raise ValueError(f"utterance_end_ms must be milliseconds; got {utterance_end[:20]!r}")
        utterance_end_ms = int(utterance_end)
        if utterance_end_ms < MIN_UTTERANCE_END_MS:
            raise ValueError(f"utterance_end_ms must be at least {MIN_UTTERANCE_END_MS}")
        if not interim:
            raise ValueError("utterance_end_ms needs interim_results=true")
    return ListenOptions(
        sample_rate_hz=int(rate),
        encoding=encoding,
        language=language,
        interim_results=interim,
        punctuate=flag("punctuate", False) or flag("smart_format", False),
        filler_words=flag("filler_words", False),
        endpointing=endpointing != "false",
        endpointing_ms=endpointing_ms,
        utterance_end_ms=utterance_end_ms,
        vad_events=flag("vad_events", False),
        diarize=flag("diarize", False),
    )


def handshake_problem(request: Request, streaming: StreamingConfig | None = None) -> str | None:
    """Why this upgrade request is refused with HTTP 400 by a server configured with
    ``streaming``, or None."""
    try:
        options = parse_options(request.path)
    except ValueError as exc:
        return str(exc)
    if options.diarize and not (streaming is not None and streaming.speakers.enabled):
        return "diarize=true is not available: this server was started without --speakers"
    return None


def language_code(tag: str) -> str | None:
    """Deepgram's BCP-47 tag (``en-US``) as a Whisper code; ``multi`` asks to detect."""
    if tag == "multi":
        return None
    code = tag.split("-", 1)[0].lower()
    if not code.isalpha() or not 2 <= len(code) <= 3:
        raise ValueError(f"language must be a language tag such as en or en-US; got {tag[:20]!r}")
    return code


@dataclass(frozen=True)
class _Finalize(AdapterEvent):
    """The client sent Finalize: the speech so far was closed for it."""


@dataclass(frozen=True)
class _UtteranceEnd(AdapterEvent):
    """The audio ran ``utterance_end_ms`` past the last final word, which ended at ``end``."""

    end: float = 0.0


class DeepgramAdapter(PlainErrors):
    """Deepgram live transcription on a ``Session``."""

    def __init__(self) -> None:
        self._settings: SessionSettings | None = None
        self._options = ListenOptions(sample_rate_hz=16_000)
        self._request_id = str(uuid.uuid4())
        self._created = datetime.datetime.now(datetime.timezone.utc)
        self._sha256 = hashlib.sha256()
        self._partial_sample = b""  # the start of a sample a frame cut, for the next frame
        self._sample_bytes = 2
        self._held: list[FinalMessage] = []  # finals of closed speech, until it is settled
        self._closed_by_vad = False  # speech ended since the last Settled
        self._closed_by_finalize = False  # Finalize since the last Settled
        self._last_word_end: float | None = None  # of the last final sent
        self._utterance_end_due: float | None = None  # last_word_end that awaits UtteranceEnd
        self._utterance_ended: float | None = None  # last_word_end that had its UtteranceEnd

    # -- opening ---------------------------------------------------------------------------
    def open_session(self, settings: SessionSettings, request: Request | None) -> Session:
        """A session in the query's format and language. Raises ProtocolError (1008)."""
        self._settings = settings
        try:
            options = parse_options(request.path if request is not None else "")
        except ValueError as exc:
            raise ProtocolError(str(exc), close_code=1008) from exc
        self._options = options
        audio_format = AudioFormat(sample_rate_hz=options.sample_rate_hz, encoding=options.encoding)
        self._sample_bytes = audio_format.bytes_per_sample
        session = Session(
            settings.session_id,
            audio_format=audio_format,
            streaming=settings.streaming,
            vad=settings.vad,
            multilingual=settings.multilingual,
            frame_voicing=settings.frame_voicing,
        )
        end_ms = options.endpointing_ms
        if end_ms is not None:
            end_ms = nearest_end_of_speech_ms(end_ms)
        try:
            session.configure(
                dataclasses.replace(
                    session.settings,
                    language=options.language,
                    end_of_speech_ms=end_ms,
                    speakers=options.diarize,
                    finals=settings.streaming.agent_finals,
                )
            )
        except ProtocolError as exc:
            raise ProtocolError(str(exc), close_code=1008) from exc
        return session

    # -- client messages -------------------------------------------------------------------
    def receive(self, frame: str | bytes, driver: StreamDriver) -> None:
        """Audio, or one of KeepAlive, Finalize and CloseStream."""
        if isinstance(frame, bytes):
            self._sha256.update(frame)
            # linear16 is a byte stream: a frame may end inside a sample, the next completes it.
            data = self._partial_sample + frame
            whole = len(data) - len(data) % self._sample_bytes
            self._partial_sample = data[whole:]
            driver.feed_audio(data[:whole])
            self._check_utterance_end(driver)
            return
        try:
            message = json.loads(frame)
        except (json.JSONDecodeError, RecursionError):
            raise ProtocolError(
                "text messages must be JSON: KeepAlive, Finalize or CloseStream"
            ) from None
        kind = message.get("type") if isinstance(message, dict) else None
        if kind == "KeepAlive":
            return  # the frame itself keeps the session from its idle timeout
        if kind == "Finalize":
            # Marked before the flush: with nothing pending, the flush settles at once, and
            # that Settled must answer this Finalize, not leave its mark on the next speech.
            driver.send(_Finalize(audio_received_s=driver.session.audio_received_s))
            driver.flush()
        elif kind == "CloseStream":
            driver.end()
        else:
            name = kind[:40] if isinstance(kind, str) else kind
            raise ProtocolError(
                f"unsupported message type {name!r}: send KeepAlive, Finalize or CloseStream"
            )

    def _check_utterance_end(self, driver: StreamDriver) -> None:
        due = self._utterance_end_due
        gap_ms = self._options.utterance_end_ms
        if due is None or gap_ms is None:
            return
        if driver.session.audio_received_s >= due + gap_ms / 1000:
            self._utterance_end_due = None
            driver.send(_UtteranceEnd(end=due, audio_received_s=driver.session.audio_received_s))

    # -- server messages -------------------------------------------------------------------
    def render(self, message: Outgoing) -> list[str]:
        """Deepgram's messages for one session message."""
        if isinstance(message, Settled):
            return self._settle(message.audio_received_s)
        if isinstance(message, _Finalize):
            self._closed_by_finalize = True
            return []
        if isinstance(message, _UtteranceEnd):
            if message.end != self._last_word_end:
                return []  # words came since; the gap is not there
            self._utterance_ended = message.end
            return [
                _dumps({"type": "UtteranceEnd", "channel": CHANNEL, "last_word_end": message.end})
            ]
        if isinstance(message, FinalMessage):
            self._utterance_end_due = None
            if self._closed_by_vad or self._closed_by_finalize:
                self._held.append(message)
                return []
            return [self._results([message], is_final=True)]
        if isinstance(message, PartialMessage):
            if not message.text or not self._options.interim_results:
                return []
            self._utterance_end_due = None
            return [self._interim(message)]
        if isinstance(message, SpeechStartedMessage):
            if not self._options.vad_events:
                return []
            return [
                _dumps({"type": "SpeechStarted", "channel": CHANNEL, "timestamp": message.start})
            ]
        if isinstance(message, SpeechEndedMessage):
            self._closed_by_vad = True
            return []
        if isinstance(message, ErrorMessage):
            return [
                _dumps({"type": "Error", "variant": message.code, "description": message.message})
            ]
        if isinstance(message, DoneMessage):
            received_s = message.audio_received_s
            return [
                *self._settle(received_s),
                *self._utterance_end_if_due(received_s),
                self._metadata(message),
            ]
        return []  # ready, and v1 messages without a Deepgram counterpart

    def _settle(self, audio_received_s: float) -> list[str]:
        """The held finals of closed speech as one ``Results`` (``speech_final``), and the
        ``UtteranceEnd`` behind it when its gap is in the audio already (``audio_received_s``,
        stream time when the speech settled)."""
        if not (self._closed_by_vad or self._closed_by_finalize or self._held):
            return []
        out = [
            self._results(
                self._held,
                is_final=True,
                speech_final=self._closed_by_vad and self._options.endpointing,
                from_finalize=self._closed_by_finalize,
            )
        ]
        # Every final word of the speech was sent before its endpoint (nothing held) still
        # has its UtteranceEnd owed: armed here unless it had one.
        if self._options.utterance_end_ms is not None and self._last_word_end not in (
            None,
            self._utterance_ended,
        ):
            self._utterance_end_due = self._last_word_end
        self._held = []
        self._closed_by_vad = self._closed_by_finalize = False
        # The final can come after the gap is in (a closing decode that waited for a lane, audio
        # sent faster than real time): the UtteranceEnd goes with it, not with a next audio
        # frame, which a client waiting for it may never send.
        return out + self._utterance_end_if_due(audio_received_s)

    def _utterance_end_if_due(self, audio_received_s: float) -> list[str]:
        due, gap_ms = self._utterance_end_due, self._options.utterance_end_ms
        if due is None or gap_ms is None or audio_received_s < due + gap_ms / 1000:
            return []
        self._utterance_end_due = None
        self._utterance_ended = due
        return [_dumps({"type": "UtteranceEnd", "channel": CHANNEL, "last_word_end": due})]

    def _results(
        self,
        finals: list[FinalMessage],
        *,
        is_final: bool,
        speech_final: bool = False,
        from_finalize: bool = False,
    ) -> str:
        words = [w for f in finals for w in f.words if self._kept(w.word)]
        punctuate = self._options.punctuate
        transcript = " ".join(text for f in finals if (text := self._text(f.text)))
        start = finals[0].start if finals else (self._last_word_end or 0.0)
        end = finals[-1].end if finals else start
        if finals:
            self._last_word_end = end
        word_objects = [
            {
                "word": plain_word(w.word) or w.word,
                "start": w.start,
                "end": w.end,
                "confidence": w.probability,
                **({"punctuated_word": w.word} if punctuate else {}),
                **_speaker_fields(w),
            }
            for w in words
        ]
        confidence = sum(w.probability for w in words) / len(words) if words else 0.0
        return self._results_json(
            start, end, transcript, confidence, word_objects, is_final, speech_final, from_finalize
        )

    def _kept(self, word: str) -> bool:
        """Whether a word is sent: filler words only with ``filler_words=true``."""
        return self._options.filler_words or plain_word(word) not in FILLER_WORDS

    def _text(self, text: str) -> str:
        """``text`` as this stream's options want it: without filler words unless asked for,
        and lower case without punctuation unless ``punctuate`` (or ``smart_format``)."""
        kept = [w for w in text.split() if self._kept(w)]
        if self._options.punctuate:
            return " ".join(kept)
        return " ".join(filter(None, map(plain_word, kept)))

    def _interim(self, partial: PartialMessage) -> str:
        text = self._text(partial.text)
        return self._results_json(partial.start, partial.end, text, 0.0, [], False, False, False)

    def _results_json(
        self,
        start: float,
        end: float,
        transcript: str,
        confidence: float,
        words: list[dict[str, Any]],
        is_final: bool,
        speech_final: bool,
        from_finalize: bool,
    ) -> str:
        return _dumps(
            {
                "type": "Results",
                "channel_index": CHANNEL,
                "duration": round(max(0.0, end - start), 3),
                "start": round(start, 3),
                "is_final": is_final,
                "speech_final": speech_final,
                "from_finalize": from_finalize,
                "channel": {
                    "alternatives": [
                        {
                            "transcript": transcript,
                            "confidence": round(confidence, 3),
                            "words": words,
                        }
                    ]
                },
                "metadata": {
                    "request_id": self._request_id,
                    "model_info": self._model_info(),
                    "model_uuid": self._model_uuid(),
                },
            }
        )

    def _metadata(self, done: DoneMessage) -> str:
        return _dumps(
            {
                "type": "Metadata",
                "transaction_key": "deprecated",
                "request_id": self._request_id,
                "sha256": self._sha256.hexdigest(),
                "created": self._created.isoformat().replace("+00:00", "Z"),
                "duration": round(done.audio_received_s, 3),
                "channels": 1,
                "models": [self._model_uuid()],
                "model_info": {self._model_uuid(): self._model_info()},
            }
        )

    def _model_info(self) -> dict[str, str]:
        return model_info(self._settings.model if self._settings is not None else "whisperwire")

    def _model_uuid(self) -> str:
        return model_uuid(self._model_info()["name"])


API = StreamApi(
    path=LISTEN_PATH,
    auth_schemes=AUTH_SCHEMES,
    adapter=DeepgramAdapter,
    problem=handshake_problem,
)


def model_info(name: str) -> dict[str, str]:
    """Deepgram's ``model_info`` entry for the server's model."""
    return {"name": name, "version": "whisperwire", "arch": "whisper"}


def model_uuid(name: str) -> str:
    """A stable id for the server's model, where Deepgram names its models by UUID."""
    return str(uuid.uuid5(uuid.NAMESPACE_URL, f"whisperwire:{name}"))


def plain_word(word: str) -> str:
    """A word as Deepgram gives it without punctuation: lower case, no punctuation around it."""
    start, end = 0, len(word)
    while start < end and unicodedata.category(word[start]).startswith("P"):
        start += 1
    while end > start and unicodedata.category(word[end - 1]).startswith("P"):
        end -= 1
    return word[start:end].strip().lower()


def _speaker_fields(word: WordInfo) -> dict[str, int | float]:
    """A word's ``speaker`` and ``speaker_confidence`` (streams with ``diarize=true``)."""
    if word.speaker is None:
        return {}
    fields: dict[str, int | float] = {"speaker": word.speaker}
    if word.speaker_confidence is not None:
        fields["speaker_confidence"] = word.speaker_confidence
    return fields


def _dumps(obj: dict[str, Any]) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
