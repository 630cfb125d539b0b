# `make demo` and `make test` install what is missing into .venv, then run.
VENV ?= .venv
PY := $(VENV)/bin/python
# CPU build of torch for machines without a GPU; a GPU node sets TORCH_SPEC= to keep its own torch.
TORCH_SPEC ?= torch==2.13.0

.PHONY: install demo headless-demo test test-slow clean

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

demo: install
	$(VENV)/bin/dflash-tui demo

headless-demo: install
	$(VENV)/bin/dflash-tui demo --headless

# The long trainings (marked slow; each has a fast path in `make test`) run on their own.
test: install
	$(PY) -m pytest -q -m "not slow"

test-slow: install
	$(PY) -m pytest -q -m slow

clean:
	rm -rf $(VENV) runs .pytest_cache
