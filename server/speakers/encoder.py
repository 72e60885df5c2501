"""Resemblyzer's GE2E speaker encoder in numpy: 16 kHz audio in, 256-d d-vectors out.

The network (Wan et al., "Generalized End-to-End Loss for Speaker Verification", as trained
by resemblyzer 0.1.4): a 40-channel mel power spectrogram at 25 ms windows and 10 ms hops,
a 3-layer LSTM of 256, a linear layer of 256, ReLU, L2 normalisation. It was trained on
partial utterances of 160 frames (1.6 s); a longer stretch is the normalised mean of the
partials' embeddings (``embed_utterance``, as resemblyzer's ``VoiceEncoder`` does).

Why numpy and not MLX: the LSTM's recurrence is 160 small matrix products a layer,
(partials, 256) x (256, 1024). ``bench/speakers.py --encoder-speed`` measured both on the
shared clips: numpy over its OpenBLAS was faster than MLX on the CPU, whose per-operation
overhead dominates at this size (figures in bench/README.md).

Preprocessing: resemblyzer's ``preprocess_wav`` raises quiet audio to -30 dBFS and cuts
silences longer than ~0.2 s out with webrtcvad (mode 3), because the mel input is not
logarithmic and silence frames pull the LSTM's state towards "nobody". ``preprocess_wav``
here does the same, for offline use and the parity test. The streaming path
(``embed_windows``) gets speech the session's VAD has already found, and its windows must
keep stream time to place a change of speaker, so it does not cut pauses out; it raises each
window's volume the same way (see ``embed_windows``).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
import webrtcvad

from server.speakers.weights import EncoderWeights, load_weights

logger = logging.getLogger("server.speakers.encoder")

Float32Array = npt.NDArray[np.float32]

SAMPLE_RATE_HZ = 16_000
MEL_WINDOW_MS = 25
MEL_HOP_MS = 10
N_MELS = 40
N_FFT = SAMPLE_RATE_HZ * MEL_WINDOW_MS // 1000  # 400
HOP_SAMPLES = SAMPLE_RATE_HZ * MEL_HOP_MS // 1000  # 160
PARTIAL_FRAMES = 160  # 1.6 s: the length the network was trained on
PARTIAL_SAMPLES = PARTIAL_FRAMES * HOP_SAMPLES  # 25600
AUDIO_NORM_TARGET_DBFS = -30.0
INT16_MAX = 2**15 - 1
# resemblyzer's VAD trimming: 30 ms webrtcvad frames, a moving average of 8 and a dilation of 7.
_VAD_FRAME_MS = 30
_VAD_AVERAGE_WIDTH = 8
_VAD_MAX_SILENCE_FRAMES = 6


@functools.lru_cache(maxsize=1)
def mel_filters() -> Float32Array:
    """librosa's ``filters.mel(sr=16000, n_fft=400, n_mels=40)``: Slaney's mel scale and area
    normalisation, 0-8000 Hz. Shape (40, 201)."""

    def hz_to_mel(hz: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
        mel = hz / (200.0 / 3)
        log_region = hz >= 1000.0
        mel[log_region] = 15.0 + np.log(hz[log_region] / 1000.0) / (np.log(6.4) / 27.0)
        return mel

    def mel_to_hz(mel: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
        hz = mel * (200.0 / 3)
        log_region = mel >= 15.0
        hz[log_region] = 1000.0 * np.exp((np.log(6.4) / 27.0) * (mel[log_region] - 15.0))
        return hz

    fft_hz = np.fft.rfftfreq(N_FFT, 1.0 / SAMPLE_RATE_HZ)
    low, high = hz_to_mel(np.array([0.0, SAMPLE_RATE_HZ / 2.0]))
    mel_hz = mel_to_hz(np.linspace(low, high, N_MELS + 2))
    widths = np.diff(mel_hz)
    ramps = mel_hz[:, None] - fft_hz[None, :]
    lower = -ramps[:-2] / widths[:-1, None]
    upper = ramps[2:] / widths[1:, None]
    weights = np.maximum(0.0, np.minimum(lower, upper))
    weights *= (2.0 / (mel_hz[2 : N_MELS + 2] - mel_hz[:N_MELS]))[:, None]
    return weights.astype(np.float32)


@functools.lru_cache(maxsize=1)
def _hann() -> npt.NDArray[np.float64]:
    # Periodic, as scipy's get_window('hann', fftbins=True) that librosa uses.
    return 0.5 - 0.5 * np.cos(2.0 * np.pi * np.arange(N_FFT) / N_FFT)


def mel_spectrogram(wav: Float32Array) -> Float32Array:
    """resemblyzer's ``wav_to_mel_spectrogram``: librosa's centred STFT (zero padding, as
    librosa >= 0.10 pads), power 2, 40 mel bands; not logarithmic. Shape (frames, 40) with
    ``1 + len(wav) // 160`` frames."""
    pad = N_FFT // 2
    padded = np.pad(wav.astype(np.float64), (pad, pad))
    n_frames = 1 + (padded.size - N_FFT) // HOP_SAMPLES
    frames = np.lib.stride_tricks.as_strided(
        padded,
        shape=(n_frames, N_FFT),
        strides=(padded.strides[0] * HOP_SAMPLES, padded.strides[0]),
        writeable=False,
    )
    power = (np.abs(np.fft.rfft(frames * _hann(), axis=1)) ** 2).astype(np.float32)
    mel: Float32Array = power @ mel_filters().T
    return mel


def normalize_volume(
    wav: Float32Array, target_dbfs: float = AUDIO_NORM_TARGET_DBFS
) -> Float32Array:
    """Raise ``wav`` to ``target_dbfs`` RMS when it is quieter (never lowered, as
    resemblyzer's ``normalize_volume(..., increase_only=True)``). Silence stays silence."""
    rms = float(np.sqrt(np.mean((wav.astype(np.float64) * INT16_MAX) ** 2))) if wav.size else 0.0
    if rms == 0.0:
        return wav
    change_db = target_dbfs - 20.0 * np.log10(rms / INT16_MAX)
    if change_db <= 0:
        return wav
    return (wav * np.float32(10 ** (change_db / 20.0))).astype(np.float32)


def trim_long_silences(wav: Float32Array) -> Float32Array:
    """resemblyzer's ``trim_long_silences``: webrtcvad (mode 3) on 30 ms frames, a moving
    average of 8 frames, the voiced mask dilated by 7 frames; the unvoiced rest is dropped
    (and the last partial frame)."""
    frame = _VAD_FRAME_MS * SAMPLE_RATE_HZ // 1000
    wav = wav[: wav.size - wav.size % frame]
    pcm = np.round(wav * INT16_MAX).astype("<i2").tobytes()
    vad = webrtcvad.Vad(3)
    flags = np.array(
        [
            vad.is_speech(pcm[2 * s : 2 * (s + frame)], SAMPLE_RATE_HZ)
            for s in range(0, wav.size, frame)
        ],
        dtype=np.float64,
    )
    width = _VAD_AVERAGE_WIDTH
    padded = np.concatenate([np.zeros((width - 1) // 2), flags, np.zeros(width // 2)])
    sums = np.cumsum(padded)
    sums[width:] = sums[width:] - sums[:-width]
    mask = np.round(sums[width - 1 :] / width).astype(bool)
    # scipy's binary_dilation with a structure of 7 ones: a frame is kept when any frame
    # within 3 on either side is voiced.
    reach = (_VAD_MAX_SILENCE_FRAMES + 1) // 2
    kept = np.convolve(mask.astype(np.int64), np.ones(2 * reach + 1, dtype=np.int64), "same") > 0
    return wav[np.repeat(kept, frame)]


def preprocess_wav(wav: Float32Array) -> Float32Array:
    """resemblyzer's ``preprocess_wav`` for 16 kHz audio: volume raised, long silences cut."""
    return trim_long_silences(normalize_volume(wav))


def partial_slices(n_samples: int, rate_hz: float = 1.3, min_coverage: float = 0.75) -> list[slice]:
    """resemblyzer's ``compute_partial_slices``: the mel frame ranges of 1.6 s partials, one
    every ``1 / rate_hz`` s; the last one kept when ``min_coverage`` of it is audio (always
    at least one)."""
    if not 0 < min_coverage <= 1:
        raise ValueError(f"min_coverage must be in (0, 1]; got {min_coverage}")
    n_frames = int(np.ceil((n_samples + 1) / HOP_SAMPLES))
    step = int(np.round((SAMPLE_RATE_HZ / rate_hz) / HOP_SAMPLES))
    if not 0 < step <= PARTIAL_FRAMES:
        raise ValueError(f"rate_hz must put partials 1 to {PARTIAL_FRAMES} frames apart")
    steps = max(1, n_frames - PARTIAL_FRAMES + step + 1)
    slices = [slice(i, i + PARTIAL_FRAMES) for i in range(0, steps, step)]
    last = slices[-1]
    coverage = (n_samples - last.start * HOP_SAMPLES) / (PARTIAL_FRAMES * HOP_SAMPLES)
    if coverage < min_coverage and len(slices) > 1:
        slices.pop()
    return slices


def _sigmoid(x: Float32Array) -> Float32Array:
    # tanh form: no overflow warning for large negative inputs, and one ufunc fewer.
    y: Float32Array = (0.5 + 0.5 * np.tanh(0.5 * x)).astype(np.float32, copy=False)
    return y


class SpeakerEncoder:
    """The d-vector network over numpy. Thread-safe: it keeps no state between calls
    (numpy's matrix products release the GIL, so the pipeline's threads run it in parallel)."""

    def __init__(self, weights: EncoderWeights) -> None:
        self.weights = weights
        # Transposed once: the products below take (batch, in) x (in, 4 hidden).
        self._layers = [
            (np.ascontiguousarray(w_ih.T), np.ascontiguousarray(w_hh.T), b)
            for w_ih, w_hh, b in weights.lstm
        ]
        self._linear_t = np.ascontiguousarray(weights.linear_weight.T)

    @classmethod
    def load(cls) -> SpeakerEncoder:
        """The encoder with the installed resemblyzer wheel's weights. Raises
        ``WeightsError`` with an install hint when it is missing."""
        return cls(load_weights())

    @property
    def embedding_size(self) -> int:
        return int(self._linear_t.shape[1])

    def embed_mels(self, mels: Float32Array) -> Float32Array:
        """Embeddings of a batch of equal-length mel spectrograms, shape (batch, frames, 40)
        -> (batch, 256), each L2-normalised (resemblyzer's ``VoiceEncoder.forward``)."""
        if mels.ndim != 3 or mels.shape[2] != self.weights.input_size:
            raise ValueError(f"expected (batch, frames, {N_MELS}) mels; got {mels.shape}")
        batch, n_frames, _ = mels.shape
        hidden = self.weights.hidden_size
        x = mels.astype(np.float32, copy=False)
        h = np.zeros((batch, hidden), dtype=np.float32)
        for w_ih_t, w_hh_t, bias in self._layers:
            # The input's share of every step in one product; the recurrence goes step by step.
            projected = (x.reshape(batch * n_frames, -1) @ w_ih_t + bias).reshape(
                batch, n_frames, 4 * hidden
            )
            h = np.zeros((batch, hidden), dtype=np.float32)
            c = np.zeros((batch, hidden), dtype=np.float32)
            outputs = np.empty((batch, n_frames, hidden), dtype=np.float32)
            for t in range(n_frames):
                gates = projected[:, t] + h @ w_hh_t
                # One sigmoid over all four gates (g's is unused): a step is ~10 numpy calls,
                # whose overhead, not their arithmetic, is most of a small batch's time.
                s = _sigmoid(gates)
                g = np.tanh(gates[:, 2 * hidden : 3 * hidden])
                c = s[:, hidden : 2 * hidden] * c + s[:, :hidden] * g
                h = s[:, 3 * hidden :] * np.tanh(c)
                outputs[:, t] = h
            x = outputs
        raw = np.maximum(h @ self._linear_t + self.weights.linear_bias, 0.0)
        norms = np.linalg.norm(raw, axis=1, keepdims=True)
        unit: Float32Array = (raw / np.maximum(norms, 1e-12)).astype(np.float32)
        return unit

    def embed_utterance(
        self, wav: Float32Array, *, rate_hz: float = 1.3, min_coverage: float = 0.75
    ) -> tuple[Float32Array, Float32Array]:
        """resemblyzer's ``embed_utterance(wav, return_partials=True)`` on preprocessed audio:
        the utterance's embedding (the normalised mean of its partials') and the partials'."""
        slices = partial_slices(wav.size, rate_hz, min_coverage)
        needed = slices[-1].stop * HOP_SAMPLES
        if needed >= wav.size:
            wav = np.pad(wav, (0, needed - wav.size))
        mel = mel_spectrogram(wav)
        partials = self.embed_mels(np.stack([mel[s] for s in slices]))
        return _normalized(partials.mean(axis=0)), partials

    def embed_windows(self, audio: Float32Array, starts: list[int]) -> Float32Array:
        """One embedding per 1.6 s window of ``audio`` starting at each sample of ``starts``
        (zero-padded past the end), shape (len(starts), 256).

        Each window's volume is raised to -30 dBFS on its own, as ``preprocess_wav`` raises a
        whole utterance: the network's input is a power spectrum, so a quiet window would
        otherwise read as a different voice. Its pauses stay (see the module docstring)."""
        return self.embed_many([(audio, starts)])[0]

    def embed_many(self, pieces: Sequence[tuple[Float32Array, list[int]]]) -> list[Float32Array]:
        """``embed_windows`` of several (audio, starts) pieces -- several streams' windows --
        in one batch through the network: a batch of ten costs little more than one."""
        count = sum(len(starts) for _, starts in pieces)
        if not count:
            return [np.zeros((0, self.embedding_size), dtype=np.float32) for _ in pieces]
        windows = np.zeros((count, PARTIAL_SAMPLES), dtype=np.float32)
        k = 0
        for audio, starts in pieces:
            for start in starts:
                piece = audio[start : start + PARTIAL_SAMPLES]
                windows[k, : piece.size] = normalize_volume(piece)
                k += 1
        # One centred STFT per window, as resemblyzer's mel of a 1.6 s wav; its extra last
        # frame is dropped so that each partial is the network's 160 frames.
        mels = np.stack([mel_spectrogram(w)[:PARTIAL_FRAMES] for w in windows])
        vectors = self.embed_mels(mels)
        out: list[Float32Array] = []
        k = 0
        for _, starts in pieces:
            out.append(vectors[k : k + len(starts)])
            k += len(starts)
        return out


def _normalized(v: Float32Array) -> Float32Array:
    unit: Float32Array = (v / max(float(np.linalg.norm(v)), 1e-12)).astype(np.float32)
    return unit
