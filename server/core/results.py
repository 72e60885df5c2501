"""A decode's result folded into the stream: which words become final, what is shown, where
the window is cut next.

In order: a speculative closing decode that speech overtook counts as an ordinary re-decode
(or is held while the pause goes on); an undecided utterance decides its language; the commit
policy makes final what decodes agree on, and the finals strategy says whether it goes out now; the
rest is shown as a partial; then a closing decode finishes the utterance (or the rule
``unheard_tail`` cuts before the rest), and a re-decode may cut the window (``stalled_tail``,
``sentence_cut``).
"""

from __future__ import annotations

import dataclasses

from server.config import StreamingConfig
from server.core.agreement import Word
from server.core.cuts import (
    sentence_cut,
    stalled_tail_cut,
    unheard_tail_cut,
)
from server.core.engine_api import DecodeResult, StopReason
from server.core.finals import WordFinals, finals_for
from server.core.jobs import DecodeJob
from server.core.planner import DecodePlanner
from server.core.utterance import Utterance
from server.core.windows import Windows
from server.protocol.formats import SAMPLE_RATE_HZ
from server.protocol.messages import ErrorMessage

# Per utterance, before its remaining audio is given up with an error: one passing failure
# must not lose the words of a window, nor may a window that always fails be retried forever.
MAX_DECODE_FAILURES = 3


class ResultFolder:
    """Folds the decode results of one stream into its windows."""

    def __init__(self, windows: Windows) -> None:
        self.windows = windows
        self.counts = windows.counts
        self.log = windows.log

    def configure(self, streaming: StreamingConfig, planner: DecodePlanner) -> None:
        self.streaming = streaming
        self.planner = planner
        self.finals: WordFinals = finals_for(streaming)

    def fold(self, job: DecodeJob, result: DecodeResult) -> None:
        """Fold in the result of ``job`` (the stream's job in flight, just taken)."""
        windows = self.windows
        utt = windows.utterances[0]
        overtaken = job.speculative and utt.end != job.end_sample
        if overtaken:
            if utt.end is None and windows.audio.vad.tentative_end == job.end_sample:
                utt.speculation = (job, result)  # the endpoint may still come there
                return
            job = dataclasses.replace(job, closing=False, speculative=False)
        utt.heard_to = max(utt.heard_to, job.end_sample)
        if utt.language is None and not windows.settle_language(utt, job, result):
            return
        tail = windows.tail_words(job, result)
        windows.text.decoded(
            looped=result.stop_reason in (StopReason.REPETITION, StopReason.COMPRESSION)
        )
        utt.draft = result.sequence
        self._commit_and_show(utt, job, tail, overtaken=overtaken)
        if job.closing:
            self._close(utt)
        else:
            self._maybe_cut(utt, job, tail)

    def _commit_and_show(
        self, utt: Utterance, job: DecodeJob, tail: list[Word], *, overtaken: bool
    ) -> None:
        """Make final what the policy says of ``tail``, and show the rest."""
        committed = utt.policy.update(
            tail,
            window_start_s=self.finals.commit_window_start_s(utt, job),
            window_end_s=job.start_s + job.audio_s,
            closing=job.closing,
            cut_in_speech=utt.cut_in_speech and job.end_sample == utt.end,
            settled_context_s=self.planner.settled_context_s(job),
        )
        utt.tentative = utt.policy.tentative
        self.log.debug(
            "job %d [%.2f-%.2f s] closing=%s speculative=%s beam asked=%d: %d word(s) final, "
            "%d not",
            job.job_id,
            job.start_s,
            job.end_sample / SAMPLE_RATE_HZ,
            job.closing,
            job.speculative,
            job.request.options.beam_size,
            len(committed),
            len(utt.tentative),
        )
        hold = self.finals.holds(closing=job.closing, committed=bool(committed))
        why = "closing" if job.closing else "agreement"
        self.windows.commit(utt, committed, why=why, hold=hold)
        if not overtaken and (not utt.unsent or utt.end is None):
            # A guess that speech overtook ends in the pause ("... word."): shown, it would be
            # taken back by the next decode. Words held at a closing decode wait for the
            # tail's final without a partial.
            self.windows.partial(utt)

    def _close(self, utt: Utterance) -> None:
        """After a closing decode: finish the utterance, or decode the rest it left unheard."""
        on = self.streaming.rules.on
        cut = unheard_tail_cut(utt, self.streaming) if on("unheard_tail") else None
        if cut is not None:
            self.windows.cut(utt, cut)
        else:
            self.windows.finish(utt, decoded=True)

    def _maybe_cut(self, utt: Utterance, job: DecodeJob, tail: list[Word]) -> None:
        """After a re-decode: cut where it stalled at the final words, or after a sentence."""
        on = self.streaming.rules.on
        voiced_s = self.windows.audio.vad.voiced_s
        cut = None
        if on("stalled_tail"):
            cut = stalled_tail_cut(utt, job, tail, voiced_s, self.streaming)
            if cut is not None:
                self.log.info("decode ended at the final words with speech after them: cut")
        if cut is None and on("sentence_cut"):
            cut = sentence_cut(utt, self.streaming, inside_commit=self.finals.cuts_inside_commit)
        if cut is not None:
            self.windows.cut(utt, cut)

    def fail(self, job: DecodeJob, error: Exception) -> None:
        """``job`` (the job in flight, just taken) failed: tell the client; the window is
        retried with the next job, up to ``MAX_DECODE_FAILURES`` times per utterance (the
        closing decode too: an utterance's last window holds the words not yet final)."""
        windows = self.windows
        windows.text.emit.add(
            ErrorMessage(
                "decode_failed", f"decoding failed: {error}", False, windows.audio.seconds_in
            )
        )
        utt = windows.utterances[0]
        utt.failures += 1
        if utt.failures < MAX_DECODE_FAILURES:
            utt.decoded_to = utt.window_start  # retried with the next audio
            return
        # Keep what was shown; the audio that could not be decoded is reported, not retried
        # forever.
        shown = utt.policy.finalize() if utt.language is not None else utt.tentative
        windows.commit(utt, shown, why="failures")
        if utt.end is None:
            windows.close_open(utt.window_start + job.audio.shape[0], reopen=True)
        windows.finish(utt, decoded=False)
