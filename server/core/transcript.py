"""The stream's text: the words made final and sent, the partial shown, and the prompt.

Every word that becomes final passes through ``Transcript.commit``, whatever decided it: the
commit policy's agreement, a closing decode, words held from background searches, a window
cut at its cap, a language decided at a cut, or an utterance given up after decode failures.
Each path has a name, counted as ``final:NAME`` (``RuleCounts``), so "why is this word
final?" has one answer.

A cut (``cut``) moves an utterance's window: its final words become the prompt, the last few
are carried as the new window's forced prefix, and the audio before the cut counts as
transcribed. ``retire`` does the same for an utterance that is over.
"""

from __future__ import annotations

import logging

from server.config import StreamingConfig
from server.core.agreement import Word, normalize_word
from server.core.casing import CLOSERS, SentenceCase
from server.core.cuts import CLAUSE_END, SENTENCE_END, Cut
from server.core.emitter import Clock, Emitter
from server.core.rules import RuleCounts
from server.core.utterance import Utterance
from server.protocol.formats import SAMPLE_RATE_HZ

Language = tuple[str | None, float | None]  # a message's language and its probability
# What ends a sentence or a clause (rule ``bare_prompt_drop``); closing quotes and brackets
# after a mark still close it.
_MARKS = (*SENTENCE_END, *CLAUSE_END, "、")
MARKS = _MARKS + tuple(f"{m}{q}" for m in _MARKS for q in CLOSERS)
SENTENCE_MARKS = SENTENCE_END + tuple(f"{m}{q}" for m in SENTENCE_END for q in CLOSERS)


class Transcript:
    """One stream's text; the session hands it decisions, it records and sends them."""

    def __init__(
        self,
        streaming: StreamingConfig,
        counts: RuleCounts,
        log: logging.LoggerAdapter[logging.Logger],
    ) -> None:
        self.streaming = streaming  # as the stream's settings make it (set by the session)
        self.counts = counts
        self.log = log
        self.emit = Emitter()
        self._prompt: list[int] = []
        self._prompt_ok = True  # False after a decode that looped (rule loop_prompt_drop)
        # The prompt's last words, as text: whether they still carry punctuation (rule
        # ``bare_prompt_drop``).
        self._prompt_words: list[str] = []
        self._bare_counted = False
        # The window whose final words are the decodes' forced prefix: read after the prompt,
        # they count towards its style.
        self._window: Utterance | None = None
        self._case = SentenceCase()  # rule ``sentence_case``

    # -- the prompt ------------------------------------------------------------------------
    @property
    def prompt(self) -> tuple[int, ...]:
        """The final text the next window is decoded after, as context."""
        if not self._prompt_ok:
            return ()
        if self._bare():
            # Counted once per bare run, when a decode is first made without it.
            if not self._bare_counted:
                self._bare_counted = True
                self.counts.fired("bare_prompt_drop")
            return ()
        self._bare_counted = False
        return tuple(self._prompt[-self.streaming.prompt_max_tokens :])

    def _bare(self) -> bool:
        """Rule ``bare_prompt_drop``: the last ``min_words`` words the decoder reads before
        its own (the prompt, then the window's final words forced as its prefix) hold no
        sentence or clause mark, or the last ``max_sentence_words`` no sentence end. Whisper
        copies the style of the text it is given: a window decoded after an unpunctuated run
        comes back unpunctuated, and the run goes on from window to window (a long
        utterance's captions lost every full stop after its first cut at the window cap).
        Without that prompt the decoder punctuates as on fresh audio."""
        rules = self.streaming.rules
        if not rules.on("bare_prompt_drop"):
            return False
        bare_words = rules.bare_prompt.min_words
        sentence_words = rules.bare_prompt.max_sentence_words
        words = self._prompt_words
        if self._window is not None:
            words = words + self._unreleased(self._window)
        spoken = 0
        clause = False  # a clause mark among the words read so far (from the end)
        for word in reversed(words):
            text = word.rstrip()
            if text.endswith(SENTENCE_MARKS):
                return False
            clause = clause or text.endswith(MARKS)
            if clause and not sentence_words:
                return False
            spoken += bool(normalize_word(word))
            if (not clause and spoken == bare_words) or spoken == sentence_words:
                return True
        return False  # too little text to judge its style

    @staticmethod
    def _unreleased(utt: Utterance) -> list[str]:
        """The text of ``utt``'s final words not in the prompt yet (a mark Whisper gave a word
        of its own too: ", the")."""
        out: list[str] = []
        seen = 0
        for word in utt.committed:
            if seen >= utt.prompted_tokens:
                out.append(word.text)
            seen += len(word.tokens)
        return out

    def decoded(self, *, looped: bool) -> None:
        """A decode came back. Rule ``loop_prompt_drop``: after one that looped (a repeated
        n-gram, or text that compresses too well), the next window is decoded without the
        prompt, which may be what it copied; after one that did not, with it again."""
        if not looped:
            self._prompt_ok = True
        elif self.streaming.rules.on("loop_prompt_drop"):
            self._prompt_ok = False
            self.counts.fired("loop_prompt_drop")

    def forget_prompt(self) -> None:
        """Earlier text in another language would pull the decoder towards it."""
        self._prompt = []
        self._prompt_words = []

    def release_to_prompt(self, utt: Utterance) -> None:
        """The window's final tokens become context for the windows after it (those a cut
        carried into this window are there already)."""
        self._prompt.extend(utt.committed_tokens[utt.prompted_tokens :])
        self._prompt = self._prompt[-self.streaming.prompt_max_tokens * 2 :]
        self._prompt_words.extend(self._unreleased(utt))
        self._prompt_words = self._prompt_words[-self.streaming.prompt_max_tokens * 2 :]
        utt.prompted_tokens = len(utt.committed_tokens)

    # -- finals and partials ---------------------------------------------------------------
    def commit(
        self,
        utt: Utterance,
        words: list[Word],
        *,
        why: str,
        clock: Clock,
        language: Language,
        labelled: bool,
        hold: bool = False,
    ) -> None:
        """Make ``words`` final: record them on the window and send them as a final, after the
        words held back before them. ``why``: the path that made them final. ``hold``: keep
        them back too (``Utterance.unsent``). ``labelled``: the final waits for speakers."""
        if words:
            self.counts.fired(f"final:{why}")
        words = self._cased(words, final=True)
        utt.add_committed(words)
        self._window = utt
        words = utt.unsent + words
        if hold:
            utt.unsent = words
            return
        utt.unsent = []
        self.emit.final(words, clock, language, labelled=labelled)

    def partial(
        self, utt: Utterance, clock: Clock, language: Language, *, provisional: bool
    ) -> None:
        """Show the utterance's words not final yet (held words too: final at its end)."""
        self.emit.partial(
            utt.unsent + self._cased(utt.tentative, final=False),
            utt.window_start / SAMPLE_RATE_HZ,
            clock,
            language,
            provisional=provisional,
        )

    def _cased(self, words: list[Word], *, final: bool) -> list[Word]:
        """Rule ``sentence_case``: a word that begins a sentence starts with a capital."""
        if not self.streaming.rules.on("sentence_case"):
            return words
        cased, changed = self._case.apply(words, advance=final)
        if final and changed:
            self.counts.fired("sentence_case", changed)
        return cased

    # -- window moves ----------------------------------------------------------------------
    def cut(self, utt: Utterance, cut: Cut) -> None:
        """Start a new window at ``cut.at``; final text of the old one becomes the prompt, and
        its last ``cut.carry`` final words are the new window's forced prefix (final already,
        not sent again)."""
        self.counts.fired(cut.rule)
        self.release_to_prompt(utt)
        start = max(utt.window_start, min(cut.at, utt.end if utt.end is not None else cut.at))
        heard = max(utt.window_start, min(start, utt.heard_to))
        self.emit.account.transcribed += heard - utt.window_start
        if start > heard:
            # A cut past what the engine heard skips audio; callers cut at heard_to at most.
            self.log.error("cut at %d skipped %d samples never decoded", start, start - heard)
            self.emit.account.failed += start - heard
        utt.window_start = start
        utt.decoded_to = max(utt.decoded_to, utt.window_start)
        utt.heard_to = max(utt.heard_to, utt.window_start)
        # The last word final before the cut: where the new window's words may start at the
        # earliest (``after_committed``, ``tail.py``).
        utt.before_cut = utt.committed[-1:]
        utt.carry(utt.committed[len(utt.committed) - cut.carry :] if cut.carry else [])
        utt.forget_decodes()

    def retire(self, utt: Utterance, *, decoded: bool, audio_received_s: float) -> None:
        """Account for a closed utterance whose words are all sent. ``decoded``: its last
        window was decoded to the end (else it was given up after decode failures, and only
        what was heard counts as transcribed)."""
        assert utt.end is not None
        heard = utt.end if decoded else max(utt.window_start, min(utt.heard_to, utt.end))
        self.emit.account.transcribed += heard - utt.window_start
        self.emit.account.failed += utt.end - heard
        self.release_to_prompt(utt)
        self.emit.clear_partial(utt.end / SAMPLE_RATE_HZ, audio_received_s)
