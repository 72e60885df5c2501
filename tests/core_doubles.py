"""Small builders for the streaming core's audio-free tests: words, utterances and jobs."""

from __future__ import annotations

import numpy as np

from server.core.agreement import Word
from server.core.engine_api import DecodeOptions, DecodeRequest
from server.core.jobs import DecodeJob
from server.core.policy import CommitPolicy
from server.core.utterance import Utterance
from server.protocol.formats import SAMPLE_RATE_HZ

SR = SAMPLE_RATE_HZ


def w(text: str, start_s: float, end_s: float, token: int = 1, probability: float = 0.9) -> Word:
    """A word with Whisper's leading space and one token."""
    return Word(f" {text}", start_s, end_s, probability, (token,))


def spoken(*spec: tuple[str, float, float]) -> list[Word]:
    """Words from (text, start, end) triples, each with its own token."""
    return [w(text, a, b, token=100 + k) for k, (text, a, b) in enumerate(spec)]


def utterance(
    start_s: float = 0.0, *, window_start_s: float | None = None, heard_to_s: float = 0.0
) -> Utterance:
    """An open utterance starting at ``start_s`` (its window at ``window_start_s``)."""
    start = round(start_s * SR)
    utt = Utterance.starting_at(start, CommitPolicy(), "en")
    if window_start_s is not None:
        utt.window_start = utt.decoded_to = round(window_start_s * SR)
    utt.heard_to = max(utt.window_start, round(heard_to_s * SR))
    return utt


def commit(utt: Utterance, words: list[Word], *, carried: bool = False) -> None:
    """Make ``words`` final in ``utt``'s window (``carried``: as a cut carried them in)."""
    utt.add_committed(words)
    if carried:
        utt.prompted_tokens = len(utt.committed_tokens)


def job(
    start_s: float,
    end_s: float,
    *,
    prefix: tuple[int, ...] = (),
    closing: bool = False,
    speculative: bool = False,
    beam_size: int = 1,
) -> DecodeJob:
    """A decode of the audio from ``start_s`` to ``end_s`` (silence: only its extent counts)."""
    audio = np.zeros(round((end_s - start_s) * SR), dtype=np.float32)
    return DecodeJob(
        session_id="t",
        job_id=0,
        audio=audio,
        start_s=start_s,
        request=DecodeRequest(
            audio_s=end_s - start_s, options=DecodeOptions(beam_size=beam_size), prefix=prefix
        ),
        closing=closing,
        speculative=speculative,
    )


def voiced_everywhere(start: int, end: int) -> float:
    """``VadSegmenter.voiced_s`` of a stream that is speech throughout."""
    return max(0, end - start) / SR


def voiced_nowhere(start: int, end: int) -> float:
    return 0.0
