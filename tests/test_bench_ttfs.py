"""The TTFS benchmark (bench/ttfs.py): its clocks, percentiles, pooling and arguments on
hand-made figures; Silero's offline speech end on real speech; the plot from results files;
and one clip through Pipecat's Deepgram service against a real server."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from bench.corpus import ManifestRow, load_clip
from bench.ttfs import (
    PUBLISHED,
    ClipClock,
    ClipState,
    clip_row,
    last_word_end_s,
    parse_args,
    percentile,
    plot_points,
    plotted,
    pooled,
    run_clip,
    silero_speech_end_s,
    speech_end_s,
    write_plot,
)
from server.protocol.audio import pcm_s16le_bytes
from server.protocol.formats import SAMPLE_RATE_HZ
from server.turns.silero_vad import SileroModel

# --- the clocks ----------------------------------------------------------------------------------


def test_ttfs_runs_from_the_last_words_end_to_the_last_final() -> None:
    clock = ClipClock(
        audio_start_wall_s=1000.0,
        last_word_end_s=4.2,
        finals_wall_s=(1003.0, 1004.9, 1004.5),  # the last to arrive counts, not the last listed
        vad_stops_wall_s=(1002.0, 1004.45),
    )
    assert clock.last_word_wall_s == pytest.approx(1004.2)
    assert clock.ttfs_s == pytest.approx(0.7)
    # stt-benchmark's start: the VAD's last stop minus its 0.2 s of quiet.
    assert clock.vad_speech_end_wall_s == pytest.approx(1004.25)
    assert clock.vad_end_after_last_word_s == pytest.approx(0.05)


def test_a_clip_without_a_final_or_a_word_end_has_no_ttfs() -> None:
    no_final = ClipClock(1000.0, 4.2, finals_wall_s=(), vad_stops_wall_s=())
    assert no_final.ttfs_s is None and no_final.vad_end_after_last_word_s is None
    no_word = ClipClock(1000.0, None, finals_wall_s=(1005.0,), vad_stops_wall_s=(1004.5,))
    assert no_word.ttfs_s is None and no_word.vad_end_after_last_word_s is None
    # The last final came before the last word ended: the clip's last words got no final.
    early = ClipClock(1000.0, 4.2, finals_wall_s=(1003.5,), vad_stops_wall_s=(1004.45,))
    assert early.ttfs_s is None


def test_deepgrams_speech_is_closed_only_by_an_answer_to_a_stop_after_the_last_word() -> None:
    state = ClipState(last_word_end_s=4.2, audio_start_wall_s=1000.0)
    state.vad_stops_wall_s.append(1002.0)  # a pause inside the clip
    assert not state.closes_speech(1004.0)  # before the last word ended
    assert not state.closes_speech(1004.6)  # a late answer to the pause's Finalize
    state.vad_stops_wall_s.append(1004.45)
    assert state.closes_speech(1004.6)
    flux = ClipState(last_word_end_s=4.2, audio_start_wall_s=1000.0, closing_needs_vad_stop=False)
    assert not flux.closes_speech(1004.0) and flux.closes_speech(1004.3)  # EndOfTurn, no stop


def test_percentiles_interpolate_between_ranks() -> None:
    values = [0.4, 0.1, 0.3, 0.2]
    assert percentile(values, 0.5) == pytest.approx(0.25)
    assert percentile(values, 0.95) == pytest.approx(0.385)  # 0.3 + 0.85 * (0.4 - 0.3)
    assert percentile(values, 1.0) == pytest.approx(0.4)
    assert percentile([0.7], 0.99) == pytest.approx(0.7)
    assert percentile([], 0.5) is None
    with pytest.raises(ValueError, match=r"within 0\.\.1"):
        percentile(values, 95)


def row(errors: int, words: int, ttfs: float | None, **extra: Any) -> dict[str, Any]:
    return {
        "errors": errors,
        "ref_words": words,
        "offline_errors": extra.pop("offline_errors", 0),
        "finals": 0 if ttfs is None else 1,
        "ttfs_s": ttfs,
        "stt_benchmark_ttfs_s": ttfs,
        "pacing_late_max_s": extra.pop("late", 0.0),
        **extra,
    }


def test_wer_is_pooled_over_words_and_averaged_over_clips() -> None:
    clips = [row(1, 10, 0.3, offline_errors=1), row(9, 30, 0.5, late=0.04), row(0, 20, None)]
    figures = pooled(clips)
    assert figures["wer_pooled"] == pytest.approx(10 / 60, abs=1e-4)  # rounded to 4 places
    assert figures["wer_mean"] == pytest.approx((0.1 + 0.3 + 0.0) / 3, abs=1e-4)
    assert figures["offline_wer_pooled"] == pytest.approx(1 / 60, abs=1e-4)
    # The clip with no final counts in WER (all its words deleted) but has no TTFS.
    assert figures["clips_without_final"] == 1
    assert figures["clips_without_final_after_last_word"] == 0
    assert figures["ttfs"]["n"] == 2
    assert figures["ttfs"]["p50_s"] == pytest.approx(0.4)
    assert figures["ttfs"]["mean_s"] == pytest.approx(0.4)
    assert figures["pacing_late_max_s"] == pytest.approx(0.04)


# --- the word's end ------------------------------------------------------------------------------


def test_the_speech_end_is_the_end_of_the_last_frame_at_the_threshold() -> None:
    probabilities = [0.0, 0.9, 0.6, 0.2, 0.5, 0.49, 0.1]
    assert speech_end_s(probabilities, 0.032, 0.5) == pytest.approx(5 * 0.032)
    assert speech_end_s([0.1, 0.2], 0.032, 0.5) is None


def test_the_decoders_last_word_end_is_read_from_deepgrams_answer() -> None:
    words = [{"word": "a", "start": 0.1, "end": 0.4}, {"word": "b", "start": 0.5, "end": 1.25}]
    answer = {"results": {"channels": [{"alternatives": [{"words": words}]}]}}
    assert last_word_end_s(answer) == pytest.approx(1.25)
    answer["results"]["channels"][0]["alternatives"][0]["words"] = []
    assert last_word_end_s(answer) is None


def test_silero_hears_a_readers_last_word_end_before_the_clips_end(speech_dir: Path) -> None:
    """The test-other clip whose loudness falls to the room's at 4.19 s of 4.49 s: Silero's
    speech end lies there, where tiny.en's word times put the last word's end at 4.48 s."""
    model = SileroModel()
    clip = load_clip(speech_dir / "librispeech_test-other/2609-156975-0000.wav")
    end = silero_speech_end_s(model, clip)
    assert end is not None and 4.1 <= end <= 4.3, end
    assert silero_speech_end_s(model, np.zeros(SAMPLE_RATE_HZ, np.float32)) is None


# --- arguments ------------------------------------------------------------------------------------


def test_arguments_name_the_results_by_endpoint_and_streams() -> None:
    assert parse_args([]).out == "ttfs-deepgram"
    args = parse_args(["--endpoint", "flux", "--streams", "4", "--limit", "3"])
    assert (args.endpoint, args.streams, args.limit, args.out) == (
        "flux",
        4,
        3,
        "ttfs-flux-4streams",
    )
    assert parse_args(["--out", "smoke"]).out == "smoke"
    assert set(plotted()) == {
        "ttfs-deepgram",
        "ttfs-deepgram-4streams",
        "ttfs-flux",
        "ttfs-flux-4streams",
    }


@pytest.mark.parametrize("argv", [["--streams", "0"], ["--limit", "-1"], ["--endpoint", "openai"]])
def test_arguments_out_of_range_are_refused(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(argv)


# --- the plot -------------------------------------------------------------------------------------


def results(endpoint: str, streams: int, p50: float | None) -> dict[str, Any]:
    spread = {"p50_s": p50, "p95_s": None if p50 is None else p50 + 0.2}
    return {
        "headline": {
            "endpoint": endpoint,
            "streams": streams,
            "ttfs": spread,
            "stt_benchmark_ttfs": spread,
            "wer_pooled": 0.15,
            "clips": 40,
        }
    }


def test_plot_points_are_our_runs_in_milliseconds_and_percent() -> None:
    points = plot_points([results("flux", 4, 0.5), results("deepgram", 1, None)])
    assert points == [
        {
            "label": "flux, 4 streams, 40 clips",
            "p50_ms": pytest.approx(500.0),
            "p95_ms": pytest.approx(700.0),
            "vad_p50_ms": pytest.approx(500.0),
            "wer_percent": pytest.approx(15.0),
        }
    ]


def test_the_plot_is_drawn_from_the_default_named_runs_only(tmp_path: Path) -> None:
    assert write_plot(tmp_path) is None
    (tmp_path / "smoke.json").write_text(json.dumps(results("deepgram", 1, 0.3)))
    assert write_plot(tmp_path) is None  # not one of the plotted names
    (tmp_path / "ttfs-deepgram.json").write_text(json.dumps(results("deepgram", 1, 0.3)))
    path = write_plot(tmp_path)
    assert path == tmp_path / "ttfs.png" and path.stat().st_size > 10_000
    assert len(PUBLISHED) == 5
    (tmp_path / "smoke-ttfs-flux.json").write_text(json.dumps(results("flux", 1, 0.9)))
    assert write_plot(tmp_path, "smoke-ttfs") == tmp_path / "smoke-ttfs.png"


# --- one clip against a real server --------------------------------------------------------------


@pytest.mark.asyncio(loop_scope="session")  # the server_url fixture's loop
async def test_one_clip_through_pipecats_deepgram_service_is_timed_and_scored(
    server_url: str, speech_dir: Path, manifest: list[ManifestRow]
) -> None:
    """Pipecat's pipeline (paced input, Silero VAD at 0.2 s, ``DeepgramSTTService`` on our
    ``/v1/listen``): the VAD stops after the last word, the service's ``Finalize`` is
    answered with a final, and both clocks have a reading."""
    file = "ljspeech/LJ001-0004.wav"
    clip = load_clip(speech_dir / file)
    end = silero_speech_end_s(SileroModel(), clip)
    state = await run_clip("deepgram", server_url, pcm_s16le_bytes(clip), end)
    reference = next(r.transcript for r in manifest if r.file == file)
    offline = {"last_word_end_s": end, "decoder_last_word_end_s": None, "errors": 0}
    offline["transcript"] = ""
    figures = clip_row(file, reference, offline, state)
    assert figures["error"] is None
    assert state.closed.is_set() and figures["finalized"] >= 1
    assert figures["vad_stops"] >= 1 and figures["interims"] >= 1
    assert figures["ttfs_s"] is not None and figures["stt_benchmark_ttfs_s"] is not None
    assert figures["client_lag_at_last_word_s"] is not None  # the word's frame went out
    assert figures["errors"] / figures["ref_words"] <= 0.35, figures["transcript"]
