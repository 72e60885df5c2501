"""``whisperwire-server``'s flags: parsing and the errors a wrong value gets (exit 2).

Serving itself is tested end to end in tests/test_app.py (SIGTERM, a model that cannot load).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path

import pytest

from server.config import StreamingConfig, VadConfig
from server.core.policy import CommitConfig
from server.serve.cli import build_parser, main, pipeline_config, switched_off_rules


def test_decode_lanes_default_to_auto_and_take_a_count() -> None:
    parser = build_parser()
    assert parser.parse_args([]).decode_lanes is None  # auto: decided once MLX is loaded
    assert parser.parse_args(["--decode-lanes", "auto"]).decode_lanes is None
    assert parser.parse_args(["--decode-lanes", "3"]).decode_lanes == 3


@pytest.mark.parametrize(
    ("value", "why"),
    [("0", "must be >= 1"), ("two", "expected a number or auto"), ("65", "decode_lanes must be")],
)
def test_a_bad_lane_count_exits_2_and_says_why(
    value: str, why: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--decode-lanes", value])
    assert exited.value.code == 2
    assert why in capsys.readouterr().err


def test_auto_is_one_lane_per_core_on_the_cpu() -> None:
    from server.engine.engine import AUTO_LANES_MAX, default_decode_lanes

    assert default_decode_lanes() == min(len(os.sched_getaffinity(0)), AUTO_LANES_MAX)


@pytest.mark.parametrize(
    ("flag", "attr", "default", "good", "bad", "error"),
    [
        # the commit policy's right context is one flag away
        (
            "--min-right-context-s",
            "min_right_context_s",
            lambda: CommitConfig().min_right_context_s,
            "1.0",
            "-1",
            "min_right_context_s",
        ),
        # and, per utterance, the context past which two decodes need not agree
        (
            "--utterance-settled-context-s",
            "utterance_settled_context_s",
            lambda: StreamingConfig().utterance_settled_context_s,
            "3",
            "-1",
            "utterance_settled_context_s must be >= 0",
        ),
        # and the beam width of its closing decode
        (
            "--utterance-beam-size",
            "utterance_beam_size",
            lambda: StreamingConfig().utterance_beam_size,
            "1",
            "0",
            "utterance_beam_size must be in [1, 16]",
        ),
        # and the background searches of a long utterance (on a spare lane)
        (
            "--utterance-search-s",
            "utterance_search_s",
            lambda: StreamingConfig().utterance_search_s,
            "0",
            "-1",
            "utterance_search_s must be in [0, 30]",
        ),
    ],
)
def test_a_streaming_flag_defaults_to_its_config_and_is_checked(
    capsys: pytest.CaptureFixture[str],
    flag: str,
    attr: str,
    default: Callable[[], float],
    good: str,
    bad: str,
    error: str,
) -> None:
    parser = build_parser()
    assert getattr(parser.parse_args([]), attr) == default()
    assert getattr(parser.parse_args([flag, good]), attr) == float(good)
    with pytest.raises(SystemExit) as exited:
        main([flag, bad])
    assert exited.value.code == 2
    assert error in capsys.readouterr().err


def test_drain_s_defaults_to_the_config_and_is_checked(capsys: pytest.CaptureFixture[str]) -> None:
    from server.config import ServerConfig

    parser = build_parser()
    assert parser.parse_args([]).drain_s == ServerConfig().drain_s == 0.0
    assert parser.parse_args(["--drain-s", "300"]).drain_s == 300.0
    with pytest.raises(SystemExit) as exited:
        main(["--drain-s", "-1"])
    assert exited.value.code == 2
    assert "drain_s must be in [0, max_session_s=14400]" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exited:
        main(["--drain-s", "60", "--max-session-s", "30"])
    assert exited.value.code == 2
    assert "drain_s must be in [0, max_session_s=30]" in capsys.readouterr().err


def test_the_speculative_closing_decode_is_on_unless_turned_off() -> None:
    parser = build_parser()
    assert parser.parse_args([]).speculative_closing is True
    assert StreamingConfig().rules.on("speculative_closing")
    off = parser.parse_args(["--no-speculative-closing"])
    assert off.speculative_closing is False
    assert switched_off_rules(off) == ("speculative_closing",)


def test_the_cut_inside_a_long_utterances_finals_is_on_unless_turned_off() -> None:
    parser = build_parser()
    assert parser.parse_args([]).utterance_cut_inside_commit is True
    assert switched_off_rules(parser.parse_args([])) == ()
    off = parser.parse_args(["--no-utterance-cut-inside-commit", "--no-speculative-closing"])
    assert off.utterance_cut_inside_commit is False
    assert switched_off_rules(off) == ("speculative_closing", "cut_inside_commit")


def test_finals_default_per_utterance_for_v1_and_word_by_word_for_voice_agents() -> None:
    parser = build_parser()
    defaults = parser.parse_args([])
    assert (defaults.finals, defaults.agent_finals) == ("utterance", "words")
    assert (defaults.finals, defaults.agent_finals) == (
        StreamingConfig().finals,
        StreamingConfig().agent_finals,
    )
    chosen = parser.parse_args(["--finals", "words", "--agent-finals", "utterance"])
    assert (chosen.finals, chosen.agent_finals) == ("words", "utterance")
    with pytest.raises(SystemExit):
        parser.parse_args(["--agent-finals", "sentence"])
    with pytest.raises(ValueError, match="agent_finals must be one of"):
        StreamingConfig(agent_finals="sentence")


def test_admission_has_a_flag_of_its_own_and_is_checked(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from server.config import ADMISSION_UTILIZATION, COMFORT_UTILIZATION, PipelineConfig

    parser = build_parser()
    args = parser.parse_args([])
    assert args.admission_utilization == PipelineConfig().admission_utilization
    assert args.admission_utilization == ADMISSION_UTILIZATION
    assert args.capacity_utilization == PipelineConfig().capacity_utilization
    assert parser.parse_args(["--admission-utilization", "0.5"]).admission_utilization == 0.5
    # Past the hop: the admitted streams' round may take longer than it.
    assert parser.parse_args(["--admission-utilization", "1.5"]).admission_utilization == 1.5
    for bad in ("0", "2.5"):
        with pytest.raises(SystemExit) as exited:
            main(["--admission-utilization", bad])
        assert exited.value.code == 2
        assert "admission_utilization must be in (0, 2]" in capsys.readouterr().err
    assert pipeline_config(args).comfort_utilization == COMFORT_UTILIZATION
    lower = pipeline_config(parser.parse_args(["--admission-utilization", "0.5"]))
    assert (lower.admission_utilization, lower.comfort_utilization) == (0.5, 0.5)
    both = ["--comfort-utilization", "0.3", "--admission-utilization", "0.5"]
    assert pipeline_config(parser.parse_args(both)).comfort_utilization == 0.3
    bad_comfort = (
        ["--comfort-utilization", "1.2"],  # past the hop
        ["--comfort-utilization", "0.6", "--admission-utilization", "0.5"],
    )
    for argv in bad_comfort:
        with pytest.raises(SystemExit) as exited:
            main(argv)
        assert exited.value.code == 2
        assert "comfort_utilization must be in (0, 1] and at most admission" in (
            capsys.readouterr().err
        )


def test_the_vad_is_webrtcvad_unless_silero_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser()
    assert parser.parse_args([]).vad == VadConfig().detector == "webrtcvad"
    assert parser.parse_args(["--vad", "silero"]).vad == "silero"
    with pytest.raises(SystemExit) as exited:
        parser.parse_args(["--vad", "energy"])
    assert exited.value.code == 2
    assert "invalid choice: 'energy'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="detector must be one of webrtcvad, silero"):
        VadConfig(detector="energy")


def test_every_flag_and_its_group_are_in_the_configuration_reference() -> None:
    """docs/configuration.md is the reference the README sends users to: a flag added to the
    parser without a row there would be a flag no user can find but by reading --help."""
    reference = (Path(__file__).parents[1] / "docs" / "configuration.md").read_text()
    rows = {line.split("|")[1] for line in reference.splitlines() if line.startswith("| `--")}
    documented = {flag for row in rows for flag in re.findall(r"`(--[a-z0-9-]+)", row)}
    parser = build_parser()
    flags = {
        flag
        for action in parser._actions
        for flag in action.option_strings
        if flag.startswith("--") and flag != "--help"
    }
    assert flags - documented == set()
    assert documented - flags == set()
    for group in parser._action_groups:
        if group._group_actions and group.title not in ("options", "positional arguments"):
            heading = group.title.split(" (")[0]
            assert f"\n## {heading}" in reference
