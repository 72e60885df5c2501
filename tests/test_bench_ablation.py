"""bench.ablation's results: the committed file keeps each clip's errors and text, the events
file beside the cache keeps what ``--compare`` needs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import bench.ablation as ablation
import bench.engine


def _run(fingerprint: list[list[object]]) -> dict[str, object]:
    clip = {"errors": 1, "text": "a word", "fingerprint": fingerprint}
    return {"errors": 1, "clips": {"a.wav": clip}}


def test_the_results_keep_errors_and_text_and_the_events_go_beside_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(bench.engine, "RESULTS", tmp_path / "results")
    monkeypatch.setattr(ablation, "EVENTS", tmp_path / "events")
    data = {"runs": {"baseline": {"utterance/x": _run([[0.5, "final", "a word"]])}}}
    path = ablation._save("t", data)
    slim = json.loads(path.read_text())
    assert slim["runs"]["baseline"]["utterance/x"]["clips"]["a.wav"] == {
        "errors": 1,
        "text": "a word",
    }
    events = json.loads((tmp_path / "events" / "t-events.json").read_text())
    assert events == data  # the events untouched, and the data passed in too


class NoCache:
    misses = hits = 0


def test_the_noise_is_each_modes_spread_over_the_baselines_run_so_far() -> None:
    # Saved after every run: a noise baseline part-way through has only its first modes.
    runs = {
        "baseline": {"utterance/x": {"errors": 7}, "words/x": {"errors": 9}},
        "baseline x0.9": {"utterance/x": {"errors": 8}, "words/x": {"errors": 9}},
        "-a_rule": {"utterance/x": {"errors": 30}, "words/x": {"errors": 1}},
        "baseline x1.1": {"utterance/x": {"errors": 6}},
    }
    summary = ablation._summary(runs, NoCache(), (0.0, 0.0, 0.0), 0.0, None)  # type: ignore[arg-type]
    assert summary["noise_errors"] == {"utterance/x": [6, 7, 8], "words/x": [9]}


def test_a_comparison_with_a_file_without_events_is_refused(tmp_path: Path) -> None:
    earlier = tmp_path / "slim.json"
    earlier.write_text(
        json.dumps({"runs": {"baseline": {"utterance/x": {"clips": {"a.wav": {}}}}}})
    )
    runs = {"baseline": {"utterance/x": _run([])}}
    with pytest.raises(SystemExit, match="no clip events"):
        ablation._summary(runs, NoCache(), (0.0, 0.0, 0.0), 0.0, earlier)  # type: ignore[arg-type]
