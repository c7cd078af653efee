# Two commands from a fresh clone: `make demo` and `make test`.
# Both create/reuse .venv and install torch==2.13.0 *before* anything else: an unpinned torch
# on a machine without one would pull gigabytes of CUDA packages.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.pipeplan-installed
# The frameworks the export tests run (pyproject's `targets` extra has their pure-Python imports):
# pinned, and without their declared dependencies, which would pull a second torch or CUDA.
TARGETS_NO_DEPS ?= torchtitan==0.3.0 megatron-core==0.16.1 deepspeed==0.19.8 torchdata==0.11.0 \
	spmd_types==0.2.3 torch_checkpointing==0.1.1

.PHONY: demo test test-all lint venv clean gpu-wheels

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev,targets]"
	$(PY) -m pip install -q --no-deps $(TARGETS_NO_DEPS)
	# the vision zoo: both depend on torch, so never let pip resolve it (pyproject's "vision")
	$(PY) -m pip install -q --no-deps "torchvision==0.28.0" "timm==1.0.31"
	touch $(STAMP)

demo: $(STAMP)
	mkdir -p out
	$(VENV)/bin/pipeplan profile pipeplan.models.gpt:gpt --batch-size 32 -o out/gpt.profile.json
	$(VENV)/bin/pipeplan plan out/gpt.profile.json --stages 4 --memory 256MiB -o out/gpt.plan.json
	$(VENV)/bin/pipeplan show out/gpt.plan.json

test: $(STAMP) lint
	$(PY) -m pytest -q -n 2 --dist loadfile -m "not slow"

# everything, the zoo's slow models included (about twice as long)
test-all: $(STAMP) lint
	$(PY) -m pytest -q -n 2 --dist loadfile

lint: $(STAMP)
	$(VENV)/bin/ruff check pipeplan benchmarks tests examples
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy pipeplan benchmarks examples

# The packages the GPU machine lacks (Python 3.12, no network), as wheels for it, one version
# each (this venv's): benchmarks/gpu/run.sh installs them there.
GPU_WHEELS := ortools==9.15.6755 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 \
	typing-inspection==0.4.5 immutabledict==4.3.1 absl-py==2.5.1 protobuf==6.33.6
gpu-wheels: $(STAMP)
	$(PY) -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
		--platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
		--platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64 --platform any \
		-d benchmarks/gpu/wheels $(GPU_WHEELS)

clean:
	rm -rf $(VENV) out
