# Two entry points that work on a fresh machine: `make serve` and `make test`.
# Both bootstrap .venv idempotently; torch is installed first with an exact pin because a plain
# `torch` requirement pulls a multi-GB CUDA build.
PY := .venv/bin/python
STAMP := .venv/.installed
# triton for the interpreter tests of our Triton kernels, kept off the venv's path: importable,
# it would switch transformers' Kimi Linear (the test oracle) to fla's Triton kernels
TRITON := .venv/triton/.installed
MODEL ?= bench

# GSM8K for the benchmarks, the training commands and the tests (kdaserve/datasets.py), from the
# shared data beside the checkout where it is there (else they use ~/.cache/kdaserve/gsm8k)
ifneq ($(wildcard ../shared/data/gsm8k/test.jsonl),)
export KDASERVE_GSM8K_DIR ?= $(abspath ../shared/data/gsm8k)
endif

.PHONY: serve test test-unit test-kernels test-model test-server verify lint venv clean

venv: $(STAMP) $(TRITON)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test,pd]"
	scripts/fetch_rdma_libs.sh .venv/lib/rdma-core
	$(PY) -m pip install -q --no-deps sglang==0.5.23 lm-eval==0.4.13 mlx-vlm==0.7.10
	touch $(STAMP)

# The OpenAI-compatible server on the built-in default model (a random-weight `bench`
# checkpoint generated once into ~/.cache/kdaserve), at http://127.0.0.1:30000.
serve: $(STAMP)
	.venv/bin/kdaserve serve --model $(MODEL)

$(TRITON): $(STAMP)
	$(PY) -m pip install -q --no-deps --target .venv/triton triton==3.9.0
	touch $(TRITON)

# the whole suite, then the kernel tests again at each lower instruction-set level the host has
# (scripts/run_tests.py); prints the time each run took
test: $(STAMP) $(TRITON)
	$(PY) scripts/run_tests.py

# one tier of the suite, at the host's level (pytest markers set from the test folders)
test-unit test-kernels test-model test-server: $(STAMP) $(TRITON)
	$(PY) -m pytest -m $(@:test-%=%)

# The Kimi Vendor Verifier (../shared/kimi/vendor-verifier) against a served random-weight K3
# test checkpoint; fails on any failure a trained model is not needed to avoid.
verify: $(STAMP)
	$(PY) scripts/run_verifier.py

lint: $(STAMP)
	.venv/bin/ruff check kdaserve tests examples

clean:
	rm -rf .venv build *.egg-info
