"""Probes of a running server over plain HTTP: a GET on asyncio streams (no HTTP client
library) and one sample read from a Prometheus text page."""

from __future__ import annotations

import asyncio
from urllib.parse import urlsplit


async def http_get(
    url: str, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], bytes]:
    """A plain HTTP/1.1 GET over asyncio streams: (status, lower-cased headers, body)."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    path = parts.path or "/"
    if parts.query:
        path += "?" + parts.query
    reader, writer = await asyncio.open_connection(host, port)
    lines = [f"GET {path} HTTP/1.1", f"Host: {host}:{port}", "Connection: close"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))
    await writer.drain()
    raw = await reader.read()
    writer.close()
    await writer.wait_closed()
    head, _, body = raw.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    found = {}
    for line in header_lines:
        name, _, value = line.partition(":")
        found[name.strip().lower()] = value.strip()
    return int(status_line.split()[1]), found, body


def metric_value(text: str, sample: str) -> float:
    """The value of one sample line (``name`` or ``name{labels}``) of a Prometheus text page;
    0 when absent."""
    for line in text.splitlines():
        if line.startswith(sample + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0
