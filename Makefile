# Two commands from a fresh clone: `make demo` and `make test`.
# Both create/reuse .venv and install torch==2.13.0 *before* anything else: an unpinned torch
# on a machine without one would pull gigabytes of CUDA packages.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.pipeplan-installed

.PHONY: demo test lint venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]"
	# the vision zoo: both depend on torch, so never let pip resolve it (pyproject's "vision")
	$(PY) -m pip install -q --no-deps "torchvision==0.28.*" "timm>=1.0"
	touch $(STAMP)

demo: $(STAMP)
	mkdir -p out
	$(VENV)/bin/pipeplan profile pipeplan.models.gpt:gpt --batch-size 32 -o out/gpt.profile.json
	$(VENV)/bin/pipeplan plan out/gpt.profile.json --stages 4 --memory 256MiB -o out/gpt.plan.json
	$(VENV)/bin/pipeplan show out/gpt.plan.json

test: $(STAMP) lint
	$(PY) -m pytest -q -n 2 --dist loadgroup

lint: $(STAMP)
	$(VENV)/bin/ruff check pipeplan benchmarks tests examples
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy pipeplan benchmarks examples

clean:
	rm -rf $(VENV) out
