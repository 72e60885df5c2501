"""Conversational turns: deciding *that* a speaker finished apart from *what* was said.

A turn is a speaker's speech from its first word to a pause that ends it: one the turn model
(Smart Turn, ``server/turns/``) scores at ``eot_threshold`` or more, a silence of
``eot_timeout_ms``, or the client's request (``force_end``). Within a turn the VAD may end
and start utterances at shorter pauses; the turn goes on across them.

At each pause (the VAD's ``tentative_end``: silence has covered the pad) the session hands the
turn's audio up to the pause to the model (``TurnJob``); the closing decode of the utterance
starts at the same moment (the ``speculative_closing`` rule), so when the model says the turn
is complete, the session ends the utterance there and its final is ready, or nearly. The turn
ends (``EndOfTurn``) once every word of it is final.

Events, as Deepgram Flux names them: ``StartOfTurn`` at the first speech of a turn; ``Update``
when the turn's transcript changes; ``EagerEndOfTurn`` when a pause scores at
``eager_eot_threshold`` or more (an agent may start preparing a reply); ``TurnResumed`` when
speech goes on after that; ``EndOfTurn`` with the turn's final transcript.

Pure: the tracker sees the session's events and the model's scores, and says what to do.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import numpy.typing as npt

from server.protocol.formats import SAMPLE_RATE_HZ
from server.protocol.messages import (
    FinalMessage,
    PartialMessage,
    SpeechEndedMessage,
    SpeechStartedMessage,
    WordInfo,
)

Float32Array = npt.NDArray[np.float32]
# What the turn model hears of a turn: its last seconds up to the pause (Smart Turn's 8 s).
TURN_AUDIO_S = 8.0
_EPSILON_S = 1e-6  # stream times are sums of sample counts: equal within this


@dataclass(frozen=True)
class TurnConfig:
    """When a pause ends a turn (Deepgram Flux's names and ranges)."""

    eot_threshold: float = 0.7  # the model's probability that ends a turn, 0.5-0.9
    # The probability that announces a likely end (EagerEndOfTurn), 0.3-0.9, at most
    # eot_threshold; None: no eager events.
    eager_eot_threshold: float | None = None
    eot_timeout_ms: int = 5000  # a silence this long ends the turn whatever the model says

    def __post_init__(self) -> None:
        if not 0.5 <= self.eot_threshold <= 0.9:
            raise ValueError(f"eot_threshold must be 0.5 to 0.9; got {self.eot_threshold}")
        eager = self.eager_eot_threshold
        if eager is not None and not 0.3 <= eager <= 0.9:
            raise ValueError(f"eager_eot_threshold must be 0.3 to 0.9; got {eager}")
        if eager is not None and eager > self.eot_threshold:
            raise ValueError(
                f"eager_eot_threshold ({eager}) must be at most eot_threshold "
                f"({self.eot_threshold})"
            )
        if not 500 <= self.eot_timeout_ms <= 10_000:
            raise ValueError(f"eot_timeout_ms must be 500 to 10000; got {self.eot_timeout_ms}")


class TurnKind(enum.StrEnum):
    START = "StartOfTurn"
    UPDATE = "Update"
    EAGER_END = "EagerEndOfTurn"
    RESUMED = "TurnResumed"
    END = "EndOfTurn"


@dataclass(frozen=True)
class TurnEvent:
    """A turn's state, sent when it changes."""

    kind: TurnKind
    turn_index: int  # 0, 1, ... in the stream
    start_s: float  # the turn's audio: from its first speech ...
    end_s: float  # ... to the end of what was transcribed
    transcript: str
    words: tuple[WordInfo, ...]
    end_of_turn_confidence: float  # the model's last probability in this turn (0 before)
    audio_received_s: float
    trigger: str | None = None  # on EndOfTurn: "model", "timeout" or "manual"


class TurnScorer(Protocol):
    """A turn model: the probability that the speaker finished, from the turn's audio up to a
    pause (16 kHz). ``server.turns.smart_turn.SmartTurn`` is the real one."""

    def score(self, audio_16k: Float32Array) -> float: ...

    def load(self) -> None:
        """Get ready to score (a model loaded on first use loads now)."""


@dataclass(frozen=True)
class TurnJob:
    """A pause for the turn model: the turn's audio up to it (its last ``TURN_AUDIO_S``)."""

    session_id: str
    job_id: int
    audio: Float32Array
    pause_end: int  # stream sample where the pause began (the VAD's tentative end)


@dataclass
class _Turn:
    index: int
    start_s: float
    finals: list[WordInfo] = field(default_factory=list)
    final_texts: list[str] = field(default_factory=list)
    shown: tuple[WordInfo, ...] = ()  # the words not final yet (the partial)
    shown_text: str = ""
    confidence: float = 0.0
    eager: bool = False  # an EagerEndOfTurn was sent and speech has not gone on since
    ending: str | None = None  # decided: why it ends, once every word is final
    # The end can no longer be taken back: a timeout or the client ended the turn, or the
    # silence after the model's end outlasted ``eot_timeout_ms`` (it would have ended it).
    firm: bool = False
    silent_from_s: float | None = None  # where the turn's speech last ended, while silent
    last_text: str | None = None  # the transcript of the last event sent


class TurnTracker:
    """The turns of one stream."""

    def __init__(self, config: TurnConfig) -> None:
        self.config = config
        self._turn: _Turn | None = None
        # Speech that began after a firm end, before that turn's words were all final: where
        # the next turn starts, once the last one has ended.
        self._next_start_s: float | None = None
        self._next_index = 0
        self.scored_to = -1  # the last pause the model scored (or is scoring)

    @property
    def open(self) -> bool:
        return self._turn is not None

    @property
    def deciding(self) -> bool:
        """A turn is open and its end not decided yet."""
        return self._turn is not None and self._turn.ending is None

    @property
    def eager(self) -> bool:
        """An EagerEndOfTurn was sent and speech has not gone on since."""
        return self._turn is not None and self._turn.eager

    @property
    def start_sample(self) -> int | None:
        """Where the open turn's audio begins (what the model may need of the buffer)."""
        return None if self._turn is None else round(self._turn.start_s * SAMPLE_RATE_HZ)

    def pause_due(self, tentative_end: int | None) -> bool:
        """Whether the pause heard now is one for the model: a turn is being decided, and this
        pause was not scored yet."""
        return self.deciding and tentative_end is not None and tentative_end != self.scored_to

    def scored(self, probability: float, now_s: float) -> list[TurnEvent]:
        """The model's probability for the pause last asked about. Decides the turn's end at
        ``eot_threshold``; announces it at ``eager_eot_threshold``."""
        turn = self._turn
        if turn is None or turn.ending is not None:
            return []
        turn.confidence = probability
        events: list[TurnEvent] = []
        eager = self.config.eager_eot_threshold
        if eager is not None and probability >= eager and not turn.eager:
            turn.eager = True
            events.append(self._event(TurnKind.EAGER_END, now_s))
        if probability >= self.config.eot_threshold:
            turn.ending = "model"
        return events

    def resumed(self, now_s: float) -> list[TurnEvent]:
        """Speech went on after the pause last scored (within an utterance or in a new one)."""
        turn = self._turn
        if turn is None or turn.firm:
            return []
        if turn.ending == "model":
            turn.ending = None  # the speaker went on before the turn's words were final
        if not turn.eager:
            return []
        turn.eager = False
        return [self._event(TurnKind.RESUMED, now_s)]

    def decide(self, trigger: str) -> None:
        """End the open turn once its words are final (``trigger``: timeout or manual); a
        model's end already decided stands, and no longer yields to speech."""
        if self._turn is not None:
            self._turn.ending = self._turn.ending or trigger
            self._turn.firm = True

    def observe(self, event: object, now_s: float) -> list[TurnEvent]:
        """The turn events that one of the session's events makes."""
        if isinstance(event, SpeechStartedMessage):
            return self._speech(event.start, now_s)
        turn = self._turn
        if turn is None:
            return []
        if isinstance(event, SpeechEndedMessage):
            turn.silent_from_s = event.end
            return []
        if not isinstance(event, FinalMessage | PartialMessage):
            return []
        if self._next_start_s is not None and event.start >= self._next_start_s - _EPSILON_S:
            # Words of the speech after a firm end: the last turn's words were all final
            # before these (finals come in order); a partial waits for its own turn.
            if isinstance(event, PartialMessage):
                return []
            return [*self._end(now_s), *self.observe(event, now_s)]
        if isinstance(event, FinalMessage):
            turn.finals.extend(event.words)
            turn.final_texts.append(event.text)
            turn.shown, turn.shown_text = (), ""
        else:
            turn.shown_text = event.text
            # A partial carries no word times or probabilities: its words span it, at 0.
            turn.shown = tuple(WordInfo(w, event.start, event.end, 0.0) for w in event.text.split())
        return self._update(now_s)

    def settled(self, now_s: float) -> list[TurnEvent]:
        """Every utterance closed so far is final: a decided turn ends now."""
        turn = self._turn
        if turn is None or turn.ending is None:
            return []
        return self._end(now_s)

    def _end(self, now_s: float) -> list[TurnEvent]:
        """The decided turn's EndOfTurn; then the next turn's start, where speech began after
        a firm end."""
        turn = self._turn
        assert turn is not None and turn.ending is not None
        end = self._event(TurnKind.END, now_s, trigger=turn.ending)
        self._turn = None
        next_start, self._next_start_s = self._next_start_s, None
        return [end] if next_start is None else [end, *self._speech(next_start, now_s)]

    def _speech(self, start_s: float, now_s: float) -> list[TurnEvent]:
        turn = self._turn
        if turn is None:
            self._turn = _Turn(self._next_index, start_s)
            self._next_index += 1
            return [self._event(TurnKind.START, now_s)]
        silent_from = turn.silent_from_s
        timeout_s = self.config.eot_timeout_ms / 1000
        if (
            turn.ending is not None
            and silent_from is not None
            and start_s - silent_from >= timeout_s
        ):
            turn.firm = True  # the silence alone would have ended the turn
        turn.silent_from_s = None
        if turn.firm:
            if self._next_start_s is None:
                self._next_start_s = start_s
            return []
        return self.resumed(now_s)

    def _update(self, now_s: float) -> list[TurnEvent]:
        turn = self._turn
        assert turn is not None
        text = self._text(turn)
        if text == turn.last_text or not text:
            return []
        return [self._event(TurnKind.UPDATE, now_s)]

    @staticmethod
    def _text(turn: _Turn, *, final_only: bool = False) -> str:
        texts = [*turn.final_texts, *(() if final_only else (turn.shown_text,))]
        return " ".join(t for t in texts if t)

    def _event(self, kind: TurnKind, now_s: float, *, trigger: str | None = None) -> TurnEvent:
        turn = self._turn
        assert turn is not None
        end = kind is TurnKind.END
        words = tuple(turn.finals) + (() if end else turn.shown)
        text = self._text(turn, final_only=end)
        turn.last_text = text
        end_s = max((w.end for w in words), default=turn.start_s)
        return TurnEvent(
            kind=kind,
            turn_index=turn.index,
            start_s=turn.start_s,
            end_s=end_s,
            transcript=text,
            words=words,
            end_of_turn_confidence=turn.confidence,
            audio_received_s=now_s,
            trigger=trigger,
        )
