# dflash_mp — `make help` lists the targets.
.DEFAULT_GOAL := help
SHELL := /bin/bash

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The torch wheel to install first. On a CPU-only machine with the 2.13.0 CPU build on disk this
# takes that file; on a GPU box it takes the CUDA build. Override: make setup TORCH_SPEC='torch==2.11.0'.
TORCH_SPEC ?= torch==2.13.0
RUN_DIR ?=
ARGS ?=
SHAPE ?= qwen3-8b
DEVICE ?= auto
# Empty: bench.py names it bench-<shape>[-<T>t<D>d[-tp<k>]].json (the --shape and layout it ran).
BENCH_OUT ?=
# 2: 1 target + 1 drafter rank (every section); 1: one GPU plays both roles (no pipeline/transport);
# N: the layout in BENCH_ARGS (--targets T --drafters D --target-parallel k, T + D = N).
BENCH_RANKS ?= 2
GPUS ?= 8
BENCH ?= bench/results/h200x2-qwen3-8b.json
TARGET ?=
# Benchmark files for `make eval-benchmarks`, [NAME=]FILE each (docs/evaluation-and-serving.md).
BENCHMARKS ?=

.PHONY: help setup test lint format train eval eval-benchmarks plot start status stop doctor bench plan clean

help: ## Show this help
	@grep -hE '^[a-zA-Z_-]+:.*?## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*?## "}; {printf "  make %-8s %s\n", $$1, $$2}'

setup: $(VENV)/.installed ## Build .venv from pyproject.toml (torch, hydra, transformers, dev tools, reference dflash)

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]"
	# The reference inference package, for the parity tests; its pins (torch, transformers) are not ours.
	$(PY) -m pip install -q --no-deps "dflash==0.1.0"
	# speculators (the field's reference trainer) for the D-PACE, Muon and DSpark parity tests; the modules they
	# import need nothing beyond torch and .[dev], so its own pins are not installed either.
	$(PY) -m pip install -q --no-deps "speculators==0.9.0"
	touch $@

test: setup ## Lint, then run the test suite (CPU; GPU tests are skipped without a GPU)
	$(VENV)/bin/ruff check .
	# Bytecode for the project's own modules once: the suite starts a few hundred interpreters, and
	# with PYTHONDONTWRITEBYTECODE set (as on some CI images) each would compile them again.
	$(PY) -m compileall -q dflash_mp bench tests > /dev/null
	$(PY) -m pytest

lint: setup ## ruff check + format check
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: setup ## Apply ruff's formatter and autofixes
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

train: setup ## Train the embedded default (2 target + 1 drafter ranks, CPU); RUN_DIR=path ARGS="key=value ..."
	$(PY) -m dflash_mp.train $(if $(RUN_DIR),run_dir=$(RUN_DIR)) $(ARGS)

eval: setup ## Acceptance length (tau) of a run's drafter: RUN_DIR=path ARGS="--temperature 1"
	$(PY) -m dflash_mp.eval $(RUN_DIR) $(ARGS)

eval-benchmarks: setup ## Acceptance table on benchmark files: RUN_DIR=path BENCHMARKS="gsm8k=FILE mtbench=FILE" ARGS="--limit 8"
	$(if $(strip $(BENCHMARKS)),,$(error BENCHMARKS is empty: give benchmark files, e.g. BENCHMARKS="gsm8k=data/gsm8k.jsonl"))
	$(PY) -m dflash_mp.eval $(RUN_DIR) --benchmarks $(BENCHMARKS) $(ARGS)

plot: setup ## Training curves of RUN_DIR into RUN_DIR/plots
	$(PY) -m dflash_mp.plot $(RUN_DIR)

start: setup ## Start a job detached (survives the shell); RUN_DIR=path ARGS="key=value ..."
	$(PY) -m dflash_mp.launch start $(if $(RUN_DIR),run_dir=$(RUN_DIR)) $(ARGS)

status: setup ## State of a job: RUN_DIR=path
	$(PY) -m dflash_mp.launch status $(RUN_DIR)

stop: setup ## Stop a job (checkpoint first, SIGKILL after a timeout): RUN_DIR=path
	$(PY) -m dflash_mp.launch stop $(RUN_DIR)

doctor: setup ## Preflight checks for a config; ARGS="key=value ..."
	$(PY) -m dflash_mp.launch doctor $(ARGS)

bench: setup ## GPU benchmark (SHAPE=qwen3-8b|qwen3-4b|llama3-70b|tiny DEVICE=auto|cpu BENCH_RANKS=2|1|N BENCH_OUT=path BENCH_ARGS="--targets T --drafters D --target-parallel k ..."; profile by phase: BENCH_ARGS="--sections setup,profile")
	NCCL_NVLS_ENABLE=0 $(PY) -m torch.distributed.run --standalone --nproc-per-node $(BENCH_RANKS) bench/bench.py \
		--shape $(SHAPE) --device $(DEVICE) $(if $(BENCH_OUT),--out $(BENCH_OUT)) $(BENCH_ARGS)

plan: setup ## Best layout for GPUS=8 from a benchmark JSON: BENCH=path [TARGET=hf-dir|preset] ARGS=--json
	$(PY) -m dflash_mp.plan --gpus $(GPUS) --bench $(BENCH) $(if $(TARGET),--target $(TARGET)) $(ARGS)

clean: ## Remove .venv and local run outputs
	rm -rf $(VENV) runs outputs multirun .pytest_cache .ruff_cache
