"""Deepgram's pre-recorded API: ``POST /v1/listen`` with the recording as the body, as the
``deepgram-sdk``'s ``listen.v1.media.transcribe_file`` and LiveKit's Deepgram plugin
(``recognize``) send it.

The body is a file in any container PyAV reads (``Content-Type: audio/wav``, ``audio/mpeg``,
...), or raw audio with ``encoding=linear16`` (16-bit PCM), ``mulaw`` or ``alaw`` (G.711,
telephone audio) and ``sample_rate=N``. A JSON body asking us to
fetch a ``url`` is refused: the server fetches nothing. The answer is Deepgram's: ``metadata``
and ``results.channels[0].alternatives[0]`` with ``transcript``, ``confidence`` and ``words``
(times, confidence, ``punctuated_word`` with ``punctuate`` or ``smart_format``), plus
``results.utterances`` with ``utterances=true``. ``keywords`` and ``keyterm`` become Whisper
prompt vocabulary. ``diarize=true`` (on a server started with ``--speakers``; 400 without)
gives each word ``speaker`` and ``speaker_confidence``, and each utterance the ``speaker`` of
most of its words (``server.core.recording_speakers``). Options that would change the result
in a way we cannot deliver (``redact``, summaries) are refused with 400.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import uuid
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from websockets.datastructures import Headers

from server.apis.deepgram_live import (
    ENCODINGS as RAW_ENCODINGS,
)
from server.apis.deepgram_live import (
    FILLER_WORDS,
    LISTEN_PATH,
    ListenQuery,
    audio_encoding,
    language_code,
    model_info,
    model_uuid,
    plain_word,
)
from server.apis.files import (
    FileJob,
    FileRequestError,
    FileRoute,
    Finished,
    ModelFacts,
    Rendered,
)
from server.core.engine_api import DecodeOptions, WordTiming
from server.core.long_form import FALLBACK_TEMPERATURES, Segment
from server.core.speakers import SpeakerLabel
from server.protocol.formats import MAX_SAMPLE_RATE_HZ, MIN_SAMPLE_RATE_HZ

AUTH_SCHEMES = ("token", "bearer")
# Options whose "false" is what we do anyway; "true" asks for what we do not have.
OFF_ONLY = (
    "multichannel",
    "numerals",
    "profanity_filter",
    "paragraphs",
    "summarize",
    "topics",
    "intents",
    "sentiment",
    "detect_entities",
    "dictation",
    "measurements",
)
QUERY_PARAMETERS = (
    "model",
    "language",
    "detect_language",
    "punctuate",
    "smart_format",  # Whisper's text is formatted (punctuation, capitals, digits) already
    "filler_words",
    "utterances",
    "utt_split",  # utterances follow Whisper's segments
    "keywords",
    "keyterm",
    "encoding",
    "sample_rate",
    "channels",
    "mip_opt_out",  # nothing is kept: any value is honoured
    "tag",
    "version",  # "latest": the server has one version of its model
    "extra",  # key:value pairs echoed in the metadata, as Deepgram does
    "token",
    "redact",  # only "false"
    "diarize",  # speaker labels, on servers started with --speakers
    *OFF_ONLY,
)


@dataclass(frozen=True)
class ListenJob(FileJob):
    """A pre-recorded request's job, with how Deepgram's answer is to be written."""

    punctuate: bool = False
    filler_words: bool = False
    utterances: bool = False
    detect_language: bool = False
    sha256: str = ""
    extra: tuple[tuple[str, str], ...] = ()


class DeepgramFileApi:
    def parse(self, target: str, headers: Headers, body: bytes, model: ModelFacts) -> FileJob:
        try:
            return self._job(ListenQuery(target, QUERY_PARAMETERS), headers, body, model)
        except ValueError as exc:
            raise FileRequestError(str(exc)) from exc

    def _job(
        self, query: ListenQuery, headers: Headers, body: bytes, model: ModelFacts
    ) -> ListenJob:
        one, flag = query.one, query.flag
        for name in OFF_ONLY:
            if flag(name):
                raise FileRequestError(f"{name}=true is not available on this server")
        diarize = flag("diarize")
        if diarize and not model.speakers:
            raise FileRequestError(
                "diarize=true is not available: this server was started without --speakers"
            )
        if one("redact") not in (None, "false"):
            raise FileRequestError("redact is not available on this server")
        if one("channels") not in (None, "1"):
            raise FileRequestError("only channels=1 is supported")
        if headers.get("Content-Type", "").split(";")[0].strip() == "application/json":
            raise FileRequestError(
                "this server does not fetch remote URLs: send the audio itself as the body"
            )
        if not body:
            raise FileRequestError("the request has no audio in its body")
        encoding = one("encoding")
        pcm_rate_hz = self._pcm_rate(encoding, one("sample_rate"))
        detect = flag("detect_language")
        language = self._language(one("language"), detect, model)
        # keywords carry an optional ":intensifier"; the words themselves are the vocabulary.
        vocabulary = [k.rsplit(":", 1)[0] for k in query.every("keywords") if k]
        vocabulary += [k for k in query.every("keyterm") if k]
        return ListenJob(
            body,
            DecodeOptions(language=language, word_timestamps=True),
            FALLBACK_TEMPERATURES,
            prompt=", ".join(vocabulary),
            pcm_rate_hz=pcm_rate_hz,
            pcm_encoding="pcm_s16le" if encoding is None else audio_encoding(encoding),
            words=True,
            punctuate=flag("punctuate") or flag("smart_format"),
            filler_words=flag("filler_words"),
            utterances=flag("utterances"),
            detect_language=detect,
            speakers=diarize,
            sha256=hashlib.sha256(body).hexdigest(),
            extra=tuple(_pair(e) for e in query.every("extra")),
        )

    @staticmethod
    def _pcm_rate(encoding: str | None, rate: str | None) -> int | None:
        if encoding is None:
            return None  # containerised: the file says what it holds
        if encoding not in RAW_ENCODINGS:
            raise FileRequestError(
                f"encoding={encoding[:20]} is not supported: send a containerised file "
                "(wav, mp3, ogg, ...) without encoding, or raw audio with encoding="
                f"{', '.join(RAW_ENCODINGS)} and its sample_rate"
            )
        if rate is None or not rate.isdigit() or len(rate) > 6:
            raise FileRequestError(f"sample_rate (Hz) is required with encoding={encoding[:20]}")
        if not MIN_SAMPLE_RATE_HZ <= int(rate) <= MAX_SAMPLE_RATE_HZ:
            raise FileRequestError(
                f"sample_rate must be {MIN_SAMPLE_RATE_HZ} to {MAX_SAMPLE_RATE_HZ} Hz"
            )
        return int(rate)

    @staticmethod
    def _language(tag: str | None, detect: bool, model: ModelFacts) -> str | None:
        if not model.multilingual:
            if tag is not None and not detect and tag.split("-")[0].lower() != "en":
                raise FileRequestError(
                    f"the model {model.name} is English-only; language {tag[:20]!r} is "
                    "not available"
                )
            return "en"
        if detect or tag is None:
            return None
        try:
            code = language_code(tag)
        except ValueError as exc:
            raise FileRequestError(str(exc)) from exc
        if code is not None and model.language_name(code) is None:
            raise FileRequestError(f"unknown language {tag[:20]!r}")
        return code

    # -- answers ---------------------------------------------------------------------------
    def render(self, job: FileJob, done: Finished) -> Rendered:
        assert isinstance(job, ListenJob)
        transcript = done.transcript
        labels = done.speakers or (None,) * len(transcript.words)
        words = [
            _Word(w, label)
            for w, label in zip(transcript.words, labels, strict=True)
            if job.filler_words or _kept(w)
        ]
        channel: dict[str, Any] = {"alternatives": [_alternative(job, words)]}
        if job.detect_language:
            channel["detected_language"] = transcript.language or "en"
            channel["language_confidence"] = 1.0 if not done.model.multilingual else None
        results: dict[str, Any] = {"channels": [channel]}
        if job.utterances:
            results["utterances"] = [
                u for s in transcript.segments for u in _utterances(job, s, words, done.request_id)
            ]
        uid = model_uuid(done.model.name)
        body = {
            "metadata": {
                "transaction_key": "deprecated",
                "request_id": done.request_id,
                "sha256": job.sha256,
                "created": datetime.datetime.now(datetime.timezone.utc)
                .isoformat()
                .replace("+00:00", "Z"),
                "duration": round(done.duration_s, 3),
                "channels": 1,
                "models": [uid],
                "model_info": {uid: model_info(done.model.name)},
                **({"extra": dict(job.extra)} if job.extra else {}),
            },
            "results": results,
        }
        return Rendered("application/json", json.dumps(body, ensure_ascii=False).encode("utf-8"))

    def render_error(self, status: HTTPStatus, message: str, param: str | None) -> Rendered:
        body = {"err_code": status.phrase, "err_msg": message, "request_id": str(uuid.uuid4())}
        return Rendered("application/json", json.dumps(body).encode("utf-8"))

    def render_delta(self, segments: list[Segment]) -> bytes:
        raise NotImplementedError("Deepgram's pre-recorded API does not stream")

    def render_done(self, job: FileJob, done: Finished) -> bytes:
        raise NotImplementedError("Deepgram's pre-recorded API does not stream")


@dataclass(frozen=True)
class _Word:
    """A word of the transcript and, with ``diarize=true``, its speaker."""

    timing: WordTiming
    speaker: SpeakerLabel | None = None


def _pair(extra: str) -> tuple[str, str]:
    key, sep, value = extra.partition(":")
    if not sep or not key:
        raise FileRequestError(f"extra must be key:value; got {extra[:40]!r}")
    return key, value


def _kept(word: WordTiming) -> bool:
    return plain_word(word.word) not in FILLER_WORDS


def _alternative(job: ListenJob, words: list[_Word]) -> dict[str, Any]:
    objects = [
        {
            "word": plain_word(w.timing.word) or w.timing.word.strip(),
            "start": round(w.timing.start_s, 3),
            "end": round(w.timing.end_s, 3),
            "confidence": round(w.timing.probability, 4),
            **({"punctuated_word": w.timing.word.strip()} if job.punctuate else {}),
            **(
                {"speaker": w.speaker.speaker, "speaker_confidence": round(w.speaker.confidence, 4)}
                if job.speakers and w.speaker is not None
                else {}
            ),
        }
        for w in words
    ]
    if job.punctuate:
        text = " ".join(w.timing.word.strip() for w in words)
    else:
        text = " ".join(filter(None, (plain_word(w.timing.word) for w in words)))
    confidence = sum(w.timing.probability for w in words) / len(words) if words else 0.0
    return {"transcript": text, "confidence": round(confidence, 4), "words": objects}


def _utterances(
    job: ListenJob, segment: Segment, words: list[_Word], request_id: str
) -> list[dict[str, Any]]:
    """The utterances of one Whisper segment: the segment, or with ``diarize=true`` one per
    run of its words with the same speaker (Deepgram starts an utterance where the speaker
    changes)."""
    span = segment.span
    inside = [w for w in words if span.start_s - 0.01 <= w.timing.start_s < span.end_s]
    runs: list[list[_Word]] = [inside]
    if job.speakers and inside:
        runs = [[inside[0]]]
        for w in inside[1:]:
            if _speaker_of(w) == _speaker_of(runs[-1][-1]):
                runs[-1].append(w)
            else:
                runs.append([w])
    out = []
    for k, run in enumerate(runs):
        start = span.start_s if k == 0 else run[0].timing.start_s
        end = span.end_s if k == len(runs) - 1 else run[-1].timing.end_s
        alternative = _alternative(job, run)
        utterance: dict[str, Any] = {
            "start": round(start, 3),
            "end": round(end, 3),
            "confidence": alternative["confidence"],
            "channel": 0,
            "transcript": alternative["transcript"],
            "words": alternative["words"],
            "id": str(uuid.uuid5(uuid.NAMESPACE_URL, f"{request_id}:{start:.3f}")),
        }
        if job.speakers:
            utterance["speaker"] = _speaker_of(run[0]) if run else None
        out.append(utterance)
    return out


def _speaker_of(word: _Word) -> int | None:
    return word.speaker.speaker if word.speaker is not None else None


PRERECORDED = FileRoute(LISTEN_PATH, AUTH_SCHEMES, DeepgramFileApi())
