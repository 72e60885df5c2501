"""What each rule of the streaming core earns: the dev sets streamed with one rule switched off.

    python -m bench.ablation                     # or: make bench-ablation
    python -m bench.ablation --rules stalled_tail,unheard_tail --sets test_other

Every clip is streamed through ``Session`` in simulated real time at the modelled decode cost
(``bench.accuracy.modelled_cost_s``), so window positions, and so the text, are the same on
every run. The baseline runs with every rule on, then once per rule of
``server.core.rules.RULES`` (``RulesConfig.disabled``) switched off. Per run and set: errors
against the reference, final latency p95, end of speech to final p50 / p95 (the turn end),
flicker, the first partial's latency from the speech onset (p50), and how often each rule
fired (``Session.rule_counts``).

The noise: a rule's effect counts only where it exceeds what timing alone moves. The baseline
is repeated with every decode charged 10% less and 10% more (``--noise-scales``); the spread of
those runs' errors is the run-to-run noise stated beside each rule.

Decodes are kept in a cache (``--cache``, by the window's audio and request, draft aside: the
draft changes only the speed), so a run repeats only the decodes that a switched-off rule
changed; a second run of the same code decodes nothing. With ``--compare FILE`` the clips whose
events (finals and partials, with their times) differ from that earlier run are listed: the
check that a restructure changed nothing. The events are kept in
``.cache/ablation-events/NAME-events.json``, which ``--compare`` takes; bench/results keeps
each clip's errors and text.

``--set streaming.FIELD=JSON`` (or ``vad.FIELD``, ``commit.FIELD``) changes a setting for every
run: ``--rules none --noise-scales "" --set 'vad.detector="silero"'`` streams the sets once with
Silero VAD in webrtcvad's place.

Writes ``bench/results/ablation.json`` (``--out NAME``) and prints one table.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import hashlib
import json
import os
import pickle
import sys
import time
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from bench.accuracy import _overrides, modelled_cost_s
from bench.accuracy_metrics import count_errors
from bench.corpus import read_manifest
from bench.engine import load_speech, speech_dir, write_results
from bench.simulate import SimulationResult, simulate
from server.config import StreamingConfig, VadConfig
from server.core.engine_api import DecodeResult, Window
from server.core.rules import GUARDS, RULES
from server.core.session import DecodeJob
from server.engine.engine import Engine, EngineConfig
from server.protocol.messages import FinalMessage, PartialMessage
from server.turns.silero_vad import SileroModel, SileroVoicing

REPO = Path(__file__).resolve().parent.parent
DEFAULT_CACHE = REPO / ".cache" / "ablation-decodes.pkl"
EVENTS = REPO / ".cache" / "ablation-events"  # the full results, with every clip's events
SETS = ("test_other", "test_other_long", "clean")
MODES = ("utterance", "words")


class DecodeCache:
    """Decode results by window audio and request (the draft aside), kept on disk."""

    def __init__(self, engine: Engine, path: Path) -> None:
        self.engine = engine
        self.path = path
        self.results: dict[str, DecodeResult] = {}
        if path.is_file():
            with path.open("rb") as fh:
                self.results = pickle.load(fh)
        self.hits = 0
        self.misses = 0
        self._dirty = 0

    @staticmethod
    def key(job: DecodeJob) -> str:
        digest = hashlib.sha1(job.audio.tobytes())
        digest.update(repr(dataclasses.replace(job.request, draft=())).encode())
        return digest.hexdigest()

    def __call__(self, job: DecodeJob) -> DecodeResult:
        key = self.key(job)
        found = self.results.get(key)
        if found is not None:
            self.hits += 1
            return found
        self.misses += 1
        window = Window(self.engine.features(job.audio), job.request)
        result = self.engine.decode_windows([window])[0]
        self.results[key] = result
        self._dirty += 1
        if self._dirty >= 500:
            self.save()
        return result

    def save(self) -> None:
        if not self._dirty:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        with tmp.open("wb") as fh:
            pickle.dump(self.results, fh, protocol=pickle.HIGHEST_PROTOCOL)
        tmp.replace(self.path)
        self._dirty = 0


def clips_of(set_name: str) -> list[tuple[str, str]]:
    """(file, reference) of one dev set: test-other's short clips, its long recordings, or
    the other English short clips."""
    folder = speech_dir()
    if set_name == "test_other_long":
        rows = read_manifest(folder / "manifest_long.tsv")
        return [(r.file, r.transcript) for r in rows if "test-other" in r.file]
    rows = [r for r in read_manifest(folder / "manifest.tsv") if r.language == "en"]
    other = set_name == "test_other"
    return [(r.file, r.transcript) for r in rows if ("test-other" in r.file) == other]


def fingerprint(result: SimulationResult) -> list[list[Any]]:
    """The events a client sees, with their simulated times: equal fingerprints, same run."""
    out: list[list[Any]] = []
    for e in result.events:
        m = e.message
        if isinstance(m, FinalMessage | PartialMessage):
            kind = "final" if isinstance(m, FinalMessage) else "partial"
            out.append([kind, round(e.at_s, 3), m.text, round(m.start, 3), round(m.end, 3)])
    return out


def _p(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))], 3)


def run_set(
    engine: Engine,
    cache: DecodeCache,
    clips: Iterable[tuple[str, str]],
    streaming: StreamingConfig,
    *,
    cost_scale: float,
    vad: VadConfig | None = None,
) -> dict[str, Any]:
    """One configuration over one set's clips, pooled; the per-clip text and fingerprint.
    ``vad``: the sessions' voice activity detection (``detector`` "silero": Silero's)."""
    voicing = None
    if vad is not None and vad.detector == "silero":
        silero = SileroModel()
        voicing = functools.partial(SileroVoicing, silero)
    errors = words = 0
    finals: list[float] = []
    turn_ends: list[float] = []
    first_partials: list[float] = []
    changed = shown = 0
    fired: Counter[str] = Counter()
    per_clip: dict[str, Any] = {}
    for file, reference in clips:
        result = simulate(
            engine,
            load_speech(file),
            streaming=streaming,
            decode_cost_s=lambda job: cost_scale * modelled_cost_s(job),
            spare_lane=streaming.finals == "utterance",
            decoder=cache,
            on_session=lambda s: fired.update(s.rule_counts),
            vad=vad,
            frame_voicing=voicing,
        )
        counts = count_errors(reference, result.text)
        errors += counts.errors
        words += counts.ref_words
        finals += result.final_latencies_s()
        turn_ends += result.end_of_speech_to_final_s()
        first = result.first_partial_latency_s()
        if first is not None:
            first_partials.append(first)
        c, s = result.flicker()
        changed += c
        shown += s
        per_clip[file] = {
            "errors": counts.errors,
            "text": result.text,
            "fingerprint": fingerprint(result),
        }
    return {
        "errors": errors,
        "ref_words": words,
        "wer": round(errors / words, 4) if words else None,
        "final_p95_s": _p(finals, 0.95),
        "turn_end_p50_s": _p(turn_ends, 0.5),
        "turn_end_p95_s": _p(turn_ends, 0.95),
        "flicker": round(changed / shown, 3) if shown else None,
        "first_partial_p50_s": _p(first_partials, 0.5),
        "fired": dict(sorted(fired.items())),
        "clips": per_clip,
    }


def differing(run: dict[str, Any], other: dict[str, Any]) -> list[str]:
    """Clips whose events differ between two runs of the same set."""
    return [
        f
        for f, clip in run["clips"].items()
        if f in other["clips"] and clip["fingerprint"] != other["clips"][f]["fingerprint"]
    ]


def _save(name: str, data: dict[str, Any]) -> Path:
    """The results: with every clip's events in ``.cache/`` (``--compare`` reads them; a
    few MB a run), without them in bench/results (each clip's errors and text stay)."""
    EVENTS.mkdir(parents=True, exist_ok=True)
    (EVENTS / f"{name}-events.json").write_text(json.dumps(data) + "\n")
    slim = copy.deepcopy(data)
    for by in slim["runs"].values():
        for run in by.values():
            for clip in run["clips"].values():
                clip.pop("fingerprint", None)
    return write_results(name, slim)


def _summary(
    runs: dict[str, dict[str, dict[str, Any]]],
    cache: DecodeCache,
    load_start: tuple[float, float, float],
    started: float,
    compare: Path | None,
) -> dict[str, Any]:
    """The results file: every run so far, the noise (the baselines' spread of errors), and
    with ``compare`` the clips whose events differ from that earlier run's baseline."""
    noise = {
        label: sorted(
            {
                by[label]["errors"]
                for n, by in runs.items()
                if n.startswith("baseline") and label in by
            }
        )
        for label in runs.get("baseline", {})
    }
    data: dict[str, Any] = {
        "runs": runs,
        "noise_errors": noise,
        "rules": dict(RULES),
        "argv": sys.argv[1:],
        "loadavg_start": load_start,
        "loadavg_end": os.getloadavg(),
        "wall_s": round(time.perf_counter() - started, 1),
        "decodes_new": cache.misses,
        "decodes_cached": cache.hits,
    }
    if compare is not None:
        earlier = json.loads(compare.read_text())["runs"]["baseline"]
        if any("fingerprint" not in c for run in earlier.values() for c in run["clips"].values()):
            raise SystemExit(
                f"{compare} holds no clip events: compare with the run's events file, "
                f".cache/ablation-events/NAME-events.json"
            )
        data["compare"] = {
            label: differing(run, earlier[label])
            for label, run in runs.get("baseline", {}).items()
            if label in earlier
        }
        for label, files in data["compare"].items():
            print(f"against {compare.name}: {label}: {len(files)} clip(s) differ {files}")
    return data


def main(argv: list[str] | None = None) -> int:

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--rules", default="all", help="comma-separated rule names to switch off, or all, none"
    )
    parser.add_argument("--sets", default=",".join(SETS))
    parser.add_argument("--modes", default=",".join(MODES), help="finals: utterance, words")
    parser.add_argument("--noise-scales", default="0.9,1.1", help="baseline cost scales")
    parser.add_argument(
        "--set", action="append", default=[], help="streaming.FIELD=JSON for every run"
    )
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    parser.add_argument("--compare", type=Path, help="an earlier ablation JSON to diff against")
    parser.add_argument("--out", default="ablation")
    args = parser.parse_args(argv)
    rules = (
        [r for r in RULES if r not in GUARDS]
        if args.rules == "all"
        else []
        if args.rules == "none"
        else [r for r in args.rules.split(",") if r]
    )
    unknown = [r for r in rules if r not in RULES]
    if unknown:
        raise SystemExit(f"unknown rule(s) {unknown}; known: {', '.join(RULES)}")
    sets = [s for s in args.sets.split(",") if s]
    modes = [m for m in args.modes.split(",") if m]
    scales = [float(x) for x in args.noise_scales.split(",") if x]
    configured, _, vad = _overrides(args.set)

    engine = Engine.load(EngineConfig())
    engine.warmup()
    cache = DecodeCache(engine, args.cache)
    load_start = os.getloadavg()
    started = time.perf_counter()
    runs: dict[str, dict[str, dict[str, Any]]] = {}
    # The noise runs last: each decodes nearly every window afresh, where a rule that fires
    # rarely changes only a few clips' decodes after it fired.
    plan: list[tuple[str, tuple[str, ...], float]] = [("baseline", (), 1.0)]
    plan += [(f"-{rule}", (rule,), 1.0) for rule in rules]
    plan += [(f"baseline x{s}", (), s) for s in scales]
    for name, off, scale in plan:
        for mode in modes:
            streaming = dataclasses.replace(
                configured, finals=mode, rules=dataclasses.replace(configured.rules, disabled=off)
            )
            for set_name in sets:
                label = f"{mode}/{set_name}"
                clips = clips_of(set_name)
                run = run_set(engine, cache, clips, streaming, cost_scale=scale, vad=vad)
                runs.setdefault(name, {})[label] = run
                cache.save()
                _save(args.out, _summary(runs, cache, load_start, started, None))
                base = runs["baseline"].get(label)
                moved = len(differing(run, base)) if base is not None and name != "baseline" else 0
                print(
                    f"{name:28s} {label:26s} errors {run['errors']:4d}/{run['ref_words']:4d}"
                    f"  final p95 {run['final_p95_s']}  turn end {run['turn_end_p50_s']}/"
                    f"{run['turn_end_p95_s']}  flicker {run['flicker']}  first partial "
                    f"{run['first_partial_p50_s']}  clips changed {moved}"
                    f"  decodes {cache.misses} new, {cache.hits} cached",
                    flush=True,
                )
    path = _save(args.out, _summary(runs, cache, load_start, started, args.compare))
    print(f"wrote {path}")
    print(
        json.dumps({n: {label: r["errors"] for label, r in by.items()} for n, by in runs.items()})
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
