"""bench.served's pooling of the served clips (the run itself needs a server: bench only)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.accuracy import ServedClip
from bench.corpus import ManifestRow
from bench.served import clip_record, main, pool


def test_served_clips_are_pooled_over_words_finals_turn_ends_and_partials() -> None:
    rows = [
        ManifestRow("a.wav", 3.0, "en", "the cat sat down"),
        ManifestRow("b.wav", 2.0, "en", "a dog ran"),
    ]
    served = {
        # one substitution of four words; two finals; words shown 5, taken back 1
        "a.wav": ServedClip("the cat sat town", (0.5, 1.5), (1.5,), 0.4, (1, 5)),
        # one deletion of three words; no partial with a word came before the final
        "b.wav": ServedClip("a dog", (0.9,), (0.9,), None, (0, 0)),
    }
    got = pool([clip_record(row, served[row.file]) for row in rows])
    assert got["clips"] == 2
    assert (got["errors"], got["ref_words"], got["wer"]) == (2, 7, round(2 / 7, 4))
    assert got["final_latency_p95_s"] == 1.5
    assert (got["end_of_speech_to_final_p50_s"], got["end_of_speech_to_final_p95_s"]) == (0.9, 1.5)
    assert got["first_partial_p50_s"] == 0.4  # a clip without one is left out, not counted 0
    assert got["flicker"] == 0.2


def test_a_match_with_no_clip_is_refused(
    speech_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # speech_dir: the manifest it reads (the fixture skips without the shared speech)
    with pytest.raises(SystemExit):
        main(["--match", "no-such-folder"])
    assert "no English clip" in capsys.readouterr().err


def test_no_streams_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--streams", "0"])
    assert "--streams must be 1 or more" in capsys.readouterr().err
