"""Frozen configuration objects, one per concern, checked when built.

The CLI only maps flags onto these; nothing else reads options from dictionaries.
"""

from __future__ import annotations

from dataclasses import dataclass

SAMPLE_RATE_HZ = 16_000  # Whisper's input rate; everything downstream of ingest runs at it
ENCODINGS = ("pcm_s16le", "pcm_f32le")
MIN_SAMPLE_RATE_HZ = 8_000
MAX_SAMPLE_RATE_HZ = 48_000
TASKS = ("transcribe", "translate")


@dataclass(frozen=True)
class AudioFormat:
    """What the client says it sends: mono PCM at some rate, little-endian."""

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
        return 2 if self.encoding == "pcm_s16le" else 4


@dataclass(frozen=True)
class VadConfig:
    """Voice activity detection on 16 kHz audio with webrtcvad."""

    aggressiveness: int = 2  # webrtcvad mode 0 (least) .. 3 (most eager to call audio non-speech)
    frame_ms: int = 30  # webrtcvad accepts only 10, 20 or 30 ms frames
    speech_start_ms: int = 90  # voiced audio needed within the start window to open speech
    speech_start_window_ms: int = 150  # hysteresis window for the start decision
    speech_end_silence_ms: int = 500  # unvoiced audio that ends speech
    speech_pad_ms: int = 200  # audio kept before the onset so word starts are not clipped

    def __post_init__(self) -> None:
        if self.aggressiveness not in (0, 1, 2, 3):
            raise ValueError(f"aggressiveness must be 0, 1, 2 or 3; got {self.aggressiveness}")
        if self.frame_ms not in (10, 20, 30):
            raise ValueError(f"frame_ms must be 10, 20 or 30; got {self.frame_ms}")
        if not 0 < self.speech_start_ms <= self.speech_start_window_ms:
            raise ValueError("need 0 < speech_start_ms <= speech_start_window_ms")
        if self.speech_end_silence_ms < self.frame_ms:
            raise ValueError("speech_end_silence_ms must be at least one frame")
        if self.speech_pad_ms < 0:
            raise ValueError("speech_pad_ms must be >= 0")


@dataclass(frozen=True)
class StreamingConfig:
    """How a session turns speech into decode windows and commits words."""

    language: str | None = "en"  # None: detect (multilingual models only)
    task: str = "transcribe"
    min_new_audio_ms: int = 300  # re-decode once this much new speech arrived
    first_decode_ms: int = 300  # the first decode of a segment waits for this much speech
    max_window_s: float = 15.0  # cut the window at a committed boundary beyond this
    agreement_n: int = 2  # LocalAgreement-n: words agreed by n consecutive decodes are final
    prompt_max_tokens: int = 64  # committed text fed back as context, most recent first
    max_frame_bytes: int = 1 << 20  # one binary frame; larger gets 1009

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {', '.join(TASKS)}; got {self.task!r}")
        if not 0 < self.max_window_s <= 30.0:
            raise ValueError(f"max_window_s must be in (0, 30]; got {self.max_window_s}")
        if self.agreement_n < 1:
            raise ValueError(f"agreement_n must be >= 1; got {self.agreement_n}")
        if self.min_new_audio_ms <= 0 or self.first_decode_ms <= 0:
            raise ValueError("min_new_audio_ms and first_decode_ms must be > 0")
        if not 0 <= self.prompt_max_tokens <= 223:
            raise ValueError(
                "prompt_max_tokens must be in [0, 223] (half of Whisper's text context)"
            )
        if self.max_frame_bytes <= 0:
            raise ValueError("max_frame_bytes must be > 0")
