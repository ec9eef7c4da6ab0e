# `make demo` and `make test` are all the set-up a fresh clone needs: each creates .venv first when missing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
SGLANG_VENV := .venv-sglang
TINY_MODEL := runs/tiny-model
TORCH_EXTENSIONS := torch_extensions

.PHONY: demo test venv sglang-venv tiny-model clean

venv: $(VENV)/.installed

# torch is pinned to the CPU wheel first; constraints.txt keeps every later install from replacing it.
# DeepSpeed's CPU communication op (~45 s of CPU to compile, at a trainer's first start otherwise) is built into the
# venv's $(TORCH_EXTENSIONS), where the tests point TORCH_EXTENSIONS_DIR, by the venv's ninja (pip's, first on PATH), as
# every process of the tests finds it (tests/conftest.py): a system ninja builds the op again after it, and it after one.
$(VENV)/.installed: setup.cfg pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --disable-pip-version-check torch==2.13.0
	$(VENV)/bin/pip install -q --disable-pip-version-check -c constraints.txt -e '.[test]'
	PATH=$(abspath $(VENV))/bin:$$PATH TORCH_EXTENSIONS_DIR=$(abspath $(VENV))/$(TORCH_EXTENSIONS) \
	    $(PY) -c "from deepspeed.accelerator import get_accelerator; \
	    get_accelerator().create_op_builder('ShareMemCommBuilder').load()" >/dev/null
	touch $@

# Real SGLang 0.5.23 for the CPU, in a venv of its own (its pins differ from the project's): the tests' second server.
sglang-venv: $(SGLANG_VENV)/.installed

$(SGLANG_VENV)/.installed: tools/sglang_cpu/install.sh tools/sglang_cpu/requirements.txt
	bash tools/sglang_cpu/install.sh $(SGLANG_VENV)
	touch $@

tiny-model: $(TINY_MODEL)/config.json

$(TINY_MODEL)/config.json: tools/make_tiny_model.py tools/data/tiny_corpus.txt | venv
	$(PY) tools/make_tiny_model.py $(TINY_MODEL) --seed 0

# A fresh run each time (an old runs/demo would be resumed at its last step), then its plot.
demo: venv tiny-model
	rm -rf runs/demo
	$(PY) -m open_r1_ext.train --config recipes/tiny/grpo.yaml --set trainer.output_dir=runs/demo
	$(PY) -m open_r1_ext.cli plot runs/demo
	@echo "run directory: runs/demo  (look at it: .venv/bin/open-r1-ext status runs/demo)"
	@echo "plot:          runs/demo/plot.png"

# Three pytest-xdist workers on 2 cores (the tests wait on servers and jobs much of the time; four were slower): the
# rehearsal of the shipped recipes on one, the other SLURM tests on another (two groups, tests/conftest.py, started
# first), the other modules beside and after them. The tests against real SGLang run its server with
# $(SGLANG_VENV)'s interpreter (tests/conftest.py).
test: venv tiny-model sglang-venv
	$(PY) -m pytest -q -n 3 --dist loadgroup tests

clean:
	rm -rf runs
