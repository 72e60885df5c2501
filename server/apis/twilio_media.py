"""Twilio Media Streams, pointed straight at the server: ``<Stream url="wss://HOST/twilio/media">``.

Twilio opens a WebSocket and sends JSON text frames (``connected``, ``start``, ``media``,
``dtmf``, ``mark``, ``stop``); the audio is base64 G.711 mu-law at 8 kHz in ``media``
payloads, one track or two (``inbound``: the caller; ``outbound``: what the call plays to the
caller). Each track is transcribed as its own ``Session`` (a speaker of its own) on the shared
decode lanes. Twilio reads nothing we could send back about transcripts, so they go where the
user asks:

- an events WebSocket, ``/twilio/events?call_sid=CA...`` (or ``stream_sid=MZ...``), that
  subscribers open before or during the call: the call's ``call_started``, then v1's messages
  (``final``, ``partial``, ...) of each track with ``call_sid``, ``stream_sid`` and
  ``track`` added, ``dtmf`` and ``mark``, and ``call_ended`` before a 1000 close;
- a webhook (``TwilioConfig.webhook_url``) that receives each final as JSON, from a bounded
  queue with bounded retries, so a slow or dead receiver never holds up the audio.

With ``TwilioConfig.auth_token`` set, only handshakes carrying a valid ``X-Twilio-Signature``
are taken (HMAC-SHA1 of the URL Twilio requested, keyed with the account's auth token, base64:
what ``twilio.request_validator.RequestValidator`` computes). Bad input (a frame that is not
Twilio's JSON, an unknown event, a payload that is not base64, media before ``start``) ends the
stream as Twilio's own server-side errors do: the stream is closed (1008, the reason in the
close frame) after every track has transcribed the audio it accepted, and subscribers get an
``error`` and ``call_ended``. Docs: ``docs/telephony.md``.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import collections
import contextlib
import dataclasses
import hashlib
import hmac
import json
import logging
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol
from urllib.parse import parse_qs, urlsplit

from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request

from server.config import ServerConfig, StreamingConfig, VadConfig
from server.core.session import Session
from server.decode.pipeline import Pipeline
from server.decode.stream_driver import AdapterEvent, DriverOutcome, StreamDriver
from server.metrics import Metrics
from server.protocol.errors import StreamError
from server.protocol.formats import AudioFormat
from server.protocol.messages import ErrorMessage, FinalMessage, ServerMessage

logger = logging.getLogger("server.apis.twilio_media")

MEDIA_PATH = "/twilio/media"
EVENTS_PATH = "/twilio/events"
SIGNATURE_HEADER = "X-Twilio-Signature"
# Twilio's mediaFormat.encoding names, as our encodings (Media Streams send mu-law only today).
MEDIA_ENCODINGS = {"audio/x-mulaw": "mulaw", "audio/x-alaw": "alaw"}
TRACKS = ("inbound", "outbound")
MESSAGE_EVENTS = ("connected", "start", "media", "dtmf", "mark", "stop")
MAX_HISTORY_EVENTS = 2000  # a call's events kept for subscribers who join late
MAX_ENDED_CALLS = 256  # ended calls remembered, so a late subscriber is told, not left waiting


@dataclass(frozen=True)
class TwilioConfig:
    """Twilio Media Streams: who may connect and where finals go besides the events socket."""

    auth_token: str | None = None  # the account's auth token: signatures are checked when set
    webhook_url: str | None = None  # each final is POSTed here as JSON when set
    webhook_attempts: int = 3  # tries per final (the first and the retries)
    webhook_timeout_s: float = 5.0  # per try
    webhook_backoff_s: float = 0.5  # before the first retry; doubled for each further one
    webhook_queue_events: int = 1000  # finals waiting to be posted; the oldest goes when full
    subscriber_queue_events: int = 1000  # events waiting for one slow subscriber

    def __post_init__(self) -> None:
        if self.auth_token is not None and not self.auth_token:
            raise ValueError("auth_token must not be empty; leave it unset for no checks")
        if self.webhook_url is not None and urlsplit(self.webhook_url).scheme not in (
            "http",
            "https",
        ):
            raise ValueError(f"webhook_url must be an http or https URL; got {self.webhook_url!r}")
        if self.webhook_attempts < 1:
            raise ValueError(f"webhook_attempts must be >= 1; got {self.webhook_attempts}")
        for name in ("webhook_timeout_s", "webhook_backoff_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0; got {getattr(self, name)}")
        for name in ("webhook_queue_events", "subscriber_queue_events"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1; got {getattr(self, name)}")


# --------------------------------------------------------------------------- signatures


def signature(url: str, auth_token: str) -> str:
    """Twilio's ``X-Twilio-Signature`` of a request without POST parameters (a WebSocket
    handshake is a GET): base64 of HMAC-SHA1 of the URL, keyed with the auth token."""
    mac = hmac.new(auth_token.encode("utf-8"), url.encode("utf-8"), hashlib.sha1)
    return base64.b64encode(mac.digest()).decode("ascii")


def _urls_signed(request: Request) -> Iterator[str]:
    """The URLs Twilio may have signed for this handshake: it requested ``wss://`` (or
    ``ws://``) of the Host it connected to, with or without the scheme's default port, as
    ``RequestValidator`` also tries."""
    host = request.headers.get("Host", "")
    bare = host.rsplit(":", 1)[0] if host.endswith((":443", ":80")) else host
    for scheme, port in (("wss", 443), ("ws", 80)):
        for name in dict.fromkeys((host, bare, f"{bare}:{port}")):
            yield f"{scheme}://{name}{request.path}"


def signature_problem(request: Request, auth_token: str | None) -> str | None:
    """Why this handshake is not Twilio's (HTTP 403), or None; no token: no check."""
    if auth_token is None:
        return None
    offered = request.headers.get(SIGNATURE_HEADER)
    if not offered:
        return f"missing {SIGNATURE_HEADER}: only Twilio may open this stream"
    for url in _urls_signed(request):
        if hmac.compare_digest(signature(url, auth_token), offered):
            return None
    return f"invalid {SIGNATURE_HEADER}: the stream was not signed with this account's token"


# --------------------------------------------------------------------------- Twilio's messages


class TwilioStreamError(StreamError):
    """A frame Twilio would not send: the stream is closed with 1008."""

    code = "protocol_error"

    def __init__(self, message: str) -> None:
        super().__init__(message, close_code=1008)


@dataclass(frozen=True)
class CallStart:
    stream_sid: str
    call_sid: str
    account_sid: str
    tracks: tuple[str, ...]
    audio_format: AudioFormat
    custom_parameters: dict[str, str]
    media_format: dict[str, Any]  # as Twilio sent it


@dataclass(frozen=True)
class Media:
    track: str
    chunk: int
    timestamp_ms: int
    payload: bytes


@dataclass(frozen=True)
class Dtmf:
    track: str
    digit: str


@dataclass(frozen=True)
class Mark:
    name: str


@dataclass(frozen=True)
class CallStop:
    pass


TwilioEvent = CallStart | Media | Dtmf | Mark | CallStop


class TwilioStream:
    """Twilio's Media Streams messages in, typed events out; no I/O. Raises
    ``TwilioStreamError`` for a frame Twilio would not send, saying what is wrong."""

    def __init__(self) -> None:
        self.start: CallStart | None = None
        self.stopped = False

    def receive(self, frame: str | bytes) -> TwilioEvent | None:
        """One frame's event; None for ``connected``, which carries nothing to act on."""
        if isinstance(frame, bytes):
            raise TwilioStreamError("binary frames are not Media Streams messages")
        try:
            message = json.loads(frame)
        except (json.JSONDecodeError, RecursionError):
            raise TwilioStreamError("frames must be JSON Media Streams messages") from None
        if not isinstance(message, dict):
            raise TwilioStreamError("a Media Streams message is a JSON object")
        kind = message.get("event")
        if kind not in MESSAGE_EVENTS:
            shown = kind[:40] if isinstance(kind, str) else kind
            raise TwilioStreamError(
                f"unknown event {shown!r}; Media Streams send {', '.join(MESSAGE_EVENTS)}"
            )
        if self.stopped:
            raise TwilioStreamError(f"{kind!r} after 'stop'")
        if kind == "connected":
            return None
        if kind == "start":
            if self.start is not None:
                raise TwilioStreamError("a second 'start' on one stream")
            self.start = _start(message)
            return self.start
        if self.start is None:
            raise TwilioStreamError(f"{kind!r} before 'start'")
        if message.get("streamSid") not in (None, self.start.stream_sid):
            raise TwilioStreamError("streamSid differs from the one 'start' gave")
        if kind == "media":
            return self._media(_object(message, "media"))
        if kind == "dtmf":
            body = _object(message, "dtmf")
            return Dtmf(_text(body, "track", "dtmf"), _text(body, "digit", "dtmf"))
        if kind == "mark":
            return Mark(_text(_object(message, "mark"), "name", "mark"))
        self.stopped = True
        return CallStop()

    def _media(self, body: Mapping[str, Any]) -> Media:
        assert self.start is not None
        track = body.get("track", "inbound")
        if track not in self.start.tracks:
            raise TwilioStreamError(
                f"media.track {str(track)[:20]!r} is not one of the stream's tracks "
                f"{', '.join(self.start.tracks)}"
            )
        payload = _text(body, "payload", "media")
        try:
            audio = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise TwilioStreamError("media.payload is not valid base64") from None
        return Media(
            track,
            _number(body.get("chunk", 0), "media.chunk"),
            _number(body.get("timestamp", 0), "media.timestamp"),
            audio,
        )


def _object(message: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    body = message.get(key)
    if not isinstance(body, dict):
        raise TwilioStreamError(f"'{key}' message without its '{key}' object")
    return body


def _text(body: Mapping[str, Any], key: str, where: str) -> str:
    value = body.get(key)
    if not isinstance(value, str):
        raise TwilioStreamError(f"{where}.{key} must be a string")
    return value


def _number(value: Any, where: str) -> int:
    """Twilio sends counters as decimal strings ("chunk": "1"); numbers are taken too."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and value.isdigit() and len(value) <= 15:
        return int(value)
    raise TwilioStreamError(f"{where} must be a whole number")


def _start(message: Mapping[str, Any]) -> CallStart:
    body = _object(message, "start")
    fmt = body.get("mediaFormat")
    if not isinstance(fmt, dict):
        raise TwilioStreamError("start.mediaFormat must be an object")
    encoding = MEDIA_ENCODINGS.get(fmt.get("encoding"))  # type: ignore[arg-type]
    if encoding is None:
        raise TwilioStreamError(
            f"start.mediaFormat.encoding must be one of {', '.join(MEDIA_ENCODINGS)}"
        )
    if fmt.get("channels", 1) != 1:
        raise TwilioStreamError("start.mediaFormat.channels must be 1")
    try:
        audio_format = AudioFormat(_number(fmt.get("sampleRate"), "sampleRate"), encoding)
    except ValueError as exc:
        raise TwilioStreamError(f"start.mediaFormat: {exc}") from None
    tracks = body.get("tracks", ["inbound"])
    if (
        not isinstance(tracks, list)
        or not tracks
        or any(t not in TRACKS for t in tracks)
        or len(set(tracks)) != len(tracks)
    ):
        raise TwilioStreamError(f"start.tracks must list {' and/or '.join(TRACKS)}")
    custom = body.get("customParameters", {})
    if not isinstance(custom, dict) or not all(isinstance(v, str) for v in custom.values()):
        raise TwilioStreamError("start.customParameters must map names to strings")
    return CallStart(
        stream_sid=_text(body, "streamSid", "start"),
        call_sid=_text(body, "callSid", "start"),
        account_sid=str(body.get("accountSid", "")),
        tracks=tuple(tracks),
        audio_format=audio_format,
        custom_parameters=dict(custom),
        media_format=dict(fmt),
    )


# --------------------------------------------------------------------------- subscribers


@dataclass
class _Call:
    """One call's events so far, for subscribers who join while it runs."""

    call_sid: str
    stream_sid: str
    history: collections.deque[dict[str, Any]] = field(
        default_factory=lambda: collections.deque(maxlen=MAX_HISTORY_EVENTS)
    )


class Subscription:
    """One events socket's queue: events, then None when its call ended (or the server
    stops). ``overflowed`` when the subscriber fell ``max_events`` behind."""

    def __init__(self, key: str, max_events: int) -> None:
        self.key = key
        self.queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue(max_events + 1)
        self.max_events = max_events
        self.overflowed = False

    def put(self, event: dict[str, Any] | None) -> None:
        if self.overflowed:
            return
        if event is not None and self.queue.qsize() >= self.max_events:
            self.overflowed = True
            event = None  # the subscriber does not read: it is closed, and says so
        with contextlib.suppress(asyncio.QueueFull):
            self.queue.put_nowait(event)


class CallHub:
    """Calls in progress and the subscribers of each, by call SID and stream SID. Lives on
    the server: it is how a call's connection and its subscribers' connections meet."""

    def __init__(self, max_subscriber_events: int = 1000) -> None:
        self._calls: dict[str, _Call] = {}
        self._subscribers: dict[str, set[Subscription]] = {}
        self._ended: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._max_events = max_subscriber_events
        self._closed = False

    def subscribe(self, key: str) -> Subscription:
        """A subscription to the call with this SID: past events of a call in progress first;
        a call that already ended gets only the end."""
        sub = Subscription(key, self._max_events)
        call = self._calls.get(key)
        if call is not None:
            for event in call.history:
                sub.put(event)
        if self._closed or key in self._ended:
            sub.put(None)
            return sub
        self._subscribers.setdefault(key, set()).add(sub)
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        subs = self._subscribers.get(sub.key)
        if subs is not None:
            subs.discard(sub)
            if not subs:
                del self._subscribers[sub.key]

    def open_call(self, call_sid: str, stream_sid: str) -> None:
        call = _Call(call_sid, stream_sid)
        self._calls[call_sid] = self._calls[stream_sid] = call

    def publish(self, call_sid: str, stream_sid: str, event: dict[str, Any]) -> None:
        call = self._calls.get(call_sid)
        if call is not None and event.get("type") != "partial":
            call.history.append(event)  # partials are superseded: late joiners need none
        for key in dict.fromkeys((call_sid, stream_sid)):
            for sub in list(self._subscribers.get(key, ())):
                sub.put(event)

    def end_call(self, call_sid: str, stream_sid: str) -> None:
        for key in dict.fromkeys((call_sid, stream_sid)):
            self._calls.pop(key, None)
            self._ended[key] = None
            for sub in self._subscribers.pop(key, set()):
                sub.put(None)
        while len(self._ended) > MAX_ENDED_CALLS:
            self._ended.popitem(last=False)

    def close(self) -> None:
        """The server stops: subscribers waiting for a call that has not started end now;
        those of a call in progress end with it (its finals are still to come)."""
        self._closed = True
        for key in [k for k in self._subscribers if k not in self._calls]:
            for sub in self._subscribers.pop(key):
                sub.put(None)


def subscription_key(request: Request | None) -> str | None:
    """The SID an events socket asks for: ``call_sid`` / ``callSid`` or ``stream_sid`` /
    ``streamSid`` in the query; None when it names none."""
    params = parse_qs(urlsplit(request.path if request is not None else "").query)
    for name in ("call_sid", "callSid", "stream_sid", "streamSid"):
        values = params.get(name)
        if values and values[-1]:
            return values[-1][:64]
    return None


def events_problem(request: Request, streaming: StreamingConfig) -> str | None:
    """Why an events socket's handshake is refused (HTTP 400), or None."""
    if subscription_key(request) is None:
        return "name the call: /twilio/events?call_sid=CA... or ?stream_sid=MZ..."
    return None


async def serve_subscriber(ws: ServerConnection, hub: CallHub, close_timeout_s: float) -> None:
    """Forward the call's events to one subscriber until the call ends (1000), the
    subscriber stops reading (1008) or goes away."""
    key = subscription_key(ws.request)
    assert key is not None  # events_problem refused the handshake otherwise
    sub = hub.subscribe(key)
    reader = asyncio.create_task(_discard_incoming(ws))
    try:
        while True:
            getter = asyncio.ensure_future(sub.queue.get())
            done, _ = await asyncio.wait({getter, reader}, return_when=asyncio.FIRST_COMPLETED)
            if getter not in done:
                getter.cancel()
                return  # the subscriber closed
            event = getter.result()
            if event is None:
                break
            await ws.send(json.dumps(event, ensure_ascii=False))
        code, reason = (1008, "subscriber does not read") if sub.overflowed else (1000, "done")
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(ws.close(code, reason), 2 * close_timeout_s)
    except ConnectionClosed:
        return
    finally:
        hub.unsubscribe(sub)
        reader.cancel()
        with contextlib.suppress(asyncio.CancelledError, ConnectionClosed):
            await reader


async def _discard_incoming(ws: ServerConnection) -> None:
    """Subscribers have nothing to say; reading keeps pings answered and notices the close."""
    with contextlib.suppress(ConnectionClosed):
        async for _ in ws:
            pass


# --------------------------------------------------------------------------- the webhook

Post = Callable[[str, bytes, float], Awaitable[int]]


async def post_json(url: str, body: bytes, timeout_s: float) -> int:
    """POST ``body`` as JSON (in a worker thread: urllib blocks); the HTTP status."""

    def post() -> int:
        request = urllib.request.Request(
            url, data=body, method="POST", headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as answer:
                return int(answer.status)
        except urllib.error.HTTPError as exc:
            return int(exc.code)

    return await asyncio.to_thread(post)


class Webhook:
    """Posts each final to the configured URL from a bounded queue: ``submit`` never waits
    (when the queue is full the oldest final is dropped, and counted), and each final is
    tried ``attempts`` times with doubling backoff on a network error or a 5xx/429 answer."""

    def __init__(self, config: TwilioConfig, post: Post = post_json) -> None:
        assert config.webhook_url is not None
        self._url = config.webhook_url
        self._config = config
        self._post = post
        self._queue: collections.deque[dict[str, Any]] = collections.deque()
        self._ready = asyncio.Event()
        self._idle = asyncio.Event()  # set while nothing is queued or being posted
        self._idle.set()
        self._task: asyncio.Task[None] | None = None
        self.delivered = 0
        self.failed = 0  # gave up after every attempt, or refused with a 4xx
        self.dropped = 0  # pushed out of a full queue

    def submit(self, event: dict[str, Any]) -> None:
        if len(self._queue) >= self._config.webhook_queue_events:
            self._queue.popleft()
            self.dropped += 1
            logger.warning("webhook queue full: dropped the oldest final")
        self._queue.append(event)
        self._idle.clear()
        self._ready.set()
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="twilio-webhook")

    async def wait_idle(self) -> None:
        """Until every final submitted so far was delivered or given up on."""
        await self._idle.wait()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        while True:
            await self._ready.wait()
            while self._queue:
                await self._deliver(self._queue.popleft())
            self._ready.clear()
            self._idle.set()

    async def _deliver(self, event: dict[str, Any]) -> None:
        body = json.dumps(event, ensure_ascii=False).encode("utf-8")
        backoff = self._config.webhook_backoff_s
        for attempt in range(1, self._config.webhook_attempts + 1):
            try:
                status = await self._post(self._url, body, self._config.webhook_timeout_s)
            except (OSError, asyncio.TimeoutError) as exc:
                why = f"{type(exc).__name__}: {exc}"
            else:
                if 200 <= status < 300:
                    self.delivered += 1
                    return
                why = f"HTTP {status}"
                if 400 <= status < 500 and status != 429:
                    break  # the receiver refuses it: trying again would not change that
            if attempt < self._config.webhook_attempts:
                logger.info("webhook attempt %d failed (%s); retrying", attempt, why)
                await asyncio.sleep(backoff)
                backoff *= 2
        self.failed += 1
        logger.warning("webhook gave up on a final of call %s: %s", event.get("call_sid"), why)


# --------------------------------------------------------------------------- one call


class CallServer(Protocol):
    """What a call's connection uses of the server (``WhisperwireServer``)."""

    @property
    def pipeline(self) -> Pipeline: ...

    @property
    def metrics(self) -> Metrics: ...

    @property
    def config(self) -> ServerConfig: ...

    @property
    def streaming(self) -> StreamingConfig: ...

    @property
    def vad(self) -> VadConfig: ...

    @property
    def calls(self) -> CallHub: ...

    @property
    def webhook(self) -> Webhook | None: ...


@dataclass(frozen=True)
class _Stop:
    code: int
    reason: str
    error: str | None = None  # told to subscribers first when set
    code_name: str = "protocol_error"  # the error's code (StreamError.code)


class TwilioCall:
    """One Media Streams connection: a session per track, fed from Twilio's frames, whose
    events go to the call's subscribers and finals to the webhook. The server keeps it with
    its connections (``done``, ``lag_s``, ``request_stop``, ``abort``)."""

    def __init__(self, ws: ServerConnection, session_id: str, server: CallServer) -> None:
        self.ws = ws
        self.session_id = session_id
        self.server = server
        self.log = logging.LoggerAdapter(logger, {"session_id": session_id})
        self.parser = TwilioStream()
        self.drivers: dict[str, StreamDriver] = {}
        self._pumps: list[asyncio.Task[None]] = []
        self._stop: asyncio.Future[_Stop] = asyncio.get_running_loop().create_future()
        self._ended = False

    @property
    def done(self) -> bool:
        return self._ended

    @property
    def lag_s(self) -> float:
        return max((d.session.lag_s for d in self.drivers.values()), default=0.0)

    def request_stop(self, stop: Any) -> None:
        """The server ends the call (shutdown): every track's finals, then close 1001."""
        if not self._stop.done():
            self._stop.set_result(_Stop(stop.close_code, stop.close_reason))

    def abort(self) -> None:
        self.ws.transport.abort()

    async def run(self) -> None:
        ingest = asyncio.create_task(self._ingest(), name=f"twilio-{self.session_id}")
        try:
            await asyncio.wait({ingest, self._stop}, return_when=asyncio.FIRST_COMPLETED)
            if ingest.done():
                stop = ingest.result()  # a bug raises here: the server's catch-all
            else:
                stop = self._stop.result()
                ingest.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await ingest
            await self._finish(stop)
        finally:
            if not ingest.done():
                ingest.cancel()
            for driver in self.drivers.values():
                await driver.close()
            for pump in self._pumps:
                pump.cancel()
            self._ended = True

    async def _ingest(self) -> _Stop:
        """Frames until ``stop`` (1000), a bad frame (1008), silence on the socket for the
        idle timeout (Twilio sends media all through a call), or the socket closing."""
        idle_s = self.server.config.idle_timeout_s
        try:
            while True:
                try:
                    frame = await asyncio.wait_for(self.ws.recv(), idle_s)
                except asyncio.TimeoutError:
                    why = f"no frame received for {idle_s:g} s; finishing the call"
                    return _Stop(1000, "idle timeout", why, "idle_timeout")
                try:
                    event = self.parser.receive(frame)
                    if event is not None:
                        self._act(event)
                except StreamError as exc:
                    self.log.info("Twilio stream error: %s", exc)
                    return _Stop(exc.close_code or 1008, str(exc), str(exc), exc.code)
                if isinstance(event, CallStop):
                    return _Stop(1000, "stop")
        except ConnectionClosed:
            pass
        return _Stop(1000, "disconnected")

    def _act(self, event: TwilioEvent) -> None:
        if isinstance(event, CallStart):
            self._open(event)
        elif isinstance(event, Media):
            driver = self.drivers[event.track]
            before_s = driver.session.audio_received_s
            try:
                driver.feed_audio(event.payload)
            finally:
                received_s = driver.session.audio_received_s - before_s
                self.server.metrics.audio_received_s.inc(max(0.0, received_s))
            if driver.session.audio_received_s > self.server.config.max_session_s:
                raise StreamError(
                    f"calls are limited to {self.server.config.max_session_s:g} s per track",
                    close_code=1013,
                )
        elif isinstance(event, Dtmf):
            self._publish({"type": "dtmf", "track": event.track, "digit": event.digit})
        elif isinstance(event, Mark):
            self._publish({"type": "mark", "name": event.name})

    def _open(self, start: CallStart) -> None:
        server = self.server
        engine = server.pipeline.engine
        server.calls.open_call(start.call_sid, start.stream_sid)
        self._publish(
            {
                "type": "call_started",
                "account_sid": start.account_sid,
                "tracks": list(start.tracks),
                "media_format": start.media_format,
                "custom_parameters": start.custom_parameters,
            }
        )
        self.log.info(
            "call %s stream %s: tracks %s", start.call_sid, start.stream_sid, start.tracks
        )
        for track in start.tracks:
            session = Session(
                f"{self.session_id}-{track}",
                audio_format=start.audio_format,
                streaming=server.streaming,
                vad=server.vad,
                multilingual=engine.dims.is_multilingual,
                frame_voicing=server.pipeline.frame_voicing,
            )
            # Each track is one speaker already: no labels to wait for within it.
            session.configure(dataclasses.replace(session.settings, speakers=False))
            driver = StreamDriver(
                session, server.pipeline, max_pending_messages=server.config.max_pending_messages
            )
            self.drivers[track] = driver
            self._pumps.append(
                asyncio.create_task(self._pump(track, driver), name=f"twilio-{track}")
            )

    async def _pump(self, track: str, driver: StreamDriver) -> None:
        """A track's session events to the subscribers, its finals to the webhook."""
        while True:
            message = await driver.outbox.get()
            try:
                if isinstance(message, AdapterEvent) or not isinstance(message, ServerMessage):
                    continue
                event: dict[str, Any] = json.loads(message.to_json())
                event["track"] = track
                self._publish(event)
                webhook = self.server.webhook
                if webhook is not None and isinstance(message, FinalMessage):
                    assert self.parser.start is not None
                    webhook.submit(self._stamped(event))
            finally:
                driver.outbox.task_done()

    def _stamped(self, event: dict[str, Any]) -> dict[str, Any]:
        start = self.parser.start
        assert start is not None
        return {"call_sid": start.call_sid, "stream_sid": start.stream_sid, **event}

    def _publish(self, event: dict[str, Any]) -> None:
        start = self.parser.start
        if start is not None:
            self.server.calls.publish(start.call_sid, start.stream_sid, self._stamped(event))

    async def _finish(self, stop: _Stop) -> None:
        """End every track (the audio accepted is transcribed to its last final), tell the
        subscribers, close the Twilio socket."""
        if stop.error is not None:
            error = ErrorMessage(stop.code_name, stop.error, True, self._audio_s())
            self._publish(json.loads(error.to_json()))
        for driver in self.drivers.values():
            if not driver.session.ended:
                driver.end(by_server=stop.code != 1000 or stop.reason != "stop")
        outcomes = [d.outcome for d in self.drivers.values()]
        if outcomes:
            await asyncio.wait(outcomes)
            for outcome in outcomes:
                if outcome.result() is DriverOutcome.OVERFLOW:  # a session bug raises here
                    self.log.warning("a track's events overflowed")
            await asyncio.gather(*(d.outbox.join() for d in self.drivers.values()))
        start = self.parser.start
        if start is not None:
            self._publish({"type": "call_ended", "reason": stop.reason})
            self.server.calls.end_call(start.call_sid, start.stream_sid)
        with contextlib.suppress(asyncio.TimeoutError, ConnectionClosed):
            await asyncio.wait_for(
                self.ws.close(stop.code, stop.reason[:120]), 2 * self.server.config.close_timeout_s
            )
        self.log.info(
            "call stream closed (%d %s), %.1f s of audio", stop.code, stop.reason, self._audio_s()
        )

    def _audio_s(self) -> float:
        return sum(d.session.audio_received_s for d in self.drivers.values())


# --------------------------------------------------------------------------- the routes


class Subscriber:
    """An events socket, as the server keeps its connections: it decodes nothing (``done``),
    and ends when its call does or the server closes the hub."""

    def __init__(self, ws: ServerConnection, session_id: str, server: CallServer) -> None:
        self.ws = ws
        self.server = server
        self.done = True  # never counted as an open stream
        self.lag_s = 0.0

    def request_stop(self, stop: Any) -> None:
        """Nothing to do: the hub ends it with its call, or at shutdown."""

    def abort(self) -> None:
        self.ws.transport.abort()

    async def run(self) -> None:
        await serve_subscriber(self.ws, self.server.calls, self.server.config.close_timeout_s)


class ServedConnection(Protocol):
    """What the server keeps of each open connection (``Connection`` and these)."""

    @property
    def done(self) -> bool: ...

    @property
    def lag_s(self) -> float: ...

    def request_stop(self, stop: Any) -> None: ...

    def abort(self) -> None: ...

    async def run(self) -> None: ...


@dataclass(frozen=True)
class CallRoute:
    """A telephony path: its handshake check and the connection that serves it."""

    path: str
    stream: bool  # its connections decode audio: the server's admission applies
    # Replaces the API key check when it returns a verdict: (HTTP status, why) to refuse,
    # "" to accept; None: the server's API key check applies.
    authorize: Callable[[Request, TwilioConfig], tuple[int, str] | str | None]
    problem: Callable[[Request, StreamingConfig], str | None] | None
    connection: Callable[[ServerConnection, str, CallServer], ServedConnection]


def _media_authorize(request: Request, config: TwilioConfig) -> tuple[int, str] | str | None:
    """With an auth token, Twilio's signature is the credential (Twilio cannot send our API
    key); without one, the server's API key check applies."""
    if config.auth_token is None:
        return None
    problem = signature_problem(request, config.auth_token)
    return "" if problem is None else (403, problem)


MEDIA = CallRoute(
    path=MEDIA_PATH,
    stream=True,
    authorize=_media_authorize,
    problem=None,
    connection=TwilioCall,
)
EVENTS = CallRoute(
    path=EVENTS_PATH,
    stream=False,
    authorize=lambda request, config: None,  # subscribers are the user's apps: the API key
    problem=events_problem,
    connection=Subscriber,
)
