# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
# The virtual environment is built on first use. On a machine without an NVIDIA GPU we install the
# CPU build of torch first, so pip never pulls a multi-GB CUDA build; a GPU machine keeps the torch
# it has (set LIONCUB_SYSTEM_TORCH=1 to reuse the system's site-packages).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
CPU_TORCH ?= torch==2.13.0
STAMP := $(VENV)/.lioncub-installed
NB_STAMP := $(VENV)/.lioncub-notebooks

.PHONY: demo test lint notebooks bench clean-venv lab-clean validation gpu-check docs

$(STAMP): pyproject.toml
	@test -x $(PY) || { \
	  if [ "$${LIONCUB_SYSTEM_TORCH:-0}" = 1 ]; then $(PYTHON) -m venv --system-site-packages $(VENV); \
	  else $(PYTHON) -m venv $(VENV); fi; }
	@if ! $(PY) -c "import torch" 2>/dev/null; then \
	  if command -v nvidia-smi >/dev/null 2>&1; then $(PY) -m pip install -q torch; \
	  else $(PY) -m pip install -q $(CPU_TORCH); fi; fi
	$(PY) -m pip install -q -e '.[dev,integrations]'
	@touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/lioncub demo

test: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m pytest -q -x --timeout=600

lint: $(STAMP)
	$(PY) -m ruff check .

# The docs site (mkdocs.yml, docs/) into site/, strictly: a broken link, a missing reference or any warning fails
# (tests/test_docs.py builds it the same way inside `make test`).
docs: $(STAMP)
	$(VENV)/bin/mkdocs build --strict

# JupyterLab comes from the `notebooks` extra, installed once (editable, like the rest: a plain '.[notebooks]'
# would replace the editable lioncub with a copy). The notebooks are stored without outputs: notebooks/README.md.
$(NB_STAMP): $(STAMP)
	$(PY) -m pip install -q -e '.[dev,integrations,notebooks]'
	@touch $(NB_STAMP)

notebooks: $(NB_STAMP)
	$(VENV)/bin/jupyter lab notebooks/ $$([ "$$(id -u)" = 0 ] && echo --allow-root)

bench: $(STAMP)
	$(VENV)/bin/lioncub bench step
	$(VENV)/bin/lioncub bench kernels
	$(VENV)/bin/lioncub bench simulator

# Every CUDA check and benchmark in one command, < 6 minutes (scripts/README.md). On a GPU machine it uses that
# machine's Python and installs lioncub into it offline (wheels from .whl/: scripts/fetch_gpu_wheels.sh);
# without a GPU it builds .venv and rehearses on CPU tensors (Triton interpreter, tiny sizes).
OUT ?= out/gpu-check
gpu-check:
	@command -v nvidia-smi >/dev/null 2>&1 || $(MAKE) --no-print-directory $(STAMP)
	bash scripts/gpu_check.sh $(OUT)

validation: $(STAMP)
	$(VENV)/bin/python -m research lab validate --output research/notebook/VALIDATION.md

lab-clean: $(STAMP)
	$(VENV)/bin/lioncub lab clean

clean-venv:
	rm -rf $(VENV)
