"""A whole recording transcribed on the decode lanes, window by window, after the streams.

The long-form loop (``server.core.long_form``) says which 30 s window comes next; each is one
background call (``Pipeline.background``): the lane computes its full-context features and
decodes it with Whisper's temperature fallback (``SpeechEngine.transcribe_window``). A stream's
window waiting for a lane goes first, so an upload never holds up live captions by more than
the window a lane is already decoding.
"""

from __future__ import annotations

import operator
from collections.abc import AsyncIterator

from server.core.long_form import LongForm, Segment
from server.decode.pipeline import Pipeline


async def transcribe_on_lanes(
    pipeline: Pipeline, recording: LongForm
) -> AsyncIterator[list[Segment]]:
    """Decode ``recording`` to its end, yielding the segments each window adds (an empty
    list for a window without speech); ``recording.transcript()`` has them all afterwards."""
    while (job := recording.next_window()) is not None:
        call = operator.methodcaller("transcribe_window", job.audio, job.request, job.temperatures)
        result, temperature = await pipeline.background(call)
        yield recording.take(result, temperature)
