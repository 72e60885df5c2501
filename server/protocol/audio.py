"""PCM ingest: decode client frames to 16 kHz mono float32, read audio files, encode s16le.

Frames are linear PCM (s16le, f32le) or G.711 (mu-law, A-law: ``server.protocol.g711``).

Nothing here touches a socket or an event loop. A session owns one ``PcmDecoder`` and feeds
it every binary frame; the decoder validates the frame, converts it to float32 in [-1, 1] and
resamples it to ``SAMPLE_RATE_HZ`` with a streaming resampler, so frames may be any length.
"""

from __future__ import annotations

import logging
import struct
import wave
from pathlib import Path

import numpy as np
import numpy.typing as npt
import soxr

from server.protocol import g711
from server.protocol.errors import AudioFormatError, FrameTooLargeError
from server.protocol.formats import SAMPLE_RATE_HZ, AudioFormat

logger = logging.getLogger("server.protocol.audio")

_S16_SCALE = 32768.0  # int16 full scale; decode and encode use the same factor so s16 round-trips
_RESAMPLE_QUALITY = "HQ"
_WAVE_FORMAT_PCM = 0x0001
_WAVE_FORMAT_IEEE_FLOAT = 0x0003
_WAVE_FORMAT_EXTENSIBLE = 0xFFFE


def _empty() -> npt.NDArray[np.float32]:
    return np.zeros(0, dtype=np.float32)


class PcmDecoder:
    """Turns one client's binary frames into 16 kHz mono float32 samples.

    One instance per session: the streaming resampler keeps filter state between frames, so
    frame boundaries leave no trace in the output. Every frame must hold whole samples; a
    partial sample is rejected rather than carried over, because it means the client's byte
    stream is misaligned.
    """

    def __init__(self, fmt: AudioFormat, *, max_frame_bytes: int) -> None:
        if max_frame_bytes <= 0:
            raise ValueError(f"max_frame_bytes must be > 0; got {max_frame_bytes}")
        self._fmt = fmt
        self._max_frame_bytes = max_frame_bytes
        # 16 kHz input needs no resampling; a pass-through resampler would only add delay.
        self._resampler: soxr.ResampleStream | None = None
        if fmt.sample_rate_hz != SAMPLE_RATE_HZ:
            self._resampler = soxr.ResampleStream(
                fmt.sample_rate_hz,
                SAMPLE_RATE_HZ,
                1,
                dtype="float32",
                quality=_RESAMPLE_QUALITY,
            )
        self._samples_in = 0
        self._flushed = False

    @property
    def format(self) -> AudioFormat:
        """The format this decoder was built for."""
        return self._fmt

    @property
    def samples_in(self) -> int:
        """Input samples accepted so far, at the client's sample rate."""
        return self._samples_in

    @property
    def seconds_in(self) -> float:
        """Seconds of audio accepted so far."""
        return self._samples_in / self._fmt.sample_rate_hz

    def decode(self, frame: bytes) -> npt.NDArray[np.float32]:
        """Validate one binary frame and return its samples at 16 kHz, mono, in [-1, 1].

        An empty frame returns an empty array. ``pcm_f32le`` values outside [-1, 1] are
        clipped to that range; NaN or infinite values are rejected. With resampling, the
        output lags the input by the resampler's delay; ``flush`` releases the rest.

        Raises:
            FrameTooLargeError: the frame is longer than ``max_frame_bytes``.
            AudioFormatError: the frame is not a whole number of samples, holds NaN or
                infinity, or arrives after ``flush``.
        """
        if self._flushed:
            raise AudioFormatError("audio received after the decoder was flushed")
        size = len(frame)
        if size > self._max_frame_bytes:
            raise FrameTooLargeError(
                f"frame of {size} bytes exceeds the limit of {self._max_frame_bytes} bytes"
            )
        if size == 0:
            return _empty()
        width = self._fmt.bytes_per_sample
        if size % width:
            raise AudioFormatError(
                f"frame of {size} bytes is not a whole number of {width}-byte "
                f"{self._fmt.encoding} samples"
            )
        encoding = self._fmt.encoding
        if encoding in g711.LAWS:
            samples = g711.decode(frame, encoding)
        elif encoding == "pcm_s16le":
            raw = np.frombuffer(frame, dtype="<i2")
            samples = raw.astype(np.float32) / np.float32(_S16_SCALE)
        else:
            raw = np.frombuffer(frame, dtype="<f4")
            if not np.isfinite(raw).all():
                bad = int(np.count_nonzero(~np.isfinite(raw)))
                raise AudioFormatError(
                    f"frame holds {bad} NaN or infinite pcm_f32le sample(s) of {raw.size}"
                )
            samples = np.clip(raw, -1.0, 1.0).astype(np.float32)
        self._samples_in += samples.size
        if self._resampler is None:
            return samples
        return np.asarray(self._resampler.resample_chunk(samples), dtype=np.float32)

    def flush(self) -> npt.NDArray[np.float32]:
        """Return the samples still inside the resampler; the decoder accepts no more audio.

        Calling it again returns an empty array.
        """
        if self._flushed:
            return _empty()
        self._flushed = True
        if self._resampler is None:
            return _empty()
        return np.asarray(self._resampler.resample_chunk(_empty(), last=True), dtype=np.float32)


def pcm_s16le_bytes(samples: npt.NDArray[np.float32]) -> bytes:
    """Encode float samples as little-endian int16 PCM, clipping to full scale.

    NaN becomes silence. Decoding the result with ``PcmDecoder`` gives back the input to within
    one quantisation step (exactly, for input that came from int16).
    """
    x = np.nan_to_num(np.asarray(samples, dtype=np.float32), nan=0.0)
    scaled = np.clip(np.round(x.astype(np.float64) * _S16_SCALE), -32768, 32767)
    return scaled.astype("<i2").tobytes()


def read_audio_file(path: str | Path) -> npt.NDArray[np.float32]:
    """Read a whole audio file as mono float32 at 16 kHz.

    WAV is read here (8/16/24/32-bit integer PCM and 32/64-bit IEEE float, any channel count,
    averaged to mono, any rate, resampled with soxr); anything else (flac, mp3, m4a, ogg,
    webm, or a WAV variant not read here) by PyAV (``server.protocol.media``).

    Raises:
        FileNotFoundError: no file at ``path``.
        ValueError: the file cannot be decoded.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no such audio file: {path}")
    with path.open("rb") as f:
        head = f.read(12)
    if head[:4] == b"RIFF" and head[8:12] == b"WAVE":
        try:
            samples, rate = _read_wav(path)
        except _NotReadHere:
            pass
        else:
            if rate != SAMPLE_RATE_HZ:
                samples = np.asarray(
                    soxr.resample(samples, rate, SAMPLE_RATE_HZ, quality=_RESAMPLE_QUALITY),
                    dtype=np.float32,
                )
            return samples
    # Imported here: the client streams WAV files without loading FFmpeg's libraries.
    from server.protocol.media import MediaError, decode_media

    logger.debug("decoding %s with PyAV", path)
    try:
        return decode_media(path)
    except MediaError as exc:
        raise ValueError(f"cannot read {path}: {exc}") from exc


class _NotReadHere(ValueError):
    """A WAV variant this module does not read (PyAV does)."""


def _not_readable(path: Path, why: str) -> ValueError:
    return _NotReadHere(f"cannot read {path} as WAV: {why}")


def _read_wav(path: Path) -> tuple[npt.NDArray[np.float32], int]:
    """Mono float32 samples and their rate from a WAV file."""
    try:
        with wave.open(str(path), "rb") as w:
            channels, width, rate = w.getnchannels(), w.getsampwidth(), w.getframerate()
            data = w.readframes(w.getnframes())
    except (wave.Error, EOFError):
        # wave reads integer PCM only; float and WAVE_FORMAT_EXTENSIBLE files land here.
        return _read_riff(path)
    return _downmix(_int_pcm_to_float(data, width, path), channels), rate


def _read_riff(path: Path) -> tuple[npt.NDArray[np.float32], int]:
    """Parse RIFF chunks by hand for the WAV variants the ``wave`` module rejects."""
    blob = path.read_bytes()
    if len(blob) < 12 or blob[:4] != b"RIFF" or blob[8:12] != b"WAVE":
        raise _not_readable(path, "not a RIFF/WAVE file")
    fmt: bytes | None = None
    data: bytes | None = None
    pos = 12
    while pos + 8 <= len(blob):
        chunk_id = blob[pos : pos + 4]
        (chunk_size,) = struct.unpack_from("<I", blob, pos + 4)
        body = blob[pos + 8 : pos + 8 + chunk_size]  # streamed files may overstate the size
        if chunk_id == b"fmt ":
            fmt = body
        elif chunk_id == b"data":
            data = body
        pos += 8 + chunk_size + (chunk_size & 1)  # chunks are padded to an even length
    if fmt is None or data is None or len(fmt) < 16:
        raise _not_readable(path, "missing or short fmt/data chunk")
    tag, channels, rate, _, block_align, bits = struct.unpack_from("<HHIIHH", fmt)
    if tag == _WAVE_FORMAT_EXTENSIBLE and len(fmt) >= 26:
        # The real format code is the first two bytes of the SubFormat GUID.
        (tag,) = struct.unpack_from("<H", fmt, 24)
    if channels < 1 or rate <= 0 or block_align <= 0:
        raise _not_readable(path, f"bad header: {channels} channels at {rate} Hz")
    data = data[: len(data) - len(data) % block_align]
    if tag == _WAVE_FORMAT_IEEE_FLOAT and bits in (32, 64):
        floats = np.frombuffer(data, dtype="<f4" if bits == 32 else "<f8")
        if not np.isfinite(floats).all():
            raise ValueError(f"{path} holds NaN or infinite samples")
        return _downmix(floats.astype(np.float32), channels), rate
    if tag == _WAVE_FORMAT_PCM:
        return _downmix(_int_pcm_to_float(data, bits // 8, path), channels), rate
    raise _not_readable(path, f"WAV format code {tag:#06x} with {bits}-bit samples")


def _int_pcm_to_float(data: bytes, width: int, path: Path) -> npt.NDArray[np.float32]:
    if width == 1:  # 8-bit WAV is unsigned, centred on 128
        return (np.frombuffer(data, dtype=np.uint8).astype(np.float32) - 128.0) / 128.0
    if width == 2:
        return np.frombuffer(data, dtype="<i2").astype(np.float32) / np.float32(_S16_SCALE)
    if width == 3:
        # Put the three bytes in the top of an int32 so the sign comes along for free.
        triples = np.frombuffer(data, dtype=np.uint8).reshape(-1, 3)
        wide = np.zeros((triples.shape[0], 4), dtype=np.uint8)
        wide[:, 1:] = triples
        return (wide.view("<i4").ravel().astype(np.float64) / 2.0**31).astype(np.float32)
    if width == 4:
        return (np.frombuffer(data, dtype="<i4").astype(np.float64) / 2.0**31).astype(np.float32)
    raise _not_readable(path, f"{8 * width}-bit integer samples")


def _downmix(samples: npt.NDArray[np.float32], channels: int) -> npt.NDArray[np.float32]:
    if channels == 1:
        return samples
    frames = samples[: samples.size - samples.size % channels].reshape(-1, channels)
    return np.asarray(frames.mean(axis=1, dtype=np.float32), dtype=np.float32)
