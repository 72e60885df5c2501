"""bench.gpu: its batches of real speech, the model list, the budget's shares, turbo-shaped
at cut depth and the capacity section's plumbing (with a recorded sweep, no server)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from bench.capacity import Contender, SweepConfig, why_not_run
from bench.gpu import (
    BATCH_WINDOW_S,
    BATCHES,
    TURBO,
    Deadline,
    ModelRun,
    batch_windows,
    bench_capacity,
    headline,
    load_engine,
    measure_model,
    parse_counts,
    parse_models,
    report,
)
from bench.latency_audio import Stream
from server.protocol.formats import SAMPLE_RATE_HZ


def test_the_largest_batch_is_distinct_five_second_windows_of_speech(
    speech_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WHISPERWIRE_SPEECH_DIR", str(speech_dir))
    windows = batch_windows(max(BATCHES))
    assert len(windows) == max(BATCHES)
    assert all(len(w) == BATCH_WINDOW_S * SAMPLE_RATE_HZ for w in windows)
    assert len({w.tobytes() for w in windows}) == len(windows)
    # Speech, not silence: each window carries the level of read speech somewhere in it.
    assert all(float(np.abs(w).max()) > 0.05 for w in windows)


# --- the model list, the budget, turbo-shaped and the capacity section ---------------------------


def test_model_lists_parse_and_a_wrong_name_lists_the_allowed() -> None:
    allowed = ("tiny.en", "base", TURBO)
    assert parse_models(" tiny.en,base , turbo-shaped", allowed) == ("tiny.en", "base", TURBO)
    assert parse_models("none", allowed) == parse_models("", allowed) == ()
    with pytest.raises(ValueError, match=r"choose from tiny\.en, base, turbo-shaped"):
        parse_models("tiny.en,large-v3", allowed)
    with pytest.raises(ValueError, match="twice"):
        parse_models("base,base", allowed)
    assert parse_counts("1,4,16") == (1, 4, 16)
    with pytest.raises(ValueError, match="increasing"):
        parse_counts("4,1")


def test_a_section_takes_its_share_of_what_is_left_and_a_late_one_none() -> None:
    whole = Deadline(time.perf_counter() + 100.0)
    first = whole.section(1.0, 3.0)  # one of four equal shares
    assert 24.0 < first.left_s() <= 25.0
    assert Deadline(time.perf_counter() - 1.0).section(1.0, 0.0).left_s() <= 0.0


@pytest.mark.heavy
def test_turbo_shaped_at_cut_depth_is_built_loaded_and_reported_without_accuracy(
    speech_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Large-v3-turbo's widths, mel bands and vocabulary at one layer each side, built and
    loaded; a spent budget skips every measurement and says so. (tests/test_model.py decodes
    and streams turbo-shaped checkpoints.) The measurements read their speech up front."""
    monkeypatch.setenv("WHISPERWIRE_SPEECH_DIR", str(speech_dir))
    run = ModelRun(repeats=1, batches=(1,), turbo_layers=(1, 1))
    out: dict[str, Any] = {}
    engine = load_engine(TURBO, "float32", run, out)
    dims = out["dims"]
    assert (dims["n_mels"], dims["n_vocab"], dims["n_audio_state"]) == (128, 51866, 1280)
    assert (dims["n_audio_layer"], dims["n_text_layer"]) == (1, 1)
    # Its own tokenizer: large-v3's, multilingual with 100 languages.
    assert engine.dims.num_languages == 100
    assert engine.decode_text(engine.encode_text(" hello world")) == " hello world"
    assert out["random_weights"] and "token cap" in out["note"]
    assert out["build_s"] > 0 and out["load_s"] > 0
    measure_model(TURBO, engine, run, Deadline(time.perf_counter()), out)
    assert set(out["windows"].values()) == {"skipped: out of time"}
    assert out["throughput"]["b1"] == "skipped: out of time"
    assert out["accuracy"] == "none: random weights"


def test_budgeted_sweeps_stop_after_an_unsustained_count_or_out_of_time() -> None:
    config = SweepConfig(counts=(1, 4, 16), peer=False, stop_after_unsustained=True)
    later = time.perf_counter() + 60.0
    assert why_not_run(config, [{"sustained": True}], 10.0, later) is None
    assert why_not_run(config, [{"sustained": False}], 10.0, later) == (
        "a smaller N was not sustained"
    )
    assert why_not_run(config, [], 90.0, later) == "out of time"
    unbudgeted = SweepConfig(counts=(1, 4), peer=False)
    assert why_not_run(unbudgeted, [{"sustained": False}], 90.0, None) is None


def test_our_contender_serves_the_model_it_is_given() -> None:
    cmd = Contender("base", None, model="base").process()._cmd
    assert cmd[cmd.index("--model") + 1] == "base"
    assert os.path.isfile(cmd[0])  # the installed script, or this Python with -m


class RecordedSweeps:
    """A double for ``bench.capacity.sweep_server``: records who was swept and until when,
    and answers as a sweep that sustained every count."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, float]] = []

    async def __call__(
        self, who: Contender, streams: list[Stream], config: SweepConfig, *, deadline: float
    ) -> dict[str, Any]:
        self.calls.append((who.name, who.model, deadline))
        runs = [_run_entry(n) for n in config.counts]
        return {"runs": runs, "skipped": {}, "startup_s": 1.0, "max_streams_p95_final_le_2s": 4}


def _run_entry(clients: int) -> dict[str, Any]:
    latency = {"p50_ms": 500.0, "p95_ms": 900.0}
    return {
        "clients": clients,
        "final_latency": latency,
        "ttft": latency,
        "end_of_speech_to_final": latency,
        "largest_lag_s": 0.4,
        "largest_text_lag_s": 0.6,
        "wer": 0.1,
        "cpu_percent_mean": 90.0,
        "rss_mb_max": 700.0,
        "refused": 0,
        "sustained": True,
    }


def _streams(config: SweepConfig, count: int) -> tuple[list[Stream], float | None]:
    audio = np.zeros(2 * SAMPLE_RATE_HZ, dtype=np.float32)
    return [Stream(f"s{k}", audio, "", "", ()) for k in range(count)], 12.5


def test_the_capacity_section_sweeps_each_model_on_the_same_streams_within_the_budget() -> None:
    sweeps = RecordedSweeps()
    started = time.perf_counter()
    out = bench_capacity(
        ("tiny.en", "base"), (1, 4), 5.0, Deadline(started + 100.0), build=_streams, sweep=sweeps
    )
    assert [(name, model) for name, model, _ in sweeps.calls] == [
        ("tiny.en", "tiny.en"),
        ("base", "base"),
    ]
    # The first sweep may take half of what is left; the second all the rest.
    assert sweeps.calls[0][2] <= started + 50.5 < sweeps.calls[1][2] <= started + 100.0
    assert out["config"]["stop_after_unsustained"] and not out["config"]["alone"]
    assert out["streams"] == {"s0": 2.0, "s1": 2.0, "s2": 2.0, "s3": 2.0}
    assert out["window_2s_ms_p50"] == 12.5 and out["skipped"] == {}
    results = {
        "device": {"default_device": "Device(cpu, 0)", "mlx": "0"},
        "dtype": "float32",
        "models": {TURBO: "skipped: out of time"},
        "capacity": out,
        "wall_s": 1.0,
    }
    assert "base: sustained 4" in report(results)
    assert headline(results)["base"] == {"max_streams_p95_final_le_2s": 4}
    # Out of time before it starts: no streams built, every model skipped.
    late = bench_capacity(("tiny.en",), (1,), 5.0, Deadline(started), build=_streams, sweep=sweeps)
    assert late["skipped"] == {"tiny.en": "out of time"} and len(sweeps.calls) == 2
