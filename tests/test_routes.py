"""HTTP answers before the handshake: the page's files, probes, metrics and stream refusals,
against a server state double (no socket, no engine)."""

from __future__ import annotations

from dataclasses import dataclass, field
from http import HTTPStatus

import pytest
from websockets.datastructures import Headers
from websockets.http11 import Request, Response

from bench.http_probe import metric_value
from server.apis.v1_stream import STREAM_PATH
from server.config import ServerConfig, StreamingConfig
from server.metrics import Metrics
from server.serve.routes import Full, process_request, response, web_file


@dataclass
class StubServerState:
    """A ``ServerState`` whose readiness and fullness the test sets."""

    config: ServerConfig = field(default_factory=ServerConfig)
    metrics: Metrics = field(default_factory=Metrics)
    streaming: StreamingConfig = field(default_factory=StreamingConfig)
    ready: bool = True
    closing: bool = False
    draining: bool = False
    full: Full | None = None
    summary: str = "capacity 4 real-time stream(s) on 2 lane(s); 0 open"

    def full_reason(self) -> Full | None:
        return self.full

    def capacity_summary(self) -> str:
        return self.summary


def get(state: StubServerState, path: str, **headers: str) -> Response:
    h = Headers()
    h["Host"] = "127.0.0.1:8765"
    for name, value in headers.items():
        h[name] = value
    answer = process_request(state, Request(path, h))
    assert answer is not None
    return answer


def test_responses_close_and_are_never_cached() -> None:
    answer = response(HTTPStatus.OK, "hi\n", headers={"Retry-After": "5"})
    assert (answer.status_code, answer.body) == (200, b"hi\n")
    assert answer.headers["Connection"] == "close"
    assert answer.headers["Cache-Control"] == "no-store"
    assert answer.headers["Content-Length"] == "3"
    assert answer.headers["Retry-After"] == "5"


def test_the_page_ships_with_the_server() -> None:
    for name, kind in (
        ("index.html", "text/html"),
        ("app.js", "text/javascript"),
        ("audio-worklet.js", "text/javascript"),
    ):
        found = web_file(name)
        assert found is not None, name
        assert found[1].startswith(kind) and found[0], name


@pytest.mark.parametrize(
    "name", ["../app.py", "..", ".hidden.js", "routes.py", "nosuch.js", "web/app.js", ""]
)
def test_only_page_files_are_served(name: str) -> None:
    assert web_file(name) is None


def test_probes_and_page() -> None:
    state = StubServerState()
    assert get(state, "/healthz").body == b"ok\n"
    ready = get(state, "/readyz")
    assert (ready.status_code, ready.body) == (200, f"ready\n{state.summary}\n".encode())
    page = get(state, "/")
    assert page.headers["Content-Type"] == "text/html; charset=utf-8"
    assert get(state, "/static/app.js").body == get(state, "/app.js").body
    assert get(state, "/nope").status_code == 404
    metrics = get(state, "/metrics")
    assert metrics.headers["Content-Type"].startswith("text/plain; version=0.0.4")


def test_readyz_says_why_it_is_not_ready() -> None:
    assert get(StubServerState(ready=False), "/readyz").body == b"not ready: loading the model\n"
    closing = StubServerState(ready=False, closing=True)
    assert get(closing, "/readyz").body == b"not ready: shutting down\n"
    state = StubServerState(full=Full("capacity", "at the limit"))
    full = get(state, "/readyz")
    assert full.status_code == 503 and full.headers["Retry-After"] == "5"
    assert full.body == f"not ready: full: at the limit\n{state.summary}\n".encode()
    draining = get(StubServerState(ready=False, draining=True), "/readyz")
    assert (draining.status_code, draining.body) == (503, b"not ready: draining\n")


def test_a_draining_server_refuses_new_streams_with_a_503_a_balancer_may_replay() -> None:
    state = StubServerState(ready=False, draining=True)
    refused = get(state, STREAM_PATH)
    assert (refused.status_code, refused.headers["Retry-After"]) == (503, "5")
    assert b"draining" in refused.body
    page = state.metrics.render()
    name = "whisperwire_sessions_refused_total"
    assert metric_value(page, f'{name}{{reason="draining"}}') == 1
    assert metric_value(page, f'{name}{{reason="not_ready"}}') == 0


@pytest.mark.parametrize("reason", ["capacity", "server_full"])
def test_a_full_server_refuses_the_handshake_with_503_and_retry_after(reason: str) -> None:
    state = StubServerState(
        config=ServerConfig(retry_after_s=7), full=Full(reason, "the server carries 2")
    )
    refused = get(state, STREAM_PATH)
    assert (refused.status_code, refused.headers["Retry-After"]) == (503, "7")
    assert refused.body == b"the server carries 2\n"
    name = "whisperwire_sessions_refused_total"
    assert metric_value(state.metrics.render(), f'{name}{{reason="{reason}"}}') == 1


def test_a_bad_key_or_query_is_told_so_before_it_is_told_to_wait() -> None:
    # A 401 or 400 is final; a 503 would have the client retry a request that cannot pass.
    full = Full("capacity", "full")
    state = StubServerState(config=ServerConfig(api_key="s3cret"), full=full)
    assert get(state, STREAM_PATH).status_code == 401
    bad_query = get(state, "/v1/listen?encoding=nonsense", Authorization="Token s3cret")
    assert bad_query.status_code == 400


def test_the_stream_handshake_goes_on_when_nothing_refuses_it() -> None:
    assert process_request(StubServerState(), Request(STREAM_PATH, Headers())) is None


def test_stream_refusals_are_http_statuses_and_counted() -> None:
    state = StubServerState(
        config=ServerConfig(api_key="s3cret", allowed_origins=("https://app.example",)),
        ready=False,
    )
    refused = get(state, STREAM_PATH)
    assert (refused.status_code, refused.headers["Retry-After"]) == (503, "5")
    state.ready = True
    refused = get(state, STREAM_PATH)
    assert refused.status_code == 401 and "Bearer" in refused.headers["WWW-Authenticate"]
    refused = get(state, STREAM_PATH, Authorization="Bearer s3cret", Origin="https://evil.example")
    assert refused.status_code == 403
    h = Headers()
    h["Authorization"] = "Bearer s3cret"
    h["Origin"] = "https://app.example"
    assert process_request(state, Request(STREAM_PATH + "?x=1", h)) is None
    page = state.metrics.render()
    name = "whisperwire_sessions_refused_total"
    for reason in ("not_ready", "unauthorized", "forbidden_origin"):
        assert metric_value(page, f'{name}{{reason="{reason}"}}') == 1, reason
