#!/usr/bin/env bash
# The one install recipe: `make install` runs it (with the dev extras) and so does
# deploy/Dockerfile (without), so the image installs exactly as a developer's machine does.
#
#   deploy/install.sh [EXTRAS]     e.g. dev, cuda, "cuda,base"; none: the server and client
#
# Environment: PYTHON (default python3) makes the virtualenv VENV (default .venv), in the
# repository root.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
EXTRAS=${1:-}

# OpenBLAS from cmeel-openblas links libgfortran.so.5, which Debian ships as libgfortran5.
if ! ldconfig -p | grep -q 'libgfortran.so.5 '; then
  if [ "$(id -u)" = 0 ]; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libgfortran5 >/dev/null
  else
    echo "WARNING: libgfortran5 missing (sudo apt-get install libgfortran5); CPU decoding will be ~20x slower"
  fi
fi

test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q -e ".${EXTRAS:+[$EXTRAS]}"
# lightning-whisper-mlx goes in a second, --no-deps step: its metadata pins torch,
# tiktoken==0.3.3, numba, scipy and huggingface-hub, none of which we run (docs/internals.md).
"$VENV/bin/python" -m pip install -q --no-deps 'lightning-whisper-mlx==0.0.10'
# resemblyzer (the speaker encoder behind --speakers) likewise: its metadata requires torch,
# librosa and scipy; we read only its trained weights, pretrained.pt, without torch
# (server/speakers/weights.py), and run the network in numpy.
"$VENV/bin/python" -m pip install -q --no-deps 'resemblyzer==0.1.4'
# pipecat-ai likewise, for two data files only: the ONNX models of Smart Turn v3.2 and Silero
# VAD (server/turns/onnx.py finds them without importing pipecat). Its dependencies are a
# voice-agent framework's (aiohttp, loguru, numba, ...), none of which the server runs; the dev
# extra installs it with them for the Pipecat client tests, at this same version.
"$VENV/bin/python" -m pip install -q --no-deps 'pipecat-ai==1.14.0'
