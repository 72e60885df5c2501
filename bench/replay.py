"""Replay audio in real time through a server's own WebSocket protocol and record what came back.

One pacing loop serves both servers, so they get byte-for-byte the same timing: 100 ms frames,
frame k sent no earlier than ``pace`` times its end in stream time after the first, each send's
wall time logged. A ``ProtocolAdapter`` owns everything protocol-specific: the handshake, the
frame encoding, turning each message into the client's view (finalised words + tentative
words), and how a stream is ended. The view is recorded as an ``Observation`` whenever it
changes, which is all the metrics need.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from bench.latency_metrics import Observation, SendLog, words_of
from server.protocol.formats import SAMPLE_RATE_HZ

logger = logging.getLogger("bench.replay")

Float32Array = npt.NDArray[np.float32]
View = tuple[tuple[str, ...], tuple[str, ...]]  # (finalised words, tentative words)


class ReplayError(RuntimeError):
    """The server refused or broke the stream."""


class ProtocolAdapter(Protocol):
    """One server's protocol, for one stream (adapters hold per-stream state)."""

    url: str

    async def handshake(self, ws: ClientConnection) -> None:
        """After connecting, before audio: wait for the server's go-ahead."""

    def encode(self, samples: Float32Array) -> bytes:
        """One audio frame on the wire."""

    def receive(self, raw: str | bytes) -> View | None:
        """Account for a server message; the client's view after it, None if unchanged."""

    async def end(self, ws: ClientConnection, changed: asyncio.Event) -> None:
        """After the last frame: tell the server the audio is over (``changed`` is set on
        every view change, for adapters that wait for the server to settle)."""

    def final_text(self) -> str:
        """The stream's transcript as the server's own client would keep it."""


@dataclass
class Replay:
    """What one stream sent and saw."""

    sends: SendLog = field(default_factory=SendLog)
    observations: list[Observation] = field(default_factory=list)
    messages: int = 0
    text: str = ""
    extra: dict[str, Any] = field(default_factory=dict)  # adapter-specific figures
    wall_s: float = 0.0  # connect to close
    close_code: int | None = None


def pcm_s16le(samples: Float32Array) -> bytes:
    return (np.clip(samples, -1.0, 32767 / 32768) * 32768).astype("<i2").tobytes()


async def replay(
    adapter: ProtocolAdapter,
    audio: Float32Array,
    *,
    pace: float = 1.0,
    frame_s: float = 0.1,
    close_timeout_s: float = 120.0,
    clock: Callable[[], float] = time.perf_counter,
) -> Replay:
    """Stream ``audio`` (16 kHz float32) through ``adapter``; see the module docstring."""
    record = Replay()
    step = round(frame_s * SAMPLE_RATE_HZ)
    changed = asyncio.Event()
    started = clock()
    async with connect(adapter.url, max_size=None, open_timeout=30) as ws:
        await adapter.handshake(ws)

        async def read() -> None:
            last: View | None = None
            # Iteration ends quietly after a normal close and raises after any other.
            with contextlib.suppress(ConnectionClosed):
                async for raw in ws:
                    wall = clock()
                    record.messages += 1
                    view = adapter.receive(raw)
                    if view is not None and view != last:
                        record.observations.append(Observation(wall, *view))
                        last = view
                        changed.set()

        reader = asyncio.create_task(read())
        try:
            first = clock()
            for k in range(0, audio.shape[0], step):
                frame = audio[k : k + step]
                end_s = (k + frame.shape[0]) / SAMPLE_RATE_HZ
                if pace > 0:
                    # Like a microphone: a frame exists only once its last sample was recorded.
                    delay = first + pace * end_s - clock()
                    if delay > 0:
                        await asyncio.sleep(delay)
                await ws.send(adapter.encode(frame))
                record.sends.sent(frame.shape[0] / SAMPLE_RATE_HZ, clock())
            await adapter.end(ws, changed)
            await asyncio.wait_for(asyncio.shield(reader), close_timeout_s)
        finally:
            if not reader.done():
                reader.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await reader
        record.close_code = ws.close_code
    record.wall_s = clock() - started
    record.text = adapter.final_text()
    return record


class WhisperwireAdapter:
    """Our protocol (docs/protocol.md): ``ready``, pcm_s16le frames, ``partial``/``final``,
    ``end`` then ``done``."""

    def __init__(self, base_url: str) -> None:
        self.url = f"{base_url}/v1/stream?sample_rate={SAMPLE_RATE_HZ}&encoding=pcm_s16le"
        self._finals: list[str] = []
        self._final_words: tuple[str, ...] = ()
        self._tentative: tuple[str, ...] = ()

    async def handshake(self, ws: ClientConnection) -> None:
        ready = json.loads(await ws.recv())
        if ready.get("type") != "ready":
            raise ReplayError(f"expected ready, got {ready}")

    def encode(self, samples: Float32Array) -> bytes:
        return pcm_s16le(samples)

    def receive(self, raw: str | bytes) -> View | None:
        message = json.loads(raw)
        kind = message["type"]
        if kind == "partial":
            # A partial replaces the open segment's text entirely.
            self._tentative = words_of(message["text"])
        elif kind == "final":
            self._finals.append(message["text"].strip())
            self._final_words += words_of(message["text"])
            self._tentative = ()
        elif kind == "error" and message.get("fatal"):
            raise ReplayError(f"server error {message['code']}: {message['message']}")
        else:
            return None
        return self._final_words, self._tentative

    async def end(self, ws: ClientConnection, changed: asyncio.Event) -> None:
        await ws.send(json.dumps({"type": "end"}))

    def final_text(self) -> str:
        return " ".join(t for t in self._finals if t)


class TimedAdapter:
    """A ``ProtocolAdapter`` that also keeps every server message with its arrival time (the
    replay's clock, read right after it)."""

    def __init__(self, inner: ProtocolAdapter) -> None:
        self.inner = inner
        self.url = inner.url
        self.messages: list[tuple[float, dict[str, Any]]] = []

    async def handshake(self, ws: ClientConnection) -> None:
        await self.inner.handshake(ws)

    def encode(self, samples: Float32Array) -> bytes:
        return self.inner.encode(samples)

    def receive(self, raw: str | bytes) -> View | None:
        self.messages.append((time.perf_counter(), json.loads(raw)))
        return self.inner.receive(raw)

    async def end(self, ws: ClientConnection, changed: asyncio.Event) -> None:
        await self.inner.end(ws, changed)

    def final_text(self) -> str:
        return self.inner.final_text()
