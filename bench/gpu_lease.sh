#!/usr/bin/env bash
# bench-gpu on a lent CUDA machine that reaches no package index, with a 64 MiB limit on what
# one call may carry, the working tree included (this workplace's device tool). The payload
# (bench/gpu_payload.py: MLX's CUDA library, tiny.en's and base's weights, the clips, the
# wheels the machine lacks) goes in parts, one call each; bench/README.md, "make bench-gpu",
# gives the calls, and `stage` prints them for the parts it wrote.
#
#   bash bench/gpu_lease.sh stage     # here, in the checkout that travels: .gpu/part.aa, ab, ...
#   bash bench/gpu_lease.sh take      # there, each call but the last: keep its part in /tmp/stage
#   bash bench/gpu_lease.sh run       # there, the last call: unpack, run bench-gpu, fill $OUT
#
# The calls must follow each other within the machine's idle release (30 s): a machine given
# back takes the parts staged on it along, and `take` then says to start again.
set -euo pipefail
cd "$(dirname "$0")/.."

stage() {
    .venv/bin/python -m bench.gpu_payload stage
    ls -la .gpu
    calls
}

# The device tool's calls for the parts staged: each carries its part and the checksums.
calls() {
    local parts last
    parts=$(awk '{print $2}' .gpu/SHA256SUMS)
    last=$(tail -1 <<<"$parts")
    echo
    echo "Calls, one after the other, each within 30 s of the last one's answer:"
    for part in $parts; do
        if [ "$part" != "$last" ]; then
            echo "  run(command='bash bench/gpu_lease.sh take', timeout_s=120, carry=['.gpu/$part', '.gpu/SHA256SUMS'])"
        else
            echo "  run(command='bash bench/gpu_lease.sh run', timeout_s=600, carry=['.gpu/$part', '.gpu/SHA256SUMS'])"
        fi
    done
    echo "then give_back()."
}

take() {
    python3 -m bench.gpu_payload take
}

run() {
    python3 -m bench.gpu_payload unpack --site /tmp/site --speech-out /tmp/speech
    # libmlx.so finds the CUDA libraries at $ORIGIN/../../nvidia/{cu13,cublas,cudnn,...}/lib,
    # and NVRTC the runtime's headers beside them: the machine's own, wherever its pip put
    # them (CUDA 13's wheels share nvidia/cu13; cuDNN and NCCL keep folders of their own).
    local nv rc
    nv=$(python3 -c 'import nvidia, os; print(next(p for p in nvidia.__path__
        if os.path.isdir(p + "/cu13") or os.path.isdir(p + "/cublas")))')
    ln -sfn "$nv" /tmp/site/nvidia
    export LD_LIBRARY_PATH="$(ls -d "$nv"/*/lib | paste -sd:)${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    export PYTHONPATH="/tmp/site:$PWD" WHISPERWIRE_SPEECH_DIR=/tmp/speech
    export WHISPERWIRE_CACHE=/tmp/wwcache PYTHONUNBUFFERED=1
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    python3 -c 'import mlx.core as mx; print("mlx", mx.__version__, mx.default_device())'
    # The budget leaves the command's 600 s room for the unpacking (~30 s) and for a section
    # that overruns its share; the timeout stops a hung run with its log still copied back.
    set +e
    timeout "${BENCH_TIMEOUT_S:-540}" python3 -m bench.gpu --budget-s "${BENCH_BUDGET_S:-450}" \
        ${BENCH_GPU_ARGS:-} 2>&1 | tee "$OUT/gpu.log"
    rc=${PIPESTATUS[0]}
    set -e
    cp bench/results/gpu.json "$OUT/" 2>/dev/null || echo "no bench/results/gpu.json"
    cp bench/results/logs/capacity_*.log "$OUT/" 2>/dev/null || true
    return "$rc"
}

case "${1:-}" in
    stage) stage ;;
    calls) calls ;;
    take) take ;;
    run) run ;;
    *) echo "usage: $0 stage|calls|take|run" >&2; exit 2 ;;
esac
