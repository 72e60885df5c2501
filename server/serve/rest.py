"""The file APIs' I/O (``server.apis.registry.FILE_ROUTES``): a POSTed recording checked,
decoded, transcribed on the decode lanes after the live streams, and answered.

Checked before the body is read (so a refused upload costs no bandwidth): the path and
method, readiness (503 with ``Retry-After``, as for streams), the API key (each API's
``Authorization`` schemes, or ``?token=``), the Origin, and how many uploads are being decoded
(``ServerConfig.max_file_requests``; more get 503 with ``Retry-After``). The body may be
``ServerConfig.max_upload_bytes`` (413 beyond). Every error is in the API's own shape.

The audio is decoded by PyAV in a worker thread, then the long-form loop runs one 30 s window
per lane call (``server.decode.file_transcription``): live streams' windows go first. A client
that goes away cancels its transcription at the next window.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import uuid
from collections.abc import Mapping
from dataclasses import replace
from http import HTTPStatus
from typing import Protocol

import numpy as np
import numpy.typing as npt
from websockets.http11 import Response

from server.apis.files import FileJob, FileRequestError, FileRoute, Finished, ModelFacts
from server.apis.registry import FILE_ROUTES
from server.config import ServerConfig, StreamingConfig, VadConfig
from server.core.long_form import LongForm, join_transcripts, split_recording
from server.core.speakers import SpeakerLabel
from server.decode.file_speakers import label_words_in_thread
from server.decode.file_transcription import transcribe_parts
from server.decode.pipeline import Pipeline
from server.metrics import Metrics
from server.protocol.audio import PcmDecoder
from server.protocol.errors import AudioFormatError
from server.protocol.formats import SAMPLE_RATE_HZ, AudioFormat
from server.protocol.media import MediaError, decode_media
from server.serve.access import api_key_offered, origin_allowed
from server.serve.http_front import HttpRequest, Reply
from server.serve.routes import response

logger = logging.getLogger("server.serve.rest")

Float32Array = npt.NDArray[np.float32]

# A form around the file (field names, boundaries, other fields) adds a little to the body.
FORM_OVERHEAD_BYTES = 64 * 1024
RETRY_AFTER_S = 5
MAX_FILE_DURATION_S = 4 * 3600.0
MIN_PART_S = 25.0  # an upload is cut into parts no shorter than this
SSE_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8", "X-Accel-Buffering": "no"}


class RestServer(Protocol):
    """What the file APIs read from the server (``WhisperwireServer`` is the real one)."""

    @property
    def config(self) -> ServerConfig: ...

    @property
    def metrics(self) -> Metrics: ...

    @property
    def pipeline(self) -> Pipeline: ...

    @property
    def streaming(self) -> StreamingConfig: ...

    @property
    def vad(self) -> VadConfig: ...

    @property
    def ready(self) -> bool: ...


def language_name(code: str) -> str | None:
    """Whisper's name of a language code (``en`` -> ``english``); None for no such code."""
    # The tokenizer's table, read when the first upload is checked: the app imports no engine.
    from server.engine.lightning import module

    names: Mapping[str, str] = module("tokenizer").LANGUAGES
    return names.get(code)


class RestApp:
    """Serves ``FILE_ROUTES`` for the HTTP front (``http_front.HttpApp``)."""

    def __init__(self, server: RestServer, routes: Mapping[str, FileRoute] = FILE_ROUTES) -> None:
        self._server = server
        self._routes = routes
        self._running: set[asyncio.Task[None]] = set()

    @property
    def running(self) -> int:
        """Uploads being answered now."""
        return len(self._running)

    async def wait_finished(self, timeout_s: float) -> None:
        """Wait for the uploads being answered, up to ``timeout_s``; then cancel the rest."""
        pending = set(self._running)
        if not pending:
            return
        _, late = await asyncio.wait(pending, timeout=timeout_s)
        for task in late:
            task.cancel()
        if late:
            logger.warning("%d upload(s) cancelled at shutdown", len(late))
            await asyncio.wait(late)

    # -- before the body -------------------------------------------------------------------
    def check(self, request: HttpRequest) -> Response | None:
        route = self._routes.get(request.path)
        if route is None:
            return response(HTTPStatus.NOT_FOUND, f"not found: {request.path[:100]}\n")
        config = self._server.config
        if request.method == "OPTIONS":
            return self._preflight(request)
        if request.method != "POST":
            return self._error(
                route,
                request,
                HTTPStatus.METHOD_NOT_ALLOWED,
                f"{request.path} takes POST",
                headers={"Allow": "POST, OPTIONS"},
            )
        if not self._server.ready:
            return self._error(
                route,
                request,
                HTTPStatus.SERVICE_UNAVAILABLE,
                "the server is not ready; retry later",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        handshake = request.as_handshake()
        if config.api_key is not None and not api_key_offered(
            handshake, config.api_key, schemes=route.auth_schemes
        ):
            return self._error(
                route,
                request,
                HTTPStatus.UNAUTHORIZED,
                "missing or wrong API key",
                headers={"WWW-Authenticate": 'Bearer realm="whisperwire"'},
            )
        if not origin_allowed(handshake, config.allowed_origins, tls=config.tls):
            return self._error(route, request, HTTPStatus.FORBIDDEN, "this Origin may not connect")
        if self.running >= config.max_file_requests:
            return self._error(
                route,
                request,
                HTTPStatus.SERVICE_UNAVAILABLE,
                f"the server is decoding {self.running} upload(s), its limit; retry later",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        return None

    def max_body_bytes(self, request: HttpRequest) -> int:
        return self._server.config.max_upload_bytes + FORM_OVERHEAD_BYTES

    # -- with the body ---------------------------------------------------------------------
    async def handle(self, request: HttpRequest, reply: Reply) -> None:
        route = self._routes[request.path]
        task = asyncio.current_task()
        assert task is not None
        self._running.add(task)
        try:
            await self._answer(route, request, reply)
        finally:
            self._running.discard(task)

    async def _answer(self, route: FileRoute, request: HttpRequest, reply: Reply) -> None:
        pipeline = self._server.pipeline
        engine = pipeline.engine
        model = ModelFacts(
            engine.name,
            engine.dims.is_multilingual,
            language_name,
            speakers=pipeline.speakers is not None,
        )
        request_id = str(uuid.uuid4())
        started = time.monotonic()
        try:
            job = route.api.parse(request.target, request.headers, request.body, model)
            audio = await asyncio.get_running_loop().run_in_executor(
                None, functools.partial(_audio, job)
            )
        except FileRequestError as exc:
            await reply.send(self._error(route, request, exc.status, str(exc), param=exc.param))
            return
        except MediaError as exc:
            await reply.send(
                self._error(route, request, HTTPStatus.BAD_REQUEST, str(exc), param="file")
            )
            return
        prompt = engine.encode_text(" " + job.prompt.strip()) if job.prompt.strip() else ()
        # The server's beam size, for the windows decoded at temperature 0 (sampled ones,
        # in the fallback or at the client's temperature, take best_of candidates instead).
        options = replace(job.options, beam_size=self._server.config.file_beam_size)
        recording = LongForm(audio, options, job.temperatures, prompt=prompt)
        # Cut at pauses into parts decoded side by side, one per lane the streams leave free,
        # none shorter than MIN_PART_S (a 60 s upload on two idle lanes: two 30 s windows at
        # once); the text before a cut is not the next part's context.
        count = min(pipeline.background_lanes, int(recording.duration_s // MIN_PART_S))
        parts = split_recording(recording, max(1, count))
        log = logging.LoggerAdapter(logger, {"request_id": request_id})
        log.info("%s: %.1f s of audio", request.path, recording.duration_s)
        if job.stream:
            await reply.start(HTTPStatus.OK, SSE_HEADERS | self._cors(request))
            async for segments in transcribe_parts(pipeline, parts):
                if segments:
                    await reply.chunk(route.api.render_delta(segments))
        else:
            async for _ in transcribe_parts(pipeline, parts):
                pass
        transcript = join_transcripts([part.transcript() for part in parts])
        labels: tuple[SpeakerLabel | None, ...] = ()
        if job.speakers and pipeline.speakers is not None:
            # The voices of the speech under the words, in a worker thread (file_speakers).
            labels = tuple(
                await label_words_in_thread(
                    audio,
                    transcript.words,
                    pipeline.speakers,
                    vad=self._server.vad,
                    config=self._server.streaming.speakers,
                )
            )
        done = Finished(transcript, recording.duration_s, request_id, model, speakers=labels)
        log.info(
            "%s: %.1f s of audio transcribed in %.2f s",
            request.path,
            recording.duration_s,
            time.monotonic() - started,
        )
        self._server.metrics.file_audio_s.inc(recording.duration_s)
        self._server.metrics.file_requests.inc(1, "200")
        if job.stream:
            await reply.chunk(route.api.render_done(job, done))
            await reply.finish()
            return
        rendered = route.api.render(job, done)
        await reply.send(
            response(
                HTTPStatus.OK,
                rendered.body,
                rendered.content_type,
                headers={"X-Request-Id": request_id, **self._cors(request)},
            )
        )

    def _error(
        self,
        route: FileRoute,
        request: HttpRequest,
        status: HTTPStatus,
        message: str,
        *,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> Response:
        self._server.metrics.file_requests.inc(1, str(status.value))
        rendered = route.api.render_error(status, message, param)
        headers = (headers or {}) | self._cors(request)
        return response(status, rendered.body, rendered.content_type, headers=headers)

    def _cors(self, request: HttpRequest) -> dict[str, str]:
        """CORS headers for a page of an allowed Origin (``--allowed-origin``) that uploads
        from the browser; none for other clients, which send no Origin."""
        origin = request.headers.get("Origin")
        config = self._server.config
        if origin is None or not origin_allowed(
            request.as_handshake(), config.allowed_origins, tls=config.tls
        ):
            return {}
        return {
            "Access-Control-Allow-Origin": origin,
            "Access-Control-Expose-Headers": "Retry-After, X-Request-Id",
            "Vary": "Origin",
        }

    def _preflight(self, request: HttpRequest) -> Response:
        """The answer to a browser's CORS preflight: which requests may follow, or 403."""
        cors = self._cors(request)
        if not cors:
            return response(HTTPStatus.FORBIDDEN, "this Origin may not upload here\n")
        allow = {
            "Access-Control-Allow-Methods": "POST",
            "Access-Control-Allow-Headers": "Authorization, Content-Type",
            "Access-Control-Max-Age": "600",
        }
        return response(HTTPStatus.NO_CONTENT, b"", headers=cors | allow)


def _audio(job: FileJob) -> Float32Array:
    """The job's audio as 16 kHz mono float32 (runs in a worker thread)."""
    if job.pcm_rate_hz is None:
        return decode_media(job.media, max_duration_s=MAX_FILE_DURATION_S)
    fmt = AudioFormat(sample_rate_hz=job.pcm_rate_hz, encoding=job.pcm_encoding)
    if len(job.media) % fmt.bytes_per_sample:
        raise MediaError("raw linear16 audio must have an even number of bytes")
    try:
        pcm = PcmDecoder(fmt, max_frame_bytes=max(2, len(job.media)))
        samples = pcm.decode(job.media)
        tail = pcm.flush()
    except AudioFormatError as exc:
        raise MediaError(str(exc)) from exc
    audio = np.concatenate([samples, tail]) if tail.size else samples
    if audio.shape[0] == 0:
        raise MediaError("the request holds no audio samples")
    if audio.shape[0] > MAX_FILE_DURATION_S * SAMPLE_RATE_HZ:
        raise MediaError(f"the recording is longer than {MAX_FILE_DURATION_S:.0f} s")
    return audio
