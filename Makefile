# The README's two commands: `make train` and `make test`. Both create the venv on first use.
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
# A CPU build of this torch lies on the machines we develop on; install it first so pip
# never resolves a multi-GB CUDA build through a looser requirement.
TORCH_VERSION ?= 2.13.0
LITGPT_VERSION ?= 0.5.13

.PHONY: venv train test unit benchmark clean

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==$(TORCH_VERSION)
	$(PY) -m pip install --quiet -e ".[dev]"
	# LitGPT's model, tested as a library other than transformers: its package pins huggingface-hub<1.4,
	# which transformers 5 cannot use, and litgpt.model itself needs only torch, lightning and psutil.
	$(PY) -m pip install --quiet --no-deps litgpt==$(LITGPT_VERSION) psutil
	touch $@

# Hydra overrides go in ARGS, e.g. make train ARGS="strategy=data trainer.devices=2"
train: venv
	$(PY) recipes/train.py $(ARGS)

test: venv
	$(PY) -m pytest tests $(ARGS)

unit: venv
	$(PY) -m pytest tests/unit $(ARGS)

benchmark: venv
	$(PY) -m pip install --quiet -e ".[dev,bench]"
	$(PY) benchmarks/dp_vs_ddp.py
	$(PY) benchmarks/tp_vs_model_parallel.py
	$(PY) benchmarks/tp_vs_hf_tp.py
	$(PY) benchmarks/expert_parallel.py
	$(PY) benchmarks/pp_efficiency.py
	$(PY) benchmarks/hybrid_layouts.py
	$(PY) benchmarks/checkpoint_io.py
	$(PY) benchmarks/planner_accuracy.py
	$(PY) benchmarks/sync_stragglers.py
	$(PY) benchmarks/context_parallel.py
	$(PY) benchmarks/hot_path.py

clean:
	rm -rf $(VENV) outputs multirun lightning_logs
