"""multipart/form-data parsing (server/protocol/multipart.py): the forms real clients build
(httpx, which the openai package uses) come apart into their fields, byte for byte."""

from __future__ import annotations

import httpx
import pytest

from server.protocol.multipart import FormError, parse_form_data


def _form(
    files: dict[str, tuple[str, bytes, str]], data: dict[str, str | list[str]]
) -> tuple[str, bytes]:
    request = httpx.Request("POST", "http://localhost/", files=files, data=data)
    return request.headers["Content-Type"], request.read()


def test_fields_and_a_binary_file_come_back_exactly() -> None:
    # Bytes that look like the delimiter's pieces must not end the part.
    payload = b"RIFF\r\n\r\n--\r\n--x\x00\xff" * 1000
    content_type, body = _form(
        {"file": ("my clip.wav", payload, "audio/wav")},
        {"model": "whisper-1", "timestamp_granularities[]": ["word", "segment"], "prompt": "Zoë"},
    )
    parts = parse_form_data(content_type, body)
    assert [(p.name, p.filename) for p in parts] == [
        ("model", None),
        ("timestamp_granularities[]", None),
        ("timestamp_granularities[]", None),
        ("prompt", None),
        ("file", "my clip.wav"),
    ]
    assert [p.text() for p in parts[:4]] == ["whisper-1", "word", "segment", "Zoë"]
    assert parts[4].data == payload and parts[4].content_type == "audio/wav"


def test_an_empty_file_is_a_part_with_no_bytes() -> None:
    content_type, body = _form({"file": ("a.wav", b"", "audio/wav")}, {})
    assert parse_form_data(content_type, body)[0].data == b""


@pytest.mark.parametrize(
    ("content_type", "body", "reason"),
    [
        ("application/json", b"{}", "must be multipart/form-data"),
        ("multipart/form-data", b"--x\r\n", "boundary"),
        ("multipart/form-data; boundary=x", b"hello", "does not start"),
        (
            "multipart/form-data; boundary=x",
            b"--x\r\nContent-Disposition: form-data; name=a\r\n\r\nv",
            "truncated",
        ),
        ("multipart/form-data; boundary=x", b"--x\r\nno header block\r\n--x--", "header"),
        (
            "multipart/form-data; boundary=x",
            b"--x\r\nContent-Type: text/plain\r\n\r\nv\r\n--x--",
            "form-data",
        ),
    ],
)
def test_malformed_bodies_are_refused_with_the_reason(
    content_type: str, body: bytes, reason: str
) -> None:
    with pytest.raises(FormError, match=reason):
        parse_form_data(content_type, body)


def test_a_field_that_is_not_utf8_says_so() -> None:
    content_type, body = _form({"file": ("a.wav", b"1", "audio/wav")}, {"prompt": "x"})
    body = body.replace(b"\r\n\r\nx\r\n", b"\r\n\r\n\xff\r\n")
    with pytest.raises(FormError, match="not UTF-8"):
        parse_form_data(content_type, body)[0].text()
