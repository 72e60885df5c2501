"""The file APIs' I/O (server/serve/rest.py) on a real server with the scripted engine: who
may upload, how many at once, what a client that leaves or a shutdown does to an upload."""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import pytest

from bench.http_probe import http_get, metric_value
from server.config import ServerConfig
from server.core.engine_api import SpeechEngine
from server.serve.app import WhisperwireServer
from tests.helpers import ScriptedEngine, scripted_server
from tests.test_http_front import exchange, multipart, noise_wav, post_head

pytestmark = pytest.mark.asyncio(loop_scope="session")

WAIT_S = 30.0


async def post(
    server: WhisperwireServer,
    path: str = "/v1/audio/transcriptions",
    seconds: float = 2.0,
    **headers: str,
) -> httpx.Response:
    if path == "/v1/listen":
        content, kind = noise_wav(seconds), "audio/wav"
    else:
        content = multipart({"model": "whisper-1"}, noise_wav(seconds))
        kind = "multipart/form-data; boundary=b0undary"
    async with httpx.AsyncClient(timeout=WAIT_S) as client:
        return await client.post(
            server.http_url + path, content=content, headers={"Content-Type": kind, **headers}
        )


async def test_a_server_still_loading_says_503_with_retry_after() -> None:
    release = threading.Event()
    engine = ScriptedEngine()

    def slow_load() -> SpeechEngine:
        release.wait(WAIT_S)
        return engine

    server = WhisperwireServer(slow_load, server=ServerConfig(host="127.0.0.1", port=0))
    await server.start()
    try:
        answer = await post(server)
        assert answer.status_code == 503 and answer.headers["Retry-After"].isdigit()
        assert "not ready" in answer.json()["error"]["message"]
        release.set()
        await asyncio.wait_for(server.wait_ready(), WAIT_S)
        assert (await post(server)).status_code == 200
    finally:
        release.set()
        await server.shutdown()


async def test_the_api_key_in_each_apis_own_scheme() -> None:
    async with scripted_server(api_key="secret") as server:
        assert (await post(server)).status_code == 401
        assert (await post(server, Authorization="Bearer wrong")).status_code == 401
        assert (await post(server, Authorization="Bearer secret")).status_code == 200
        # Deepgram's clients send "Token KEY"; OpenAI's path does not take that scheme.
        refused = await post(server, "/v1/listen", Authorization="Bearer wrong")
        assert refused.status_code == 401 and refused.json()["err_msg"]
        assert (await post(server, "/v1/listen", Authorization="Token secret")).status_code == 200
        assert (await post(server, Authorization="Token secret")).status_code == 401


async def test_an_origin_not_allowed_is_refused() -> None:
    async with scripted_server() as server:
        assert (await post(server, Origin="https://evil.example")).status_code == 403
        own = await post(server, Origin=f"http://127.0.0.1:{server.port}")
        assert own.status_code == 200


async def test_uploads_beyond_the_limit_wait_their_turn_with_503() -> None:
    engine = ScriptedEngine()
    async with scripted_server(engine, max_file_requests=1) as server:
        engine.entered.clear()  # set by the startup calibration
        engine.release.clear()
        first = asyncio.create_task(post(server))
        await asyncio.to_thread(engine.entered.wait, WAIT_S)
        busy = await post(server)
        assert busy.status_code == 503 and busy.headers["Retry-After"].isdigit()
        assert "limit" in busy.json()["error"]["message"]
        engine.release.set()
        assert (await first).status_code == 200
        metrics = (await http_get(server.http_url + "/metrics"))[2].decode()
        assert metric_value(metrics, 'whisperwire_file_requests_total{status="503"}') == 1
        assert metric_value(metrics, 'whisperwire_file_requests_total{status="200"}') == 1


async def test_a_client_that_leaves_stops_its_transcription() -> None:
    engine = ScriptedEngine()
    async with scripted_server(engine) as server:
        engine.entered.clear()  # set by the startup calibration
        engine.release.clear()
        body = multipart({"model": "m"}, noise_wav(100.0))  # four 30 s windows
        _, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(post_head("/v1/audio/transcriptions", len(body)) + body)
        await writer.drain()
        await asyncio.to_thread(engine.entered.wait, WAIT_S)
        writer.close()  # gone while its first window is on the lane
        for _ in range(100):
            if server.rest.running == 0:
                break
            await asyncio.sleep(0.05)
        assert server.rest.running == 0
        engine.release.set()
        await asyncio.sleep(0.5)
        assert server.pipeline.background_queued == 0
    # The window on the lane when the client left was the only one decoded of four.
    assert [b for b in engine.batches if b == [30.0]] == [[30.0]]


async def test_a_shutdown_lets_an_upload_in_progress_finish() -> None:
    engine = ScriptedEngine()
    async with scripted_server(engine) as server:
        engine.entered.clear()  # set by the startup calibration
        engine.release.clear()
        upload = asyncio.create_task(post(server, seconds=40.0))
        await asyncio.to_thread(engine.entered.wait, WAIT_S)
        stopping = asyncio.create_task(server.shutdown())
        await asyncio.sleep(0.2)
        with pytest.raises(OSError):  # no longer listening
            await exchange(server, post_head("/v1/audio/transcriptions", 10))
        engine.release.set()
        answer = await upload
        await stopping
    assert answer.status_code == 200
    assert json.loads(answer.content)["text"].split()[:2] == ["w0", "w1"]


async def test_a_page_of_an_allowed_origin_may_upload_from_the_browser() -> None:
    page = "https://captions.example"
    async with scripted_server(allowed_origins=(page,)) as server:
        async with httpx.AsyncClient(timeout=WAIT_S) as client:
            preflight = await client.options(
                server.http_url + "/v1/audio/transcriptions",
                headers={"Origin": page, "Access-Control-Request-Method": "POST"},
            )
            stranger = await client.options(
                server.http_url + "/v1/audio/transcriptions",
                headers={"Origin": "https://evil.example"},
            )
        answer = await post(server, Origin=page)
    assert preflight.status_code == 204
    assert preflight.headers["Access-Control-Allow-Origin"] == page
    assert "POST" in preflight.headers["Access-Control-Allow-Methods"]
    assert "Authorization" in preflight.headers["Access-Control-Allow-Headers"]
    assert stranger.status_code == 403
    assert answer.status_code == 200 and answer.headers["Access-Control-Allow-Origin"] == page
