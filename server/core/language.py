"""Which language a session speaks, when the client asked the server to detect it.

Whisper's detector reads the logits after <|startoftranscript|>; on a short window it guesses.
``LanguageTracker`` turns the guess of each decode into a decision per utterance:

- An utterance is decided once a window with ``decide_speech_s`` of audio gives a language with
  ``confident_probability`` or more; until then its words stay partial (nothing is final in a
  language the detector is unsure of).
- An utterance that never gets there is decided on its closing decode, or once its window holds
  ``decide_max_speech_s``: the session's language if it has one (a short or unclear utterance
  does not switch it), else the best guess.
- Each new utterance is checked again, so a speaker who switches is followed; the confidence
  rule above is the hysteresis that keeps it from flapping.

No I/O: the session feeds it each decode's detection and asks which language to decode in.
"""

from __future__ import annotations

from dataclasses import dataclass

from server.config import LanguageConfig


@dataclass(frozen=True)
class LanguageDecision:
    """An utterance's language, and whether it changed the session's."""

    language: str
    probability: float  # the detector's, on the window that decided
    changed: bool  # the session's language is new (first decision, or a switch)


class LanguageTracker:
    """The session's detected language and how each utterance settles its own."""

    def __init__(self, config: LanguageConfig) -> None:
        self.config = config
        self.language: str | None = None  # None until the first utterance is decided
        self.probability: float | None = None

    def decode_language(self) -> str | None:
        """The language an undecided utterance is decoded in: the session's, or None (the
        decoder detects per window) before any utterance was decided."""
        return self.language

    def observe(
        self,
        detected: tuple[str, float] | None,
        *,
        window_s: float,
        closing: bool,
        is_speech: bool,
    ) -> LanguageDecision | None:
        """Fold one decode's detection of an undecided utterance; the decision, or None while
        the utterance stays undecided.

        ``window_s``: audio in the decoded window (the utterance's speech so far, as its first
        window starts at the onset). ``closing``: the window reaches the utterance's end."""
        c = self.config
        forced = closing or window_s >= c.decide_max_speech_s
        if detected is None or not is_speech:
            if not forced:
                return None
            # Nothing heard to judge by: the utterance has no text, and the session's language
            # stays as it is.
            fallback = self.language or (detected[0] if detected else None)
            if fallback is None:
                return None
            return LanguageDecision(fallback, self.probability or 0.0, changed=False)
        language, probability = detected
        confident = window_s >= c.decide_speech_s and probability >= c.confident_probability
        if confident or (forced and self.language is None):
            changed = language != self.language
            self.language, self.probability = language, probability
            return LanguageDecision(language, probability, changed=changed)
        if forced:
            assert self.language is not None
            return LanguageDecision(self.language, self.probability or 0.0, changed=False)
        return None
