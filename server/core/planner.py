"""When a window is decoded next, and with what: the decode planner's rules.

The session asks the planner at every chance (``Session.next_job``); the planner reads the
utterance and the server's load and says whether a decode is due, where it ends and how it is
asked for. Its rules (``rules.py``):

- cadence: an open utterance is decoded again once ``min_new_audio_ms`` of new audio arrived,
  or the scheduler's hop under load (``Load.min_hop_s``), whichever is longer;
- ``first_words``: until the utterance shows a word, at ``first_decode_ms`` whatever the load:
  the time to the first word is what a listener notices most (under load, first words waiting
  on the stretched hop made the time to first token grow with the streams);
- ``speculative_closing``: once the silence after speech covers the trailing pad, the
  closing decode starts before the endpoint; if the endpoint comes where it guessed, its final
  is ready or on its way, and if speech goes on it counts as an ordinary re-decode;
- ``window_cap``: a window is never decoded past its cap (``max_window_s``, shorter while
  streams outnumber the lanes: ``Load.crowded``); the session cuts first;
- ``supersede`` (per utterance): the closing decode replaces a re-decode in flight, whose
  result would be overtaken by the final anyway (its wait was most of the turn end's tail).
"""

from __future__ import annotations

from dataclasses import dataclass

from server.config import StreamingConfig
from server.core.engine_api import DecodeOptions, DecodeRequest
from server.core.jobs import DecodeJob, Float32Array
from server.core.language import LanguageTracker
from server.core.rules import RuleCounts
from server.core.utterance import Utterance
from server.protocol.formats import SAMPLE_RATE_HZ


@dataclass(frozen=True)
class Load:
    """What the scheduler says about the server's load when it asks a stream for a job."""

    # The scheduler's floor on the new audio a re-decode waits for, raised as the server gets
    # busier (``Pipeline.stream_hop_s``); closing decodes and first words never wait for it.
    min_hop_s: float = 0.0
    # Streams outnumber the decode lanes: windows are capped at ``crowded_max_window_s``.
    crowded: bool = False
    # More streams are open than the server's comfortable estimate (``DecodeJob.past_comfort``).
    past_comfort: bool = False


IDLE = Load()


class DecodePlanner:
    """The planning rules of one stream (its streaming config as its settings make it)."""

    def __init__(self, streaming: StreamingConfig, counts: RuleCounts) -> None:
        self.streaming = streaming
        self.counts = counts

    def window_cap_s(self, crowded: bool) -> float:
        c = self.streaming
        return min(c.max_window_s, c.crowded_max_window_s) if crowded else c.max_window_s

    def window_cap(self, utt: Utterance, crowded: bool) -> int:
        """The last sample a decode of ``utt``'s window may hear."""
        return utt.window_start + int(self.window_cap_s(crowded) * SAMPLE_RATE_HZ)

    def fits(self, utt: Utterance, end: int, crowded: bool) -> bool:
        """Whether a window of ``utt`` up to ``end`` is within its cap."""
        return end - utt.window_start <= self.window_cap_s(crowded) * SAMPLE_RATE_HZ

    def awaits_first_words(self, utt: Utterance, end: int) -> bool:
        """Whether a decode of ``utt`` up to ``end`` is one its first word waits on: nothing
        shown yet, and the utterance still short enough for the first-decode pace."""
        c = self.streaming.rules
        return (
            c.on("first_words")
            and not utt.committed_tokens
            and not utt.tentative
            and end - utt.start < c.first_words.window_s * SAMPLE_RATE_HZ
        )

    def due(self, utt: Utterance, end: int, load: Load) -> bool:
        """Whether the open ``utt`` has heard enough new audio up to ``end`` for a re-decode."""
        new = end - utt.decoded_to
        usual_s = max(self.streaming.min_new_audio_ms / 1000, load.min_hop_s)
        first = self.awaits_first_words(utt, end)
        need_s = self.streaming.first_decode_ms / 1000 if first else usual_s
        if new < need_s * SAMPLE_RATE_HZ:
            return False
        if first and new < usual_s * SAMPLE_RATE_HZ:
            self.counts.fired("first_words")
        return True

    def speculative_end(
        self, utt: Utterance, tentative_end: int | None, open_utterances: int, crowded: bool
    ) -> int | None:
        """Where a speculative closing decode of ``utt`` would end, when one is due: the open
        utterance (the only one) heard silence covering its pad, and that end was not decoded
        speculatively yet (nor past the window's cap, where a cut comes first)."""
        end = tentative_end
        if (
            end is None
            or not self.speculative_on
            or utt.end is not None
            or open_utterances > 1
            or utt.language is None
            or end == utt.speculated_to
            or end <= utt.window_start
            or not self.fits(utt, end, crowded)
        ):
            return None
        return end

    @property
    def speculative_on(self) -> bool:
        """Start the closing decode once the silence after speech covers the trailing pad,
        before the endpoint: when the endpoint comes, its final is ready or on its way; when
        speech goes on, the result counts as an ordinary re-decode. The audio, prefix and
        prompt are what the closing decode after the endpoint would get: the same final."""
        return self.streaming.rules.on("speculative_closing")

    @property
    def supersedes(self) -> bool:
        """Per utterance: a closing decode may replace the decode in flight."""
        return self.streaming.finals == "utterance" and self.streaming.rules.on("supersede")

    def options(
        self, utt: Utterance, detector: LanguageTracker | None, task: str, *, closing: bool
    ) -> DecodeOptions:
        """The decode options of ``utt``'s next window: its language (or detection), and a
        beam search for a closing decode (which the scheduler runs greedy when the lanes
        cannot afford it: ``Pipeline.past_comfort``)."""
        beam = self.streaming.closing_beam_size if closing else 1
        if utt.language is not None or detector is None:
            return DecodeOptions(language=utt.language, task=task, beam_size=beam)
        return DecodeOptions(
            language=detector.decode_language(), task=task, detect_language=True, beam_size=beam
        )

    def job(
        self,
        utt: Utterance,
        audio: Float32Array,
        options: DecodeOptions,
        prompt: tuple[int, ...],
        *,
        session_id: str,
        job_id: int,
        closing: bool,
        speculative: bool = False,
        past_comfort: bool = False,
    ) -> DecodeJob:
        """The decode of ``utt``'s window, ``audio`` from its start."""
        end = utt.window_start + int(audio.shape[0])
        return DecodeJob(
            session_id=session_id,
            job_id=job_id,
            audio=audio,
            start_s=utt.window_start / SAMPLE_RATE_HZ,
            request=DecodeRequest(
                audio_s=audio.shape[0] / SAMPLE_RATE_HZ,
                options=options,
                prompt=prompt,
                prefix=tuple(utt.committed_tokens),
                draft=utt.draft,
            ),
            closing=closing,
            urgent=closing or self.awaits_first_words(utt, end),
            speculative=speculative,
            past_comfort=past_comfort,
        )

    def settled_context_s(self, job: DecodeJob) -> float | None:
        """The settled context ``job``'s words commit with (``CommitPolicy.update``): less
        past the comfortable estimate; None: the policy's own."""
        if not job.past_comfort:
            return None
        c = self.streaming
        return min(c.commit.settled_context_s, c.utterance_busy_settled_context_s)
