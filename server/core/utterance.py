"""One utterance's window: where it starts, what was decoded and heard, which words are final.

An utterance is a stretch of speech between VAD boundaries (or a flush). Its *window* is the
audio since its last cut: each decode hears the window and is forced to start with the words
already final in it (``committed``), so it only proposes the tail after them. A cut moves the
window's start forward; the final words before it become the prompt.

Plain state and the few operations on it that touch nothing else: no events, no decoding.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from server.core.agreement import Word
from server.core.engine_api import DecodeResult
from server.core.jobs import DecodeJob
from server.core.policy import CommitPolicy


@dataclass(frozen=True)
class SearchedWords:
    """The settled words of a background search (``searches.py``)."""

    basis: tuple[int, int]  # Utterance.basis when the search was asked for
    end_sample: int  # the end of the audio it heard
    words: list[Word]


@dataclass
class Utterance:
    """One stretch of speech, in stream samples."""

    start: int
    end: int | None = None  # set when speech ended
    window_start: int = 0
    decoded_to: int = 0  # end sample of the last decode's window
    # End sample of the last decode of the current window that came back with a result. Unlike
    # decoded_to (set when a job is dispatched, reset after a failure), it only counts audio the
    # engine has actually heard: it bounds where a cut may go and measures the lag.
    heard_to: int = 0
    committed: list[Word] = field(default_factory=list)  # final in the current window
    committed_tokens: list[int] = field(default_factory=list)
    prompted_tokens: int = 0  # leading committed_tokens already in the session's prompt
    policy: CommitPolicy = field(default_factory=CommitPolicy)
    tentative: list[Word] = field(default_factory=list)
    draft: tuple[int, ...] = ()  # DecodeResult.sequence of the window's last decode
    failures: int = 0
    before_cut: list[Word] = field(default_factory=list)  # the last word final before a cut
    # The language its words are committed in; None while a session that detects its language
    # has not decided this utterance's (its words stay partial until then).
    language: str | None = None
    detected: tuple[str, float] | None = None  # the last detection while undecided
    # A speculative closing decode's result, held until the endpoint says whether it closes
    # the utterance (nothing else of the window is decoded meanwhile).
    speculation: tuple[DecodeJob, DecodeResult] | None = None
    speculated_to: int = 0  # end sample of the last speculative closing decode
    # The server ended the stream inside this speech (``Session.end``, ``by_server``): its
    # closing decode commits nothing placed at the audio's very end.
    cut_in_speech: bool = False
    # Final words not sent yet: per utterance, they go out with the rest of the utterance.
    unsent: list[Word] = field(default_factory=list)
    # Background beam searches of the open window (``searches.py``):
    searched_to: int = 0  # end sample of the last one asked for
    search_words: SearchedWords | None = None  # the settled words of the last one back
    agreed: SearchedWords | None = None  # words two of them agreed on, to hold at the next job

    @classmethod
    def starting_at(cls, start: int, policy: CommitPolicy, language: str | None) -> Utterance:
        return cls(
            start=start,
            window_start=start,
            decoded_to=start,
            heard_to=start,
            policy=policy,
            language=language,
        )

    @property
    def basis(self) -> tuple[int, int]:
        """What a decode's words depend on besides its audio: the window's start and the
        committed words forced as its prefix."""
        return self.window_start, len(self.committed_tokens)

    @property
    def only_carried(self) -> bool:
        """Nothing was committed in this window beyond the words a cut carried into it."""
        return len(self.committed_tokens) <= self.prompted_tokens

    def add_committed(self, words: list[Word]) -> None:
        for w in words:
            self.committed_tokens.extend(w.tokens)
        self.committed.extend(words)

    def forget_decodes(self) -> None:
        """The window's words changed under its decodes (a cut, held or dropped words): what
        they agreed on, showed and drafted no longer applies."""
        self.policy.reset()
        self.tentative = []
        self.draft = ()

    def carry(self, words: list[Word]) -> None:
        """The window's final words are ``words``, carried from before a cut: they are final and
        in the prompt already, and the window's decodes are forced to start with them."""
        self.committed = list(words)
        self.committed_tokens = [t for w in words for t in w.tokens]
        self.prompted_tokens = len(self.committed_tokens)

    def drop_carried_prefix(self) -> None:
        """Decode the window from its start with no forced prefix (the carried words are final
        and in the prompt already, so nothing is sent again)."""
        self.carry([])
        self.forget_decodes()
        self.decoded_to = self.window_start
        # Nothing of the window was heard by a decode that counts: a cut at the window's cap
        # before the next decode would skip it.
        self.heard_to = self.window_start
