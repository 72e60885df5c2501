"""A whole recording transcribed on the decode lanes, window by window, after the streams.

The long-form loop (``server.core.long_form``) says which 30 s window comes next; each is one
background call (``Pipeline.background``): the lane computes its full-context features and
decodes it with Whisper's temperature fallback (``SpeechEngine.transcribe_window``). A stream's
window waiting for a lane goes first, so an upload never holds up live captions by more than
the window a lane is already decoding.

A recording cut into parts at pauses (``long_form.split_recording``) is decoded part by part
side by side, on as many lanes as the streams leave free, and its text still comes in order.
"""

from __future__ import annotations

import asyncio
import operator
from collections.abc import AsyncIterator

from server.core.long_form import LongForm, Segment
from server.decode.pipeline import Pipeline

_Item = list[Segment] | BaseException | None


async def transcribe_on_lanes(
    pipeline: Pipeline, recording: LongForm
) -> AsyncIterator[list[Segment]]:
    """Decode ``recording`` to its end, yielding the segments each window adds (an empty
    list for a window without speech); ``recording.transcript()`` has them all afterwards."""
    while (job := recording.next_window()) is not None:
        call = operator.methodcaller("transcribe_window", job.audio, job.request, job.temperatures)
        result, temperature = await pipeline.background(call)
        yield recording.take(result, temperature)


async def transcribe_parts(
    pipeline: Pipeline, parts: list[LongForm]
) -> AsyncIterator[list[Segment]]:
    """Decode the parts of one recording side by side, yielding each window's segments in the
    recording's order: a later part's wait until the parts before it are done."""
    outboxes: list[asyncio.Queue[_Item]] = [asyncio.Queue() for _ in parts]

    async def decode(part: LongForm, outbox: asyncio.Queue[_Item]) -> None:
        try:
            async for segments in transcribe_on_lanes(pipeline, part):
                outbox.put_nowait(segments)
        except Exception as exc:
            outbox.put_nowait(exc)
        else:
            outbox.put_nowait(None)

    tasks = [asyncio.create_task(decode(p, o)) for p, o in zip(parts, outboxes, strict=True)]
    try:
        for outbox in outboxes:
            while (item := await outbox.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
