"""``multipart/form-data`` (RFC 7578) of a request body that is all in memory: the form an
OpenAI client posts a file in."""

from __future__ import annotations

import email.utils
from dataclasses import dataclass
from email.message import Message


class FormError(ValueError):
    """A body that is no well-formed ``multipart/form-data``; the message says why."""


@dataclass(frozen=True)
class FormPart:
    name: str
    data: bytes
    filename: str | None = None
    content_type: str | None = None

    def text(self) -> str:
        """The value as text (form fields are UTF-8)."""
        try:
            return self.data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise FormError(f"form field {self.name!r} is not UTF-8 text") from exc


def content_type_options(header: str) -> tuple[str, dict[str, str]]:
    """``multipart/form-data; boundary=x`` -> (``multipart/form-data``, {boundary: x})."""
    message = Message()
    message["Content-Type"] = header
    params = {k.lower(): str(v) for k, v in message.get_params(failobj=[])[1:]}
    return message.get_content_type(), params


def parse_form_data(content_type: str, body: bytes) -> list[FormPart]:
    """The parts of a ``multipart/form-data`` body, in order. Raises ``FormError``."""
    kind, params = content_type_options(content_type)
    if kind != "multipart/form-data":
        raise FormError(f"the body must be multipart/form-data, not {kind}")
    boundary = params.get("boundary", "")
    if not 1 <= len(boundary) <= 70:
        raise FormError("multipart/form-data without a valid boundary")
    delimiter = b"--" + boundary.encode("latin-1")
    chunks = body.split(b"\r\n" + delimiter)
    # The first delimiter may open the body without a CRLF before it.
    first = chunks[0]
    if not first.startswith(delimiter):
        raise FormError("the body does not start with its multipart boundary")
    chunks[0] = first[len(delimiter) :]
    parts: list[FormPart] = []
    for chunk in chunks:
        if chunk.startswith(b"--"):
            return parts  # the close delimiter: what follows is epilogue
        head, sep, data = chunk.removeprefix(b"\r\n").partition(b"\r\n\r\n")
        if not sep:
            raise FormError("a multipart part has no header block")
        parts.append(_part(head, data))
    raise FormError("the multipart body is truncated (no closing boundary)")


def _part(head: bytes, data: bytes) -> FormPart:
    message = Message()
    for line in head.decode("utf-8", "replace").split("\r\n"):
        header, sep, value = line.partition(":")
        if not sep:
            raise FormError(f"malformed multipart header line {line[:60]!r}")
        message[header.strip()] = value.strip()
    disposition = message.get("Content-Disposition")
    if disposition is None or message.get_content_disposition() != "form-data":
        raise FormError("a multipart part without Content-Disposition: form-data")
    param = message.get_param("name", header="Content-Disposition")
    # RFC 2231 encoded values come as a tuple
    name = email.utils.collapse_rfc2231_value(param) if isinstance(param, tuple) else param
    if not isinstance(name, str):
        raise FormError("a multipart part without a name")
    filename = message.get_filename()
    content_type = message.get("Content-Type")
    return FormPart(name, data, filename, content_type)
