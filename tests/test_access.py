"""The API key and Origin checks on handshake requests, without a server."""

from __future__ import annotations

from websockets.datastructures import Headers
from websockets.http11 import Request

from server.serve.access import api_key_offered, origin_allowed, single_header

OWN_HOST = "127.0.0.1:8765"


def request(path: str = "/v1/stream", **headers: str | list[str]) -> Request:
    h = Headers()
    h["Host"] = OWN_HOST
    for name, value in headers.items():
        for one in [value] if isinstance(value, str) else value:
            h[name] = one
    return Request(path, h)


def test_single_header_is_none_when_absent_or_repeated() -> None:
    assert single_header(request(Origin="https://a.example").headers, "Origin") == (
        "https://a.example"
    )
    assert single_header(request().headers, "Origin") is None
    assert single_header(request(Origin=["https://a", "https://b"]).headers, "Origin") is None


def test_the_api_key_is_taken_from_a_bearer_header_or_the_token_query() -> None:
    assert api_key_offered(request(Authorization="Bearer s3cret"), "s3cret")
    assert api_key_offered(request(Authorization="bearer  s3cret "), "s3cret")
    assert api_key_offered(request("/v1/stream?token=s3cret"), "s3cret")
    assert api_key_offered(request("/v1/stream?token=nope&token=s3cret"), "s3cret")


def test_a_wrong_or_missing_api_key_is_refused() -> None:
    assert not api_key_offered(request(), "s3cret")
    assert not api_key_offered(request(Authorization="Bearer nope"), "s3cret")
    assert not api_key_offered(request(Authorization="Basic s3cret"), "s3cret")
    assert not api_key_offered(request("/v1/stream?token=s3cre"), "s3cret")
    # Two Authorization headers: neither is trusted.
    assert not api_key_offered(request(Authorization=["Bearer s3cret", "Bearer x"]), "s3cret")


def test_requests_without_origin_pass_and_browsers_need_an_allowed_one() -> None:
    allowed = ("https://app.example",)
    assert origin_allowed(request(), allowed, tls=False)  # not a browser
    assert origin_allowed(request(Origin="https://app.example"), allowed, tls=False)
    assert not origin_allowed(request(Origin="https://evil.example"), allowed, tls=False)
    assert origin_allowed(request(Origin="https://evil.example"), ("*",), tls=False)
    both = ["https://app.example", "https://evil.example"]
    assert not origin_allowed(request(Origin=both), ("*",), tls=False)


def test_the_servers_own_page_may_connect_with_its_scheme() -> None:
    assert origin_allowed(request(Origin=f"http://{OWN_HOST}"), (), tls=False)
    assert not origin_allowed(request(Origin=f"https://{OWN_HOST}"), (), tls=False)
    assert origin_allowed(request(Origin=f"https://{OWN_HOST}"), (), tls=True)
