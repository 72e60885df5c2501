"""Shared test helpers: tiny.en's dimensions and the hard-speech clips; for the server tests,
a scripted test-double engine, PCM frames and a small WebSocket client; offline transcripts
shared between workers.

The speech corpus (manifest, clips, word error rate) is ``bench/corpus.py`` and the HTTP
probes are ``bench/http_probe.py``: the benchmarks use them too, and ``bench/`` never
imports ``tests/``."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import json
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from bench.corpus import ManifestRow, wav_bytes
from server.config import PipelineConfig, ServerConfig, StreamingConfig
from server.core.engine_api import (
    DecodeInterrupted,
    DecodeRequest,
    DecodeResult,
    ModelShape,
    SpeechEngine,
    StopReason,
    TextSpan,
    Window,
    WordTiming,
    stop_if_interrupted,
)
from server.protocol.errors import DecodeError
from server.protocol.formats import SAMPLE_RATE_HZ
from server.serve.app import WhisperwireServer

if TYPE_CHECKING:
    from multiprocessing.synchronize import Semaphore as SemaphoreLike

REPO = Path(__file__).resolve().parents[1]

Float32Array = npt.NDArray[np.float32]

# tiny.en's dimensions, for ``ModelDimensions(**TINY_EN_DIMS)`` (kept plain: no MLX import here).
TINY_EN_DIMS: dict[str, int] = {
    "n_mels": 80,
    "n_audio_ctx": 1500,
    "n_audio_state": 384,
    "n_audio_head": 6,
    "n_audio_layer": 4,
    "n_vocab": 51864,
    "n_text_ctx": 448,
    "n_text_state": 384,
    "n_text_head": 6,
    "n_text_layer": 4,
}


HARD_SPEECH = "librispeech_test-other"  # accented, fast or noisy readers


def hard_clips(manifest: list[ManifestRow]) -> list[ManifestRow]:
    """The longest test-other clip of at most 12 s of each chapter (four readers): the hard
    speech that the accuracy tests hold to bounds of their own."""
    by_chapter: dict[str, list[ManifestRow]] = {}
    for row in manifest:
        hard = row.file.startswith(HARD_SPEECH + "/") and "/long/" not in row.file
        if hard and row.seconds <= 12:
            by_chapter.setdefault(row.file.rsplit("-", 1)[0], []).append(row)
    return [max(rows, key=lambda r: r.seconds) for _, rows in sorted(by_chapter.items())]


# --------------------------------------------------------------------------- server tests


class ScriptedDims:
    """``ModelShape`` of the scripted engine: an English-only model."""

    is_multilingual = False


class ScriptedEngine:
    """A ``SpeechEngine`` test double: no model, instant and deterministic.

    ``features`` returns the audio itself as the "mel". ``decode_windows`` hears one word per
    half second of window audio, ``" w0"``, ``" w1"``, ... (one token each, 1000 + k), so
    LocalAgreement commits them as audio grows. ``fail_when(window)`` chooses windows whose
    batch raises ``DecodeError``. Clear ``release`` to hold the worker inside
    ``decode_windows`` (``entered`` is set when it gets there). ``batches`` records the
    ``audio_s`` of every window of every call, in call order, and ``beam_sizes`` their beam
    widths; ``calls_finished`` counts the calls that returned or raised.

    ``call_cost_s`` and ``window_cost_s`` model a decode's cost: each call sleeps (on the
    decode thread, like a real decode) ``call_cost_s + window_cost_s * len(windows)``.
    """

    name = "scripted"
    WORD_S = 0.5

    def __init__(
        self,
        fail_when: Callable[[Window], bool] | None = None,
        *,
        call_cost_s: float = 0.0,
        window_cost_s: float = 0.0,
    ) -> None:
        self.dims = ScriptedDims()
        self.fail_when = fail_when
        self.call_cost_s = call_cost_s
        self.window_cost_s = window_cost_s
        self.batches: list[list[float]] = []
        self.beam_sizes: list[list[int]] = []
        self.calls_finished = 0
        self.entered = threading.Event()
        self.release = threading.Event()
        self.release.set()
        self.warmups = 0
        self.releases = 0

    def encode_text(self, text: str) -> tuple[int, ...]:
        return tuple(1000 + int(w[1:]) for w in text.split() if w.startswith("w"))

    def features(self, audio: Float32Array) -> Float32Array:
        return np.array(audio, dtype=np.float32, copy=True)

    def warmup(self) -> float:
        self.warmups += 1
        return 0.0

    def release_memory(self) -> None:
        self.releases += 1

    def decode_windows(self, windows: list[Window]) -> list[DecodeResult]:
        self.batches.append([w.request.audio_s for w in windows])
        self.beam_sizes.append([w.request.options.beam_size for w in windows])
        self.entered.set()
        try:
            self.release.wait()
            cost_s = self.call_cost_s + self.window_cost_s * len(windows)
            if cost_s > 0:
                time.sleep(cost_s)
            if self.fail_when is not None and any(self.fail_when(w) for w in windows):
                raise DecodeError("scripted failure")
            return [self._result(w) for w in windows]
        finally:
            self.calls_finished += 1

    def transcribe_window(
        self, audio: Float32Array, request: DecodeRequest, temperatures: tuple[float, ...]
    ) -> tuple[DecodeResult, float]:
        """A long-form window: its words as one text span, at the first temperature."""
        result = self.decode_windows([Window(audio, request)])[0]
        span = TextSpan(0.0, request.audio_s, result.text, result.tokens)
        return replace(result, spans=(span,) if result.words else ()), temperatures[0]

    def _result(self, window: Window) -> DecodeResult:
        words = tuple(
            WordTiming(f" w{k}", (1000 + k,), k * self.WORD_S, k * self.WORD_S + 0.4, 0.9)
            for k in range(int(window.request.audio_s / self.WORD_S))
        )
        return DecodeResult(
            tokens=tuple(t for w in words for t in w.tokens),
            text="".join(w.word for w in words),
            spans=(),
            words=words,
            language="en",
            avg_logprob=-0.1,
            no_speech_prob=0.0,
            compression_ratio=1.0,
            stop_reason=StopReason.EOT,
            n_generated=len(words),
        )


def scripted_engine() -> ScriptedEngine:
    """A new ``ScriptedEngine``: a module-level function, so a process lane can pickle it."""
    return ScriptedEngine()


GATE_TIMEOUT_S = 60.0  # only a broken test leaves a gate closed this long
GATE_STEP_S = 0.01


class GatedEngine(ScriptedEngine):
    """A ``ScriptedEngine`` held at a gate that works across processes: every
    ``decode_windows`` call releases ``entered`` once, then takes one pass from ``gate``
    (the test releases ``gate`` once per call it lets through).

    Build it with ``functools.partial(GatedEngine, gate, entered)`` from two
    ``multiprocessing`` semaphores: a process lane inherits them through its
    ``load_engine``, so the test sees calls enter in the child as well as in this process.
    Semaphores, not an ``Event``: a child killed while waiting on an ``Event`` leaves its
    condition expecting a waiter that will never wake, and ``set`` then blocks forever.
    """

    def __init__(self, gate: SemaphoreLike, entered: SemaphoreLike) -> None:
        super().__init__()
        self.gate = gate
        self.entered_calls = entered

    def decode_windows(self, windows: list[Window]) -> list[DecodeResult]:
        self.entered_calls.release()
        waited_s = 0.0
        # The wait at the gate stands for the token steps, and checks between them as the
        # real engine does: a lane's ``interrupt`` stops a call held here. A call asked to
        # stop gives back a pass it got meanwhile: the test meant it for another call.
        while not self.gate.acquire(True, GATE_STEP_S):
            stop_if_interrupted()
            waited_s += GATE_STEP_S
            if waited_s > GATE_TIMEOUT_S:
                raise DecodeError("the test never opened the gate")
        try:
            stop_if_interrupted()
        except DecodeInterrupted:
            self.gate.release()
            raise
        return super().decode_windows(windows)


class TimedEngine:
    """A ``SpeechEngine`` that is another one (the real model) and notes when each of its
    decode calls returned (``time.monotonic``, in ``returned_at``): a test on a server in
    this process tells which decode a message came out with."""

    def __init__(self, engine: SpeechEngine) -> None:
        self.engine = engine
        self.returned_at: list[float] = []  # appended on the decode lane's thread

    @property
    def name(self) -> str:
        return self.engine.name

    @property
    def dims(self) -> ModelShape:
        return self.engine.dims

    def encode_text(self, text: str) -> tuple[int, ...]:
        return self.engine.encode_text(text)

    def features(self, audio: Float32Array) -> Float32Array:
        return self.engine.features(audio)

    def decode_windows(self, windows: list[Window]) -> list[DecodeResult]:
        try:
            return self.engine.decode_windows(windows)
        finally:
            self.returned_at.append(time.monotonic())

    def transcribe_window(
        self, audio: Float32Array, request: DecodeRequest, temperatures: tuple[float, ...]
    ) -> tuple[DecodeResult, float]:
        return self.engine.transcribe_window(audio, request, temperatures)

    def warmup(self) -> float:
        return self.engine.warmup()

    def release_memory(self) -> None:
        self.engine.release_memory()

    def returned_between(self, since: float, until: float) -> int:
        """Decode calls that returned after ``since`` and by ``until``."""
        return sum(since < t <= until for t in self.returned_at)


def pcm_frames(audio: Float32Array, chunk_s: float = 0.1) -> list[bytes]:
    """16 kHz float audio as ``pcm_s16le`` frames of ``chunk_s`` seconds."""
    pcm = (np.clip(audio, -1.0, 32767 / 32768) * 32768).astype("<i2").tobytes()
    step = int(chunk_s * SAMPLE_RATE_HZ) * 2
    return [pcm[i : i + step] for i in range(0, len(pcm), step)]


@dataclass
class StreamOutcome:
    """What one client saw: every server message (parsed JSON) and how the connection ended."""

    messages: list[dict[str, Any]]
    close_code: int | None
    close_reason: str | None

    def of_type(self, kind: str) -> list[dict[str, Any]]:
        return [m for m in self.messages if m["type"] == kind]

    @property
    def text(self) -> str:
        return " ".join(m["text"] for m in self.of_type("final"))


async def stream_frames(
    url: str,
    frames: Sequence[bytes | str],
    *,
    end: bool = True,
    additional_headers: dict[str, str] | None = None,
) -> StreamOutcome:
    """Connect, wait for ``ready``, send ``frames`` back to back (no pacing) while reading
    concurrently, send ``end``, and read until the server closes."""
    async with connect(url, additional_headers=additional_headers, max_size=None) as ws:
        messages: list[dict[str, Any]] = [json.loads(await ws.recv())]
        assert messages[0]["type"] == "ready", messages[0]

        async def read() -> None:
            # Iteration ends quietly after a 1000/1001 close and raises after any other.
            with contextlib.suppress(ConnectionClosed):
                async for raw in ws:
                    messages.append(json.loads(raw))

        reader = asyncio.create_task(read())
        try:
            for frame in frames:
                await ws.send(frame)
            if end:
                await ws.send('{"type": "end"}')
        except ConnectionClosed:
            pass  # the server closed first; what it sent is in messages
        await reader
        return StreamOutcome(messages, ws.close_code, ws.close_reason)


def decoded_once(folder: Path, path: Path, decode: Callable[[Path], str]) -> str:
    """``decode(path)``, kept in ``folder`` for the other worker processes; a lock file makes
    a second asker wait for the first one's transcript instead of decoding it again."""
    key = hashlib.sha1(str(path.resolve()).encode()).hexdigest()
    done = folder / f"{key}.txt"
    with (folder / f"{key}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.is_file():
            partial = folder / f"{key}.part"
            partial.write_text(decode(path), encoding="utf-8")
            partial.replace(done)
        return done.read_text(encoding="utf-8")


@contextlib.asynccontextmanager
async def scripted_server(
    engine: SpeechEngine | None = None,
    *,
    pipeline: PipelineConfig | None = None,
    streaming: StreamingConfig | None = None,
    turn_model: bool = True,
    **overrides: Any,
) -> AsyncIterator[WhisperwireServer]:
    """A server on a free port with the scripted test-double engine (or ``engine``), and the
    real turn model where it is installed (``turn_model`` False: a server without one)."""
    config = ServerConfig(host="127.0.0.1", port=0, **overrides)
    chosen = engine or ScriptedEngine()
    async with WhisperwireServer(
        lambda: chosen, server=config, pipeline=pipeline, streaming=streaming
    ) as server:
        if not turn_model:
            server.pipeline.turn_model = None
        yield server


# Containers and codecs people upload, encoded with PyAV (FFmpeg) from real speech.
UPLOAD_FORMATS: dict[str, tuple[str, str]] = {
    "wav": ("wav", "pcm_s16le"),
    "mp3": ("mp3", "libmp3lame"),
    "m4a": ("ipod", "aac"),
    "ogg": ("ogg", "libopus"),
    "webm": ("webm", "libopus"),
    "flac": ("flac", "flac"),
}


def encode_audio(audio: Float32Array, suffix: str, rate_hz: int = 48_000) -> bytes:
    """16 kHz mono speech as a ``suffix`` file (``UPLOAD_FORMATS``) at ``rate_hz`` stereo: a
    phone's or browser's recording, not our own format."""
    import io

    import av
    import soxr

    container_format, codec = UPLOAD_FORMATS[suffix]
    resampled = np.asarray(soxr.resample(audio, SAMPLE_RATE_HZ, rate_hz), dtype=np.float32)
    stereo = np.stack([resampled, resampled]).astype(np.float32)
    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format=container_format) as container:
        stream = container.add_stream(codec, rate=rate_hz, layout="stereo")
        assert isinstance(stream, av.audio.stream.AudioStream)
        frame_samples = 960
        for start in range(0, stereo.shape[1], frame_samples):
            piece = np.ascontiguousarray(stereo[:, start : start + frame_samples])
            frame = av.AudioFrame.from_ndarray(piece, format="fltp", layout="stereo")
            frame.sample_rate = rate_hz
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)
    return buffer.getvalue()


@dataclass(frozen=True)
class Conversation:
    """Two readers, one after the other: ``audio`` (16 kHz) and the time between their
    turns (the middle of the pause, or the seam when they follow each other at once). A
    word is the first reader's when it starts before it: Whisper stretches the first turn's
    last word through the pause, so its end says nothing."""

    audio: Float32Array
    boundary_s: float


# Two readers of the shared recordings: LibriSpeech test-other 367 (a man, 11.3 s) and LJ
# Speech (a woman, 9.7 s), which the speaker tracker's own tests tell apart.
FIRST_READER = "librispeech_test-other/367-130732-0002.wav"
SECOND_READER = "ljspeech/LJ001-0003.wav"


def two_readers(speech_dir: Path, *, gap_s: float = 1.0) -> Conversation:
    """``FIRST_READER`` then ``SECOND_READER``, ``gap_s`` apart, with 0.5 s of silence before
    and 1 s after (for the VAD's end of speech)."""
    from bench.corpus import load_clip

    a = load_clip(speech_dir / FIRST_READER)
    b = load_clip(speech_dir / SECOND_READER)
    lead = np.zeros(SAMPLE_RATE_HZ // 2, np.float32)
    gap = np.zeros(round(gap_s * SAMPLE_RATE_HZ), np.float32)
    tail = np.zeros(SAMPLE_RATE_HZ, np.float32)
    audio = np.concatenate([lead, a, gap, b, tail])
    return Conversation(audio, (lead.size + a.size + gap.size / 2) / SAMPLE_RATE_HZ)


def write_wav(path: Path, audio: Float32Array) -> None:
    """``wav_bytes`` written to ``path``."""
    path.write_bytes(wav_bytes(audio))


class GatedSpeakerEncoder:
    """The real speaker encoder behind a gate: each ``embed_many`` call waits for
    ``release`` (set by default), then runs; ``batches`` records the pieces each call got."""

    def __init__(self) -> None:
        from server.speakers.encoder import SpeakerEncoder

        self.encoder = SpeakerEncoder.load()
        self.release = threading.Event()
        self.release.set()
        self.entered = threading.Event()  # a call is waiting at the gate, or past it
        self.batches: list[int] = []

    def embed_windows(self, audio: Float32Array, starts: list[int]) -> Float32Array:
        return self.embed_many([(audio, starts)])[0]

    def embed_many(self, pieces: Sequence[tuple[Float32Array, list[int]]]) -> list[Float32Array]:
        self.batches.append(len(pieces))
        self.entered.set()
        self.release.wait()
        return self.encoder.embed_many(pieces)


class FixedTurnModel:
    """A turn model (``TurnScorer``) that gives every pause the same probability, so which
    pause ends a turn is known in advance: none below the stream's threshold (the silence
    timeout ends it), every one at or above it. Smart Turn itself calls most pauses of read
    speech complete, mid-sentence ones too, so it cannot make a turn span a pause on cue.
    ``scored`` counts its calls (the thread of the pipeline's turn pool makes them)."""

    def __init__(self, probability: float) -> None:
        self.probability = probability
        self.scored = 0

    def load(self) -> None:
        """Nothing to load."""

    def score(self, audio_16k: Float32Array) -> float:
        self.scored += 1
        return self.probability
