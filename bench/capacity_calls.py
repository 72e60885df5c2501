"""Record the engine calls a real server's capacity model is fed (tests/capacity_calls.json).

    python -m bench.capacity_calls [--clients 8] [--seconds 40]

Starts the default server (tiny.en, its default lanes) in a child process that writes every
call its ``CapacityModel`` is given to a file as it comes: the startup calibration's seeds and
batch, then the clients' calls with what each window's stream held beyond it. Then, one phase
after the other: eight clients send 11 s of speech each as fast as they can, all at once (a
burst at pace 0, the history of issue #32), and ``--clients`` clients stream
``make bench-capacity``'s recordings at 1x. ``tests/test_capacity.py`` replays the calls into
the model: what the estimate says after each phase, against what ``make bench-capacity``
sustains on the same machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.capacity import SweepConfig, build_streams
from bench.replay import Replay, WhisperwireAdapter, replay
from bench.server_process import ServerProcess, free_port, http_ok
from server.protocol.formats import SAMPLE_RATE_HZ

logger = logging.getLogger("bench.capacity_calls")

OUTPUT = Path(__file__).resolve().parent.parent / "tests" / "capacity_calls.json"
# Past the comfortable estimate, so that the burst's closing decodes are greedy and timed
# into the model (a beam search's time is not fitted): four clients on a 2-core CPU were
# within it, and the model saw none of their calls.
BURST_CLIENTS = 8
BURST_S = 11.0  # each burst client's speech, sent at pace 0


def serve(calls_path: Path, server_argv: Sequence[str]) -> int:
    """Run the server with its capacity model's inputs written to ``calls_path`` (JSON
    lines, each with the wall time it came at)."""
    from server.decode.capacity import CapacityModel
    from server.serve import cli

    out = calls_path.open("a", encoding="utf-8")

    def write(kind: str, **fields: Any) -> None:
        out.write(json.dumps({"t": time.time(), "kind": kind, **fields}) + "\n")
        out.flush()

    seed, seed_batch, observe = CapacityModel.seed, CapacityModel.seed_batch, CapacityModel.observe

    def recorded_seed(self: CapacityModel, window_audio_s: Sequence[float], cost_s: float) -> None:
        write("seed", windows=list(window_audio_s), cost_s=cost_s)
        seed(self, window_audio_s, cost_s)

    def recorded_seed_batch(
        self: CapacityModel, alone_s: Sequence[float], together_s: float
    ) -> None:
        write("seed_batch", alone_s=list(alone_s), together_s=together_s)
        seed_batch(self, alone_s, together_s)

    def recorded_observe(
        self: CapacityModel,
        window_audio_s: Sequence[float],
        cost_s: float,
        catch_up_s: Sequence[float] = (),
    ) -> bool:
        write("observe", windows=list(window_audio_s), cost_s=cost_s, catch_up_s=list(catch_up_s))
        return observe(self, window_audio_s, cost_s, catch_up_s)

    CapacityModel.seed = recorded_seed  # type: ignore[method-assign]
    CapacityModel.seed_batch = recorded_seed_batch  # type: ignore[method-assign]
    CapacityModel.observe = recorded_observe  # type: ignore[method-assign]
    try:
        return cli.main(list(server_argv))
    finally:
        out.close()


async def record(clients: int, seconds: float, calls_path: Path) -> dict[str, float]:
    """Start the recording server, run the phases; the wall time each phase ended at."""
    streams, _ = build_streams(SweepConfig(counts=(clients,), seconds=seconds), clients)
    port = free_port()
    cmd = [
        sys.executable,
        *("-m", "bench.capacity_calls", "--serve", str(calls_path), "--"),
        *("--port", str(port), "--model", "tiny.en", "--no-capacity-limit"),
    ]
    url = f"ws://127.0.0.1:{port}"
    log = Path(tempfile.gettempdir()) / "capacity_calls_server.log"
    ends: dict[str, float] = {}
    async with ServerProcess(
        "ours", cmd, ready=lambda: http_ok(f"http://127.0.0.1:{port}/readyz"), log_path=log
    ):
        ends["seeds"] = time.time()
        burst = [s.audio[: round(BURST_S * SAMPLE_RATE_HZ)] for s in streams[:BURST_CLIENTS]]
        await _all(url, burst, pace=0.0)
        ends["burst"] = time.time()
        await asyncio.sleep(2.0)  # the burst's last decodes
        await _all(url, [s.audio for s in streams], pace=1.0)
        ends["realtime"] = time.time()
    return ends


async def _all(url: str, audio: Sequence[Any], pace: float) -> None:
    done = await asyncio.gather(
        *(replay(WhisperwireAdapter(url), a, pace=pace) for a in audio), return_exceptions=True
    )
    failed = [d for d in done if not isinstance(d, Replay)]
    if failed:
        raise RuntimeError(f"{len(failed)} client(s) failed: {failed[0]!r}")


def phases(calls_path: Path, ends: dict[str, float]) -> dict[str, list[Any]]:
    """The recorded calls, by the phase they came in."""
    out: dict[str, list[Any]] = {"seeds": [], "seed_batch": [], "burst": [], "realtime": []}
    for line in calls_path.read_text(encoding="utf-8").splitlines():
        call = json.loads(line)
        if call["kind"] == "seed":
            out["seeds"].append([call["windows"], round(call["cost_s"], 4)])
        elif call["kind"] == "seed_batch":
            out["seed_batch"] = [[round(a, 4) for a in call["alone_s"]], call["together_s"]]
        else:
            phase = "burst" if call["t"] <= ends["burst"] + 2.0 else "realtime"
            windows = [round(w, 2) for w in call["windows"]]
            behind = [round(c, 2) for c in call["catch_up_s"]]
            out[phase].append([windows, round(call["cost_s"], 4), behind])
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--serve"]:
        return serve(Path(argv[1]), argv[3:] if argv[2:3] == ["--"] else argv[2:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--clients", type=int, default=8, help="real-time clients")
    parser.add_argument("--seconds", type=float, default=40.0, help="speech per client")
    parser.add_argument("--output", type=Path, default=OUTPUT)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    with tempfile.TemporaryDirectory() as scratch:
        calls_path = Path(scratch) / "calls.jsonl"
        ends = asyncio.run(record(args.clients, args.seconds, calls_path))
        calls = phases(calls_path, ends)
    recorded: dict[str, object] = {
        "about": (
            "Engine calls timed by a real server (tiny.en, its default lanes; "
            f"python -m bench.capacity_calls on {os.cpu_count()} CPUs, "
            f"{time.strftime('%Y-%m-%d')}): the startup calibration's seeds and batch, "
            f"{BURST_CLIENTS} clients sending {BURST_S:g} s of speech each at pace 0 at once, "
            f"then {args.clients} clients streaming bench-capacity's recordings "
            f"({args.seconds:g} s each) at 1x. Each call: its windows' audio seconds, wall "
            "seconds, what each window's stream held beyond it, sent ahead of real time."
        ),
        **calls,
    }
    args.output.write_text(json.dumps(recorded, indent=None) + "\n", encoding="utf-8")
    counts = {k: len(v) for k, v in recorded.items() if isinstance(v, list)}
    print(f"wrote {args.output}: {counts}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
