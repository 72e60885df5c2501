"""Who may open a stream: the API key and the Origin check, made on the handshake request.

Both run before the WebSocket handshake completes, so a refused client gets an HTTP status
(401 or 403, ``routes.py``) instead of a WebSocket that closes at once.
"""

from __future__ import annotations

import hmac
from urllib.parse import parse_qs, urlsplit

from websockets.datastructures import Headers
from websockets.http11 import Request


def single_header(headers: Headers, name: str) -> str | None:
    """The value of header ``name`` when it appears exactly once, else None."""
    values = headers.get_all(name)
    return values[0] if len(values) == 1 else None


def api_key_offered(
    request: Request, api_key: str, *, schemes: tuple[str, ...] = ("bearer",)
) -> bool:
    """True when the request carries ``api_key``, as ``Authorization: SCHEME KEY`` with one
    of ``schemes`` (lower case; Deepgram's clients send ``Token``) or in the ``token`` query
    parameter."""
    expected = api_key.encode("utf-8")
    offered: list[str] = []
    auth = single_header(request.headers, "Authorization")
    if auth is not None:
        scheme, _, value = auth.partition(" ")
        if scheme.lower() in schemes:
            offered.append(value.strip())
    offered.extend(parse_qs(urlsplit(request.path).query).get("token", []))
    # compare_digest: the time taken must not tell how many leading bytes were right.
    return any(hmac.compare_digest(o.encode("utf-8"), expected) for o in offered)


def origin_allowed(request: Request, allowed_origins: tuple[str, ...], *, tls: bool) -> bool:
    """True for a request without Origin (not a browser), a listed Origin, any Origin when
    ``allowed_origins`` holds ``"*"``, and the server's own page (Origin equal to Host)."""
    if not request.headers.get_all("Origin"):
        return True
    origin = single_header(request.headers, "Origin")
    if origin is None:
        return False  # several Origin headers
    if "*" in allowed_origins or origin in allowed_origins:
        return True
    host = single_header(request.headers, "Host")
    scheme = "https" if tls else "http"
    return host is not None and origin == f"{scheme}://{host}"
