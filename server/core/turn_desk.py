"""A stream's conversational turns as the session runs them: the pause the turn model is
scoring, the silence that times a turn out, and the turn events placed among the session's
events (``turns.py`` decides; this unit asks it and applies what it says)."""

from __future__ import annotations

from collections.abc import Callable

from server.core.emitter import SessionEvent, Settled
from server.core.ingest import AudioIngest
from server.core.turns import TURN_AUDIO_S, TurnConfig, TurnJob, TurnTracker
from server.core.windows import Windows
from server.protocol.errors import ProtocolError
from server.protocol.formats import SAMPLE_RATE_HZ


class TurnDesk:
    """The turns of one stream, when its settings ask for them (``configure``)."""

    def __init__(
        self,
        session_id: str,
        audio: AudioIngest,
        windows: Windows,
        *,
        take: Callable[[], list[SessionEvent]],
        end_speech_at_pause: Callable[[], None],
    ) -> None:
        self.session_id = session_id
        self.audio = audio
        self.windows = windows
        self._take = take  # the session's events ready to send
        self._end_speech_at_pause = end_speech_at_pause
        self.tracker: TurnTracker | None = None
        self._job: TurnJob | None = None  # the pause the turn model is scoring
        self._next_job_id = 0
        self._speech_ended_at: int | None = None  # the end of the last speech, while silent
        self._out: list[SessionEvent] = []  # events taken, turn events placed among them

    def configure(self, config: TurnConfig | None) -> None:
        """Turns on (with ``config``) or off; new thresholds keep the turn that is open."""
        if config is None:
            self.tracker = None
        elif self.tracker is None:
            self.tracker = TurnTracker(config)
        else:
            self.tracker.config = config

    def require(self) -> TurnTracker:
        if self.tracker is None:
            raise ProtocolError("this stream has no turn detection")
        return self.tracker

    # -- events ------------------------------------------------------------------------------
    def pump(self) -> None:
        """Take the session's ready events, each followed by the turn events it makes."""
        now_s = self.audio.seconds_in
        for event in self._take():
            self._out.append(event)
            if self.tracker is None:
                continue
            if isinstance(event, Settled):
                self._out.extend(self.tracker.settled(now_s))
            else:
                self._out.extend(self.tracker.observe(event, now_s))

    def drain(self) -> list[SessionEvent]:
        self.pump()
        out, self._out = self._out, []
        return out

    def speech(self, ended_at: int | None) -> None:
        """The VAD opened speech (None) or ended it at ``ended_at``."""
        self._speech_ended_at = ended_at

    # -- the turn model ----------------------------------------------------------------------
    def next_job(self) -> TurnJob | None:
        """The pause heard now, for the turn model, when one is due, or None."""
        tracker = self.tracker
        vad = self.audio.vad
        pause = vad.tentative_end
        if tracker is None or self._job is not None or not vad.in_speech:
            return None
        if pause is None or not tracker.pause_due(pause):
            return None
        tracker.scored_to = pause
        start = max(
            pause - round(TURN_AUDIO_S * SAMPLE_RATE_HZ),
            tracker.start_sample or 0,
            self.audio.buffer.start,
        )
        job = TurnJob(self.session_id, self._next_job_id, self.audio.slice(start, pause), pause)
        self._next_job_id += 1
        self._job = job
        return job

    def receive_score(self, job: TurnJob, probability: float | None) -> None:
        """The model's probability that ``job``'s pause ends the turn; None: it failed (the
        turn then ends at its timeout). A score for a pause speech went on after counts for
        nothing."""
        if self._job is None or job.job_id != self._job.job_id:
            return
        self._job = None
        tracker = self.tracker
        vad = self.audio.vad
        if tracker is None or probability is None:
            return
        if vad.in_speech and vad.tentative_end != job.pause_end:
            return  # the speaker went on
        self.pump()
        self._out.extend(tracker.scored(probability, self.audio.seconds_in))
        if tracker.deciding:
            return
        if vad.in_speech:
            # The turn ends at this pause: so does its utterance, whose closing decode began
            # here (speculative_closing), rather than at the VAD's longer endpoint.
            self._end_speech_at_pause()
        self.end_if_final()

    # -- decisions ---------------------------------------------------------------------------
    def decide(self, trigger: str) -> None:
        """The open turn ends once its words are final (``trigger``: timeout or manual)."""
        if self.tracker is not None:
            self.pump()
            self.tracker.decide(trigger)

    def follow_audio(self) -> None:
        """After new audio: speech after an eager end resumes the turn; a silence of
        ``eot_timeout_ms`` ends it whatever the model said."""
        tracker = self.tracker
        if tracker is None or not tracker.deciding:
            return
        vad = self.audio.vad
        if vad.in_speech and vad.tentative_end is None and tracker.eager:
            self.pump()
            self._out.extend(tracker.resumed(self.audio.seconds_in))
        silent_since = vad.tentative_end if vad.in_speech else self._speech_ended_at
        timeout = tracker.config.eot_timeout_ms * SAMPLE_RATE_HZ // 1000
        if silent_since is None or self.audio.end - silent_since < timeout:
            return
        self.decide("timeout")
        if vad.in_speech:
            self._end_speech_at_pause()
        self.end_if_final()

    def end_if_final(self) -> None:
        """A decided turn whose words are all final ends now (else at the next ``Settled``)."""
        if self.tracker is None or self.windows.utterances:
            return
        self.pump()
        self._out.extend(self.tracker.settled(self.audio.seconds_in))

    def keep_from(self) -> int | None:
        """The buffer keeps an open turn's last seconds for the turn model."""
        tracker = self.tracker
        if tracker is None or not tracker.deciding:
            return None
        start = tracker.start_sample or 0
        return max(start, self.audio.end - round(TURN_AUDIO_S * SAMPLE_RATE_HZ))
