"""Decoding options: one frozen dataclass, one line per field."""

from __future__ import annotations

from dataclasses import dataclass

from ..config import TASKS


@dataclass(frozen=True)
class DecodeOptions:
    language: str | None = "en"  # None: detect (multilingual models only)
    task: str = "transcribe"  # or "translate" (multilingual models only)
    timestamps: bool = True  # segment timestamp tokens; they also curb loops on short contexts
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

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {', '.join(TASKS)}; got {self.task!r}")
        if self.max_tokens_per_audio_s <= 0:
            raise ValueError("max_tokens_per_audio_s must be > 0")
        if self.repetition_min_repeats < 2:
            raise ValueError("repetition_min_repeats must be >= 2")
        if self.repetition_phrase_tokens < 2 or self.repetition_phrase_words < 2:
            raise ValueError("repetition_phrase_tokens and repetition_phrase_words must be >= 2")
