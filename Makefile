# make demo | make test | make bench -- each does the set-up first.
PY      ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
STAMP   := $(VENV)/.deps-installed
SOURCES := $(wildcard csrc/*.c csrc/*.h csrc/*.cpp) setup.py
BUILT   := $(VENV)/.built

.PHONY: setup demo demo-attention test bench clean

setup: $(BUILT)

$(STAMP):
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install --upgrade pip >/dev/null
	$(VPY) -m pip install torch==2.13.0 pytest matplotlib numpy
	touch $@

# --no-build-isolation: build against the torch installed above; an isolated
# build environment would download another (multi-GB CUDA) torch.
$(BUILT): $(STAMP) $(SOURCES)
	$(VPY) -m pip install --no-build-isolation --no-deps -e .
	touch $@

# the main job: train a small causal LM on torch.nn and on ours side by side,
# then a tour of the attention op on a padded batch
demo: setup
	$(VPY) examples/demo.py
	$(VPY) examples/attention_demo.py

demo-attention: setup
	$(VPY) examples/attention_demo.py

test: setup
	$(VPY) -m pytest tests -q

bench: setup
	$(VPY) benchmarks/run.py

clean:
	rm -rf build *.egg-info torch_masked_attn/_C*.so
