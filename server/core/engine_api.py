"""What the server asks of a speech engine, and what it gets back. No engine code here and no
heavy imports (NumPy only): the session, the pipeline and their test doubles use these types
without loading MLX; ``server.engine`` is the MLX implementation.

Guarantees an engine gives (the session relies on each):
- ``DecodeResult.tokens`` starts with the request's ``prefix``, token for token, and the
  ``tokens`` of the first words of ``DecodeResult.words`` cover that prefix exactly: the
  session tells the words it forced from the new ones by counting tokens.
- Word times are seconds from the window's start, non-decreasing, within the real audio
  (``DecodeRequest.audio_s``) plus at most one timestamp step.
- ``DecodeRequest.draft`` changes only the speed: the result is the same for any draft.
- A result whose ``stop_reason`` is not speech (``StopReason.is_speech``) carries no text.
- One result per window, in the order the windows came; a failure raises ``DecodeError``
  for the whole call.
- Between its steps (after the encoder, and at each token step) an engine calls
  ``stop_if_interrupted``: a decode lane stops a call nobody waits for any more that way
  (``interruptible``), and the call raises ``DecodeInterrupted``.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import numpy.typing as npt

from server.protocol.errors import DecodeError
from server.protocol.formats import TASKS

Float32Array = npt.NDArray[np.float32]


class StopReason(str, enum.Enum):
    """Why a window's decoding stopped."""

    EOT = "eot"  # the model ended the transcript
    MAX_TOKENS = "max_tokens"  # the token cap per audio second was reached
    REPETITION = "repetition"  # an n-gram repeated: cut where it started looping
    # The transcript said its ending again, or looped after reaching the end of the audio:
    # cut, nothing is missing.
    REPEAT_AT_END = "repeat_at_end"
    NO_SPEECH = "no_speech"  # the window holds no speech: no text
    COMPRESSION = "compression"  # the text compresses too well to be speech: dropped

    @property
    def is_speech(self) -> bool:
        return self not in (StopReason.NO_SPEECH, StopReason.COMPRESSION)

    @property
    def looped(self) -> bool:
        """The decode hit a loop guard: a longer audio context usually fixes it."""
        return self in (StopReason.REPETITION, StopReason.COMPRESSION, StopReason.MAX_TOKENS)

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class DecodeOptions:
    language: str | None = "en"  # None: detect (multilingual models only)
    task: str = "transcribe"  # or "translate" (multilingual models only)
    # Run language detection even when ``language`` is given (DecodeResult.detected): a stream
    # that decodes in its current language checks whether the speaker has switched.
    detect_language: bool = False
    # Timestamp tokens around text spans; they also curb loops on short contexts.
    timestamps: bool = True
    word_timestamps: bool = True  # word times from cross-attention alignment (DTW)
    max_initial_timestamp_s: float = 1.0  # the first timestamp may not be later than this
    max_tokens_per_audio_s: float = 12.0  # token cap: 8 + this x audio seconds
    no_speech_threshold: float = 0.6  # P(<|nospeech|>) above this, with low logprob: no text
    logprob_threshold: float = -1.0  # average log-probability below this counts as doubtful
    no_speech_certain: float = 0.9  # P(<|nospeech|>) above this alone: no text (speech < 0.2)
    compression_ratio_threshold: float = 2.4  # gzip ratio above this: a loop; output dropped
    repetition_max_ngram: int = 64  # longest n-gram checked for consecutive repeats
    repetition_min_repeats: int = 3  # an n-gram repeated this often in a row cuts the decode
    repetition_phrase_tokens: int = 6  # n-grams this long cut the decode at their 2nd copy
    repetition_phrase_words: int = 3  # a window ending in the same words twice loses a copy
    suppress_blank: bool = True  # no space or end-of-text as the first sampled token
    # Beam search (OpenAI Whisper's rules): 1 is greedy decoding. A search keeps ``beam_size``
    # hypotheses and ends once ``round(beam_size * patience)`` have finished; they are ranked
    # by log-probability over length, or over ((5 + length) / 6) ** ``length_penalty``.
    beam_size: int = 1
    patience: float = 1.0
    length_penalty: float | None = None
    # Above 0, tokens are sampled from softmax(logits / temperature), ``best_of`` times, and
    # the best-ranked sample kept (Whisper's temperature fallback); ``seed`` makes it repeatable.
    temperature: float = 0.0
    best_of: int = 5
    seed: int = 0

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {', '.join(TASKS)}; got {self.task!r}")
        if self.max_tokens_per_audio_s <= 0:
            raise ValueError("max_tokens_per_audio_s must be > 0")
        if self.repetition_min_repeats < 2:
            raise ValueError("repetition_min_repeats must be >= 2")
        if self.repetition_phrase_tokens < 2 or self.repetition_phrase_words < 2:
            raise ValueError("repetition_phrase_tokens and repetition_phrase_words must be >= 2")
        if self.beam_size < 1 or self.best_of < 1:
            raise ValueError("beam_size and best_of must be >= 1")
        if self.patience <= 0:
            raise ValueError("patience must be > 0")
        if self.length_penalty is not None and not 0 <= self.length_penalty <= 1:
            raise ValueError("length_penalty must be None or in [0, 1]")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if self.temperature > 0 and self.beam_size > 1:
            raise ValueError("beam search is for temperature 0; sampling uses best_of")

    @property
    def searches(self) -> bool:
        """Whether decoding keeps several hypotheses (beam search or best-of sampling)."""
        return self.beam_size > 1 or self.temperature > 0


@dataclass(frozen=True)
class DecodeRequest:
    """What to decode in one window, from the session to the decoder unchanged."""

    audio_s: float  # seconds of real audio in the window (the rest is padding)
    options: DecodeOptions = field(default_factory=DecodeOptions)
    prompt: tuple[int, ...] = ()  # earlier committed text, as context
    prefix: tuple[int, ...] = ()  # text tokens forced at the start of the output
    # A guess at the output: the previous DecodeResult.sequence of the same stream, passed
    # unchanged (stale, wrong or empty is fine). Only the speed depends on it.
    draft: tuple[int, ...] = ()


@dataclass(frozen=True)
class Window:
    """A job's log-mel and its request: what a decode lane hands the engine. (The window in
    flight is a ``DecodeJob`` in the core, the scheduler's queued job in ``server.decode``,
    and this at the engine.)"""

    mel: Float32Array  # (context frames, n_mels), from SpeechEngine.features
    request: DecodeRequest


@dataclass(frozen=True)
class WordTiming:
    word: str  # with Whisper's leading space
    tokens: tuple[int, ...]
    start_s: float  # relative to the window start
    end_s: float
    probability: float


@dataclass(frozen=True)
class TextSpan:
    """A stretch of the output between two timestamp tokens."""

    start_s: float
    end_s: float
    text: str
    tokens: tuple[int, ...]


@dataclass(frozen=True)
class DecodeResult:
    tokens: tuple[int, ...]  # text tokens after the prompt, forced prefix included
    text: str
    spans: tuple[TextSpan, ...]
    words: tuple[WordTiming, ...]  # empty unless word_timestamps
    language: str | None
    avg_logprob: float
    no_speech_prob: float
    compression_ratio: float
    stop_reason: StopReason
    n_generated: int  # tokens sampled (not forced) in this call
    # Every token emitted after the start tokens, timestamps and forced prefix included (not
    # end-of-text), also when the text is dropped: the next decode's draft.
    sequence: tuple[int, ...] = ()
    n_steps: int = 0  # sequential forward passes after the prefill this row needed
    # The language detector's best guess and its probability, when it ran (language None or
    # detect_language); multilingual models only.
    detected: tuple[str, float] | None = None

    @property
    def is_speech(self) -> bool:
        return self.stop_reason.is_speech


class ModelShape(Protocol):
    """What the server needs to know about the model's dimensions."""

    @property
    def is_multilingual(self) -> bool: ...


class SpeechEngine(Protocol):
    """The engine as the pipeline uses it; ``server.engine.engine.Engine`` is the real one.

    ``features`` must be safe to call from several threads at once (it runs in the feature
    pool); everything else is called only from the thread of the decode lane that owns it,
    except ``name``, ``dims`` and ``encode_text`` (the session's tokenizer), which must not
    touch MLX.
    """

    @property
    def name(self) -> str: ...

    @property
    def dims(self) -> ModelShape: ...

    def encode_text(self, text: str) -> tuple[int, ...]: ...

    def features(self, audio: Float32Array) -> Float32Array: ...

    def decode_windows(self, windows: list[Window]) -> list[DecodeResult]: ...

    def transcribe_window(
        self, audio: Float32Array, request: DecodeRequest, temperatures: tuple[float, ...]
    ) -> tuple[DecodeResult, float]: ...

    def warmup(self) -> float: ...

    def release_memory(self) -> None: ...


class DecodeInterrupted(DecodeError):
    """The lane running the call was asked to stop it (``interruptible``): whoever asked
    for it has gone (a closing decode replaced it, a search went stale, a client left)."""


# What the engine call running on this thread (a lane's) asks to learn whether to stop. A
# context variable, so that each lane's thread has its own: the engine is not told per call.
_interrupt_requested: ContextVar[Callable[[], bool] | None] = ContextVar(
    "whisperwire_interrupt_requested", default=None
)


@contextlib.contextmanager
def interruptible(requested: Callable[[], bool]) -> Iterator[None]:
    """Engine calls made inside stop at their next step once ``requested()`` is true
    (``stop_if_interrupted``). ``requested`` is read from the thread that runs the call
    while another thread or process sets it: it must be cheap and need no lock."""
    token = _interrupt_requested.set(requested)
    try:
        yield
    finally:
        _interrupt_requested.reset(token)


def stop_if_interrupted() -> None:
    """Raise ``DecodeInterrupted`` if the call running on this thread was asked to stop;
    an engine calls this between its steps."""
    requested = _interrupt_requested.get()
    if requested is not None and requested():
        raise DecodeInterrupted("the decode was stopped: nobody waits for its result")
