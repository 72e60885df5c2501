"""Recorded cases of the streaming core: a real run's VAD verdicts and decode results, replayed
through the core with no model and no audio.

A case is recorded once from the real model on a real clip (``record``): every 30 ms frame's
webrtcvad verdict, and every decode the session asked for with what it heard (window start and
length, forced prefix, beam) and what came back. ``replay`` streams a constant signal of the
same length through a fresh session whose VAD takes the recorded verdicts, at the modelled
decode cost (``bench.accuracy.modelled_cost_s``), and answers each decode from the recording;
a session that asks for a decode the real run did not make fails with ``Diverged``. So a case
pins a rule's behaviour on the speech that once needed it, in a fraction of a second.

    python -m tests.recorded_cases record NAME CLIP [--finals words] [--no-spare-lane]
        [--set FIELD=JSON ...] [--cost-s S] [--first-s S]
    python -m tests.recorded_cases scan [--finals words]   # which rules fire on which clip
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from bench.accuracy import modelled_cost_s
from bench.simulate import SimulationResult, simulate
from server.config import StreamingConfig
from server.core.engine_api import DecodeResult, StopReason, WordTiming
from server.core.jobs import DecodeJob
from server.protocol.formats import SAMPLE_RATE_HZ

CASES = Path(__file__).parent / "fixtures" / "cases"
# The replayed signal: any constant that is not digital silence (the VAD's warm-up counts
# frames that hold audio), far too quiet to matter, since the verdicts are replayed.
REPLAY_LEVEL = 0.001


class Diverged(AssertionError):
    """The session asked for a decode the recorded run did not make."""


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    clip: str
    finals: str
    spare_lane: bool
    samples: int
    verdicts: str  # "1" voiced, "0" not, one per frame in the order the VAD asked
    decodes: list[dict[str, Any]]  # the window each decode heard, and its result
    finals_seen: list[list[Any]]  # [text, start, end] of each final of the real run
    rules_fired: dict[str, int]
    # StreamingConfig fields the run set besides ``finals`` (JSON values), e.g. a short cap.
    settings: dict[str, Any] = dataclasses.field(default_factory=dict)
    # Every decode's cost in seconds; None: ``modelled_cost_s``. A cost far above the audio's
    # length is a stream whose audio all arrives before its first decode ends.
    cost_s: float | None = None

    def streaming(self, **overrides: Any) -> StreamingConfig:
        """The run's streaming settings, with ``overrides`` (e.g. a rule switched off)."""
        return StreamingConfig(**{"finals": self.finals, **self.settings, **overrides})

    def decode_cost_s(self) -> Callable[[DecodeJob], float]:
        cost_s = self.cost_s
        return modelled_cost_s if cost_s is None else (lambda job: cost_s)

    @classmethod
    def load(cls, name: str) -> Case:
        return cls(**json.loads((CASES / f"{name}.json").read_text()))

    def save(self) -> Path:
        path = CASES / f"{self.name}.json"
        path.write_text(json.dumps(dataclasses.asdict(self), separators=(",", ":")) + "\n")
        return path


def _window(job: DecodeJob) -> dict[str, Any]:
    return {
        "start_s": round(job.start_s, 5),
        "audio_s": round(job.audio_s, 5),
        "prefix": list(job.request.prefix),
        "prompt": len(job.request.prompt),
        "beam": job.request.options.beam_size,
    }


def _result_to_json(r: DecodeResult) -> dict[str, Any]:
    return {
        "words": [[w.word, list(w.tokens), w.start_s, w.end_s, w.probability] for w in r.words],
        "language": r.language,
        "stop": r.stop_reason.value,
        "sequence": list(r.sequence),
        "avg_logprob": r.avg_logprob,
        "no_speech_prob": r.no_speech_prob,
        "compression_ratio": r.compression_ratio,
    }


def _result_from_json(d: dict[str, Any]) -> DecodeResult:
    words = tuple(WordTiming(w, tuple(t), a, b, p) for w, t, a, b, p in d["words"])
    tokens = tuple(t for w in words for t in w.tokens)
    return DecodeResult(
        tokens=tokens,
        text="".join(w.word for w in words),
        spans=(),
        words=words,
        language=d["language"],
        avg_logprob=d["avg_logprob"],
        no_speech_prob=d["no_speech_prob"],
        compression_ratio=d["compression_ratio"],
        stop_reason=StopReason(d["stop"]),
        n_generated=len(tokens),
        sequence=tuple(d["sequence"]),
    )


def _finals(result: SimulationResult) -> list[list[Any]]:
    return [[f.text, round(f.start, 3), round(f.end, 3)] for f in result.finals]


class _Shape:
    is_multilingual = False


class _NoEngine:
    """What ``simulate`` reads of an engine when a ``decoder`` answers every decode."""

    dims = _Shape()


def replay(case: Case, **overrides: Any) -> tuple[SimulationResult, Any]:
    """Stream ``case`` through a fresh session (``overrides``: StreamingConfig fields instead
    of the run's, e.g. ``rules``); returns the simulation and the session's rule counts.
    Raises ``Diverged``."""
    verdicts = iter(case.verdicts)
    decodes = iter(case.decodes)

    def classify(frame: bytes) -> bool:
        return next(verdicts) == "1"

    def decode(job: DecodeJob) -> DecodeResult:
        recorded = next(decodes, None)
        asked = _window(job)
        if recorded is None or recorded["window"] != asked:
            raise Diverged(
                f"decode {asked} was not recorded (next: {recorded and recorded['window']})"
            )
        return _result_from_json(recorded["result"])

    counts: dict[str, int] = {}
    result = simulate(
        _NoEngine(),  # type: ignore[arg-type]
        np.full(case.samples, REPLAY_LEVEL, dtype=np.float32),
        streaming=case.streaming(**overrides),
        decode_cost_s=case.decode_cost_s(),
        spare_lane=case.spare_lane,
        decoder=decode,
        on_session=lambda s: counts.update(s.rule_counts),
        frame_classifier=classify,
    )
    return result, counts


def record(
    name: str,
    clip: str,
    *,
    finals: str,
    spare_lane: bool,
    settings: dict[str, Any] | None = None,
    cost_s: float | None = None,
    first_s: float | None = None,
) -> Case:
    """Run ``clip`` (its first ``first_s`` seconds, or all of it) through the real model and
    webrtcvad, at the modelled cost (or ``cost_s`` a decode) with ``settings``
    (StreamingConfig fields), and keep what a replay needs."""
    import webrtcvad

    from bench.ablation import DEFAULT_CACHE, DecodeCache
    from bench.engine import load_speech
    from server.config import VadConfig
    from server.engine.engine import Engine, EngineConfig

    engine = Engine.load(EngineConfig())
    cache = DecodeCache(engine, DEFAULT_CACHE)  # decodes the ablation runs made already
    vad = webrtcvad.Vad(VadConfig().aggressiveness)
    verdicts: list[str] = []
    decodes: list[dict[str, Any]] = []

    def classify(frame: bytes) -> bool:
        voiced = bool(vad.is_speech(frame, SAMPLE_RATE_HZ))
        verdicts.append("1" if voiced else "0")
        return voiced

    def decode(job: DecodeJob) -> DecodeResult:
        result = cache(job)
        decodes.append({"window": _window(job), "result": _result_to_json(result)})
        return result

    audio = load_speech(clip)
    if first_s is not None:
        audio = audio[: round(first_s * SAMPLE_RATE_HZ)]
        clip = f"{clip} (its first {first_s:g} s)"
    counts: dict[str, int] = {}
    shape = Case(name, clip, finals, spare_lane, 0, "", [], [], {}, settings or {}, cost_s)
    result = simulate(
        engine,
        audio,
        streaming=shape.streaming(),
        decode_cost_s=shape.decode_cost_s(),
        spare_lane=spare_lane,
        decoder=decode,
        on_session=lambda s: counts.update(s.rule_counts),
        frame_classifier=classify,
    )
    return Case(
        name,
        clip,
        finals,
        spare_lane,
        int(audio.shape[0]),
        "".join(verdicts),
        decodes,
        _finals(result),
        counts,
        shape.settings,
        cost_s,
    )


def scan(finals: str, clips: list[str], decoder: Callable[[DecodeJob], DecodeResult]) -> None:
    """Print the rules that fire on each clip (decodes from ``decoder``, e.g. a cache)."""
    from bench.engine import load_speech
    from server.engine.engine import Engine, EngineConfig

    engine = Engine.load(EngineConfig())
    for clip in clips:
        counts: dict[str, int] = {}

        def keep(session: Any, counts: dict[str, int] = counts) -> None:
            counts.update(session.rule_counts)

        simulate(
            engine,
            load_speech(clip),
            streaming=StreamingConfig(finals=finals),
            decode_cost_s=modelled_cost_s,
            spare_lane=finals == "utterance",
            decoder=decoder,
            on_session=keep,
        )
        rules = {k: v for k, v in sorted(counts.items()) if not k.startswith("final:")}
        print(clip, json.dumps(rules), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record")
    rec.add_argument("name")
    rec.add_argument("clip")
    rec.add_argument("--finals", default="utterance")
    rec.add_argument("--no-spare-lane", action="store_true")
    rec.add_argument("--set", action="append", default=[], help="FIELD=JSON (StreamingConfig)")
    rec.add_argument("--cost-s", type=float, help="every decode's cost (default: modelled)")
    rec.add_argument("--first-s", type=float, help="only the clip's first seconds")
    sc = sub.add_parser("scan")
    sc.add_argument("--finals", default="utterance")
    sc.add_argument("--match", default="test-other")
    args = parser.parse_args(argv)
    if args.command == "record":
        settings = {k: json.loads(v) for k, v in (item.split("=", 1) for item in args.set)}
        case = record(
            args.name,
            args.clip,
            finals=args.finals,
            spare_lane=not args.no_spare_lane,
            settings=settings,
            cost_s=args.cost_s,
            first_s=args.first_s,
        )
        print(f"wrote {case.save()}: {len(case.decodes)} decodes, rules {case.rules_fired}")
        return 0
    from bench.ablation import DEFAULT_CACHE, DecodeCache
    from bench.corpus import read_manifest
    from bench.engine import speech_dir
    from server.engine.engine import Engine, EngineConfig

    rows = read_manifest(speech_dir() / "manifest.tsv")
    clips = [r.file for r in rows if args.match in r.file and r.language == "en"]
    cache = DecodeCache(Engine.load(EngineConfig()), DEFAULT_CACHE)
    scan(args.finals, clips, cache)
    return 0


if __name__ == "__main__":
    sys.exit(main())
