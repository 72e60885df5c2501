"""A stream's utterances and the operations that move their windows and make their text.

``Windows`` keeps the utterances in order (only the last may still be open) and applies the
decisions of the rules: it makes words final (through ``Transcript.commit``), shows partials,
cuts a window, retires an utterance, decides an utterance's language, and tells the buffer
which audio may go. The rules themselves live in ``cuts.py``, ``searches.py``, ``tail.py``,
``planner.py`` and ``policy.py``; the session routes to them.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import deque
from collections.abc import Callable

from server.config import StreamingConfig
from server.core.agreement import Word
from server.core.cuts import Cut, cut_point
from server.core.emitter import Clock, Settled
from server.core.engine_api import DecodeResult
from server.core.ingest import AudioIngest
from server.core.jobs import DecodeJob
from server.core.language import LanguageTracker
from server.core.planner import DecodePlanner
from server.core.policy import CommitPolicy
from server.core.rules import RuleCounts
from server.core.searches import held_cut_point, holdable, rest_after_held
from server.core.speakers import SpeakerTracker
from server.core.tail import tail_words
from server.core.transcript import Language, Transcript
from server.core.utterance import Utterance
from server.protocol.formats import SAMPLE_RATE_HZ


class Windows:
    """The utterances of one stream (not thread-safe, like its session)."""

    def __init__(
        self,
        audio: AudioIngest,
        text: Transcript,
        counts: RuleCounts,
        log: logging.LoggerAdapter[logging.Logger],
    ) -> None:
        self.audio = audio
        self.text = text
        self.counts = counts
        self.log = log
        self.utterances: deque[Utterance] = deque()
        self.unsettled = False  # speech was closed and a Settled is owed for it
        # Audio someone else still needs from the buffer (a turn's for its model), or None.
        self.also_keep: Callable[[], int | None] = lambda: None
        self.configure(StreamingConfig(), DecodePlanner(StreamingConfig(), counts), None, None)

    def configure(
        self,
        streaming: StreamingConfig,
        planner: DecodePlanner,
        language: str | None,
        speakers: SpeakerTracker | None,
    ) -> None:
        """The stream's settings: its config and planner, the language asked for (None:
        detected per utterance) and its speaker tracker (None: no labels)."""
        self.streaming = streaming
        self.planner = planner
        self.language = language
        self.speakers = speakers
        self._detector: LanguageTracker | None = None

    # -- reading ---------------------------------------------------------------------------
    @property
    def first(self) -> Utterance | None:
        return self.utterances[0] if self.utterances else None

    @property
    def lag_s(self) -> float:
        """Speech received that no finished decode has covered yet (the window in flight
        counts as not covered): how far this stream's text is behind its audio."""
        behind = 0
        for utt in self.utterances:
            end = utt.end if utt.end is not None else self.audio.end
            behind += max(0, end - max(utt.heard_to, utt.window_start))
        return behind / SAMPLE_RATE_HZ

    @property
    def detector(self) -> LanguageTracker | None:
        """The language tracker when the stream detects its language (made on first use,
        after the client's config has settled the language)."""
        if self.language is not None:
            return None
        if self._detector is None:
            self._detector = LanguageTracker(self.streaming.detection)
        return self._detector

    def clock(self) -> Clock:
        return Clock(self.audio.seconds_in, self.lag_s)

    def language_fields(self, utt: Utterance) -> Language:
        """``language`` and ``language_probability`` of a decided utterance's messages."""
        if self._detector is None or utt.language is None:
            return None, None
        return utt.language, self._detector.probability

    def tail_words(self, job: DecodeJob, result: DecodeResult) -> list[Word]:
        """``result``'s words after its forced prefix, cleaned (``tail.py``)."""
        return tail_words(job, result, self.first, self.streaming.rules, self.counts)

    # -- utterances open and close ---------------------------------------------------------
    def open(self, start: int) -> None:
        c = self.streaming
        # The first commit is due by half the smallest window cap at the latest: a window cut
        # at its cap before anything was agreed makes its words final unchecked.
        cap_s = self.planner.window_cap_s(crowded=True)
        commit = dataclasses.replace(c.commit, min_window_s=min(c.commit.min_window_s, cap_s / 2))
        self.utterances.append(Utterance.starting_at(start, CommitPolicy(commit), self.language))
        if self.speakers is not None:
            self.speakers.open_utterance(start)

    def close_open(self, end: int, *, reopen: bool) -> None:
        """End the open utterance at ``end`` (``reopen``: speech goes on in a new one)."""
        if self.utterances and self.utterances[-1].end is None:
            utt = self.utterances[-1]
            utt.end = max(end, utt.window_start)
            self.text.emit.account.speech += utt.end - utt.start
            if self.speakers is not None:
                self.speakers.close_utterance(utt.end)
            if reopen:
                self.open(end)

    def finish(self, utt: Utterance, *, decoded: bool) -> None:
        """Retire a closed utterance. ``decoded``: its last window was decoded to the end (else
        it is given up after decode failures)."""
        if utt.end is None:
            return
        self.commit(utt, [], why="closing")  # whatever path retires it, no held word stays
        self.text.retire(utt, decoded=decoded, audio_received_s=self.audio.seconds_in)
        self.utterances.popleft()
        self.settle_if_closed_finished()
        self.trim()

    def settle_if_closed_finished(self) -> None:
        """Emit ``Settled`` once no closed utterance is left to decode (utterances finish in
        order; only the last one may still be open)."""
        if self.unsettled and (not self.utterances or self.utterances[0].end is None):
            self.unsettled = False
            self.text.emit.add(Settled(self.audio.seconds_in))

    def trim(self) -> None:
        """Let the buffer forget audio no window and no speaker job needs any more."""
        if self.utterances:
            keep_from = self.utterances[0].window_start
        else:
            keep_from = self.audio.idle_keep_from
        for needed in (
            self.speakers.keep_from() if self.speakers is not None else None,
            self.also_keep(),
        ):
            if needed is not None:
                keep_from = min(keep_from, needed)
        self.audio.trim(keep_from)

    # -- text ------------------------------------------------------------------------------
    def commit(self, utt: Utterance, words: list[Word], *, why: str, hold: bool = False) -> None:
        """Make ``words`` final (``Transcript.commit``): ``why`` names the path."""
        self.text.commit(
            utt,
            words,
            why=why,
            clock=self.clock(),
            language=self.language_fields(utt),
            labelled=self.speakers is not None,
            hold=hold,
        )

    def partial(
        self, utt: Utterance, guess: str | None = None, detected: tuple[str, float] | None = None
    ) -> None:
        """Show the utterance's tentative words when they changed. ``guess``, ``detected``: an
        undecided utterance's decode language and the detector's guess (its probability is
        reported when the two agree)."""
        provisional = utt.language is None
        if provisional:
            probability = detected[1] if detected and detected[0] == guess else None
            language: Language = (guess, probability)
        else:
            language = self.language_fields(utt)
        self.text.partial(utt, self.clock(), language, provisional=provisional)

    # -- window moves ----------------------------------------------------------------------
    def cut(self, utt: Utterance, cut: Cut) -> None:
        self.text.cut(utt, cut)
        self.trim()

    def cut_at_cap(self, utt: Utterance, limit: int) -> None:
        """Rule ``window_cap``: the window outgrew its cap: cut at the last final word, or make
        the tentative words final first if nothing was agreed on since the window began (the
        words a cut carried into it do not count: a cut behind them would skip the whole
        window).

        Never past what the engine has heard of the window: a stream that fell behind (its
        decodes slower than its audio) holds more than the cap of undecoded speech, and a cut
        there would skip it. Without a cut the next job is the window's first cap; the cut
        follows once that was decoded."""
        if utt.language is None:
            self._decide_before_cut(utt)
        elif utt.only_carried and utt.tentative:
            self.commit(utt, utt.policy.finalize(), why="window_cap")
        heard = min(utt.heard_to, limit)
        at, carry = cut_point(utt, heard, self.streaming.cut_carry_words)
        if at <= utt.window_start:
            if utt.committed and utt.only_carried:
                # Whisper ended the text right after the carried prefix: decode the window
                # again without it rather than skip the speech after it.
                self.counts.fired("window_cap")
                utt.drop_carried_prefix()
                return
            at, carry = heard, 0
        if at > utt.window_start:
            self.cut(utt, Cut(at, carry, "window_cap"))

    def hold_agreed(self, utt: Utterance) -> None:
        """Hold the words background searches agreed on and cut the window before the last of
        them (``searches.py``). Only while no decode of the stream is in flight: a cut moves
        the window under it."""
        agreed, utt.agreed = utt.agreed, None
        assert agreed is not None
        if not holdable(utt, agreed, self.streaming.cut_carry_words):
            return
        self.log.debug(
            "%d word(s) held from background searches to %.2f s",
            len(agreed.words),
            agreed.end_sample / SAMPLE_RATE_HZ,
        )
        latest = utt.search_words
        self.commit(utt, agreed.words, why="held_search", hold=True)
        utt.heard_to = max(utt.heard_to, agreed.end_sample)
        at, carry = held_cut_point(utt, self.streaming)
        if at > utt.window_start:
            self.cut(utt, Cut(at, carry, "background_search"))
        else:
            self.counts.fired("background_search")
            utt.forget_decodes()
        utt.search_words = rest_after_held(latest, agreed, utt.basis)

    # -- language --------------------------------------------------------------------------
    def settle_language(self, utt: Utterance, job: DecodeJob, result: DecodeResult) -> bool:
        """A decode of an utterance whose language is not decided: decide it when the detector
        is sure enough (``LanguageTracker``). True when the result can be committed from;
        False when it stays partial, or was decoded in a language the utterance did not get
        and the window is decoded again."""
        detector = self.detector
        decision = (
            detector.observe(
                result.detected,
                window_s=job.audio_s,
                closing=job.closing,
                is_speech=result.is_speech,
            )
            if detector is not None
            else None
        )
        if decision is None:
            utt.detected = result.detected
            utt.draft = result.sequence
            utt.tentative = self.tail_words(job, result)
            self.partial(utt, result.language, result.detected)
            return False
        utt.language = decision.language
        if decision.changed:
            self.log.info(
                "language %s (p=%.2f) after %.1f s of speech",
                decision.language,
                decision.probability,
                job.audio_s,
            )
            # Earlier text in another language would pull the decoder towards it.
            self.text.forget_prompt()
        if result.language == decision.language:
            return True
        utt.draft = ()
        utt.tentative = []
        utt.decoded_to = utt.window_start  # decoded again at once, in its language
        return False

    def _decide_before_cut(self, utt: Utterance) -> None:
        """An undecided window reached its cap (a cap under ``decide_max_speech_s``): decide
        as at an utterance's end, and commit the words shown, decoded in that language (an
        unsure detection keeps the language they were decoded in)."""
        detector = self.detector
        decision = (
            detector.observe(utt.detected, window_s=0.0, closing=True, is_speech=True)
            if detector is not None
            else None
        )
        if decision is not None:  # None: nothing of the window was decoded yet
            utt.language = decision.language
            self.commit(utt, utt.tentative, why="language_cut")
