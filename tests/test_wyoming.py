"""Home Assistant's Wyoming protocol (``server/apis/wyoming.py``, ``server/serve/wyoming.py``).

Recognition: the ``wyoming`` package's own ``AsyncTcpClient`` driven as Home Assistant's
``components/wyoming/stt.py`` drives it (``describe`` on a connection of its own, as its
``data.py`` does; then ``transcribe``, ``audio-start``, ``audio-chunk``..., ``audio-stop``
and read until ``transcript``), against a real server in this process with the real model,
on real speech. The protocol's edges (bad input, limits, admission, shutdown) use servers of
their own with the scripted engine, which hears one word per half second of window, and raw
sockets for bytes no Wyoming client would send. The framing and the audio conversion are
tested without a server.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
import pytest_asyncio
import soxr
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus
from wyoming.asr import Transcribe, Transcript, TranscriptChunk
from wyoming.audio import AudioChunk, AudioStart, AudioStop
from wyoming.client import AsyncTcpClient
from wyoming.event import Event, async_read_event, read_event, write_event
from wyoming.info import Describe, Info
from wyoming.ping import Ping

from bench.corpus import ManifestRow, load_clip, wer
from server.apis.wyoming import (
    MAX_HEADER_BYTES,
    AudioConverter,
    EventDecoder,
    Started,
    TranscriptStream,
    WyomingAudioFormat,
    WyomingFramingError,
    encode_event,
    server_version,
)
from server.config import PipelineConfig, ServerConfig, WyomingConfig
from server.protocol.errors import AudioFormatError, FrameTooLargeError, ProtocolError
from server.protocol.formats import SAMPLE_RATE_HZ
from server.protocol.messages import DoneMessage, ErrorMessage, FinalMessage, PartialMessage
from server.serve.app import WhisperwireServer
from server.serve.cli import build_parser
from server.serve.wyoming import SERVICE_TYPE, advertised_address, model_languages
from tests.helpers import Float32Array, ScriptedEngine

if TYPE_CHECKING:
    from server.engine.engine import Engine

# The async tests run on the session's loop, the wyoming_server fixture's.
session_loop = pytest.mark.asyncio(loop_scope="session")

WAIT_S = 120.0  # a bound for waits on the real model on a busy 2-core machine
MAX_WER_CLIP = 0.35  # as tests/test_app.py: one short clip, streamed
JFK = "misc_en/jfk.wav"
CLEAN = "librispeech_test-clean/1089-134686-0000.wav"
CHUNK_SAMPLES = 1024  # a chunk of Home Assistant's audio stream: 64 ms at 16 kHz
HOST = "127.0.0.1"


def reference(manifest: list[ManifestRow], file: str) -> str:
    return next(row.transcript for row in manifest if row.file == file)


def s16(audio: Float32Array) -> bytes:
    return (np.clip(audio, -1.0, 32767 / 32768) * 32768).astype("<i2").tobytes()


def chunks(pcm: bytes, fmt: WyomingAudioFormat, samples: int = CHUNK_SAMPLES) -> list[Event]:
    step = samples * fmt.frame_bytes
    return [
        AudioChunk(
            rate=fmt.rate, width=fmt.width, channels=fmt.channels, audio=pcm[i : i + step]
        ).event()
        for i in range(0, len(pcm), step)
    ]


MONO_16K = WyomingAudioFormat(SAMPLE_RATE_HZ, 2, 1)  # what Home Assistant sends


async def transcribe(
    client: AsyncTcpClient,
    pcm: bytes,
    fmt: WyomingAudioFormat = MONO_16K,
    language: str | None = "en",
) -> list[Event]:
    """One transcription as Home Assistant's stt.py makes it: every event written before any
    is read, then the answer read up to ``transcript`` (and here on to ``transcript-stop``)."""
    await client.write_event(Transcribe(language=language).event())
    await client.write_event(
        AudioStart(rate=fmt.rate, width=fmt.width, channels=fmt.channels).event()
    )
    for chunk in chunks(pcm, fmt):
        await client.write_event(chunk)
    await client.write_event(AudioStop().event())
    events: list[Event] = []
    while not events or events[-1].type != "transcript-stop":
        event = await asyncio.wait_for(client.read_event(), WAIT_S)
        assert event is not None, f"connection closed after {[e.type for e in events]}"
        events.append(event)
    return events


def check_stream(events: list[Event]) -> str:
    """The transcript of one transcription's events, checked for their order: start, the
    chunks, the transcript, stop; the chunks, joined as they are, are the transcript."""
    kinds = [e.type for e in events]
    assert kinds[0] == "transcript-start", kinds
    assert kinds[-2:] == ["transcript", "transcript-stop"], kinds
    assert set(kinds[1:-2]) <= {"transcript-chunk"}, kinds
    text = Transcript.from_event(events[-2]).text
    joined = "".join(TranscriptChunk.from_event(e).text for e in events[1:-2])
    assert joined == text, (joined, text)
    return text


# --------------------------------------------------------------------------- servers


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def wyoming_server(engine: Engine) -> AsyncIterator[WhisperwireServer]:
    """A real server with the real model and Wyoming on a free loopback port."""
    config = ServerConfig(host=HOST, port=0, max_sessions=16, capacity_limit=False)
    pipeline = PipelineConfig(max_batch_size=8, batch_wait_ms=5.0)
    async with WhisperwireServer(
        lambda: engine, server=config, pipeline=pipeline, wyoming=WyomingConfig(port=0)
    ) as server:
        yield server


@contextlib.asynccontextmanager
async def scripted(
    engine: ScriptedEngine | None = None,
    wyoming: WyomingConfig | None = None,
    **overrides: Any,
) -> AsyncIterator[WhisperwireServer]:
    config = ServerConfig(host=HOST, port=0, **overrides)
    chosen = engine or ScriptedEngine()
    async with WhisperwireServer(
        lambda: chosen, server=config, wyoming=wyoming or WyomingConfig(port=0)
    ) as server:
        yield server


async def raw(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection(HOST, port)


async def read_all(reader: asyncio.StreamReader) -> list[Event]:
    """Events until the server closes the connection."""
    events: list[Event] = []
    while (event := await asyncio.wait_for(async_read_event(reader), WAIT_S)) is not None:
        events.append(event)
    return events


def errors(events: list[Event]) -> list[dict[str, Any]]:
    return [e.data for e in events if e.type == "error"]


async def speech(speech_dir: Path, seconds: float | None = None) -> bytes:
    audio = load_clip(speech_dir / JFK)
    if seconds is not None:
        audio = audio[: int(seconds * SAMPLE_RATE_HZ)]
    return s16(audio)


# --------------------------------------------------------------------------- recognition


@session_loop
async def test_home_assistant_describes_then_transcribes_real_speech(
    wyoming_server: WhisperwireServer,
    engine: Engine,
    speech_dir: Path,
    manifest: list[ManifestRow],
) -> None:
    port = wyoming_server.wyoming_port
    async with AsyncTcpClient(HOST, port) as client:  # data.py: describe, read until info
        await client.write_event(Describe().event())
        event = await asyncio.wait_for(client.read_event(), WAIT_S)
    assert event is not None and Info.is_type(event.type), event
    (program,) = Info.from_event(event).asr
    assert program.supports_transcript_streaming and program.installed
    assert program.version == server_version()
    (model,) = program.models
    assert (model.name, model.languages, model.installed) == (engine.name, ["en"], True)

    async with AsyncTcpClient(HOST, port) as client:
        events = await transcribe(client, s16(load_clip(speech_dir / JFK)))
    text = check_stream(events)
    assert events[0].data.get("language") == "en"
    assert Transcript.from_event(events[-2]).language == "en"
    assert len(events) > 3, "no transcript-chunk streamed"
    assert wer(reference(manifest, JFK), text) <= MAX_WER_CLIP, text
    assert wyoming_server.active_sessions == 0


@session_loop
async def test_one_connection_serves_transcriptions_in_a_row(
    wyoming_server: WhisperwireServer, speech_dir: Path, manifest: list[ManifestRow]
) -> None:
    async with AsyncTcpClient(HOST, wyoming_server.wyoming_port) as client:
        for clip in (CLEAN, JFK):
            text = check_stream(await transcribe(client, s16(load_clip(speech_dir / clip))))
            assert wer(reference(manifest, clip), text) <= MAX_WER_CLIP, (clip, text)


@pytest.mark.parametrize(
    "fmt",
    [
        WyomingAudioFormat(44_100, 4, 2),  # 32-bit stereo at a rate the session resamples
        WyomingAudioFormat(96_000, 3, 1),  # 24-bit above the session's rates: resampled here
    ],
    ids=["44k1-s32-stereo", "96k-s24-mono"],
)
@session_loop
async def test_any_declared_format_is_converted_for_the_model(
    wyoming_server: WhisperwireServer,
    speech_dir: Path,
    manifest: list[ManifestRow],
    fmt: WyomingAudioFormat,
) -> None:
    audio = soxr.resample(load_clip(speech_dir / JFK), SAMPLE_RATE_HZ, fmt.rate)
    audio = np.clip(audio * 0.9, -1.0, 1.0)
    full = 2 ** (8 * fmt.width - 1)
    ints = np.round(audio.astype(np.float64) * (full - 1)).astype("<i4")
    frames = as_bytes(ints, fmt.width)
    if fmt.channels == 2:
        # Left carries the speech, right a quieter copy: the downmix averages them.
        quiet = np.round(audio.astype(np.float64) * 0.5 * (full - 1)).astype("<i4")
        frames = np.concatenate([frames, as_bytes(quiet, fmt.width)], axis=1)
    async with AsyncTcpClient(HOST, wyoming_server.wyoming_port) as client:
        text = check_stream(await transcribe(client, frames.tobytes(), fmt))
    assert wer(reference(manifest, JFK), text) <= MAX_WER_CLIP, text


def as_bytes(ints: np.ndarray[Any, np.dtype[np.int32]], width: int) -> np.ndarray[Any, Any]:
    """Each int32 sample as ``width`` little-endian bytes (the low ones), one row each."""
    return ints.astype("<i4").view(np.uint8).reshape(-1, 4)[:, :width]


@session_loop
async def test_a_client_is_served_after_one_that_sent_garbage(
    wyoming_server: WhisperwireServer, speech_dir: Path, manifest: list[ManifestRow]
) -> None:
    reader, writer = await raw(wyoming_server.wyoming_port)
    writer.write(b"GET / HTTP/1.1\r\nHost: example\r\n\r\n")
    bad = await read_all(reader)
    writer.close()
    assert [e.get("code") for e in errors(bad)] == ["bad_event"], bad
    async with AsyncTcpClient(HOST, wyoming_server.wyoming_port) as client:
        text = check_stream(await transcribe(client, s16(load_clip(speech_dir / JFK))))
    assert wer(reference(manifest, JFK), text) <= MAX_WER_CLIP, text


# --------------------------------------------------------------------------- bad input


@session_loop
async def test_garbage_header_line_gets_an_error_and_a_close() -> None:
    async with scripted() as app:
        reader, writer = await raw(app.wyoming_port)
        writer.write(b"\x00\xffnot json at all\n")
        events = await read_all(reader)
        assert [e.type for e in events] == ["error"], events
        assert events[0].data["code"] == "bad_event"
        assert "Wyoming" in events[0].data["text"]
        writer.close()
        # The server goes on: a new connection is described.
        async with AsyncTcpClient(HOST, app.wyoming_port) as client:
            await client.write_event(Describe().event())
            event = await asyncio.wait_for(client.read_event(), WAIT_S)
        assert event is not None and event.type == "info"


@session_loop
async def test_payload_longer_than_declared_breaks_the_framing(speech_dir: Path) -> None:
    pcm = await speech(speech_dir, 1.0)
    async with scripted() as app:
        reader, writer = await raw(app.wyoming_port)
        header = {"type": "audio-chunk", "data": MONO, "payload_length": 3200}
        writer.write(
            encode_event(Transcribe(language="en").event())
            + encode_event(AudioStart(**MONO).event())
            + json.dumps(header).encode()
            + b"\n"
            + pcm[:3300]  # 100 bytes more than declared: they run into the next header
            + encode_event(AudioStop().event())
        )
        events = await read_all(reader)
        writer.close()
        assert events[0].type == "transcript-start", events
        assert [e["code"] for e in errors(events)] == ["bad_event"], events
        assert events[-1].type == "error"  # and then the close
        assert app.active_sessions == 0


@session_loop
async def test_payload_shorter_than_declared_breaks_the_framing(speech_dir: Path) -> None:
    pcm = await speech(speech_dir, 1.0)
    async with scripted() as app:
        reader, writer = await raw(app.wyoming_port)
        header = {"type": "audio-chunk", "data": MONO, "payload_length": 3200}
        writer.write(
            encode_event(AudioStart(**MONO).event())
            + json.dumps(header).encode()
            + b"\n"
            + pcm[:3180]  # 20 bytes short: the next header's first 20 bytes make them up
            + encode_event(AudioStop().event())
        )
        events = await read_all(reader)
        writer.close()
        assert [e["code"] for e in errors(events)] == ["bad_event"], events
        assert "transcript" not in [e.type for e in events]


@session_loop
async def test_payload_over_the_frame_limit_is_refused_before_it_is_read() -> None:
    async with scripted() as app:
        reader, writer = await raw(app.wyoming_port)
        limit = app.streaming.max_frame_bytes
        header = {"type": "audio-chunk", "data": MONO, "payload_length": limit + 2}
        writer.write(encode_event(AudioStart(**MONO).event()) + json.dumps(header).encode() + b"\n")
        events = await read_all(reader)
        writer.close()
        assert [e["code"] for e in errors(events)] == ["frame_too_large"], events


MONO = {"rate": SAMPLE_RATE_HZ, "width": 2, "channels": 1}


@pytest.mark.parametrize(
    ("before", "code"),
    [
        ([Transcribe(language="en").event()], "protocol_error"),  # no audio-start
        ([], "protocol_error"),
    ],
    ids=["after-transcribe", "first-event"],
)
@session_loop
async def test_audio_before_audio_start_gets_an_error_and_a_close(
    speech_dir: Path, before: list[Event], code: str
) -> None:
    pcm = await speech(speech_dir, 0.5)
    async with scripted() as app:
        reader, writer = await raw(app.wyoming_port)
        for event in [*before, *chunks(pcm, MONO_16K)]:
            writer.write(encode_event(event))
        events = await read_all(reader)
        writer.close()
        assert [e.type for e in events] == ["error"], events
        assert events[0].data["code"] == code
        assert "audio-start" in events[0].data["text"]


@session_loop
async def test_chunk_of_partial_frames_or_another_format_is_refused(speech_dir: Path) -> None:
    pcm = await speech(speech_dir, 0.5)
    async with scripted() as app:
        for bad, code in (
            (AudioChunk(rate=SAMPLE_RATE_HZ, width=2, channels=1, audio=pcm[:101]), "bad_audio"),
            (AudioChunk(rate=8000, width=2, channels=1, audio=pcm[:100]), "protocol_error"),
        ):
            reader, writer = await raw(app.wyoming_port)
            writer.write(encode_event(AudioStart(**MONO).event()) + encode_event(bad.event()))
            events = await read_all(reader)
            writer.close()
            assert [e["code"] for e in errors(events)] == [code], events


@session_loop
async def test_unknown_event_gets_an_error_and_the_connection_goes_on() -> None:
    async with scripted() as app, AsyncTcpClient(HOST, app.wyoming_port) as client:
        await client.write_event(Event(type="frobnicate", data={"x": 1}))
        await client.write_event(Ping(text="still there?").event())
        await client.write_event(Describe().event())
        replies = [await asyncio.wait_for(client.read_event(), WAIT_S) for _ in range(3)]
    assert [e.type for e in replies if e is not None] == ["error", "pong", "info"], replies
    assert replies[0] is not None and replies[0].data["code"] == "unknown_event"
    assert replies[1] is not None and replies[1].data["text"] == "still there?"


@session_loop
async def test_a_language_the_model_lacks_is_refused() -> None:
    async with scripted() as app, AsyncTcpClient(HOST, app.wyoming_port) as client:
        await client.write_event(Transcribe(language="de-DE").event())
        await client.write_event(AudioStart(**MONO).event())
        event = await asyncio.wait_for(client.read_event(), WAIT_S)
        assert event is not None and event.type == "error", event
        assert "English-only" in event.data["text"]
        assert await asyncio.wait_for(client.read_event(), WAIT_S) is None


# --------------------------------------------------------------------------- limits


@session_loop
async def test_a_transcription_counts_against_the_same_admission_as_websocket_streams(
    speech_dir: Path,
) -> None:
    async with scripted(max_sessions=1, capacity_limit=False) as app:
        async with connect(f"{app.url}/v1/stream") as ws:
            assert json.loads(await ws.recv())["type"] == "ready"
            async with AsyncTcpClient(HOST, app.wyoming_port) as client:
                await client.write_event(AudioStart(**MONO).event())
                event = await asyncio.wait_for(client.read_event(), WAIT_S)
                assert event is not None and event.data.get("code") == "server_full", event
                assert await asyncio.wait_for(client.read_event(), WAIT_S) is None
        await wait_for_no_sessions(app)
        async with AsyncTcpClient(HOST, app.wyoming_port) as client:
            await client.write_event(AudioStart(**MONO).event())
            event = await asyncio.wait_for(client.read_event(), WAIT_S)
            assert event is not None and event.type == "transcript-start", event
            assert app.active_sessions == 1
            with pytest.raises(InvalidStatus) as refused:
                async with connect(f"{app.url}/v1/stream"):
                    pass
            assert refused.value.response.status_code == 503
            for chunk in chunks(await speech(speech_dir, 2.0), MONO_16K):
                await client.write_event(chunk)
            await client.write_event(AudioStop().event())
            rest = [await asyncio.wait_for(client.read_event(), WAIT_S)]
            while rest[-1] is not None and rest[-1].type != "transcript-stop":
                rest.append(await asyncio.wait_for(client.read_event(), WAIT_S))
            transcript = next(e for e in rest if e is not None and e.type == "transcript")
            assert Transcript.from_event(transcript).text
        await wait_for_no_sessions(app)
        # The transcription refused, then the WebSocket handshake (HTTP 503).
        assert app.metrics.sessions_refused.value("server_full") == 2


async def wait_for_no_sessions(app: WhisperwireServer) -> None:
    """Until the server has counted the closed streams out (its handlers finish after the
    client's side of the close)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT_S
    while app.active_sessions:
        assert loop.time() < deadline, "a closed stream is still counted"
        await asyncio.sleep(0.01)


@session_loop
async def test_an_idle_transcription_is_finished_with_its_transcript(speech_dir: Path) -> None:
    async with scripted(idle_timeout_s=0.5) as app:
        reader, writer = await raw(app.wyoming_port)
        writer.write(encode_event(AudioStart(**MONO).event()))
        for chunk in chunks(await speech(speech_dir, 3.0), MONO_16K):
            writer.write(encode_event(chunk))
        events = await read_all(reader)  # the client sends nothing more
        writer.close()
    kinds = [e.type for e in events]
    assert kinds[-2:] == ["transcript", "transcript-stop"], kinds
    assert [e["code"] for e in errors(events)] == ["idle_timeout"], events
    assert Transcript.from_event(events[-2]).text.split(), "the audio sent was not transcribed"


@session_loop
async def test_an_idle_connection_is_closed() -> None:
    async with scripted(wyoming=WyomingConfig(port=0, idle_connection_s=0.2)) as app:
        reader, writer = await raw(app.wyoming_port)
        assert await read_all(reader) == []
        writer.close()


@session_loop
async def test_shutdown_finishes_an_open_transcription(speech_dir: Path) -> None:
    async with scripted() as app, AsyncTcpClient(HOST, app.wyoming_port) as client:
        await client.write_event(AudioStart(**MONO).event())
        started = await asyncio.wait_for(client.read_event(), WAIT_S)
        assert started is not None and started.type == "transcript-start"
        for chunk in chunks(await speech(speech_dir, 3.0), MONO_16K):
            await client.write_event(chunk)
        await client.write_event(Ping().event())  # the pong says every chunk was taken
        events: list[Event] = []
        while not events or events[-1].type != "pong":
            event = await asyncio.wait_for(client.read_event(), WAIT_S)
            assert event is not None
            events.append(event)
        stopping = asyncio.create_task(app.shutdown())
        while (event := await asyncio.wait_for(client.read_event(), WAIT_S)) is not None:
            events.append(event)
        await stopping
    kinds = [e.type for e in events]
    assert kinds[-2:] == ["transcript", "transcript-stop"], kinds
    assert len(Transcript.from_event(events[-2]).text.split()) >= 4  # w0..: 3 s of speech


# --------------------------------------------------------------------------- framing


def wyoming_bytes(*events: Event) -> bytes:
    buffer = io.BytesIO()
    for event in events:
        write_event(event, buffer)
    return buffer.getvalue()


SAMPLE_EVENTS = [
    Describe().event(),
    Transcribe(name="tiny.en", language="en").event(),
    AudioStart(rate=16000, width=2, channels=1).event(),
    AudioChunk(rate=16000, width=2, channels=1, audio=bytes(range(256)) * 4).event(),
    AudioStop().event(),
]


def test_decoder_reads_what_the_wyoming_package_writes_in_any_pieces() -> None:
    data = wyoming_bytes(*SAMPLE_EVENTS)
    for piece in (1, 7, len(data)):
        decoder = EventDecoder(max_payload_bytes=4096)
        got: list[Event] = []
        for i in range(0, len(data), piece):
            decoder.receive_data(data[i : i + piece])
            while (event := decoder.next_event()) is not None:
                got.append(event)
        assert [(e.type, e.data, e.payload) for e in got] == [
            (e.type, e.data, e.payload) for e in SAMPLE_EVENTS
        ]
        assert decoder.buffered_bytes == 0


def test_decoder_merges_inline_data_with_the_data_block() -> None:
    block = json.dumps({"language": "en"}).encode()
    line = json.dumps({"type": "transcribe", "data": {"name": "x"}, "data_length": len(block)})
    decoder = EventDecoder(max_payload_bytes=16)
    decoder.receive_data(line.encode() + b"\n" + block)
    event = decoder.next_event()
    assert event is not None and event.data == {"name": "x", "language": "en"}


def test_the_wyoming_package_reads_what_the_server_writes() -> None:
    data = b"".join(encode_event(e) for e in SAMPLE_EVENTS)
    stream = io.BytesIO(data)
    for sent in SAMPLE_EVENTS:
        got = read_event(stream)
        assert got is not None and (got.type, got.data, got.payload) == (
            sent.type,
            sent.data,
            sent.payload,
        )


@pytest.mark.parametrize(
    ("data", "error"),
    [
        (b"not json\n", WyomingFramingError),
        (b"[1, 2]\n", WyomingFramingError),
        (b'{"data": {}}\n', WyomingFramingError),  # no type
        (b'{"type": "x", "data": [1]}\n', WyomingFramingError),
        (b'{"type": "x", "payload_length": -1}\n', WyomingFramingError),
        (b'{"type": "x", "payload_length": true}\n', WyomingFramingError),
        (b'{"type": "x", "payload_length": "12"}\n', WyomingFramingError),
        (b'{"type": "x", "payload_length": 17}\n', FrameTooLargeError),
        (b'{"type": "x", "data_length": 1000000}\n', WyomingFramingError),
        (b'{"type": "x", "data_length": 3}\n[1]', WyomingFramingError),  # data not an object
        (b"x" * (MAX_HEADER_BYTES + 1), WyomingFramingError),  # no line end in sight
    ],
)
def test_decoder_refuses_what_is_not_a_wyoming_event(data: bytes, error: type[Exception]) -> None:
    decoder = EventDecoder(max_payload_bytes=16)
    decoder.receive_data(data)
    with pytest.raises(error):
        decoder.next_event()


def test_finals_stream_as_chunks_that_join_into_the_transcript() -> None:
    stream = TranscriptStream(language=None)  # a session that detects its language
    messages = [
        Started(language=None),
        PartialMessage(0, "Ask not", 0.0, 0.5, 0.6),  # Wyoming streams only final text
        FinalMessage(0, "Ask not what", 0.0, 0.9, (), 1.0, language="en"),
        FinalMessage(1, ", your country", 1.0, 1.8, (), 2.0, language="en"),
        FinalMessage(2, "  ", 2.0, 2.1, (), 2.2),  # nothing to say
        ErrorMessage("decode_failed", "could not decode 0.4 s", False, 2.3),
        FinalMessage(3, "can do.", 2.2, 2.9, (), 3.0, language="en"),
        DoneMessage(segments=4, audio_received_s=3.0, speech_s=2.9, session_s=3.1),
    ]
    events = [e for m in messages for e in stream.render(m)]
    assert [e.type for e in events] == [
        "transcript-start",
        "transcript-chunk",
        "transcript-chunk",
        "error",
        "transcript-chunk",
        "transcript",
        "transcript-stop",
    ]
    chunks_sent = [e.data["text"] for e in events if e.type == "transcript-chunk"]
    assert chunks_sent == ["Ask not what", ", your country", " can do."]
    assert events[5].data == {"text": "Ask not what, your country can do.", "language": "en"}
    assert events[3].data == {"text": "could not decode 0.4 s", "code": "decode_failed"}


# --------------------------------------------------------------------------- audio


def test_converter_passes_16_bit_mono_through_and_downmixes_other_formats() -> None:
    rng = np.random.default_rng(0)
    left = rng.integers(-20000, 20000, 4000).astype("<i2")
    right = rng.integers(-20000, 20000, 4000).astype("<i2")
    mono = AudioConverter(WyomingAudioFormat(16000, 2, 1))
    assert (mono.encoding, mono.sample_rate_hz) == ("pcm_s16le", 16000)
    assert mono.convert(left.tobytes()) == left.tobytes()

    stereo = AudioConverter(WyomingAudioFormat(16000, 2, 2))
    assert stereo.encoding == "pcm_f32le"
    interleaved = np.stack([left, right], axis=1).tobytes()
    got = np.frombuffer(stereo.convert(interleaved), "<f4")
    want = (left.astype(np.float32) + right.astype(np.float32)) / 2 / 32768
    assert np.allclose(got, want, atol=1e-6)


@pytest.mark.parametrize("width", [1, 3, 4])
def test_converter_reads_every_sample_width(width: int) -> None:
    values = np.array([-1.0, -0.5, 0.0, 0.25, 0.5], np.float64)
    full = 2 ** (8 * width - 1)
    ints = np.round(values * full).clip(-full, full - 1).astype(np.int64)
    if width == 1:
        raw = (ints + 128).astype(np.uint8).tobytes()
    elif width == 3:
        raw = ints.astype("<i4").view(np.uint8).reshape(-1, 4)[:, :3].tobytes()
    else:
        raw = ints.astype("<i4").tobytes()
    converter = AudioConverter(WyomingAudioFormat(16000, width, 1))
    got = np.frombuffer(converter.convert(raw), "<f4")
    assert np.allclose(got, values, atol=1.0 / full)


def test_converter_resamples_rates_the_session_does_not_take() -> None:
    converter = AudioConverter(WyomingAudioFormat(96_000, 2, 1))
    assert converter.sample_rate_hz == SAMPLE_RATE_HZ
    tone = (np.sin(np.arange(96_000) * 2 * np.pi * 440 / 96_000) * 16000).astype("<i2")
    out = b"".join(converter.convert(piece) for piece in np.split(tone, 10)) + converter.flush()
    assert abs(len(out) // 4 - SAMPLE_RATE_HZ) <= 2  # one second, at 16 kHz, as float32


def test_converter_refuses_partial_frames() -> None:
    converter = AudioConverter(WyomingAudioFormat(16000, 2, 2))
    with pytest.raises(AudioFormatError, match="whole frames"):
        converter.convert(bytes(6))


@pytest.mark.parametrize(
    ("data", "error"),
    [
        ({"rate": 16000, "width": 2}, ProtocolError),
        ({"rate": "16000", "width": 2, "channels": 1}, ProtocolError),
        ({"rate": 16000, "width": 5, "channels": 1}, AudioFormatError),
        ({"rate": 16000, "width": 2, "channels": 0}, AudioFormatError),
        ({"rate": 10, "width": 2, "channels": 1}, AudioFormatError),
    ],
)
def test_audio_start_needs_a_format_the_converter_reads(
    data: dict[str, Any], error: type[Exception]
) -> None:
    with pytest.raises(error):
        WyomingAudioFormat.from_data("audio-start", data)


# --------------------------------------------------------------------------- configuration


def test_config_and_flags() -> None:
    assert not WyomingConfig().enabled
    assert WyomingConfig().host == "127.0.0.1"  # no authentication: loopback unless named
    for bad in ({"port": 70000}, {"idle_connection_s": 0.0}, {"host": ""}):
        with pytest.raises(ValueError):
            WyomingConfig(**bad)
    args = build_parser().parse_args(["--wyoming-port", "10300"])
    assert (args.wyoming_port, args.wyoming_host, args.wyoming_zeroconf) == (
        10300,
        "127.0.0.1",
        True,
    )
    assert build_parser().parse_args([]).wyoming_port is None


# --------------------------------------------------------------------------- discovery


@session_loop
async def test_zeroconf_advertises_the_port_unless_on_loopback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    zc = pytest.importorskip("zeroconf")
    zc_asyncio = pytest.importorskip("zeroconf.asyncio")
    caplog.set_level(logging.INFO, logger="server.serve.wyoming")
    async with scripted():
        pass
    assert "mDNS" not in caplog.text  # loopback: nobody else could connect
    address = advertised_address("0.0.0.0")
    if address is None:
        pytest.skip("no IPv4 route to the mDNS group on this machine")

    browser_zc = zc_asyncio.AsyncZeroconf()
    changes: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()

    def on_change(zeroconf: Any, service_type: str, name: str, state_change: Any) -> None:
        changes.put_nowait((name, state_change))

    browser = zc_asyncio.AsyncServiceBrowser(
        browser_zc.zeroconf, SERVICE_TYPE, handlers=[on_change]
    )
    try:
        async with scripted(wyoming=WyomingConfig(port=0, host=address)) as app:
            if "could not advertise" in caplog.text:
                pytest.skip("multicast is not available here")
            name, change = await asyncio.wait_for(changes.get(), 20)
            assert change is zc.ServiceStateChange.Added
            info = zc_asyncio.AsyncServiceInfo(SERVICE_TYPE, name)
            assert await info.async_request(browser_zc.zeroconf, 3000)
            assert (info.port, info.parsed_addresses()) == (app.wyoming_port, [address])
        # Shutdown says goodbye, so Home Assistant forgets the address.
        while change is not zc.ServiceStateChange.Removed:
            gone, change = await asyncio.wait_for(changes.get(), 20)
        assert gone == name
    finally:
        await browser.async_cancel()
        await browser_zc.async_close()


def test_info_lists_the_languages_of_the_loaded_model() -> None:
    assert model_languages(False) == ["en"]  # an English-only model
    multilingual = model_languages(True)  # Whisper's table, as the tokenizer has it
    assert {"en", "de", "fr", "ja"} <= set(multilingual) and len(multilingual) >= 99
    assert multilingual == sorted(multilingual)
