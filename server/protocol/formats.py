"""What protocol v1 carries: the audio formats a client may send and the tasks it may ask for.

Shared by the server and the client (``messages.py`` checks ``config`` messages against these,
the client's sources produce an ``AudioFormat``), so it imports nothing: a client must not pull
in the server's configuration, let alone MLX or webrtcvad, to speak the protocol.
"""

from __future__ import annotations

from dataclasses import dataclass

SAMPLE_RATE_HZ = 16_000  # Whisper's input rate; everything downstream of ingest runs at it
# Linear PCM, and G.711's mu-law and A-law (telephone audio: one byte per sample).
ENCODINGS = ("pcm_s16le", "pcm_f32le", "mulaw", "alaw")
_BYTES_PER_SAMPLE = {"pcm_s16le": 2, "pcm_f32le": 4, "mulaw": 1, "alaw": 1}
MIN_SAMPLE_RATE_HZ = 8_000
MAX_SAMPLE_RATE_HZ = 48_000
TASKS = ("transcribe", "translate")
# When a stream's words become final: one by one as decodes agree on them, or an utterance's
# together when it ends (``StreamingConfig.finals``).
FINALS = ("words", "utterance")


@dataclass(frozen=True)
class AudioFormat:
    """What the client says it sends: mono audio at some rate, linear PCM little-endian or
    G.711 (``mulaw``, ``alaw``)."""

    sample_rate_hz: int = SAMPLE_RATE_HZ
    encoding: str = "pcm_s16le"

    def __post_init__(self) -> None:
        if self.encoding not in ENCODINGS:
            raise ValueError(
                f"encoding must be one of {', '.join(ENCODINGS)}; got {self.encoding!r}"
            )
        if not MIN_SAMPLE_RATE_HZ <= self.sample_rate_hz <= MAX_SAMPLE_RATE_HZ:
            raise ValueError(
                f"sample_rate must be between {MIN_SAMPLE_RATE_HZ} and {MAX_SAMPLE_RATE_HZ} Hz; "
                f"got {self.sample_rate_hz}"
            )

    @property
    def bytes_per_sample(self) -> int:
        return _BYTES_PER_SAMPLE[self.encoding]
