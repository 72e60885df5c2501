"""OpenAI's file transcription API: ``POST /v1/audio/transcriptions`` and
``POST /v1/audio/translations``, as the ``openai`` package's ``audio.transcriptions.create``
and ``audio.translations.create`` send them (``multipart/form-data``).

Fields: ``file`` (any format PyAV decodes), ``model`` (any name: the server's model serves
it), ``language``, ``prompt``, ``temperature`` (0: Whisper's temperature fallback, as OpenAI
does; above 0: sampling at that temperature), ``response_format`` (``json``, ``text``,
``srt``, ``vtt``, ``verbose_json``), ``timestamp_granularities[]`` (``segment``, ``word``;
with ``verbose_json``), ``stream`` (server-sent ``transcript.text.delta`` events as each 30 s
window is decoded, then ``transcript.text.done``). ``keywords[]`` (the SDK's vocabulary list)
join the prompt. Errors are OpenAI's ``{"error": {...}}``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from websockets.datastructures import Headers

from server.apis.files import (
    FileJob,
    FileRequestError,
    FileRoute,
    Finished,
    ModelFacts,
    Rendered,
)
from server.core.engine_api import DecodeOptions
from server.core.long_form import FALLBACK_TEMPERATURES, Segment
from server.protocol.multipart import FormError, FormPart, parse_form_data

TRANSCRIPTIONS_PATH = "/v1/audio/transcriptions"
TRANSLATIONS_PATH = "/v1/audio/translations"
RESPONSE_FORMATS = ("json", "text", "srt", "vtt", "verbose_json")
GRANULARITIES = ("segment", "word")
# Fields that ask for nothing we do differently: chunking is ours (30 s windows at full
# context), and a list of candidate languages is served by detection.
IGNORED_FIELDS = ("chunking_strategy", "languages[]", "languages")
FIELDS = (
    "file",
    "model",
    "language",
    "prompt",
    "temperature",
    "response_format",
    "timestamp_granularities[]",
    "timestamp_granularities",
    "stream",
    "keywords[]",
    "keywords",
    "include[]",
    *IGNORED_FIELDS,
)
SSE_CONTENT_TYPE = "text/event-stream; charset=utf-8"


def _fields(parts: list[FormPart]) -> dict[str, list[FormPart]]:
    fields: dict[str, list[FormPart]] = {}
    for part in parts:
        fields.setdefault(part.name, []).append(part)
    unknown = sorted(set(fields) - set(FIELDS))
    if unknown:
        raise FileRequestError(
            f"Unrecognized request argument supplied: {', '.join(u[:40] for u in unknown[:5])}",
            param=unknown[0][:40],
        )
    return fields


def _one(fields: dict[str, list[FormPart]], name: str) -> str | None:
    parts = fields.get(name)
    return parts[-1].text().strip() if parts else None


def _many(fields: dict[str, list[FormPart]], name: str) -> list[str]:
    return [p.text().strip() for key in (f"{name}[]", name) for p in fields.get(key, [])]


@dataclass(frozen=True)
class OpenAIFileApi:
    """Transcription (``task="transcribe"``) or translation into English."""

    task: str

    def parse(self, target: str, headers: Headers, body: bytes, model: ModelFacts) -> FileJob:
        try:
            fields = _fields(parse_form_data(headers.get("Content-Type", ""), body))
            return self._job(fields, model)
        except FormError as exc:
            raise FileRequestError(str(exc)) from exc

    def _job(self, fields: dict[str, list[FormPart]], model: ModelFacts) -> FileJob:
        files = fields.get("file")
        if not files:
            raise FileRequestError("you must provide a file", param="file")
        if not _one(fields, "model"):
            raise FileRequestError("you must provide a model parameter", param="model")
        response_format = _one(fields, "response_format") or "json"
        if response_format not in RESPONSE_FORMATS:
            raise FileRequestError(
                f"response_format must be one of {', '.join(RESPONSE_FORMATS)}; "
                f"got {response_format[:40]!r}",
                param="response_format",
            )
        granularities = _many(fields, "timestamp_granularities")
        bad = [g for g in granularities if g not in GRANULARITIES]
        if bad:
            raise FileRequestError(
                f"timestamp_granularities must be segment or word; got {bad[0][:40]!r}",
                param="timestamp_granularities",
            )
        if granularities and response_format != "verbose_json":
            raise FileRequestError(
                "timestamp_granularities needs response_format verbose_json",
                param="timestamp_granularities",
            )
        if _many(fields, "include"):
            raise FileRequestError(
                "include (token log-probabilities) is not available on this server",
                param="include",
            )
        stream = _flag(_one(fields, "stream"))
        if stream and response_format not in ("json", "text"):
            raise FileRequestError(
                "stream=true answers with transcript.text events: response_format must be "
                "json or text",
                param="stream",
            )
        language = self._language(_one(fields, "language"), model)
        temperature = _temperature(_one(fields, "temperature"))
        prompt = " ".join(
            p for p in (_one(fields, "prompt") or "", ", ".join(_many(fields, "keywords"))) if p
        )
        words = "word" in granularities
        options = DecodeOptions(language=language, task=self.task, word_timestamps=words)
        temperatures = FALLBACK_TEMPERATURES if temperature == 0 else (temperature,)
        return FileJob(
            files[-1].data,
            options,
            temperatures,
            prompt=prompt,
            stream=stream,
            response_format=response_format,
            words=words,
        )

    def _language(self, code: str | None, model: ModelFacts) -> str | None:
        if self.task == "translate" and not model.multilingual:
            raise FileRequestError(
                f"the model {model.name} is English-only and cannot translate", param="model"
            )
        if not code:
            return None if model.multilingual else "en"
        code = code.lower()
        if model.language_name(code) is None:
            raise FileRequestError(f"unknown language code {code[:20]!r}", param="language")
        if not model.multilingual and code != "en":
            raise FileRequestError(
                f"the model {model.name} is English-only; language {code!r} is not available",
                param="language",
            )
        return code

    # -- answers ---------------------------------------------------------------------------
    def render(self, job: FileJob, done: Finished) -> Rendered:
        text = done.transcript.text
        if job.response_format == "text":
            return Rendered("text/plain; charset=utf-8", (text + "\n").encode("utf-8"))
        if job.response_format == "srt":
            return Rendered("text/plain; charset=utf-8", _srt(done.transcript.segments))
        if job.response_format == "vtt":
            return Rendered("text/vtt; charset=utf-8", _vtt(done.transcript.segments))
        body: dict[str, Any] = {"text": text, "usage": _usage(done.duration_s)}
        if job.response_format == "verbose_json":
            language = done.transcript.language or "en"
            body = {
                "task": self.task,
                "language": done.model.language_name(language) or language,
                "duration": round(done.duration_s, 3),
                "text": text,
                "segments": [_segment(i, s) for i, s in enumerate(done.transcript.segments)],
                "usage": _usage(done.duration_s),
            }
            if job.words:
                body["words"] = [
                    {"word": w.word.strip(), "start": round(w.start_s, 3), "end": round(w.end_s, 3)}
                    for w in done.transcript.words
                ]
        return Rendered("application/json", json.dumps(body, ensure_ascii=False).encode("utf-8"))

    def render_error(self, status: HTTPStatus, message: str, param: str | None) -> Rendered:
        kind = "invalid_request_error" if status < 500 else "server_error"
        body = {"error": {"message": message, "type": kind, "param": param, "code": None}}
        return Rendered("application/json", json.dumps(body).encode("utf-8"))

    def render_delta(self, segments: list[Segment]) -> bytes:
        text = "".join(s.span.text for s in segments)
        return _event({"type": "transcript.text.delta", "delta": text, "logprobs": None})

    def render_done(self, job: FileJob, done: Finished) -> bytes:
        return _event(
            {
                "type": "transcript.text.done",
                "text": done.transcript.text,
                "logprobs": None,
                "usage": _usage(done.duration_s),
            }
        )


def _flag(value: str | None) -> bool:
    if value in (None, "", "false", "False", "0"):
        return False
    if value in ("true", "True", "1"):
        return True
    raise FileRequestError(f"stream must be true or false; got {value[:20]!r}", param="stream")


def _temperature(value: str | None) -> float:
    if not value:
        return 0.0
    try:
        t = float(value)
    except ValueError:
        t = math.nan
    if not 0.0 <= t <= 1.0:
        raise FileRequestError(
            f"temperature must be a number from 0 to 1; got {value[:20]!r}", param="temperature"
        )
    return t


def _usage(duration_s: float) -> dict[str, Any]:
    return {"type": "duration", "seconds": math.ceil(duration_s)}


def _segment(index: int, s: Segment) -> dict[str, Any]:
    return {
        "id": index,
        "seek": round(s.seek_s * 100),  # in mel frames, as Whisper counts
        "start": round(s.span.start_s, 3),
        "end": round(s.span.end_s, 3),
        "text": s.span.text,
        "tokens": list(s.span.tokens),
        "temperature": s.temperature,
        "avg_logprob": round(s.avg_logprob, 4),
        "compression_ratio": round(s.compression_ratio, 4),
        "no_speech_prob": round(s.no_speech_prob, 4),
    }


def _clock(seconds: float, decimal: str) -> str:
    ms = max(0, round(seconds * 1000))
    hours, ms = divmod(ms, 3_600_000)
    minutes, ms = divmod(ms, 60_000)
    secs, ms = divmod(ms, 1000)
    return f"{hours:02d}:{minutes:02d}:{secs:02d}{decimal}{ms:03d}"


def _srt(segments: tuple[Segment, ...]) -> bytes:
    cues = [
        f"{i}\n{_clock(s.span.start_s, ',')} --> {_clock(s.span.end_s, ',')}\n"
        f"{s.span.text.strip()}\n"
        for i, s in enumerate(segments, start=1)
    ]
    return "\n".join(cues).encode("utf-8")


def _vtt(segments: tuple[Segment, ...]) -> bytes:
    cues = [
        f"{_clock(s.span.start_s, '.')} --> {_clock(s.span.end_s, '.')}\n{s.span.text.strip()}\n"
        for s in segments
    ]
    return ("WEBVTT\n\n" + "\n".join(cues)).encode("utf-8")


def _event(data: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n".encode()


AUTH_SCHEMES = ("bearer",)
TRANSCRIPTIONS = FileRoute(TRANSCRIPTIONS_PATH, AUTH_SCHEMES, OpenAIFileApi("transcribe"))
TRANSLATIONS = FileRoute(TRANSLATIONS_PATH, AUTH_SCHEMES, OpenAIFileApi("translate"))
