"""Silero VAD v5 (MIT) on onnxruntime: a speech probability per 32 ms frame, and a segmenter
that turns those into utterances: server/core/vad.py's ``VadSegmenter`` on Silero's verdicts
(``SileroVoicing``) instead of webrtcvad's, so a session can take either.

The network is recurrent: each call takes 512 new samples at 16 kHz, the last 64 samples of
the previous call (its context) and a (2, 1, 128) state, and returns the probability and the
next state. A stream's state and context live on its own ``SileroVad``; the loaded network
(``SileroModel``) holds none and is shared by every stream.

The segmenter reads ``VadConfig``'s durations (start hysteresis, end silence, short-speech
silence, pad) in 32 ms frames instead of webrtcvad's 10-30 ms ones; ``aggressiveness`` and
``frame_ms`` are webrtcvad's and mean nothing here: ``SileroVadConfig.threshold`` takes their
place.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from server.config import VadConfig
from server.core.vad import VadSegmenter
from server.protocol.formats import SAMPLE_RATE_HZ
from server.turns.onnx import SILERO_VAD_FILE, cpu_session, resolve_model

logger = logging.getLogger("server.turns.silero_vad")

FRAME_SAMPLES = 512  # Silero v5 at 16 kHz takes exactly 512 new samples a call
FRAME_MS = FRAME_SAMPLES * 1000 // SAMPLE_RATE_HZ  # 32
CONTEXT_SAMPLES = 64  # ... after the last 64 samples of the call before
_STATE_SHAPE = (2, 1, 128)

Float32Array = npt.NDArray[np.float32]


@dataclass(frozen=True)
class SileroVadConfig:
    """The Silero model file and when its probabilities count as speech."""

    model_path: Path | None = None  # None: silero_vad.onnx in the pipecat-ai wheel
    threshold: float = 0.5  # a frame at this speech probability or above is speech
    # Inside speech a frame counts as silence only below threshold - negative_margin:
    # probabilities dip between syllables, and Silero's own get_speech_timestamps uses 0.15.
    negative_margin: float = 0.15
    # onnxruntime intra-op threads; one is plenty: a frame costs about 0.25 ms of CPU, under
    # 1% of a core per stream (bench/vad_compare.py).
    threads: int = 1

    def __post_init__(self) -> None:
        if not 0 < self.threshold < 1:
            raise ValueError(f"threshold must be in (0, 1); got {self.threshold}")
        if not 0 <= self.negative_margin < self.threshold:
            raise ValueError("need 0 <= negative_margin < threshold")
        if self.threads < 1:
            raise ValueError(f"threads must be >= 1; got {self.threads}")


class SileroModel:
    """The loaded Silero network. Stateless: any number of streams share one (onnxruntime
    sessions may be run from several threads at once)."""

    def __init__(self, config: SileroVadConfig | None = None) -> None:
        self.config = config or SileroVadConfig()
        self.path = resolve_model(self.config.model_path, SILERO_VAD_FILE)
        self._session = cpu_session(self.path, threads=self.config.threads)
        self._sr = np.array(SAMPLE_RATE_HZ, dtype=np.int64)

    def run(
        self, window: Float32Array, state: Float32Array
    ) -> tuple[float, npt.NDArray[np.float32]]:
        """One step: ``window`` is context + frame (576 samples), ``state`` (2, 1, 128).
        Returns the speech probability and the next state."""
        probability, new_state = self._session.run(
            ["output", "stateN"], {"input": window[None], "state": state, "sr": self._sr}
        )
        return float(np.asarray(probability).reshape(-1)[0]), np.asarray(new_state, np.float32)


class SileroVad:
    """One stream's frame scorer: its recurrent state and context, carried frame to frame."""

    def __init__(self, model: SileroModel) -> None:
        self._model = model
        self.reset()

    def reset(self) -> None:
        """Forget the stream so far (state and context back to zeros)."""
        self._state = np.zeros(_STATE_SHAPE, dtype=np.float32)
        self._window = np.zeros(CONTEXT_SAMPLES + FRAME_SAMPLES, dtype=np.float32)

    def probability(self, frame: Float32Array) -> float:
        """P(speech) of the next 512 samples (32 ms at 16 kHz) of the stream."""
        if frame.shape != (FRAME_SAMPLES,):
            raise ValueError(f"expected {FRAME_SAMPLES} mono samples; got shape {frame.shape}")
        self._window[CONTEXT_SAMPLES:] = frame
        p, self._state = self._model.run(self._window, self._state)
        self._window[:CONTEXT_SAMPLES] = self._window[-CONTEXT_SAMPLES:]
        return p


class SileroVoicing:
    """Silero's verdict on each 32 ms frame of one stream, for ``server.core.vad``'s
    ``VadSegmenter``: speech from ``threshold`` up while no utterance is open, and until the
    probability falls below ``threshold - negative_margin`` inside one (probabilities dip
    between syllables). Unlike webrtcvad, Silero needs no warm-up: it calls nothing speech on
    digital silence, so every verdict counts."""

    frame_samples = FRAME_SAMPLES

    def __init__(self, model: SileroModel, config: SileroVadConfig | None = None) -> None:
        silero = config or model.config
        self._vad = SileroVad(model)
        self._on = silero.threshold
        self._off = silero.threshold - silero.negative_margin

    def voiced(self, frame: Float32Array, in_speech: bool) -> tuple[bool, bool]:
        """(whether ``frame`` is speech, True)."""
        p = self._vad.probability(frame)
        return p >= (self._off if in_speech else self._on), True


def silero_segmenter(
    config: VadConfig, model: SileroModel, silero: SileroVadConfig | None = None
) -> VadSegmenter:
    """A segmenter on Silero's verdicts: ``VadConfig``'s durations (start hysteresis, end
    silence, short-speech silence, pad) in 32 ms frames; its ``aggressiveness`` and
    ``frame_ms`` are webrtcvad's and mean nothing here."""
    return VadSegmenter(config, voicing=SileroVoicing(model, silero))
