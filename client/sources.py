"""Audio sources for the client: a file, raw PCM on standard input, or the microphone.

Each source yields little-endian PCM chunks of about ``chunk_ms`` in the format it announces
(``audio_format``), as an async iterator, so the streamer never blocks the event loop on a
read. A ``live`` source (the microphone) produces audio in real time by itself and must not be
paced again; the others produce it as fast as they are read.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Protocol

from server.protocol.audio import pcm_s16le_bytes, read_audio_file
from server.protocol.errors import WhisperwireError
from server.protocol.formats import SAMPLE_RATE_HZ, AudioFormat

logger = logging.getLogger("client.sources")

DEFAULT_CHUNK_MS = 100
_MIC_QUEUE_CHUNKS = 100  # 10 s of 100 ms chunks: covers a network stall, then we drop


class SourceError(WhisperwireError):
    """An audio source cannot be opened: a missing module, no input device, an unreadable file.

    The message is one line meant for the user.
    """


class ByteReader(Protocol):
    """A binary stream to read PCM from: ``sys.stdin.buffer``, a pipe, ``io.BytesIO``."""

    def read(self, size: int = -1, /) -> bytes | None:
        """Up to ``size`` bytes; empty at end of input (None: none ready, non-blocking)."""
        ...


class AudioSource(Protocol):
    """What ``stream_audio`` reads from."""

    @property
    def audio_format(self) -> AudioFormat:
        """Rate and encoding of the chunks, announced to the server."""
        ...

    @property
    def live(self) -> bool:
        """True when chunks arrive in real time by themselves (no pacing needed)."""
        ...

    def chunks(self) -> AsyncIterator[bytes]:
        """Yield PCM chunks until the audio ends or ``stop`` is called."""
        ...

    def stop(self) -> None:
        """End the audio early; ``chunks`` finishes after at most one more chunk."""
        ...


def _chunk_bytes(fmt: AudioFormat, chunk_ms: int) -> int:
    if chunk_ms <= 0:
        raise ValueError(f"chunk_ms must be > 0; got {chunk_ms}")
    samples = max(1, fmt.sample_rate_hz * chunk_ms // 1000)
    return samples * fmt.bytes_per_sample


class FileSource:
    """An audio file (anything ``server.protocol.audio.read_audio_file`` reads), sent as
    16 kHz s16le.

    The file is decoded when the source is built, so an unreadable file fails before any
    connection is made.

    Raises:
        SourceError: the file is missing or cannot be decoded.
    """

    def __init__(self, path: str | Path, chunk_ms: int = DEFAULT_CHUNK_MS) -> None:
        self._fmt = AudioFormat(SAMPLE_RATE_HZ, "pcm_s16le")
        self._chunk_bytes = _chunk_bytes(self._fmt, chunk_ms)
        try:
            samples = read_audio_file(path)
        except FileNotFoundError as exc:
            raise SourceError(f"no such audio file: {path}") from exc
        except (OSError, ValueError) as exc:
            raise SourceError(f"cannot read {path}: {exc}") from exc
        self._pcm = pcm_s16le_bytes(samples)
        self._stopped = False

    @property
    def audio_format(self) -> AudioFormat:
        """Always 16 kHz ``pcm_s16le``."""
        return self._fmt

    @property
    def live(self) -> bool:
        """False: a file is read as fast as it is consumed."""
        return False

    @property
    def duration_s(self) -> float:
        """Length of the audio in seconds."""
        return len(self._pcm) / (self._fmt.bytes_per_sample * self._fmt.sample_rate_hz)

    async def chunks(self) -> AsyncIterator[bytes]:
        """Yield the audio in chunks of ``chunk_ms`` (the last may be shorter)."""
        for offset in range(0, len(self._pcm), self._chunk_bytes):
            if self._stopped:
                return
            yield self._pcm[offset : offset + self._chunk_bytes]

    def stop(self) -> None:
        """Stop before the end of the file."""
        self._stopped = True


class StdinSource:
    """Raw PCM from a binary stream (standard input by default), passed on unconverted.

    The stated rate and encoding go to the server, which converts; a trailing partial sample
    at end of input is dropped with a warning.

    Raises:
        ValueError: the rate or encoding is not one the protocol accepts (the message lists
            the allowed values).
    """

    def __init__(
        self,
        sample_rate_hz: int = SAMPLE_RATE_HZ,
        encoding: str = "pcm_s16le",
        chunk_ms: int = DEFAULT_CHUNK_MS,
        stream: ByteReader | None = None,
    ) -> None:
        self._fmt = AudioFormat(sample_rate_hz, encoding)
        self._chunk_bytes = _chunk_bytes(self._fmt, chunk_ms)
        self._stream: ByteReader = stream if stream is not None else sys.stdin.buffer
        self._stopped = False

    @property
    def audio_format(self) -> AudioFormat:
        """The rate and encoding given to the constructor."""
        return self._fmt

    @property
    def live(self) -> bool:
        """False: pacing a pipe that is already real time (``arecord``) costs nothing, since
        each chunk is read no earlier than it was recorded; a redirected file needs it."""
        return False

    async def chunks(self) -> AsyncIterator[bytes]:
        """Yield whole-sample chunks until end of input."""
        width = self._fmt.bytes_per_sample
        while not self._stopped:
            # A blocking read on a pipe would stall the event loop; run it on a thread.
            data = await asyncio.to_thread(self._read_chunk)
            if not data:
                return
            whole = len(data) - len(data) % width
            if whole != len(data):
                logger.warning(
                    "dropping %d trailing byte(s): input ended inside a %d-byte sample",
                    len(data) - whole,
                    width,
                )
            if whole:
                yield data[:whole]
            if len(data) < self._chunk_bytes:
                return

    def _read_chunk(self) -> bytes:
        # read(n) on a pipe may return less than n before end of input; fill the chunk.
        parts: list[bytes] = []
        wanted = self._chunk_bytes
        while wanted > 0:
            part = self._stream.read(wanted)
            if not part:
                break
            parts.append(part)
            wanted -= len(part)
        return b"".join(parts)

    def stop(self) -> None:
        """Stop after the chunk being read."""
        self._stopped = True


class MicrophoneSource:
    """The default input device through ``sounddevice`` (PortAudio), as mono s16le.

    ``sounddevice`` is an optional dependency (``pip install 'whisperwire[mic]'``), imported
    here and not at module import, so the rest of the client works without it.

    Raises:
        SourceError: ``sounddevice`` or PortAudio is missing, or there is no input device.
    """

    def __init__(
        self, sample_rate_hz: int = SAMPLE_RATE_HZ, chunk_ms: int = DEFAULT_CHUNK_MS
    ) -> None:
        self._fmt = AudioFormat(sample_rate_hz, "pcm_s16le")
        self._frames_per_chunk = _chunk_bytes(self._fmt, chunk_ms) // self._fmt.bytes_per_sample
        try:
            import sounddevice
        except ImportError as exc:
            raise SourceError(
                "microphone capture needs the sounddevice package: pip install 'whisperwire[mic]'"
            ) from exc
        except OSError as exc:  # sounddevice raises OSError when libportaudio is missing
            raise SourceError(
                f"microphone capture needs the PortAudio library ({exc}): "
                "e.g. apt-get install libportaudio2 or brew install portaudio"
            ) from exc
        self._sd = sounddevice
        try:
            device = sounddevice.query_devices(kind="input")
        except (sounddevice.PortAudioError, ValueError) as exc:
            raise SourceError(f"no microphone: no default audio input device ({exc})") from exc
        self.device_name = str(device["name"])
        self._queue: asyncio.Queue[bytes | None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._dropped = 0
        self._stopped = False

    @property
    def audio_format(self) -> AudioFormat:
        """``pcm_s16le`` at the rate asked for (16 kHz by default)."""
        return self._fmt

    @property
    def live(self) -> bool:
        """True: the device delivers audio in real time."""
        return True

    async def chunks(self) -> AsyncIterator[bytes]:
        """Yield chunks as the device records them, until ``stop``."""
        if self._stopped:
            return
        self._loop = asyncio.get_running_loop()
        self._queue = asyncio.Queue(maxsize=_MIC_QUEUE_CHUNKS)
        try:
            stream = self._sd.RawInputStream(
                samplerate=self._fmt.sample_rate_hz,
                blocksize=self._frames_per_chunk,
                channels=1,
                dtype="int16",
                callback=self._on_audio,
            )
        except self._sd.PortAudioError as exc:
            raise SourceError(f"cannot open the microphone {self.device_name!r}: {exc}") from exc
        logger.info("recording from %s at %d Hz", self.device_name, self._fmt.sample_rate_hz)
        with stream:
            while True:
                chunk = await self._queue.get()
                if chunk is None:
                    break
                yield chunk
        if self._dropped:
            logger.warning("dropped %d microphone chunk(s) while the network lagged", self._dropped)

    # indata is a CFFI buffer, which has no static type.
    def _on_audio(self, indata: Any, frames: int, time: object, status: object) -> None:
        # Runs on PortAudio's thread: copy the buffer (PortAudio reuses it) and hand it over.
        if status:
            logger.debug("microphone status: %s", status)
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._enqueue, bytes(indata))

    def _enqueue(self, chunk: bytes | None) -> None:
        assert self._queue is not None
        if self._queue.full():
            # A live source cannot wait: drop the oldest audio rather than grow without bound.
            self._queue.get_nowait()
            self._dropped += 1
        self._queue.put_nowait(chunk)

    def stop(self) -> None:
        """Stop recording; call from the event loop's thread (e.g. a signal handler)."""
        self._stopped = True
        if self._queue is not None:
            self._enqueue(None)
