"""Reading resemblyzer's checkpoint without PyTorch, and the venv staying torch-free."""

from __future__ import annotations

import importlib.util
import pickle
import subprocess
import sys

import numpy as np
import pytest

from server.speakers.weights import (
    WeightsError,
    load_weights,
    package_weights_path,
    read_legacy_checkpoint,
)


def test_torch_cannot_be_imported_in_the_venv() -> None:
    """The speaker encoder must not pull PyTorch in (issue #33): resemblyzer is installed
    with --no-deps, and nothing else may bring torch along."""
    assert importlib.util.find_spec("torch") is None
    process = subprocess.run(
        [sys.executable, "-c", "import torch"], capture_output=True, text=True, timeout=60
    )
    assert process.returncode != 0
    assert "No module named 'torch'" in process.stderr


def test_the_wheel_is_located_without_importing_it() -> None:
    path = package_weights_path()
    assert path.name == "pretrained.pt" and path.stat().st_size > 10_000_000
    assert "resemblyzer" not in sys.modules


def test_the_checkpoint_holds_the_ge2e_network() -> None:
    weights = load_weights()
    assert len(weights.lstm) == 3
    assert [w_ih.shape for w_ih, _, _ in weights.lstm] == [(1024, 40), (1024, 256), (1024, 256)]
    assert all(w_hh.shape == (1024, 256) and b.shape == (1024,) for _, w_hh, b in weights.lstm)
    assert weights.linear_weight.shape == (256, 256) and weights.linear_bias.shape == (256,)
    assert all(np.isfinite(w).all() for layer in weights.lstm for w in layer)
    # Values read through torch.load once (resemblyzer 0.1.4, lstm.weight_ih_l0[0, :2]).
    np.testing.assert_allclose(weights.lstm[0][0][0, :2], [0.0428658, -0.3056942], atol=1e-7)


def test_the_checkpoint_keeps_its_training_step() -> None:
    checkpoint = read_legacy_checkpoint(package_weights_path().read_bytes())
    assert isinstance(checkpoint["step"], int) and checkpoint["step"] > 0


def test_a_pickle_naming_other_code_is_refused() -> None:
    header = b"".join(pickle.dumps(x, protocol=2) for x in (0x1950A86A20F9469CFC6C, 1001))
    info = pickle.dumps({"little_endian": True}, protocol=2)
    evil = pickle.dumps(subprocess.Popen, protocol=2)  # a global outside the allowed few
    with pytest.raises(WeightsError, match="refuses"):
        read_legacy_checkpoint(header + info + evil)


def test_a_zip_checkpoint_is_not_mistaken_for_a_legacy_one() -> None:
    with pytest.raises(WeightsError):
        read_legacy_checkpoint(b"PK\x03\x04" + bytes(64))
