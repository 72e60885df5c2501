"""A stream's decode jobs: the one in flight, the next one, its refresh and replacement, and
the background searches of the open window.

One decode of a stream is in flight at most (and one background search beside it, on a
spare lane). The desk asks the planner (``planner.py``) when a window is due and how it is
decoded, and the windows (``windows.py``) to cut one that outgrew its cap or to hold the
words background searches agreed on; it hands out jobs and takes back the one in flight when
its result comes.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

from server.config import StreamingConfig
from server.core.finals import WordFinals, finals_for
from server.core.jobs import DecodeJob, basis_of
from server.core.planner import DecodePlanner, Load
from server.core.rules import RuleCounts
from server.core.searches import search_due
from server.core.utterance import Utterance
from server.core.windows import Windows
from server.protocol.formats import SAMPLE_RATE_HZ

# Called with an utterance whose speculative closing decode came back and is held: it is to
# be folded in now (``Session``).
Release = Callable[[Utterance], None]


class DecodeDesk:
    """The decode jobs of one stream."""

    def __init__(self, session_id: str, windows: Windows, counts: RuleCounts) -> None:
        self.session_id = session_id
        self.windows = windows
        self.counts = counts
        self.log: logging.LoggerAdapter[logging.Logger] = windows.log
        self.in_flight: DecodeJob | None = None
        self.search_in_flight: DecodeJob | None = None  # a background beam search
        self._next_job_id = 0
        self.configure(StreamingConfig(), DecodePlanner(StreamingConfig(), counts), "transcribe")

    def configure(self, streaming: StreamingConfig, planner: DecodePlanner, task: str) -> None:
        self.streaming = streaming
        self.planner = planner
        self.finals: WordFinals = finals_for(streaming)
        self.task = task

    # -- the stream's own decodes ----------------------------------------------------------
    def next_job(self, load: Load, release: Release) -> DecodeJob | None:
        """The next window to decode, or None (one job in flight at most). An utterance with
        nothing left to decode is retired on the way."""
        windows = self.windows
        while self.in_flight is None and windows.utterances:
            utt = windows.utterances[0]
            if utt.agreed is not None:
                windows.hold_agreed(utt)
            if utt.speculation is not None:
                tentative_end = windows.audio.vad.tentative_end
                if utt.end is None and tentative_end == utt.speculation[0].end_sample:
                    return None  # the silence goes on: the endpoint decides
                release(utt)
                continue
            speculative = self._speculative_end(utt, load.crowded)
            if speculative is not None:
                utt.speculated_to = speculative
                self.counts.fired("speculative_closing")
                return self._dispatch(utt, speculative, closing=True, load=load, speculative=True)
            end = utt.end if utt.end is not None else windows.audio.end
            if utt.end is None and not self.planner.due(utt, end, load):
                return None
            end, closing = self._within_cap(utt, end, load.crowded)
            if end > utt.window_start:
                return self._dispatch(utt, end, closing=closing, load=load)
            # Nothing left to decode (a flush at a window's end leaves an empty utterance).
            windows.finish(utt, decoded=True)
        return None

    def take(self, job: DecodeJob) -> DecodeJob | None:
        """The job in flight, as last refreshed, if ``job`` is it: its result is being folded
        in and the next may start. None: not this stream's job in flight."""
        if self.in_flight is None or job.job_id != self.in_flight.job_id:
            return None
        taken, self.in_flight = self.in_flight, None
        return taken

    def _within_cap(self, utt: Utterance, end: int, crowded: bool) -> tuple[int, bool]:
        """The end of the next decode of ``utt`` up to ``end``, cut first when the window
        outgrew its cap (rule ``window_cap``); and whether it is the closing decode."""
        closing = utt.end is not None
        if end <= self.planner.window_cap(utt, crowded):
            return end, closing
        self.windows.cut_at_cap(utt, self.planner.window_cap(utt, crowded))
        end = utt.end if closing and utt.end is not None else self.windows.audio.end
        end = min(end, self.planner.window_cap(utt, crowded))
        return end, closing and end == utt.end

    def _dispatch(
        self, utt: Utterance, end: int, *, closing: bool, load: Load, speculative: bool = False
    ) -> DecodeJob:
        """Make the decode of ``utt``'s window up to ``end`` the job in flight."""
        job = self._job(
            utt, end, closing=closing, past_comfort=load.past_comfort, speculative=speculative
        )
        utt.decoded_to = end
        self.in_flight = job
        return job

    def _job(
        self,
        utt: Utterance,
        end: int,
        *,
        closing: bool,
        past_comfort: bool,
        speculative: bool = False,
    ) -> DecodeJob:
        windows = self.windows
        job = self.planner.job(
            utt,
            windows.audio.slice(utt.window_start, end),
            self.planner.options(utt, windows.detector, self.task, closing=closing),
            windows.text.prompt,
            session_id=self.session_id,
            job_id=self._next_job_id,
            closing=closing,
            speculative=speculative,
            past_comfort=past_comfort,
        )
        self._next_job_id += 1
        return job

    def _speculative_end(self, utt: Utterance, crowded: bool) -> int | None:
        windows = self.windows
        return self.planner.speculative_end(
            utt, windows.audio.vad.tentative_end, len(windows.utterances), crowded
        )

    def supersede(self, load: Load, release: Release) -> DecodeJob | None:
        """The utterance's closing decode, to start now in place of the decode in flight, or
        None (rule ``supersede``). The caller drops the job in flight (its result is never
        folded in; the pipeline stops it on its lane) and asks only while a decode lane is idle
        that no other stream needs.

        Nothing is lost by dropping such a decode: it makes no word final that the closing
        decode does not, and its partial would be overtaken by the final at the endpoint. Word
        by word it is not done: there a re-decode through the pause makes the last words final
        before the endpoint.
        """
        job = self.in_flight
        utt = self.windows.first
        if job is None or utt is None or not self.finals.supersedes:
            return None
        if (
            (job.closing and not job.speculative)
            or utt.language is None
            or utt.speculation is not None
        ):
            return None
        end = utt.end if utt.end is not None else self._speculative_end(utt, load.crowded)
        if (
            end is None
            or (job.speculative and job.end_sample == end)
            or end <= utt.window_start
            or not self.planner.fits(utt, end, load.crowded)
        ):
            return None
        self.in_flight = None
        basis = utt.basis
        # The closing decode never waits for the scheduler's hop.
        replacement = self.next_job(dataclasses.replace(load, min_hop_s=0.0), release)
        if replacement is None and utt.basis == basis:
            self.in_flight = job  # nothing to start after all: the decode in flight stays
            return None
        self.counts.fired("supersede")
        if replacement is None:
            # Held words moved the window: the decode in flight is of the old one, and its
            # result is dropped when it comes.
            self.log.debug("job %d dropped: the window moved under it", job.job_id)
        else:
            self.log.debug("job %d dropped for job %d to %d", job.job_id, replacement.job_id, end)
        return replacement

    def refresh(self, job: DecodeJob, load: Load) -> DecodeJob:
        """``job``, still waiting for a decode lane, over the audio that arrived meanwhile: it
        grows to the end of the audio, at most to the window's cap (the cut comes with the
        next job), and becomes the closing decode if the utterance ended. The window keeps its
        start, prefix, prompt and draft (nothing changes them while a job is in flight).
        Returns ``job`` itself when nothing arrived."""
        utt = self.windows.first
        if job is not self.in_flight or job.closing or utt is None:
            return job
        cap = self.planner.window_cap(utt, load.crowded)
        end = min(utt.end if utt.end is not None else self.windows.audio.end, cap)
        if end <= utt.decoded_to:
            return job
        audio = self.windows.audio.slice(utt.window_start, end)
        closing = end == utt.end
        options = self.planner.options(utt, self.windows.detector, self.task, closing=closing)
        fresh = dataclasses.replace(
            job,
            audio=audio,
            request=dataclasses.replace(
                job.request, audio_s=audio.shape[0] / SAMPLE_RATE_HZ, options=options
            ),
            closing=closing,
            past_comfort=load.past_comfort,
        )
        utt.decoded_to = end
        self.in_flight = fresh
        return fresh

    # -- background searches ---------------------------------------------------------------
    def next_search(self, load: Load) -> DecodeJob | None:
        """A beam search of the open utterance's window so far, for a decode lane that no
        stream needs, or None (``searches.py``)."""
        windows = self.windows
        if (
            not self.finals.searches
            or load.past_comfort
            or self.search_in_flight is not None
            or len(windows.utterances) != 1
        ):
            return None
        utt = windows.utterances[0]
        end = windows.audio.end
        if not search_due(
            utt, end, windows.audio.vad.tentative_end, self.streaming
        ) or not self.planner.fits(utt, end, crowded=False):
            return None
        job = dataclasses.replace(
            self._job(utt, end, closing=True, past_comfort=False), closing=False, urgent=False
        )
        utt.searched_to = end
        self.search_in_flight = job
        return job

    @property
    def search_stale(self) -> bool:
        """A background search is in flight whose result cannot count any more: its
        utterance has ended (the closing decode, started at once, hears the whole window)
        or held words moved the window it searched."""
        job = self.search_in_flight
        if job is None:
            return False
        utt = self.windows.first
        return utt is None or utt.end is not None or utt.basis != basis_of(job)

    def take_search(self, job: DecodeJob) -> bool:
        """Whether ``job`` is the search in flight (which it no longer is)."""
        if self.search_in_flight is None or job.job_id != self.search_in_flight.job_id:
            return False
        self.search_in_flight = None
        return True
