"""Twilio Media Streams on ``/twilio/media``, subscribers on ``/twilio/events``, the webhook.

Frames are shaped exactly as Twilio's Media Streams docs show them (``connected``, ``start``
with ``mediaFormat`` and ``customParameters``, ``media`` with string ``chunk`` and
``timestamp`` and base64 mu-law ``payload``, ``dtmf``, ``mark``, ``stop``), built from real
speech sent through a telephone line (``bench/phone_line.py``); handshakes are signed by the
``twilio`` package's own ``RequestValidator``. Recognition uses the real model; the protocol's
edges use the scripted engine, which hears one word per half second of window.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
from twilio.request_validator import RequestValidator
from websockets.asyncio.client import ClientConnection, connect
from websockets.datastructures import Headers
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.http11 import Request

from bench.corpus import ManifestRow, load_clip, wer
from bench.http_probe import http_get, metric_value
from bench.phone_line import PHONE_RATE_HZ, phone_line
from server.apis.twilio_media import (
    EVENTS_PATH,
    MEDIA_PATH,
    CallHub,
    CallStart,
    CallStop,
    Dtmf,
    Mark,
    Media,
    TwilioConfig,
    TwilioStream,
    TwilioStreamError,
    Webhook,
    signature,
    signature_problem,
)
from server.config import ServerConfig
from server.protocol.formats import SAMPLE_RATE_HZ, AudioFormat
from server.serve.app import WhisperwireServer
from tests.helpers import ScriptedEngine, pcm_frames

if TYPE_CHECKING:
    from server.engine.engine import Engine

WAIT_S = 120.0  # a bound for waits on the real model on a busy 2-core machine
MAX_WER_CLIP = 0.35  # as tests/test_app.py: one short clip, streamed
TOKEN = "12345678901234567890123456789012"  # an auth token's shape: 32 characters
ACCOUNT = "AC" + "a" * 32
CALL = "CA" + "b" * 32
STREAM = "MZ" + "c" * 32
INBOUND_CLIP = "librispeech_test-clean/1089-134686-0000.wav"
OUTBOUND_CLIP = "ljspeech/LJ001-0004.wav"
FRAME_BYTES = PHONE_RATE_HZ // 50  # Twilio sends 20 ms of mu-law per media message


# --------------------------------------------------------------------------- Twilio's frames


def start_message(tracks: list[str], **custom: str) -> dict[str, Any]:
    """``start`` as Twilio's docs show it."""
    return {
        "event": "start",
        "sequenceNumber": "1",
        "start": {
            "accountSid": ACCOUNT,
            "streamSid": STREAM,
            "callSid": CALL,
            "tracks": tracks,
            "mediaFormat": {"encoding": "audio/x-mulaw", "sampleRate": 8000, "channels": 1},
            "customParameters": custom,
        },
        "streamSid": STREAM,
    }


class CallFrames:
    """A call's Media Streams frames: each track's mu-law in 20 ms ``media`` messages,
    interleaved as Twilio sends them, numbered as Twilio numbers them."""

    def __init__(self, tracks: dict[str, bytes]) -> None:
        self.tracks = tracks
        self.sequence = 1

    def _next(self) -> str:
        self.sequence += 1
        return str(self.sequence)

    def opening(self, **custom: str) -> list[str]:
        connected = {"event": "connected", "protocol": "Call", "version": "1.0.0"}
        return [json.dumps(connected), json.dumps(start_message(list(self.tracks), **custom))]

    def media(self) -> Iterator[str]:
        longest = max(len(b) for b in self.tracks.values())
        for chunk, start in enumerate(range(0, longest, FRAME_BYTES), start=1):
            for track, line in self.tracks.items():
                payload = line[start : start + FRAME_BYTES]
                if not payload:
                    continue
                yield json.dumps(
                    {
                        "event": "media",
                        "sequenceNumber": self._next(),
                        "media": {
                            "track": track,
                            "chunk": str(chunk),
                            "timestamp": str(start * 1000 // PHONE_RATE_HZ),
                            "payload": base64.b64encode(payload).decode(),
                        },
                        "streamSid": STREAM,
                    }
                )

    def dtmf(self, digit: str) -> str:
        return json.dumps(
            {
                "event": "dtmf",
                "streamSid": STREAM,
                "sequenceNumber": self._next(),
                "dtmf": {"track": "inbound_track", "digit": digit},
            }
        )

    def mark(self, name: str) -> str:
        return json.dumps(
            {
                "event": "mark",
                "sequenceNumber": self._next(),
                "streamSid": STREAM,
                "mark": {"name": name},
            }
        )

    def stop(self) -> str:
        return json.dumps(
            {
                "event": "stop",
                "sequenceNumber": self._next(),
                "stop": {"accountSid": ACCOUNT, "callSid": CALL},
                "streamSid": STREAM,
            }
        )


# --------------------------------------------------------------------------- the parser


def test_twilios_documented_frames_become_typed_events() -> None:
    frames = CallFrames({"inbound": bytes(range(161)), "outbound": b"\xff" * 160})
    stream = TwilioStream()
    opening = [stream.receive(f) for f in frames.opening(FirstName="Jane")]
    assert opening[0] is None  # connected
    start = opening[1]
    assert isinstance(start, CallStart)
    assert (start.call_sid, start.stream_sid, start.account_sid) == (CALL, STREAM, ACCOUNT)
    assert start.tracks == ("inbound", "outbound")
    assert start.audio_format == AudioFormat(8000, "mulaw")
    assert start.custom_parameters == {"FirstName": "Jane"}
    media = [stream.receive(f) for f in frames.media()]
    assert all(isinstance(m, Media) for m in media)
    # 161 bytes: an odd length is 161 whole mu-law samples, all of them kept.
    inbound = b"".join(m.payload for m in media if isinstance(m, Media) and m.track == "inbound")
    assert inbound == bytes(range(161))
    assert [m.chunk for m in media if isinstance(m, Media)] == [1, 1, 2]
    assert media[2] == Media("inbound", 2, 20, bytes([160]))
    assert stream.receive(frames.dtmf("7")) == Dtmf("inbound_track", "7")
    assert stream.receive(frames.mark("greeting")) == Mark("greeting")
    assert stream.receive(frames.stop()) == CallStop()


def _started() -> TwilioStream:
    stream = TwilioStream()
    stream.receive(json.dumps(start_message(["inbound"])))
    return stream


def _media(payload: Any, track: str = "inbound") -> str:
    body = {"track": track, "chunk": "1", "timestamp": "0", "payload": payload}
    return json.dumps({"event": "media", "sequenceNumber": "2", "media": body})


@pytest.mark.parametrize(
    ("frame", "says"),
    [
        ("{not json", "JSON"),
        (json.dumps({"event": "transcript"}), "unknown event 'transcript'; Media Streams send"),
        (json.dumps([1]), "JSON object"),
        (_media("%%% not base64"), "media.payload is not valid base64"),
        (_media("AAA"), "media.payload is not valid base64"),  # a length no base64 has
        (_media(5), "media.payload must be a string"),
        (_media("AAAA", track="outbound"), "not one of the stream's tracks inbound"),
        (json.dumps({"event": "media", "media": {"payload": "AAAA", "chunk": "x"}}), "chunk"),
        (json.dumps(start_message(["inbound"])), "a second 'start'"),
        (json.dumps({"event": "mark", "mark": {}}), "mark.name must be a string"),
        (b"\x00\x01", "binary frames"),
    ],
)
def test_frames_twilio_would_not_send_are_refused_saying_why(frame: str | bytes, says: str) -> None:
    with pytest.raises(TwilioStreamError, match=says) as info:
        _started().receive(frame)
    assert info.value.close_code == 1008


def test_media_before_start_and_anything_after_stop_are_refused() -> None:
    with pytest.raises(TwilioStreamError, match="'media' before 'start'"):
        TwilioStream().receive(_media("AAAA"))
    stream = _started()
    stream.receive(json.dumps({"event": "stop", "stop": {}}))
    with pytest.raises(TwilioStreamError, match="after 'stop'"):
        stream.receive(_media("AAAA"))


@pytest.mark.parametrize(
    ("media_format", "says"),
    [
        ({"encoding": "audio/l16", "sampleRate": 8000, "channels": 1}, "audio/x-mulaw"),
        ({"encoding": "audio/x-mulaw", "sampleRate": 4000, "channels": 1}, "between 8000"),
        ({"encoding": "audio/x-mulaw", "sampleRate": 8000, "channels": 2}, "channels must be 1"),
    ],
)
def test_a_start_with_a_format_we_cannot_decode_is_refused(
    media_format: dict[str, Any], says: str
) -> None:
    message = start_message(["inbound"])
    message["start"]["mediaFormat"] = media_format
    with pytest.raises(TwilioStreamError, match=says):
        TwilioStream().receive(json.dumps(message))


# --------------------------------------------------------------------------- signatures


def _handshake(url: str, **headers: str) -> Request:
    split = url.split("/", 3)
    return Request("/" + split[3], Headers({"Host": split[2], **headers}))


def test_the_signature_is_twilios_own() -> None:
    url = "wss://calls.example.com/twilio/media"
    assert signature(url, TOKEN) == RequestValidator(TOKEN).compute_signature(url, {})
    signed = RequestValidator(TOKEN).compute_signature(url, {})
    assert signature_problem(_handshake(url, **{"X-Twilio-Signature": signed}), TOKEN) is None
    # Twilio may sign with the default port named; RequestValidator takes both, so do we.
    with_port = RequestValidator(TOKEN).compute_signature(
        "wss://calls.example.com:443/twilio/media", {}
    )
    assert signature_problem(_handshake(url, **{"X-Twilio-Signature": with_port}), TOKEN) is None
    assert "missing X-Twilio-Signature" in (signature_problem(_handshake(url), TOKEN) or "")
    other = RequestValidator("another-token").compute_signature(url, {})
    refused = signature_problem(_handshake(url, **{"X-Twilio-Signature": other}), TOKEN)
    assert refused is not None and "invalid X-Twilio-Signature" in refused
    assert signature_problem(_handshake(url), None) is None  # no token: no check


# --------------------------------------------------------------------------- the hub


async def test_subscribers_by_either_sid_get_the_call_and_late_ones_its_history() -> None:
    hub = CallHub()
    early = hub.subscribe(CALL)
    hub.open_call(CALL, STREAM)
    hub.publish(CALL, STREAM, {"type": "call_started"})
    hub.publish(CALL, STREAM, {"type": "partial", "text": "hel"})
    hub.publish(CALL, STREAM, {"type": "final", "text": "hello"})
    late = hub.subscribe(STREAM)
    hub.end_call(CALL, STREAM)
    after = hub.subscribe(CALL)

    def drained(sub: Any) -> list[str | None]:
        out = []
        while not sub.queue.empty():
            event = sub.queue.get_nowait()
            out.append(None if event is None else event["type"])
        return out

    assert drained(early) == ["call_started", "partial", "final", None]
    assert drained(late) == ["call_started", "final", None]  # partials are not replayed
    assert drained(after) == [None]  # the call is over: told at once, not left waiting


async def test_a_subscriber_that_does_not_read_is_cut_off_not_the_call() -> None:
    hub = CallHub(max_subscriber_events=3)
    sub = hub.subscribe(CALL)
    hub.open_call(CALL, STREAM)
    for k in range(10):
        hub.publish(CALL, STREAM, {"type": "final", "text": str(k)})
    assert sub.overflowed
    events = [sub.queue.get_nowait() for _ in range(sub.queue.qsize())]
    assert events[-1] is None and len(events) == 4


# --------------------------------------------------------------------------- the webhook


class ScriptedReceiver:
    """A webhook receiver double: answers each POST with the next status of ``statuses``
    (raising ``OSError`` for None), records every body."""

    def __init__(self, statuses: list[int | None], hold: asyncio.Event | None = None) -> None:
        self.statuses = statuses
        self.bodies: list[dict[str, Any]] = []
        self.hold = hold
        self.waiting = False  # a post is held at ``hold``

    async def __call__(self, url: str, body: bytes, timeout_s: float) -> int:
        if self.hold is not None:
            self.waiting = True
            await self.hold.wait()
        self.bodies.append(json.loads(body))
        status = self.statuses.pop(0) if self.statuses else 200
        if status is None:
            raise OSError("connection refused")
        return status


def _webhook_config(**fields: Any) -> TwilioConfig:
    return TwilioConfig(webhook_url="http://127.0.0.1:9/finals", webhook_backoff_s=0.01, **fields)


async def test_the_webhook_retries_a_bounded_number_of_times() -> None:
    receiver = ScriptedReceiver([None, 503, 200, 500, 500, 500, 404])
    webhook = Webhook(_webhook_config(), post=receiver)
    for k in range(3):
        webhook.submit({"type": "final", "text": str(k)})
    await asyncio.wait_for(webhook.wait_idle(), 5)
    # 0: refused, 503, then delivered; 1: three 500s, given up; 2: 404, not retried.
    assert [b["text"] for b in receiver.bodies] == ["0", "0", "0", "1", "1", "1", "2"]
    assert (webhook.delivered, webhook.failed, webhook.dropped) == (1, 2, 0)
    await webhook.close()


async def test_a_stuck_webhook_never_blocks_submit_and_drops_the_oldest() -> None:
    hold = asyncio.Event()
    receiver = ScriptedReceiver([], hold=hold)
    webhook = Webhook(_webhook_config(webhook_queue_events=2), post=receiver)
    webhook.submit({"type": "final", "text": "0"})
    while not receiver.waiting:
        await asyncio.sleep(0)  # until the poster holds "0" inside the stuck receiver
    for k in range(1, 5):
        webhook.submit({"type": "final", "text": str(k)})  # returns at once: nothing awaits
    hold.set()
    await asyncio.wait_for(webhook.wait_idle(), 5)
    # "0" was taken by the poster before it stuck; of the rest only the newest two fit.
    assert [b["text"] for b in receiver.bodies] == ["0", "3", "4"]
    assert webhook.dropped == 2
    await webhook.close()


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"webhook_url": "ftp://x"}, "http or https"),
        ({"auth_token": ""}, "must not be empty"),
        ({"webhook_attempts": 0}, "webhook_attempts"),
    ],
)
def test_config_is_checked(fields: dict[str, Any], says: str) -> None:
    with pytest.raises(ValueError, match=says):
        TwilioConfig(**fields)


# --------------------------------------------------------------------------- real servers


class WebhookServer:
    """A real HTTP receiver on loopback: records each POSTed JSON body, answers 200."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}/finals"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(
            int(line.split(b":", 1)[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        )
        self.bodies.append(json.loads(await reader.readexactly(length)))
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
        await writer.drain()
        writer.close()

    async def __aenter__(self) -> WebhookServer:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()


@contextlib.asynccontextmanager
async def call_server(
    engine: Any, twilio: TwilioConfig | None = None, **overrides: Any
) -> AsyncIterator[WhisperwireServer]:
    config = ServerConfig(host="127.0.0.1", port=0, capacity_limit=False, **overrides)
    async with WhisperwireServer(lambda: engine, server=config, twilio=twilio) as server:
        yield server


def media_url(server: WhisperwireServer) -> str:
    return f"{server.url}{MEDIA_PATH}"


def signed_headers(server: WhisperwireServer, token: str = TOKEN) -> dict[str, str]:
    """What Twilio sends: the signature of the URL it was given in ``<Stream url>``."""
    url = f"wss://127.0.0.1:{server.port}{MEDIA_PATH}"
    return {"X-Twilio-Signature": RequestValidator(token).compute_signature(url, {})}


async def read_all(ws: ClientConnection) -> list[dict[str, Any]]:
    events = []
    with contextlib.suppress(ConnectionClosed):
        async for raw in ws:
            events.append(json.loads(raw))
    return events


async def send_all(url: str, frames: list[str], **headers: str) -> ClientConnection:
    """Twilio's side: send every frame, then wait for the server to close the stream."""
    async with connect(url, additional_headers=headers) as ws:
        with contextlib.suppress(ConnectionClosed):
            for frame in frames:
                await ws.send(frame)
            await asyncio.wait_for(ws.wait_closed(), WAIT_S)
    return ws


def text_of(events: list[dict[str, Any]], track: str) -> str:
    return " ".join(e["text"] for e in events if e["type"] == "final" and e["track"] == track)


def reference(manifest: list[ManifestRow], file: str) -> str:
    return next(row.transcript for row in manifest if row.file == file)


async def test_a_two_track_call_is_transcribed_per_track_to_subscribers_and_the_webhook(
    engine: Engine, speech_dir: Path, manifest: list[ManifestRow]
) -> None:
    """The call Twilio streams with ``track="both_tracks"``, signed with the account's token:
    each track's speech comes back as its own finals to a subscriber by callSid and one by
    streamSid, with the DTMF digit and the mark; every final also reaches the webhook."""
    inbound = load_clip(speech_dir / INBOUND_CLIP)
    outbound = load_clip(speech_dir / OUTBOUND_CLIP)
    pad = np.zeros(SAMPLE_RATE_HZ, np.float32)
    frames = CallFrames(
        {
            "inbound": phone_line(np.concatenate([inbound, pad])),
            "outbound": phone_line(np.concatenate([pad, outbound, pad])),
        }
    )
    async with WebhookServer() as receiver:
        twilio = TwilioConfig(auth_token=TOKEN, webhook_url=receiver.url)
        async with call_server(engine, twilio) as server:
            base = f"{server.url}{EVENTS_PATH}"
            async with (
                connect(f"{base}?call_sid={CALL}") as by_call,
                connect(f"{base}?streamSid={STREAM}") as by_stream,
            ):
                readers = [asyncio.create_task(read_all(ws)) for ws in (by_call, by_stream)]
                wire = [
                    *frames.opening(FirstName="Jane"),
                    *frames.media(),
                    frames.dtmf("5"),
                    frames.mark("end-of-greeting"),
                    frames.stop(),
                ]
                twilio_ws = await send_all(media_url(server), wire, **signed_headers(server))
                call_events, stream_events = await asyncio.wait_for(
                    asyncio.gather(*readers), WAIT_S
                )
                assert by_call.close_code == 1000
            assert server.webhook is not None
            await asyncio.wait_for(server.webhook.wait_idle(), WAIT_S)
    assert twilio_ws.close_code == 1000
    assert [e["type"] for e in call_events] == [e["type"] for e in stream_events]
    started, ended = call_events[0], call_events[-1]
    assert started["type"] == "call_started" and started["custom_parameters"] == {
        "FirstName": "Jane"
    }
    assert ended == {"call_sid": CALL, "stream_sid": STREAM, "type": "call_ended", "reason": "stop"}
    assert all((e["call_sid"], e["stream_sid"]) == (CALL, STREAM) for e in call_events)
    assert {"type": "dtmf", "track": "inbound_track", "digit": "5"}.items() <= next(
        e for e in call_events if e["type"] == "dtmf"
    ).items()
    assert any(e["type"] == "mark" and e["name"] == "end-of-greeting" for e in call_events)
    assert not [e for e in call_events if e["type"] == "error"]
    for track, clip, line in (
        ("inbound", INBOUND_CLIP, frames.tracks["inbound"]),
        ("outbound", OUTBOUND_CLIP, frames.tracks["outbound"]),
    ):
        text = text_of(call_events, track)
        assert wer(reference(manifest, clip), text) <= MAX_WER_CLIP, (track, text)
        [done] = [e for e in call_events if e["type"] == "done" and e["track"] == track]
        assert done["audio_received_s"] == pytest.approx(len(line) / PHONE_RATE_HZ, abs=1e-3)
    hooked = receiver.bodies
    finals = [e for e in call_events if e["type"] == "final"]
    assert [(b["track"], b["text"]) for b in hooked] == [(f["track"], f["text"]) for f in finals]
    assert all(b["call_sid"] == CALL and b["type"] == "final" for b in hooked)


async def test_unsigned_or_wrongly_signed_streams_are_refused_with_403(speech_dir: Path) -> None:
    async with call_server(ScriptedEngine(), TwilioConfig(auth_token=TOKEN)) as server:
        for headers in ({}, signed_headers(server, token="not-the-account-token")):
            with pytest.raises(InvalidStatus) as refused:
                async with connect(media_url(server), additional_headers=headers):
                    pass
            assert refused.value.response.status_code == 403
            assert b"X-Twilio-Signature" in refused.value.response.body
        # Signed, it is taken (an empty call: connected, start, stop).
        frames = CallFrames({"inbound": b""})
        ws = await send_all(
            media_url(server), [*frames.opening(), frames.stop()], **signed_headers(server)
        )
        assert ws.close_code == 1000


@pytest.mark.parametrize(
    ("bad", "says"),
    [
        (_media("%%%"), "media.payload is not valid base64"),
        (json.dumps({"event": "transcribe", "streamSid": STREAM}), "unknown event 'transcribe'"),
    ],
)
async def test_bad_input_closes_the_stream_after_its_accepted_audio_and_spares_others(
    bad: str, says: str, speech_dir: Path
) -> None:
    """Audio, then a frame Twilio would not send: the stream closes 1008 saying why, the
    subscriber gets the error, the finals of every byte accepted before it (``done`` counts
    them), and the end; a v1 stream on the same server at the same time is untouched."""
    line = phone_line(load_clip(speech_dir / INBOUND_CLIP)[: 3 * SAMPLE_RATE_HZ])
    line += bytes([0xFF]) * 161  # silence, in a payload of odd length
    frames = CallFrames({"inbound": line})
    async with (
        call_server(ScriptedEngine()) as server,
        connect(f"{server.url}{EVENTS_PATH}?call_sid={CALL}") as sub,
    ):
        reader = asyncio.create_task(read_all(sub))
        other = asyncio.create_task(_v1_stream(server, speech_dir))
        wire = [*frames.opening(), *frames.media(), bad, *list(frames.media())[:5]]
        twilio_ws = await send_all(media_url(server), wire)
        events = await asyncio.wait_for(reader, 30)
        other_events = await asyncio.wait_for(other, 30)
    assert twilio_ws.close_code == 1008 and says in (twilio_ws.close_reason or "")
    kinds = [e["type"] for e in events]
    assert kinds[0] == "call_started" and kinds[-1] == "call_ended"
    [error] = [e for e in events if e["type"] == "error"]
    assert says in error["message"] and error["fatal"]
    [done] = [e for e in events if e["type"] == "done"]
    assert done["audio_received_s"] == pytest.approx(len(line) / PHONE_RATE_HZ, abs=1e-3)
    assert text_of(events, "inbound").split()[:2] == ["w0", "w1"]
    assert other_events[-1]["type"] == "done" and not [
        e for e in other_events if e["type"] == "error"
    ]


async def _v1_stream(server: WhisperwireServer, speech_dir: Path) -> list[dict[str, Any]]:
    frames = pcm_frames(load_clip(speech_dir / OUTBOUND_CLIP)[: 2 * SAMPLE_RATE_HZ])
    async with connect(f"{server.url}/v1/stream") as ws:
        for frame in frames:
            await ws.send(frame)
        await ws.send('{"type": "end"}')
        return await read_all(ws)


async def test_an_events_socket_must_name_its_call(speech_dir: Path) -> None:
    async with call_server(ScriptedEngine()) as server:
        with pytest.raises(InvalidStatus) as refused:
            async with connect(f"{server.url}{EVENTS_PATH}"):
                pass
        assert refused.value.response.status_code == 400
        assert b"call_sid" in refused.value.response.body


async def test_shutdown_ends_waiting_subscribers_and_finishes_a_call_in_progress(
    speech_dir: Path,
) -> None:
    line = phone_line(load_clip(speech_dir / INBOUND_CLIP)[: 2 * SAMPLE_RATE_HZ])
    frames = CallFrames({"inbound": line})
    async with call_server(ScriptedEngine()) as server:
        waiting = await connect(f"{server.url}{EVENTS_PATH}?call_sid=CAnever")
        idle_reader = asyncio.create_task(read_all(waiting))
        sub = await connect(f"{server.url}{EVENTS_PATH}?call_sid={CALL}")
        twilio_ws = await connect(media_url(server))
        for frame in [*frames.opening(), *frames.media(), frames.mark("all-sent")]:
            await twilio_ws.send(frame)
        # Frames are taken in order: once the mark is out, every media frame is in. No stop:
        # the call is still going when the server shuts down.
        call_events = []
        while not call_events or call_events[-1]["type"] != "mark":
            call_events.append(json.loads(await asyncio.wait_for(sub.recv(), 30)))
        await server.shutdown()
        call_events += await asyncio.wait_for(read_all(sub), 30)
        idle_events = await asyncio.wait_for(idle_reader, 30)
    assert idle_events == [] and waiting.close_code == 1000
    assert call_events[-1]["type"] == "call_ended" and call_events[-1]["reason"]
    [done] = [e for e in call_events if e["type"] == "done"]
    assert done["audio_received_s"] == pytest.approx(len(line) / PHONE_RATE_HZ, abs=1e-3)
    assert twilio_ws.close_code == 1001


async def test_a_silent_socket_is_finished_after_the_idle_timeout(speech_dir: Path) -> None:
    """Twilio sends media all through a call: a stream that goes quiet is finished (its
    audio transcribed, the subscriber told why) instead of holding a session forever."""
    line = phone_line(load_clip(speech_dir / INBOUND_CLIP)[:SAMPLE_RATE_HZ])
    frames = CallFrames({"inbound": line})
    async with (
        call_server(ScriptedEngine(), idle_timeout_s=0.5) as server,
        connect(f"{server.url}{EVENTS_PATH}?call_sid={CALL}") as sub,
    ):
        reader = asyncio.create_task(read_all(sub))
        async with connect(media_url(server)) as twilio_ws:
            for frame in [*frames.opening(), *frames.media()]:
                await twilio_ws.send(frame)
            await asyncio.wait_for(twilio_ws.wait_closed(), 30)
        events = await asyncio.wait_for(reader, 30)
        _, _, body = await http_get(server.http_url + "/metrics")
    assert twilio_ws.close_code == 1000 and twilio_ws.close_reason == "idle timeout"
    [error] = [e for e in events if e["type"] == "error"]
    assert error["code"] == "idle_timeout"
    assert events[-1]["type"] == "call_ended" and events[-1]["reason"] == "idle timeout"
    received = metric_value(body.decode(), "whisperwire_audio_received_seconds_total")
    assert received == pytest.approx(len(line) / PHONE_RATE_HZ, abs=1e-3)
