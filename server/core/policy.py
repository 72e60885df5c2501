"""When a decoded word may become final: the commit policy of one window.

A final is never revised, so a word is committed only once the decoder has heard enough
around it. ``CommitPolicy`` wraps LocalAgreement-n (``agreement.py``) and adds the rules
that bench/accuracy.py measured, one by one, against offline decoding of the same clips:

- a word commits only with ``min_right_context_s`` of audio after its end in the window
  (Whisper rewrites a word, and the one before it, while the audio after it is short);
- a window commits nothing before it holds ``min_window_s`` of audio (the first words of an
  utterance decoded from a second of audio are where tiny.en is weakest);
- a word the newest decode heard ``settled_context_s`` of audio after commits without the
  decode before agreeing on it (nor on the words before it);
- the closing decode of a window (end of speech, flush, end) commits everything that is left,
  except what follows a doubtful word placed at the very end of the audio: word alignment
  puts the words it finds no audio for there, with zero length (seen: "and the first one is
  the first one." after the last word of a clip, all at its last frame, each below 0.3
  probability). A real last word can land there too (the alignment squeezes it), but
  confidently. When the server cut the audio inside speech (a drain, a session limit: the
  client goes on from its last final words), the whole run there goes, however confident:
  decoded on from the prompt with no audio under it (seen at a drain: "by a similar" with
  "a similar" in the last 40 ms, which the reconnected session then heard whole as "the
  miller", shown twice). A word the cut went through starts earlier, and stays.

Pure: no I/O, no clock. The session feeds it each decode's tail and the window's extent.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from server.core.agreement import LocalAgreement, Word, normalize_word


@dataclass(frozen=True)
class CommitConfig:
    """The commit policy's knobs (bench/accuracy.py's trade-off table chose the defaults)."""

    agreement_n: int = 2  # consecutive decodes that must agree on a word and all before it
    # Audio in the window after a word's end before it commits: with less, Whisper still
    # rewrites the last words of long recordings after they are final; with more, every
    # final waits longer and reads no better.
    min_right_context_s: float = 0.8
    # A window shorter than this commits nothing until it closes: the first words of an
    # utterance wait for the words after them, which brings hard speech close to offline
    # decoding; partials are shown as fast as before.
    min_window_s: float = 4.0
    # A word the newest decode heard this much audio after commits, and every word before
    # it, even where the decode before read it differently: both heard it whole, and waiting
    # for a third decode holds every word after it. 0: off, as in "words" finals; "utterance"
    # finals turn it on (``StreamingConfig.utterance_settled_context_s``).
    settled_context_s: float = 0.0
    # A word the newest decode puts a punctuation mark after commits with the mark or not at
    # all (``LocalAgreement``), so that no final begins with the comma of the one before.
    # Off in "words" finals: there it made finals later, partials flicker more and a couple
    # more errors. "utterance" finals turn it on: there it costs nothing in text or time.
    marks_wait: bool = False
    past_audio_margin_s: float = 0.06  # closing: a word starting this near the audio end...
    past_audio_min_probability: float = 0.5  # ...and below this probability is dropped
    # Where the server cut the audio inside speech, the words before the cut that the
    # alignment packed tighter than this per word (over the run from any of them to the last)
    # go too: no one speaks 17 words a second. Seen at a session limit: a whole sentence
    # decoded on from the prompt into the last third of a second, which the page then showed
    # as a cue that short. The client that goes on sends that audio again from its last
    # final words, so nothing heard is lost.
    cut_squeezed_word_s: float = 0.06

    def __post_init__(self) -> None:
        if self.agreement_n < 1:
            raise ValueError(f"agreement_n must be >= 1; got {self.agreement_n}")
        if (
            min(
                self.min_right_context_s,
                self.min_window_s,
                self.past_audio_margin_s,
                self.cut_squeezed_word_s,
                self.settled_context_s,
            )
            < 0
        ):
            raise ValueError(
                "min_right_context_s, min_window_s, past_audio_margin_s, "
                "cut_squeezed_word_s and settled_context_s must be >= 0"
            )
        if not 0.0 <= self.past_audio_min_probability <= 1.0:
            raise ValueError(
                "past_audio_min_probability must be in [0, 1]; "
                f"got {self.past_audio_min_probability}"
            )


class CommitPolicy:
    """Which words of successive decodes of one window are final.

    ``update`` returns the words that became final (each at most once, never retracted);
    ``tentative`` is the rest of the newest tail, shown as a partial.
    """

    def __init__(self, config: CommitConfig | None = None) -> None:
        self.config = config or CommitConfig()
        self._agreement = LocalAgreement(self.config.agreement_n, marks_wait=self.config.marks_wait)

    @property
    def tentative(self) -> list[Word]:
        return self._agreement.tentative

    def update(
        self,
        tail: Sequence[Word],
        *,
        window_start_s: float,
        window_end_s: float,
        closing: bool,
        cut_in_speech: bool = False,
        settled_context_s: float | None = None,
    ) -> list[Word]:
        """Fold in the newest decode's words after the committed ones, in stream time.

        ``window_*_s``: the audio that decode heard. ``closing``: it was the window's last
        decode, so everything it returned is committed. ``cut_in_speech``: the audio ends
        inside speech, so nothing at its very end was heard. ``settled_context_s``: this
        decode's instead of ``CommitConfig.settled_context_s`` (the rule stays off where that
        is 0).
        """
        if closing:
            tail = self._heard(tail, window_end_s, cut_in_speech=cut_in_speech)
            committed = self._agreement.update(tail, hold=0, at_least=0)
            return committed + self._agreement.finalize()
        hold = self._waiting(tail, window_start_s, window_end_s)
        settled = self._settled(tail, window_end_s, settled_context_s)
        return self._agreement.update(tail, hold=hold, at_least=settled)

    def _heard(
        self, tail: Sequence[Word], window_end_s: float, *, cut_in_speech: bool
    ) -> Sequence[Word]:
        """``tail`` up to the first doubtful word of the run of words at the audio's end (the
        whole run when the audio was cut inside speech). Confident words after a doubtful one
        go too: they were decoded on from it with no audio under them (seen: "fine
        typography, that has an example" at a clip's last frame, "that" at 0.19, the rest at
        0.68-0.93)."""
        c = self.config
        run = len(tail)
        while run > 0 and tail[run - 1].start_s >= window_end_s - c.past_audio_margin_s:
            run -= 1
        if cut_in_speech:
            return tail[: self._unsqueezed(tail, run)]
        for k in range(run, len(tail)):
            word = tail[k]
            # punctuation alone never cuts the run
            if normalize_word(word.text) and word.probability < c.past_audio_min_probability:
                return tail[:k]
        return tail

    def _unsqueezed(self, tail: Sequence[Word], run: int) -> int:
        """How many words of ``tail[:run]`` to keep before a cut in speech: up to the
        earliest word from which the words to ``run`` are packed tighter than
        ``cut_squeezed_word_s`` each (punctuation marks do not count as words)."""
        if run == 0:
            return 0
        end_s = tail[run - 1].end_s
        keep, spoken = run, 0
        for k in range(run - 1, -1, -1):
            if normalize_word(tail[k].text):
                spoken += 1
            if spoken and end_s - tail[k].start_s < spoken * self.config.cut_squeezed_word_s:
                keep = k
        return keep

    def _waiting(self, tail: Sequence[Word], window_start_s: float, window_end_s: float) -> int:
        """How many words at the end of ``tail`` are not ready to commit."""
        c = self.config
        if window_end_s - window_start_s < c.min_window_s:
            return len(tail)
        for k, word in enumerate(tail):
            if window_end_s - word.end_s < c.min_right_context_s:
                return len(tail) - k
        return 0

    def _settled(self, tail: Sequence[Word], window_end_s: float, context_s: float | None) -> int:
        """How many leading words of ``tail`` the decode heard ``context_s`` (default
        ``settled_context_s``) of audio after, each of them (none when that rule is off)."""
        if self.config.settled_context_s <= 0:
            return 0
        if context_s is None:
            context_s = self.config.settled_context_s
        for k, word in enumerate(tail):
            if window_end_s - word.end_s < context_s:
                return k
        return len(tail)

    def finalize(self) -> list[Word]:
        """Commit the tentative words now (the window is given up or force-cut)."""
        shown = self.tentative
        self.reset()
        return shown

    def reset(self) -> None:
        """A new window starts: forget every tail without committing."""
        self._agreement.reset()
