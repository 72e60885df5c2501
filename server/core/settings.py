"""What a client chooses for its stream, checked against the model and the server's configs.

Each API maps its own options onto ``StreamSettings``; ``resolve`` checks them (raising
``ProtocolError`` in words the client can act on) and ``stream_configs`` derives the streaming
and VAD configs a stream with these settings runs with.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from server.config import StreamingConfig, VadConfig
from server.core.turns import TurnConfig
from server.protocol.errors import ProtocolError
from server.protocol.formats import FINALS, AudioFormat

# The end-of-speech silences a client may choose. Below 200 ms a reader's pauses between words
# end utterances (webrtcvad frames are 30 ms).
END_OF_SPEECH_MS_RANGE = (200, 5000)
# The audio a client may ask to keep before an onset; the session keeps this much while nobody
# speaks (``IDLE_KEEP_S``), so the VAD's look-back always finds it.
MAX_SPEECH_PAD_MS = 1000
IDLE_KEEP_S = MAX_SPEECH_PAD_MS / 1000


@dataclass(frozen=True)
class StreamSettings:
    """What a client chooses for its stream; each API maps its own options onto these."""

    audio_format: AudioFormat = field(default_factory=AudioFormat)
    language: str | None = "en"  # None: detected per utterance (multilingual models only)
    task: str = "transcribe"
    # The silence that ends an utterance (its final follows), within END_OF_SPEECH_MS_RANGE;
    # None: the server's (VadConfig.speech_end_silence_ms). Short speech keeps its longer end.
    end_of_speech_ms: int | None = None
    speech_pad_ms: int | None = None  # audio kept before an onset, 0-1000; None: the server's
    vad_aggressiveness: int | None = None  # webrtcvad's mode 0-3; None: the server's
    # Speaker labels on finals and words; None: the server's (StreamingConfig.speakers).
    speakers: bool | None = None
    # "words" or "utterance" (``StreamingConfig.finals``); None: the server's.
    finals: str | None = None
    # Conversational turns (``turns.py``): when a pause ends the speaker's turn; None: the
    # stream has no turn events.
    turns: TurnConfig | None = None


def resolve(
    settings: StreamSettings, *, multilingual: bool, speakers_enabled: bool
) -> StreamSettings:
    """``settings`` as they would take effect on this model: an English-only model
    transcribes English (no detection, no translation). Raises ProtocolError."""
    low, high = END_OF_SPEECH_MS_RANGE
    if settings.end_of_speech_ms is not None and not low <= settings.end_of_speech_ms <= high:
        raise ProtocolError(
            f"end_of_speech_ms must be {low} to {high}; got {settings.end_of_speech_ms}"
        )
    if settings.speech_pad_ms is not None and not 0 <= settings.speech_pad_ms <= MAX_SPEECH_PAD_MS:
        raise ProtocolError(f"speech_pad_ms must be 0 to {MAX_SPEECH_PAD_MS}")
    if settings.vad_aggressiveness not in (None, 0, 1, 2, 3):
        raise ProtocolError("vad_aggressiveness must be 0, 1, 2 or 3")
    if settings.speakers and not speakers_enabled:
        raise ProtocolError("speaker labels are off on this server (whisperwire-server --speakers)")
    if settings.finals not in (None, *FINALS):
        raise ProtocolError(f"finals must be one of {', '.join(FINALS)}; got {settings.finals!r}")
    if multilingual:
        return settings
    if settings.language not in (None, "en"):
        raise ProtocolError(
            f"this model is English-only; language {settings.language!r} is not available"
        )
    if settings.task == "translate":
        raise ProtocolError("this model is English-only; task 'translate' is not available")
    return dataclasses.replace(settings, language="en")


def stream_configs(
    settings: StreamSettings, streaming: StreamingConfig, vad: VadConfig
) -> tuple[StreamingConfig, VadConfig]:
    """The server's configs as a stream with ``settings`` runs them."""
    stream_vad = dataclasses.replace(
        vad,
        speech_end_silence_ms=_or(settings.end_of_speech_ms, vad.speech_end_silence_ms),
        speech_pad_ms=_or(settings.speech_pad_ms, vad.speech_pad_ms),
        aggressiveness=_or(settings.vad_aggressiveness, vad.aggressiveness),
    )
    return streaming.with_finals(settings.finals or streaming.finals), stream_vad


def nearest_end_of_speech_ms(ms: int) -> int:
    """The end-of-speech silence served for a vendor API's ``ms``: the nearest one in
    ``END_OF_SPEECH_MS_RANGE`` (v1 refuses values outside it instead)."""
    low, high = END_OF_SPEECH_MS_RANGE
    return min(max(ms, low), high)


def _or(chosen: int | None, default: int) -> int:
    return default if chosen is None else chosen
