"""HTTP on the stream's port: the browser page, ``/healthz``, ``/readyz``, ``/metrics``.

websockets hands every request to ``process_request`` before any WebSocket handshake; a
``Response`` answers it there, None lets the handshake on a stream path go on. The stream
paths (the APIs of ``server.apis.registry``) are checked here too (readiness, API key, Origin, the
API's own query, room for one more stream), so a refused client gets an HTTP status
rather than a WebSocket that closes at once: a full server says 503 with ``Retry-After``,
which a balancer replays on another instance (HAProxy's ``retry-on 503``) and the clients
wait out before they try again.

The page's files are package data of ``server`` (``server/web``).
"""

from __future__ import annotations

import email.utils
import importlib.resources
import logging
import re
from dataclasses import dataclass
from http import HTTPStatus
from typing import Protocol
from urllib.parse import urlsplit

from websockets.datastructures import Headers
from websockets.http11 import Request, Response

from server.apis.registry import CALL_ROUTES, STREAM_APIS
from server.apis.twilio_media import CallRoute, TwilioConfig
from server.config import ServerConfig, StreamingConfig
from server.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from server.metrics import Metrics
from server.serve.access import api_key_offered, origin_allowed

logger = logging.getLogger("server.serve.routes")

WEB_FOLDER = "web"  # under the server package
_STATIC_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
CONTENT_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".mjs": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".json": "application/json",
    ".svg": "image/svg+xml",
    ".png": "image/png",
    ".ico": "image/x-icon",
    ".wasm": "application/wasm",
}


@dataclass(frozen=True)
class Full:
    """Why a new stream would be refused now."""

    reason: str  # whisperwire_sessions_refused_total's label: server_full (max_sessions), capacity
    message: str  # for the client: the 503's body, or the server_full error after a race


class ServerState(Protocol):
    """What the routes read from the server (``WhisperwireServer`` is the real one)."""

    @property
    def config(self) -> ServerConfig: ...

    @property
    def metrics(self) -> Metrics: ...

    @property
    def streaming(self) -> StreamingConfig: ...

    @property
    def twilio(self) -> TwilioConfig: ...

    @property
    def ready(self) -> bool: ...

    @property
    def closing(self) -> bool: ...

    @property
    def draining(self) -> bool: ...

    def full_reason(self) -> Full | None: ...

    def capacity_summary(self) -> str: ...


def response(
    status: HTTPStatus,
    body: bytes | str,
    content_type: str = "text/plain; charset=utf-8",
    headers: dict[str, str] | None = None,
) -> Response:
    """A complete response that closes the connection and is never cached."""
    data = body.encode("utf-8") if isinstance(body, str) else body
    h = Headers()
    h["Date"] = email.utils.formatdate(usegmt=True)
    h["Connection"] = "close"
    h["Content-Type"] = content_type
    h["Content-Length"] = str(len(data))
    h["Cache-Control"] = "no-store"
    h["X-Content-Type-Options"] = "nosniff"
    for name, value in (headers or {}).items():
        h[name] = value
    return Response(status.value, status.phrase, h, data)


def web_file(name: str) -> tuple[bytes, str] | None:
    """A file of the browser page (``server/web``) and its content type, or None.

    Only plain names with a known suffix are looked up, so no request reaches outside the
    page's folder.
    """
    if not _STATIC_NAME_RE.fullmatch(name) or ".." in name:
        return None
    suffix = name[name.rfind(".") :] if "." in name else ""
    content_type = CONTENT_TYPES.get(suffix)
    if content_type is None:
        return None
    try:
        resource = importlib.resources.files("server").joinpath(WEB_FOLDER).joinpath(name)
        if not resource.is_file():
            return None
        return resource.read_bytes(), content_type
    except OSError:
        return None


def process_request(server: ServerState, request: Request) -> Response | None:
    """The answer to one HTTP request, or None to go on with the stream's handshake."""
    path = urlsplit(request.path).path
    api = STREAM_APIS.get(path)
    if api is not None:
        refused = _check_stream_request(server, request, api.auth_schemes)
        if refused is not None:
            return refused
        problem = api.problem(request, server.streaming) if api.problem is not None else None
        if problem is not None:
            server.metrics.sessions_refused.inc(1, "bad_request")
            return response(HTTPStatus.BAD_REQUEST, problem + "\n")
        return _refuse_if_full(server)
    call = CALL_ROUTES.get(path)
    if call is not None:
        return _check_call_request(server, request, call)
    if path == "/healthz":
        return response(HTTPStatus.OK, "ok\n")
    if path == "/readyz":
        # The first line is the state; the second how the capacity estimate was derived.
        if not server.ready:
            return response(HTTPStatus.SERVICE_UNAVAILABLE, f"not ready: {_not_ready(server)}\n")
        capacity = server.capacity_summary() + "\n"
        full = server.full_reason()
        if full is not None:
            return response(
                HTTPStatus.SERVICE_UNAVAILABLE,
                f"not ready: full: {full.message}\n{capacity}",
                headers={"Retry-After": str(server.config.retry_after_s)},
            )
        return response(HTTPStatus.OK, f"ready\n{capacity}")
    if path == "/metrics":
        return response(HTTPStatus.OK, server.metrics.render(), METRICS_CONTENT_TYPE)
    name = "index.html" if path == "/" else path.removeprefix("/static/").lstrip("/")
    found = web_file(name)
    if found is not None:
        return response(HTTPStatus.OK, found[0], found[1])
    return response(HTTPStatus.NOT_FOUND, f"not found: {path[:100]}\n")


def _check_call_request(server: ServerState, request: Request, call: CallRoute) -> Response | None:
    """A telephony handshake: its own credential (Twilio's signature) or the API key, its
    query, and room for one more stream when it decodes audio."""
    verdict = call.authorize(request, server.twilio)
    if isinstance(verdict, tuple):
        server.metrics.sessions_refused.inc(1, "unauthorized")
        return response(HTTPStatus(verdict[0]), verdict[1] + "\n")
    refused = _check_stream_request(server, request, ("bearer",), check_key=verdict is None)
    if refused is not None:
        return refused
    problem = call.problem(request, server.streaming) if call.problem is not None else None
    if problem is not None:
        server.metrics.sessions_refused.inc(1, "bad_request")
        return response(HTTPStatus.BAD_REQUEST, problem + "\n")
    return _refuse_if_full(server) if call.stream else None


def _check_stream_request(
    server: ServerState,
    request: Request,
    auth_schemes: tuple[str, ...],
    *,
    check_key: bool = True,
) -> Response | None:
    """Refuse the handshake (HTTP status) for an unready server, a bad token or Origin."""
    config, metrics = server.config, server.metrics
    if not server.ready:
        state = _not_ready(server)
        metrics.sessions_refused.inc(1, "draining" if state == "draining" else "not_ready")
        # A 503 before the handshake is safe to replay: a balancer (HAProxy's retry-on 503)
        # sends the same request to another instance, and the client never sees it.
        return response(
            HTTPStatus.SERVICE_UNAVAILABLE,
            f"the server is not ready ({state}); retry later\n",
            headers={"Retry-After": str(config.retry_after_s)},
        )
    if (
        check_key
        and config.api_key is not None
        and not api_key_offered(request, config.api_key, schemes=auth_schemes)
    ):
        metrics.sessions_refused.inc(1, "unauthorized")
        return response(
            HTTPStatus.UNAUTHORIZED,
            "missing or wrong API key: send 'Authorization: Bearer KEY' or ?token=KEY\n",
            headers={"WWW-Authenticate": 'Bearer realm="whisperwire"'},
        )
    if not origin_allowed(request, config.allowed_origins, tls=config.tls):
        metrics.sessions_refused.inc(1, "forbidden_origin")
        return response(HTTPStatus.FORBIDDEN, "this Origin may not connect\n")
    return None


def _refuse_if_full(server: ServerState) -> Response | None:
    """503 with ``Retry-After`` before the handshake when no stream more fits: safe to replay
    elsewhere (nothing was sent), and a status every client and balancer can act on, where a
    WebSocket opened only to close with 1013 looks to a balancer like a session served."""
    full = server.full_reason()
    if full is None:
        return None
    server.metrics.sessions_refused.inc(1, full.reason)
    logger.info("refused a stream (HTTP 503): %s", full.message)
    return response(
        HTTPStatus.SERVICE_UNAVAILABLE,
        full.message + "\n",
        headers={"Retry-After": str(server.config.retry_after_s)},
    )


def _not_ready(server: ServerState) -> str:
    """Why a server that is not ready is not: what ``/readyz`` and a refused stream say."""
    if server.draining:
        return "draining"
    return "shutting down" if server.closing else "loading the model"
