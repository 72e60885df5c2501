"""The HTTP front of every connection (server/serve/http_front.py): GETs reach websockets as
before, other methods are read with h11 and answered by the file APIs, on a real server (the
scripted engine) over real sockets, with the bytes on the wire checked."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import AsyncIterator

import numpy as np
import pytest
import pytest_asyncio
from websockets.asyncio.client import connect

from bench.corpus import wav_bytes
from server.protocol.formats import SAMPLE_RATE_HZ
from server.serve.app import WhisperwireServer
from tests.helpers import REPO, scripted_server

pytestmark = pytest.mark.asyncio(loop_scope="session")


def noise_wav(seconds: float) -> bytes:
    """Faint noise as a WAV file: the scripted engine hears a word per half second of it."""
    rng = np.random.default_rng(0)
    return wav_bytes(
        (0.1 * rng.standard_normal(round(seconds * SAMPLE_RATE_HZ))).astype(np.float32)
    )


def multipart(fields: dict[str, str], file: bytes, boundary: str = "b0undary") -> bytes:
    parts = [
        f'--{boundary}\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n{v}\r\n'.encode()
        for k, v in fields.items()
    ]
    parts.append(
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n'
        "Content-Type: audio/wav\r\n\r\n".encode()
        + file
        + b"\r\n"
    )
    return b"".join(parts) + f"--{boundary}--\r\n".encode()


def post_head(path: str, length: int, *extra: str) -> bytes:
    lines = [
        f"POST {path} HTTP/1.1",
        "Host: localhost",
        "Content-Type: multipart/form-data; boundary=b0undary",
        f"Content-Length: {length}",
        *extra,
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


async def exchange(server: WhisperwireServer, data: bytes, *, timeout_s: float = 30.0) -> bytes:
    """Send ``data`` on a new connection and read until the server closes it."""
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(data)
    await writer.drain()
    try:
        return await asyncio.wait_for(reader.read(), timeout_s)
    finally:
        writer.close()


def status_of(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1])


@pytest_asyncio.fixture(loop_scope="session")
async def server() -> AsyncIterator[WhisperwireServer]:
    async with scripted_server(open_timeout_s=1.0, max_upload_bytes=4 << 20) as s:
        yield s


async def test_a_post_and_a_stream_share_the_port(server: WhisperwireServer) -> None:
    body = multipart({"model": "whisper-1"}, noise_wav(3.0))
    async with connect(server.url + "/v1/stream") as ws:
        assert json.loads(await ws.recv())["type"] == "ready"
        answer = await exchange(server, post_head("/v1/audio/transcriptions", len(body)) + body)
        await ws.send(json.dumps({"type": "end"}))
        async for message in ws:
            if json.loads(message)["type"] == "done":
                break
    head, _, payload = answer.partition(b"\r\n\r\n")
    assert status_of(answer) == 200, answer[:300]
    assert b"Connection: close" in head
    # The scripted engine hears a word per half second: six in 3 s.
    assert json.loads(payload)["text"] == "w0 w1 w2 w3 w4 w5"


async def test_unknown_paths_and_methods_get_404_and_405(server: WhisperwireServer) -> None:
    assert status_of(await exchange(server, post_head("/nowhere", 0))) == 404
    put = b"PUT /v1/audio/transcriptions HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n"
    answer = await exchange(server, put)
    assert status_of(answer) == 405 and b"Allow: POST" in answer
    assert json.loads(answer.partition(b"\r\n\r\n")[2])["error"]["message"]


async def test_a_malformed_request_gets_400(server: WhisperwireServer) -> None:
    answer = await exchange(server, b"POST /v1/audio/transcriptions\r\nHost: x\r\n\r\n")
    assert status_of(answer) == 400


async def test_a_head_too_large_gets_431(server: WhisperwireServer) -> None:
    answer = await exchange(server, b"POST / HTTP/1.1\r\nX-Junk: " + b"a" * 20_000)
    assert status_of(answer) == 431


async def test_a_head_that_never_ends_is_dropped_after_the_open_timeout(
    server: WhisperwireServer,
) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(b"POST /v1/audio/transcriptions HTTP/1.1\r\nHost: x\r\n")
    await writer.drain()
    assert await asyncio.wait_for(reader.read(), 10.0) == b""  # closed, nothing said
    writer.close()


async def test_a_body_over_the_limit_gets_413_before_it_is_sent(server: WhisperwireServer) -> None:
    # Content-Length says 8 MiB on a server that takes 4 MiB (plus the form's slack): the
    # answer comes without a byte of the body sent.
    answer = await exchange(server, post_head("/v1/audio/transcriptions", 8 << 20))
    assert status_of(answer) == 413


async def test_a_chunked_body_over_the_limit_gets_413(server: WhisperwireServer) -> None:
    head = (
        b"POST /v1/audio/transcriptions HTTP/1.1\r\nHost: x\r\n"
        b"Content-Type: multipart/form-data; boundary=b0undary\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n"
    )
    chunk = b"x" * 65536
    body = b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(80))
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(head)
    try:
        writer.write(body)
        await writer.drain()
    except ConnectionError:
        pass  # the server closed while we were still sending: it answered already
    answer = await asyncio.wait_for(reader.read(), 10.0)
    writer.close()
    assert status_of(answer) == 413


async def test_expect_100_continue_is_answered_before_the_body(server: WhisperwireServer) -> None:
    body = multipart({"model": "whisper-1"}, noise_wav(1.0))
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(post_head("/v1/audio/transcriptions", len(body), "Expect: 100-continue"))
    await writer.drain()
    interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10.0)
    assert interim.startswith(b"HTTP/1.1 100 ")
    writer.write(body)
    answer = await asyncio.wait_for(reader.read(), 30.0)
    writer.close()
    assert status_of(answer) == 200


async def test_a_refused_request_is_not_asked_for_its_body() -> None:
    async with scripted_server(api_key="secret") as server:
        answer = await exchange(
            server, post_head("/v1/audio/transcriptions", 5000, "Expect: 100-continue")
        )
    assert status_of(answer) == 401  # no 100 Continue first
    assert json.loads(answer.partition(b"\r\n\r\n")[2])["error"]["type"] == (
        "invalid_request_error"
    )


async def test_stream_true_sends_server_sent_events_chunked(server: WhisperwireServer) -> None:
    # 70 s: three 30 s windows, so three deltas before the done event.
    body = multipart({"model": "m", "stream": "true"}, noise_wav(70.0))
    answer = await exchange(server, post_head("/v1/audio/transcriptions", len(body)) + body)
    head, _, payload = answer.partition(b"\r\n\r\n")
    assert status_of(answer) == 200
    assert b"Transfer-Encoding: chunked" in head and b"text/event-stream" in head
    events = [
        json.loads(line.removeprefix(b"data: "))
        for line in payload.split(b"\r\n")
        if line.startswith(b"data: ")
    ]
    kinds = [e["type"] for e in events]
    assert kinds == ["transcript.text.delta"] * 3 + ["transcript.text.done"]
    deltas = "".join(e["delta"] for e in events[:-1])
    assert events[-1]["text"] == deltas.strip()
    assert events[-1]["usage"] == {"type": "duration", "seconds": 70}


@pytest.mark.asyncio(loop_scope="function")
async def test_the_front_under_uvloop_serves_both_kinds() -> None:
    """The CLI runs uvloop, whose transports are not asyncio's: a stream and a POST work."""
    code = """
import asyncio, json, uvloop
from tests.helpers import scripted_server
from tests.test_http_front import exchange, multipart, noise_wav, post_head
from websockets.asyncio.client import connect

async def main():
    async with scripted_server() as server:
        async with connect(server.url + "/v1/stream") as ws:
            print(json.loads(await ws.recv())["type"])
        body = multipart({"model": "m"}, noise_wav(2.0))
        answer = await exchange(server, post_head("/v1/audio/transcriptions", len(body)) + body)
        print(json.loads(answer.partition(b"\\r\\n\\r\\n")[2])["text"])

uvloop.run(main())
"""
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-c", code, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    out, err = await asyncio.wait_for(process.communicate(), 120)
    assert process.returncode == 0, err.decode()[-2000:]
    assert out.decode().split("\n")[:2] == ["ready", "w0 w1 w2 w3"]
