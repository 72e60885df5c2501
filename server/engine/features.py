"""Whisper's log-mel frontend in NumPy: pure functions, no MLX, safe to run in a thread pool.

Matches ``whisper.audio.log_mel_spectrogram``: 25 ms Hann window, 10 ms hop, reflect padding,
power spectrum, 80 (or 128) mel bands from Whisper's own filter bank, log10 floored 8 decades
below the maximum, scaled to roughly [-1, 1].
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import numpy.typing as npt

from server.protocol.formats import SAMPLE_RATE_HZ

N_FFT = 400  # 25 ms at 16 kHz
HOP_LENGTH = 160  # 10 ms at 16 kHz
CHUNK_LENGTH_S = 30
N_SAMPLES = CHUNK_LENGTH_S * SAMPLE_RATE_HZ  # 480000 samples in a 30 s window
N_FRAMES = N_SAMPLES // HOP_LENGTH  # 3000 mel frames in a 30 s window
FRAMES_PER_SECOND = SAMPLE_RATE_HZ // HOP_LENGTH  # 100
SAMPLES_PER_AUDIO_TOKEN = HOP_LENGTH * 2  # the encoder's second conv has stride 2
AUDIO_TOKENS_PER_SECOND = SAMPLE_RATE_HZ // SAMPLES_PER_AUDIO_TOKEN  # 50 (20 ms each)

Float32Array = npt.NDArray[np.float32]


@lru_cache(maxsize=2)
def mel_filters(n_mels: int) -> Float32Array:
    """Whisper's mel filter bank (n_mels, N_FFT // 2 + 1), from lightning-whisper-mlx's assets."""
    if n_mels not in (80, 128):
        raise ValueError(f"n_mels must be 80 or 128; got {n_mels}")
    from server.engine.lightning import asset

    with np.load(asset("mel_filters.npz")) as data:
        return np.asarray(data[f"mel_{n_mels}"], dtype=np.float32)


@lru_cache(maxsize=1)
def _hann() -> npt.NDArray[np.float64]:
    return np.hanning(N_FFT + 1)[:-1]


DYNAMIC_RANGE_DECADES = 8.0  # Whisper floors the log-mel this many decades below its maximum


def log_mel_spectrogram(audio: Float32Array, n_mels: int = 80, padding: int = 0) -> Float32Array:
    """Log-mel features of 16 kHz mono audio, shape (frames, n_mels), frames = len // 160.

    ``padding`` zero samples are appended first (Whisper pads with 30 s of silence so the last
    frames see a full window).
    """
    return scale_log_mel(log10_mel(audio, n_mels, padding))


def log10_mel(audio: Float32Array, n_mels: int = 80, padding: int = 0) -> Float32Array:
    """The mel power of 16 kHz mono audio in log10, before Whisper's floor and scaling."""
    x = np.asarray(audio, dtype=np.float32)
    if padding > 0:
        x = np.concatenate([x, np.zeros(padding, dtype=np.float32)])
    if x.size <= N_FFT // 2:
        x = np.concatenate([x, np.zeros(N_FFT // 2 + 1 - x.size, dtype=np.float32)])
    pad = N_FFT // 2
    x = np.concatenate([x[1 : pad + 1][::-1], x, x[-(pad + 1) : -1][::-1]])
    n_frames = 1 + (x.size - N_FFT) // HOP_LENGTH
    frames = np.lib.stride_tricks.as_strided(
        x, shape=(n_frames, N_FFT), strides=(x.strides[0] * HOP_LENGTH, x.strides[0])
    )
    spectrum = np.fft.rfft(frames * _hann(), axis=-1)
    power = (spectrum.real**2 + spectrum.imag**2)[:-1].astype(np.float32)
    mel = power @ mel_filters(n_mels).T
    out: Float32Array = np.log10(np.maximum(mel, 1e-10)).astype(np.float32)
    return out


def scale_log_mel(
    log_spec: Float32Array, dynamic_range_decades: float = DYNAMIC_RANGE_DECADES
) -> Float32Array:
    """Whisper's floor (``dynamic_range_decades`` below the maximum) and scaling to about
    [-1, 1], applied to a ``log10_mel``."""
    floored = np.maximum(log_spec, log_spec.max() - dynamic_range_decades)
    out: Float32Array = ((floored + 4.0) / 4.0).astype(np.float32)
    return out
