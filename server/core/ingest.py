"""A stream's audio on its way in: bytes decoded to 16 kHz samples, kept, and segmented.

The PCM decoder turns the client's bytes into samples at Whisper's rate, the sample buffer
keeps what a window may still need, and webrtcvad (``vad.py``) says where speech starts and
ends. No decisions about text here; the session reads the events and the audio.
"""

from __future__ import annotations

from collections.abc import Callable

from server.config import VadConfig
from server.core.buffer import SampleBuffer
from server.core.jobs import Float32Array
from server.core.settings import IDLE_KEEP_S
from server.core.vad import FrameClassifier, FrameVoicing, VadEvent, VadSegmenter
from server.protocol.audio import PcmDecoder
from server.protocol.formats import SAMPLE_RATE_HZ, AudioFormat


class AudioIngest:
    """The decoder, buffer and VAD of one stream."""

    def __init__(
        self,
        audio_format: AudioFormat,
        vad: VadConfig,
        *,
        max_frame_bytes: int,
        classifier: FrameClassifier | None = None,
        voicing: Callable[[], FrameVoicing] | None = None,
    ) -> None:
        self.buffer = SampleBuffer()
        self._classifier = classifier  # webrtcvad's frame verdicts, recorded; None: its own
        self._voicing = voicing  # makes another detector (Silero's); None: webrtcvad
        self.configure(audio_format, vad, max_frame_bytes=max_frame_bytes)

    def configure(self, audio_format: AudioFormat, vad: VadConfig, *, max_frame_bytes: int) -> None:
        """New settings, before the first audio: a new decoder and VAD (the buffer stays)."""
        self.pcm = PcmDecoder(audio_format, max_frame_bytes=max_frame_bytes)
        voicing = self._voicing() if self._voicing is not None else None
        self.vad = VadSegmenter(vad, self._classifier, voicing=voicing)

    @property
    def seconds_in(self) -> float:
        """Audio received so far, in seconds of the client's stream."""
        return self.pcm.seconds_in

    @property
    def end(self) -> int:
        """The stream sample after the last one received."""
        return self.buffer.end

    def receive(self, data: bytes) -> list[VadEvent]:
        """Take audio bytes in the stream's format. Raises a StreamError subclass."""
        return self._keep(self.pcm.decode(data))

    def finish_decoding(self) -> list[VadEvent]:
        """The stream ended: the samples the decoder still held."""
        return self._keep(self.pcm.flush())

    def finish_speech(self, *, at_pause: bool) -> list[VadEvent]:
        """The stream ended: speech still going on ends (with ``at_pause``, where the pause
        it is in began)."""
        return self.vad.flush(at_pause=at_pause)

    def _keep(self, samples: Float32Array) -> list[VadEvent]:
        if not samples.size:
            return []
        self.buffer.append(samples)
        return self.vad.receive(samples)

    def slice(self, start: int, end: int) -> Float32Array:
        return self.buffer.slice(start, end)

    @property
    def idle_keep_from(self) -> int:
        """What to keep while no window needs audio: the VAD's look-back (``IDLE_KEEP_S``)."""
        return self.buffer.end - int(IDLE_KEEP_S * SAMPLE_RATE_HZ)

    def trim(self, keep_from: int) -> None:
        """Forget audio before ``keep_from``."""
        self.buffer.trim(keep_from)
        self.vad.forget_before(keep_from)
