"""Streamed finals beside offline decoding, clip by clip and by difficulty: the accuracy
harness of the commit policy.

    python -m bench.accuracy                 # or: make bench-accuracy
    python -m bench.accuracy --limit 10 --no-long --no-beam --set commit.min_right_context_s=1.2

Every English clip of ``manifest.tsv`` is streamed as its own session (and, unless
``--no-long``, each English long recording of ``manifest_long.tsv``) through ``Session`` in
simulated real time: audio arrives at 1x and each decode's measured wall time is charged to
the clock (``bench/simulate.py``), which is what a one-stream server sees. The same clip is
decoded offline with ``transcribe_audio`` (30 s windows) twice: greedy, and with beam search
of 5 (``--no-beam`` skips it: it costs about as much again). Per clip and pooled:

- WER of the stream, offline greedy, offline beam 5 (and the real server's with
  ``--server``), and the stream's errors minus each offline reference's (the figure that
  matters);
- where the streamed errors sit (``bench.accuracy_metrics.locate_errors``): within 2 s of
  their utterance's onset, in the middle, on an utterance's last reference word, or inserted
  after the clip's last reference word; each error itself is listed with its time;
- insertions at the end of the stream (words after the last reference word);
- final latency p50/p95: arrival of a final minus the stream time of its last word;
- first-partial latency: speech onset to the first partial or final with a word;
- flicker: words shown in a partial and later changed, over words shown.

Pooled by difficulty -- ``test_other`` (LibriSpeech test-other's short clips) and
``test_other_long`` (its long recordings) against ``clean`` and ``clean_long`` (every other
folder) -- by source folder of the short clips, and by set (short, long).

``--server`` also streams every short clip as its own session at 1x through a real server
subprocess over WebSocket and reports that WER beside the simulated one, per clip and pooled:
the check that the simulation stands for the server.

``--set section.field=value`` overrides a field of ``StreamingConfig`` (``streaming.``), of
``VadConfig`` (``vad.``) or of the commit policy's config (``commit.``), so the trade-off table
is one loop over flags (``--server`` streams with the server's defaults).
Writes ``bench/results/accuracy.json`` (``--out NAME`` for another name) and prints a table by
difficulty and one by source; the last line printed is one JSON object with the headline
figures per difficulty, test-other first.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.accuracy_metrics import (
    LOCATIONS,
    OFFLINE,
    by_difficulty,
    by_source,
    count_errors,
    headline,
    locate_errors,
    location_counts,
    pooled,
    table,
)
from bench.corpus import read_manifest
from bench.engine import RESULTS, Float32Array, load_speech, speech_dir, write_results
from bench.replay import Replay, TimedAdapter, WhisperwireAdapter, replay
from bench.server_process import ServerProcess, free_port, http_ok
from bench.simulate import SimulationResult, TimedEvent, simulate, utterance_last_words
from server.config import StreamingConfig, VadConfig, with_setting
from server.core.engine_api import DecodeOptions
from server.core.policy import CommitConfig
from server.core.session import DecodeJob
from server.engine.engine import Engine, EngineConfig
from server.engine.offline import transcribe_audio
from server.protocol.messages import (
    FinalMessage,
    PartialMessage,
    SpeechStartedMessage,
    parse_server_message,
)

# The offline references by name: None is transcribe_audio's own default (greedy, as the
# harness has always decoded); beam5 is OpenAI Whisper's default beam search.
OFFLINE_OPTIONS: dict[str, DecodeOptions | None] = {
    "greedy": None,
    "beam5": DecodeOptions(word_timestamps=False, beam_size=5),
}
OfflineCache = dict[str, dict[str, str]]  # reference name -> clip file -> transcript


def _overrides(pairs: list[str]) -> tuple[StreamingConfig, CommitConfig, VadConfig]:
    sections: dict[str, dict[str, Any]] = {"streaming": {}, "commit": {}, "vad": {}}
    for pair in pairs:
        key, _, raw = pair.partition("=")
        section, _, name = key.partition(".")
        target = sections.get(section)
        if target is None or not name or not raw:
            raise SystemExit(
                f"--set takes streaming.FIELD=VALUE, commit.FIELD=VALUE or vad.FIELD=VALUE; "
                f"got {pair}"
            )
        target[name] = json.loads(raw)
    try:
        commit = CommitConfig(**sections["commit"])
        # Dotted names reach nested settings: streaming.rules.bare_prompt.min_words=12.
        streaming = StreamingConfig(commit=commit)
        for name, value in sections["streaming"].items():
            streaming = with_setting(streaming, name, value)
        vad = VadConfig()
        for name, value in sections["vad"].items():
            vad = with_setting(vad, name, value)
    except (TypeError, ValueError) as exc:
        raise SystemExit(f"--set: {exc}") from exc
    return streaming, streaming.commit, vad


def modelled_cost_s(job: DecodeJob) -> float:
    """A decode's cost as a fixed part plus one growing with the window (about what
    bench-decoder measured for tiny.en on these CPUs): window positions, and so the text, are
    then the same on every run, whatever else the machine is doing."""
    greedy = 0.1 + 0.05 * job.audio_s
    # A beam search costs more the longer the window (bench-beam, beam 5 against greedy:
    # 1.6x at 2 s, 1.9x at 5 s and 10 s, 2.2x at 30 s, its hypotheses stepped as rows of one
    # numpy step).
    extra = (job.request.options.beam_size - 1) * (0.17 + 0.005 * job.audio_s)
    return greedy * (1.0 + extra)


def offline_text(
    engine: Engine, audio: Float32Array, file: str, reference: str, cache: OfflineCache
) -> str:
    """The offline ``reference`` ("greedy", "beam5") transcript of a clip, from ``cache`` when
    it has one (offline text depends on the engine only, not on ``--set``)."""
    known = cache.setdefault(reference, {})
    if file not in known:
        known[file] = transcribe_audio(engine, audio, OFFLINE_OPTIONS[reference]).text
    return known[file]


def run_clip(
    engine: Engine,
    file: str,
    transcript: str,
    streaming: StreamingConfig,
    *,
    vad: VadConfig | None = None,
    modelled: bool = False,
    cost_scale: float = 1.0,
    offline_cache: OfflineCache | None = None,
    references: tuple[str, ...] = OFFLINE,
    spare_lane: bool = False,
) -> dict[str, Any]:
    """One clip streamed and decoded offline with each of ``references``: errors and WER of
    each, streamed minus each offline reference, where the streamed errors sit, latency."""
    audio = load_speech(file)
    cache = offline_cache if offline_cache is not None else {}
    texts = {name: offline_text(engine, audio, file, name, cache) for name in references}
    result = simulate(
        engine,
        audio,
        streaming=streaming,
        vad=vad,
        decode_cost_s=(lambda job: cost_scale * modelled_cost_s(job)) if modelled else None,
        spare_lane=spare_lane,
    )
    s = count_errors(transcript, result.text)
    words = [w for f in result.finals for w in f.words]
    onsets = [e.message.start for e in result.events if isinstance(e.message, SpeechStartedMessage)]
    located = locate_errors(transcript, result.text, words, onsets)
    changed, shown = result.flicker()
    row: dict[str, Any] = {
        "file": file,
        "audio_s": round(result.audio_s, 2),
        "ref_words": s.ref_words,
        "errors_streamed": s.errors,
        "wer_streamed": round(s.wer, 4),
        "trailing_insertions_streamed": s.trailing_insertions,
    }
    for name in OFFLINE:
        o = count_errors(transcript, texts[name]) if name in texts else None
        row[f"errors_{name}"] = None if o is None else o.errors
        row[f"wer_{name}"] = None if o is None else round(o.wer, 4)
        row[f"errors_minus_{name}"] = None if o is None else s.errors - o.errors
        row[f"trailing_insertions_{name}"] = None if o is None else o.trailing_insertions
    return row | {
        "error_locations": location_counts(located),
        "final_latencies_s": [round(x, 3) for x in result.final_latencies_s()],
        "word_final_latencies_s": [round(x, 3) for x in result.word_final_latencies_s()],
        "end_of_speech_to_final_s": [round(x, 3) for x in result.end_of_speech_to_final_s()],
        "first_partial_s": result.first_partial_latency_s(),
        "flicker_changed": changed,
        "flicker_shown": shown,
        "decodes": len(result.decode_s),
        "background_searches": len(result.search_s),
        "decode_s_total": round(sum(result.decode_s), 3),
        "text_streamed": result.text,
        **{f"text_{name}": texts.get(name) for name in OFFLINE},
        "streamed_errors": [
            {
                k: round(v, 3) if isinstance(v, float) else v
                for k, v in dataclasses.asdict(e).items()
            }
            for e in located
        ],
    }


def read_offline_cache(path: Path | None) -> OfflineCache:
    """``--offline-cache``'s transcripts by reference name; an old flat file (clip ->
    transcript, from before beam search) holds greedy ones."""
    if path is None or not path.is_file():
        return {}
    data: dict[str, Any] = json.loads(path.read_text())
    if all(isinstance(v, str) for v in data.values()):
        return {"greedy": data}
    return {name: dict(v) for name, v in data.items() if isinstance(v, dict)}


def _clip_line(clip: dict[str, Any]) -> str:
    def wer(name: str) -> str:
        value = clip[f"wer_{name}"]
        return f"{value:7.3f}" if value is not None else "      -"

    def diff(name: str) -> str:
        value = clip[f"errors_minus_{name}"]
        return f"{value:+4d}" if value is not None else "   -"

    where = " ".join(f"{clip['error_locations'][k]:3d}" for k in LOCATIONS)
    return (
        f"{wer('streamed')} {wer('greedy')} {wer('beam5')} {diff('greedy')} {diff('beam5')}"
        f"  {where}  {clip['file']}"
    )


CLIP_HEADER = (
    "streamed  greedy   beam5  -grd -bm5  " + " ".join(k[:3] for k in LOCATIONS) + "  file"
)


@dataclasses.dataclass(frozen=True)
class ServedClip:
    """One clip as a real server streamed it: its finals' text, and their latencies as the
    simulation times them (``SimulationResult``), from when the audio was sent."""

    text: str
    final_latencies_s: tuple[float, ...]  # per final: arrival - sent time of its end
    end_of_speech_to_final_s: tuple[float, ...]  # per utterance with final words
    first_partial_s: float | None  # sent time of the first speech onset to the first word
    flicker: tuple[int, int]  # (words shown in a partial and later changed, words shown)


def served_clip(record: Replay, messages: list[tuple[float, dict[str, Any]]]) -> ServedClip:
    """``record`` and its v1 ``messages`` (arrival wall time, JSON) reduced to a ServedClip."""
    events = [
        TimedEvent(wall, parse_server_message(json.dumps(m)))
        for wall, m in messages
        if m["type"] in ("speech_started", "speech_ended", "partial", "final")
    ]
    onset = next(
        (e.message.start for e in events if isinstance(e.message, SpeechStartedMessage)), None
    )
    first_word = next(
        (
            e.at_s
            for e in events
            if isinstance(e.message, (PartialMessage, FinalMessage)) and e.message.text.strip()
        ),
        None,
    )
    first_partial = (
        None if onset is None or first_word is None else first_word - record.sends.sent_at(onset)
    )
    finals = [
        e.at_s - record.sends.sent_at(e.message.end)
        for e in events
        if isinstance(e.message, FinalMessage)
    ]
    turn_ends = [
        arrived - record.sends.sent_at(word_end)
        for arrived, word_end in utterance_last_words(events)
    ]
    flicker = SimulationResult(events=events).flicker()
    return ServedClip(record.text, tuple(finals), tuple(turn_ends), first_partial, flicker)


async def stream_through_server(
    clips: Sequence[tuple[str, Float32Array]],
    server_args: Sequence[str] = (),
    *,
    streams: int = 1,
) -> dict[str, ServedClip]:
    """Each clip (name, 16 kHz audio) as its own WebSocket session at 1x into a real server
    subprocess, ``streams`` of them open at once (the capacity limit off, so that every one is
    served)."""
    port = free_port()
    cmd = [
        os.path.join(sys.prefix, "bin", "whisperwire-server"),
        *("--port", str(port), "--model", "tiny.en", "--log-level", "warning"),
        "--no-capacity-limit",
        *server_args,
    ]
    ready = f"http://127.0.0.1:{port}/readyz"
    gate = asyncio.Semaphore(streams)
    served: dict[str, ServedClip] = {}

    async def one(name: str, audio: Float32Array) -> None:
        async with gate:
            adapter = TimedAdapter(WhisperwireAdapter(f"ws://127.0.0.1:{port}"))
            record = await replay(adapter, audio)
            served[name] = served_clip(record, adapter.messages)

    log = RESULTS / "logs" / "accuracy_server.log"
    async with ServerProcess("whisperwire", cmd, ready=lambda: http_ok(ready), log_path=log):
        await asyncio.gather(*(one(name, audio) for name, audio in clips))
    return served


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--limit", type=int, default=0, help="first N short clips only")
    parser.add_argument(
        "--match", default="", help="only clips (and long recordings) whose path contains this"
    )
    parser.add_argument("--no-long", action="store_true", help="skip the long recordings")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=JSON")
    parser.add_argument("--out", default="accuracy")
    parser.add_argument(
        "--modelled-cost",
        action="store_true",
        help="charge a modelled decode cost instead of the measured one (repeatable tuning)",
    )
    parser.add_argument(
        "--cost-scale",
        type=float,
        default=1.0,
        help="multiply the modelled cost (0.5: about this machine's real decode speed, where "
        "the served text differs from the simulation's at 1.0)",
    )
    parser.add_argument(
        "--server",
        action="store_true",
        help="also stream every short clip through a real server at 1x and report its WER "
        "beside the simulation's (the check that the two agree)",
    )
    parser.add_argument(
        "--server-args",
        default="",
        help="further flags for --server's server, space-separated "
        "(e.g. --server-args=--no-speculative-closing)",
    )
    parser.add_argument(
        "--no-beam",
        action="store_true",
        help="skip the offline beam-5 reference (it costs about as much as the rest)",
    )
    parser.add_argument(
        "--offline-cache",
        type=Path,
        help="JSON file keeping offline transcripts between runs (they do not depend on --set)",
    )
    parser.add_argument(
        "--spare-lane",
        action="store_true",
        help="simulate one stream on a two-lane server: its background beam searches "
        "(StreamingConfig.utterance_search_s) run on the second lane",
    )
    args = parser.parse_args(argv)
    streaming, commit, vad = _overrides(args.set)

    folder = speech_dir()
    short = [r for r in read_manifest(folder / "manifest.tsv") if r.language == "en"]
    short = [r for r in short if args.match in r.file]
    if args.limit:
        short = short[: args.limit]
    long = (
        []
        if args.no_long
        else [
            r
            for r in read_manifest(folder / "manifest_long.tsv")
            if r.language == "en" and args.match in r.file
        ]
    )
    cache = read_offline_cache(args.offline_cache)
    references = ("greedy",) if args.no_beam else OFFLINE
    engine = Engine.load(EngineConfig())
    engine.warmup()
    load_start = os.getloadavg()
    started = time.perf_counter()
    sets: dict[str, list[dict[str, Any]]] = {"short": [], "long": []}
    print(CLIP_HEADER, flush=True)
    for name, rows in (("short", short), ("long", long)):
        for row in rows:
            clip = run_clip(
                engine,
                row.file,
                row.transcript,
                streaming,
                vad=vad,
                modelled=args.modelled_cost,
                cost_scale=args.cost_scale,
                offline_cache=cache,
                references=references,
                spare_lane=args.spare_lane,
            )
            sets[name].append(clip)
            print(_clip_line(clip), flush=True)
    if args.offline_cache:
        args.offline_cache.write_text(json.dumps(cache, indent=1))
    if args.server:
        clips = [(r.file, load_speech(r.file)) for r in short]
        served = asyncio.run(stream_through_server(clips, args.server_args.split()))
        for clip, row in zip(sets["short"], short, strict=True):
            got = served[row.file]
            counts = count_errors(row.transcript, got.text)
            clip["errors_served"] = counts.errors
            clip["wer_served"] = round(counts.wer, 4)
            clip["text_served"] = got.text
            clip["final_latencies_served_s"] = [round(x, 3) for x in got.final_latencies_s]
            clip["end_of_speech_to_final_served_s"] = [
                round(x, 3) for x in got.end_of_speech_to_final_s
            ]
            clip["first_partial_served_s"] = (
                None if got.first_partial_s is None else round(got.first_partial_s, 3)
            )
            clip["flicker_changed_served"], clip["flicker_shown_served"] = got.flicker
            turn_ends = " ".join(f"{x:.2f}" for x in got.end_of_speech_to_final_s)
            print(
                f"served {counts.wer:7.3f} simulated {clip['wer_streamed']:7.3f}  {row.file}"
                f"  end of speech to final {turn_ends or '-'} s",
                flush=True,
            )
    difficulty = {name: pooled(rows) for name, rows in by_difficulty(sets).items()}
    sources = {name: pooled(rows) for name, rows in by_source(sets["short"]).items()}
    lead = headline(difficulty)
    data = {
        "headline": lead,
        "by_difficulty": difficulty,
        "by_source": sources,
        "summary": {name: pooled(rows) for name, rows in sets.items() if rows},
        "clips": sets,
        "offline_references": list(references),
        "streaming": dataclasses.asdict(streaming),
        "commit": dataclasses.asdict(commit),
        "vad": dataclasses.asdict(vad),
        "engine": dataclasses.asdict(engine.config),
        "loadavg_start": load_start,
        "loadavg_end": os.getloadavg(),
        "wall_s": round(time.perf_counter() - started, 1),
        "decode_cost": f"modelled x{args.cost_scale}" if args.modelled_cost else "measured",
        "spare_lane": args.spare_lane,
    }
    path = write_results(args.out, data)
    print()
    print(table("difficulty", difficulty))
    print()
    print(table("source (short clips)", sources))
    print(f"wrote {path}")
    print(json.dumps(lead | {"overrides": args.set}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
