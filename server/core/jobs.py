"""A decode job: one window of one stream, as the session hands it to the decode stage."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from server.core.engine_api import DecodeRequest
from server.protocol.formats import SAMPLE_RATE_HZ

Float32Array = npt.NDArray[np.float32]


@dataclass(frozen=True)
class DecodeJob:
    """One window for the decode stage: ``audio`` (16 kHz mono, starting at ``start_s`` of
    the stream) and the request the decoder gets for it."""

    session_id: str
    job_id: int
    audio: Float32Array
    start_s: float
    request: DecodeRequest
    closing: bool  # the last decode of this window: everything it returns is committed
    created_at: float = field(default_factory=time.monotonic)
    # A decode a listener is waiting on: the utterance's first words (time to first token) or
    # its closing decode (its final). The scheduler serves it ahead of routine re-decodes
    # (``PipelineConfig.urgent_head_start_ms``).
    urgent: bool = False
    # A closing decode started when the silence after speech had covered the trailing pad,
    # before the endpoint (the ``speculative_closing`` rule): it closes the utterance
    # if the endpoint comes where it ended, and is an ordinary re-decode if speech goes on.
    speculative: bool = False
    # Created (or brought up to date) while more streams were open than the server's
    # comfortable estimate (``Pipeline.past_comfort``): its words need less settled context
    # (``utterance_busy_settled_context_s``).
    past_comfort: bool = False

    @property
    def end_sample(self) -> int:
        return round(self.start_s * SAMPLE_RATE_HZ) + int(self.audio.shape[0])

    @property
    def audio_s(self) -> float:
        return self.request.audio_s


def basis_of(job: DecodeJob) -> tuple[int, int]:
    """The window basis (``Utterance.basis``) a job was made for: its start and forced prefix."""
    return round(job.start_s * SAMPLE_RATE_HZ), len(job.request.prefix)
