"""Audio files in the formats people upload (wav, mp3, m4a/mp4, ogg/opus, webm, flac, ...),
decoded with PyAV (FFmpeg's libraries, in its wheels) to 16 kHz mono float32."""

from __future__ import annotations

import io
from pathlib import Path

import av
import numpy as np
import numpy.typing as npt

from server.protocol.formats import SAMPLE_RATE_HZ

Float32Array = npt.NDArray[np.float32]


class MediaError(ValueError):
    """The bytes are no audio FFmpeg can decode; the message says why."""


def decode_media(source: bytes | Path, *, max_duration_s: float | None = None) -> Float32Array:
    """The first audio stream of a file (bytes or a path), as 16 kHz mono float32 samples.

    Raises ``MediaError`` for bytes that are no media file, a file without audio, audio that
    decodes to nothing, or (with ``max_duration_s``) a longer recording.
    """
    if isinstance(source, bytes) and not source:
        raise MediaError("the file is empty")
    target = io.BytesIO(source) if isinstance(source, bytes) else str(source)
    limit = None if max_duration_s is None else round(max_duration_s * SAMPLE_RATE_HZ)
    pieces: list[Float32Array] = []
    samples = 0
    try:
        with av.open(target, mode="r", metadata_errors="ignore") as container:
            stream = next((s for s in container.streams if s.type == "audio"), None)
            if stream is None:
                raise MediaError("the file has no audio stream")
            resampler = av.AudioResampler(format="flt", layout="mono", rate=SAMPLE_RATE_HZ)
            for frame in container.decode(stream):
                assert isinstance(frame, av.AudioFrame)  # decoded from an audio stream
                for out in resampler.resample(frame):
                    pieces.append(_samples(out))
                    samples += pieces[-1].shape[0]
                if limit is not None and samples > limit:
                    raise MediaError(
                        f"the recording is longer than the {max_duration_s:.0f} s this server "
                        "transcribes in one request"
                    )
            for out in resampler.resample(None):
                pieces.append(_samples(out))
    except av.FFmpegError as exc:
        raise MediaError(f"the audio could not be decoded: {_reason(exc)}") from exc
    audio = np.concatenate(pieces).astype(np.float32) if pieces else np.zeros(0, np.float32)
    if audio.shape[0] == 0:
        raise MediaError("the file holds no audio samples")
    return audio


def _samples(frame: av.AudioFrame) -> Float32Array:
    return np.asarray(frame.to_ndarray(), dtype=np.float32).reshape(-1)


def _reason(exc: av.FFmpegError) -> str:
    # FFmpeg's message without the file name PyAV appends (a BytesIO's repr, or a path).
    return str(getattr(exc, "strerror", None) or exc)
