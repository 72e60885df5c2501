"""When a stream's words become final: word by word, or an utterance's together at its end.

A strategy chosen once per stream (``finals_for``), so the core asks it instead of branching
on the mode:

- ``WordFinals`` ("words"): each word is final once decodes agree on it with enough audio
  after it (``CommitPolicy``); finals come about 2 s after the word. The voice-agent APIs take
  these by default.
- ``UtteranceFinals`` ("utterance"): an utterance's words are final together when it ends,
  from a beam search over the whole utterance, while partials come as fast as ever. Past half
  the window, words commit one by one as in "words" finals, so a long utterance still gets
  finals. Its closing decode may replace a re-decode in flight (``supersede``), a spare lane
  beam-searches the open window in the background (``background_search``), and a commit cuts
  after its last sentence end (``cut_inside_commit``).
"""

from __future__ import annotations

from server.config import StreamingConfig
from server.core.jobs import DecodeJob
from server.core.utterance import Utterance
from server.protocol.formats import SAMPLE_RATE_HZ


class WordFinals:
    name = "words"

    def __init__(self, streaming: StreamingConfig) -> None:
        self.streaming = streaming

    def commit_window_start_s(self, utt: Utterance, job: DecodeJob) -> float:
        """Where "nothing final before ``min_window_s``" counts from: the decode's window."""
        return job.start_s

    def holds(self, *, closing: bool, committed: bool) -> bool:
        """Whether a decode's final words wait to go out with the rest of the utterance."""
        return False

    @property
    def supersedes(self) -> bool:
        return False

    @property
    def searches(self) -> bool:
        return False

    @property
    def cuts_inside_commit(self) -> bool:
        return False


class UtteranceFinals(WordFinals):
    name = "utterance"

    def commit_window_start_s(self, utt: Utterance, job: DecodeJob) -> float:
        """From the utterance's start: a window cut past half of it (at its cap, after a
        sentence) goes on word by word, where it would wait for half a new window."""
        return utt.start / SAMPLE_RATE_HZ

    def holds(self, *, closing: bool, committed: bool) -> bool:
        """A closing decode's words wait for the tail that it may have missed: two finals of
        one utterance, the first ending seconds before the pause, are what these finals
        promise not to send. Words held from background searches wait for the utterance's end
        too (a decode that commits nothing), unless words commit after them (past half the
        window: word by word)."""
        return closing or not committed

    @property
    def supersedes(self) -> bool:
        return self.streaming.rules.on("supersede")

    @property
    def searches(self) -> bool:
        c = self.streaming
        return c.utterance_search_s > 0 and c.rules.on("background_search")

    @property
    def cuts_inside_commit(self) -> bool:
        """A commit cuts the window after the last sentence end in it (or clause end, past
        ``clause_cut_s``), not only when its last word ends one: the word-by-word decodes
        past half the window then hear seconds, not 15-30 s (a long window's decode is dear
        on a CPU, most of it the encoder)."""
        return self.streaming.rules.on("cut_inside_commit")


def finals_for(streaming: StreamingConfig) -> WordFinals:
    """The finals strategy of a stream with this config (``StreamingConfig.finals``)."""
    if streaming.finals == "utterance":
        return UtteranceFinals(streaming)
    return WordFinals(streaming)
