"""One connection's state machine on a bare websockets server (no ``WhisperwireServer``):
the URL query, the ready message, limits and stop requests. The scripted engine decodes."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

from websockets.asyncio.client import connect
from websockets.asyncio.server import ServerConnection, serve
from websockets.exceptions import ConnectionClosed

from server.config import ServerConfig, StreamingConfig, VadConfig
from server.core.speakers import SpeakerConfig
from server.decode.pipeline import Pipeline
from server.metrics import Metrics
from server.serve.connection import (
    MAX_CLOSE_REASON_BYTES,
    SHUTDOWN,
    Connection,
    truncate_reason,
)
from tests.helpers import ScriptedEngine


@contextlib.asynccontextmanager
async def connection_server(
    streaming: StreamingConfig | None = None, **overrides: Any
) -> AsyncIterator[tuple[str, list[Connection]]]:
    """A websockets server on a free port that serves every client with a ``Connection``;
    yields its stream URL and the connections made so far."""
    config = ServerConfig(host="127.0.0.1", port=0, **overrides)
    metrics = Metrics()
    pipeline = Pipeline(metrics=metrics)
    await pipeline.start(ScriptedEngine, warmup=False)
    connections: list[Connection] = []

    async def handle(ws: ServerConnection) -> None:
        conn = Connection(
            ws,
            f"test{len(connections)}",
            pipeline=pipeline,
            metrics=metrics,
            config=config,
            streaming=streaming or StreamingConfig(),
            vad=VadConfig(),
        )
        connections.append(conn)
        await conn.run()

    try:
        async with serve(handle, "127.0.0.1", 0) as server:
            port = next(iter(server.sockets)).getsockname()[1]
            yield f"ws://127.0.0.1:{port}/v1/stream", connections
    finally:
        await pipeline.close()


async def read_all(url: str) -> tuple[list[dict[str, Any]], int | None]:
    async with connect(url) as ws:
        messages = []
        with contextlib.suppress(ConnectionClosed):
            async for raw in ws:
                messages.append(json.loads(raw))
    return messages, ws.close_code


def test_close_reasons_are_cut_on_a_character_boundary() -> None:
    assert truncate_reason("done") == "done"
    cut = truncate_reason("é" * 100)
    assert cut == "é" * (MAX_CLOSE_REASON_BYTES // 2)
    assert len(cut.encode("utf-8")) <= MAX_CLOSE_REASON_BYTES


async def test_the_url_query_configures_the_session_and_ready_tells() -> None:
    query = "?sample_rate=8000&encoding=pcm_f32le"
    async with connection_server() as (url, _), connect(url + query) as ws:
        ready = json.loads(await ws.recv())
        await ws.send('{"type": "end"}')
        assert json.loads(await ws.recv())["type"] == "done"
    assert ready["type"] == "ready" and ready["session_id"] == "test0"
    assert (ready["sample_rate"], ready["encoding"], ready["model"]) == (
        8000,
        "pcm_f32le",
        "scripted",
    )


async def test_ready_says_whether_the_stream_gets_speaker_labels() -> None:
    async def ready_speakers(url: str) -> bool:
        async with connect(url) as ws:
            ready = json.loads(await ws.recv())
            await ws.send('{"type": "end"}')
            assert json.loads(await ws.recv())["type"] == "done"
        value = ready["speakers"]
        assert isinstance(value, bool)
        return value

    async with connection_server() as (url, _):
        assert await ready_speakers(url) is False
    labelling = StreamingConfig(speakers=SpeakerConfig(enabled=True))
    async with connection_server(labelling) as (url, _):
        assert await ready_speakers(url) is True
        assert await ready_speakers(url + "?speakers=false") is False


async def test_a_bad_url_query_is_refused_with_1008() -> None:
    async with connection_server() as (url, _):
        messages, close_code = await read_all(url + "?sample_rate=fast")
    assert [m["type"] for m in messages] == ["error"]
    assert messages[0]["fatal"] and "sample_rate" in messages[0]["message"]
    assert close_code == 1008


async def test_a_stop_request_finishes_the_session_with_its_close_code() -> None:
    async with connection_server() as (url, connections):
        async with connect(url) as ws:
            assert json.loads(await ws.recv())["type"] == "ready"
            connections[0].request_stop(SHUTDOWN)
            messages = [json.loads(raw) async for raw in ws]
        assert [m["type"] for m in messages] == ["done"]
        assert (ws.close_code, ws.close_reason) == (1001, "server shutting down")
        assert connections[0].done


async def test_an_idle_client_is_finished() -> None:
    async with connection_server(idle_timeout_s=0.3) as (url, _):
        async with connect(url) as ws:
            messages = [json.loads(raw) async for raw in ws]
        assert [m["type"] for m in messages] == ["ready", "error", "done"]
        assert messages[1]["code"] == "idle_timeout"
        assert ws.close_code == 1000


async def test_a_session_past_its_length_is_finished_with_1013() -> None:
    async with connection_server(max_session_s=0.3) as (url, _):
        messages, close_code = await read_all(url)
        assert [m["type"] for m in messages] == ["ready", "error", "done"]
        assert messages[1]["code"] == "limit" and messages[1]["fatal"]
        assert close_code == 1013
