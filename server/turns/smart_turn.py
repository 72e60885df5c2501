"""Smart Turn v3.2 (pipecat-ai/smart-turn, BSD-2-Clause): has the speaker finished the turn?

A Whisper-tiny encoder with a linear head, int8-quantised, that scores the last 8 s of 16 kHz
audio up to a pause. Its input is what ``transformers.WhisperFeatureExtractor(chunk_length=8)``
gives with ``do_normalize=True`` (the model was trained on that): the audio cut to its last 8 s
or zero-padded at the start to 8 s, scaled to zero mean and unit variance over those 8 s
(padding included), then Whisper's log-mel (80 bands, 800 frames of 10 ms). Our own frontend
(server/engine/features.py) computes the same log-mel, to within float32 rounding
(tests/test_smart_turn.py holds it against pipecat's copy of the reference). The model's one
output is already a probability (a sigmoid inside the graph).

The model is meant to be run at a pause, on the turn so far (not only the last phrase: it needs
context), and again on the whole turn if speech resumes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from server.engine.features import log_mel_spectrogram
from server.protocol.errors import ModelFormatError
from server.protocol.formats import SAMPLE_RATE_HZ
from server.turns.onnx import SMART_TURN_FILE, cpu_session, resolve_model

logger = logging.getLogger("server.turns.smart_turn")

WINDOW_S = 8  # the model sees the last 8 s of the turn
WINDOW_SAMPLES = WINDOW_S * SAMPLE_RATE_HZ  # 128000
N_MELS = 80
N_FRAMES = 800  # 8 s of 10 ms frames (the reference drops the STFT's 801st)
# transformers' zero_mean_unit_var_norm adds this to the variance.
_NORM_EPS = 1e-7

Float32Array = npt.NDArray[np.float32]


@dataclass(frozen=True)
class SmartTurnConfig:
    """Where the Smart Turn model is and how many cores one call may use."""

    model_path: Path | None = None  # None: smart-turn-v3.2-cpu.onnx in the pipecat-ai wheel
    # onnxruntime intra-op threads per call. One: a score costs about 110 ms of CPU on a
    # 2-core AVX2 machine, and a second thread took more CPU (166 ms) for no shorter wait
    # there, away from the Whisper decodes on the same cores (bench/turn_model.py).
    threads: int = 1

    def __post_init__(self) -> None:
        if self.threads < 1:
            raise ValueError(f"threads must be >= 1; got {self.threads}")


def last_window(audio_16k: Float32Array) -> Float32Array:
    """The last 8 s of ``audio_16k``, zero-padded at the start when shorter."""
    if audio_16k.size >= WINDOW_SAMPLES:
        return audio_16k[-WINDOW_SAMPLES:]
    out = np.zeros(WINDOW_SAMPLES, dtype=np.float32)
    out[WINDOW_SAMPLES - audio_16k.size :] = audio_16k
    return out


def smart_turn_features(audio_16k: Float32Array) -> Float32Array:
    """The model's input for the turn audio ``audio_16k``: shape (80, 800), float32."""
    x = last_window(np.asarray(audio_16k, dtype=np.float32))
    # Normalised in float32 over the whole window, padding included, as the reference does.
    x = (x - x.mean()) / np.sqrt(x.var() + _NORM_EPS)
    mel = log_mel_spectrogram(x.astype(np.float32, copy=False), n_mels=N_MELS)
    out: Float32Array = np.ascontiguousarray(mel.T)
    return out


class SmartTurn:
    """Scores turn audio for "the turn is complete". One instance serves any number of
    streams: it holds no per-stream state, and onnxruntime sessions may be run from several
    threads at once."""

    def __init__(self, config: SmartTurnConfig | None = None) -> None:
        self.config = config or SmartTurnConfig()
        self.path = resolve_model(self.config.model_path, SMART_TURN_FILE)
        self._session = cpu_session(self.path, threads=self.config.threads)
        inputs = self._session.get_inputs()
        if [i.name for i in inputs] != ["input_features"]:
            raise ModelFormatError(
                f"{self.path}: expected one input 'input_features', got {[i.name for i in inputs]}"
            )

    def score(self, audio_16k: Float32Array) -> float:
        """P(the turn is complete) for the turn so far, 16 kHz mono float32 ending at the
        pause. Only the last 8 s count; shorter audio is padded. Raises ``ValueError`` on
        audio that is not 1-D or holds NaN or infinity."""
        return self.score_features(smart_turn_features(_checked(audio_16k)))

    def score_features(self, features: Float32Array) -> float:
        """``score`` from features already computed by ``smart_turn_features``."""
        if features.shape != (N_MELS, N_FRAMES):
            raise ValueError(f"expected features of shape (80, 800); got {features.shape}")
        (probabilities,) = self._session.run(["logits"], {"input_features": features[None]})
        return float(np.asarray(probabilities).reshape(-1)[0])


def _checked(audio: Float32Array) -> Float32Array:
    if audio.ndim != 1:
        raise ValueError(f"expected mono 16 kHz audio (1-D); got shape {audio.shape}")
    if audio.size and not np.isfinite(audio).all():
        raise ValueError("audio holds NaN or infinite samples")
    return audio
