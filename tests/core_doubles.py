"""Small builders for the streaming core's audio-free tests: words, utterances and jobs."""

from __future__ import annotations

import logging

import numpy as np

from server.config import StreamingConfig, VadConfig
from server.core.agreement import Word
from server.core.desk import DecodeDesk
from server.core.engine_api import (
    DecodeOptions,
    DecodeRequest,
    DecodeResult,
    StopReason,
    WordTiming,
)
from server.core.ingest import AudioIngest
from server.core.jobs import DecodeJob
from server.core.planner import DecodePlanner
from server.core.policy import CommitPolicy
from server.core.results import ResultFolder
from server.core.rules import RuleCounts
from server.core.transcript import Transcript
from server.core.utterance import Utterance
from server.core.windows import Windows
from server.protocol.audio import pcm_s16le_bytes
from server.protocol.formats import SAMPLE_RATE_HZ, AudioFormat

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


def quiet_stack(
    streaming: StreamingConfig | None = None,
) -> tuple[AudioIngest, Windows, DecodeDesk, ResultFolder]:
    """The core's units wired as a session wires them, with a VAD that hears nothing: a test
    opens and closes utterances itself and feeds audio for their windows."""
    c = streaming or StreamingConfig()
    log = logging.LoggerAdapter(logging.getLogger("tests.core"), {"session_id": "t"})
    counts = RuleCounts()
    audio = AudioIngest(
        AudioFormat(), VadConfig(), max_frame_bytes=1 << 20, classifier=lambda f: False
    )
    windows = Windows(audio, Transcript(c, counts, log), counts, log)
    planner = DecodePlanner(c, counts)
    windows.configure(c, planner, "en", None)
    desk = DecodeDesk("t", windows, counts)
    desk.configure(c, planner, "transcribe")
    results = ResultFolder(windows)
    results.configure(c, planner)
    return audio, windows, desk, results


def feed(audio: AudioIngest, seconds: float) -> None:
    """``seconds`` of a quiet constant signal (the VAD's verdicts are the test's)."""
    audio.receive(pcm_s16le_bytes(np.full(round(seconds * SR), 0.001, dtype=np.float32)))


def decoded(job: DecodeJob, *spec: tuple[str, float, float]) -> DecodeResult:
    """A result for ``job``: its forced prefix's words (times unknown: at 0), then ``spec``
    (text, start, end in stream time)."""
    words = [WordTiming(" p", (t,), 0.0, 0.0, 0.99) for t in job.request.prefix]
    words += [
        WordTiming(f" {t}", (200 + k,), a - job.start_s, b - job.start_s, 0.9)
        for k, (t, a, b) in enumerate(spec)
    ]
    return DecodeResult(
        tokens=tuple(t for x in words for t in x.tokens),
        text="".join(x.word for x in words),
        spans=(),
        words=tuple(words),
        language="en",
        avg_logprob=-0.2,
        no_speech_prob=0.01,
        compression_ratio=1.2,
        stop_reason=StopReason.EOT,
        n_generated=len(spec),
    )
