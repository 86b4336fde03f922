# dflash-gguf: every target sets up what it needs (venv, patched llama.cpp build) on a fresh machine.
PY      ?= python3
VENV    ?= .venv
VPY      = $(VENV)/bin/python
STAMP    = $(VENV)/.deps-installed

CROSS   ?= aarch64-linux-gnu
# KleidiAI v1.24.0 source archive for offline arm64 builds; without one upstream downloads it
KLEIDIAI_SRC ?= $(firstword $(wildcard vendor/kleidiai-v1.24.0-src.tar.gz ../shared/vendor/kleidiai-v1.24.0-src.tar.gz))

.PHONY: demo test test-fast test-pure lint build tools ggml-variants cross cross-kleidiai qemu-sme2 venv clean-cache help mutate mutate-ci gpu-dry-run

help:
	@echo "make demo    - set up everything, then run the offline DFlash demo on the shipped pair"
	@echo "make test    - set up everything (incl. upstream reference tools), then run the test suite"
	@echo "make test-fast - the edit-test loop: the tests not marked slow (no qemu, lavapipe, peer suite, reliability)"
	@echo "make test-pure - the tests marked pure with the native modules blocked (seconds; needs only numpy and pytest)"
	@echo "make build   - build/install the patched llama-cpp-python (cached; FORCE=1 rebuilds)"
	@echo "make tools   - also build upstream's reference binaries (llama-speculative-simple, ...)"
	@echo "make ggml-variants - x86: ggml's libraries without AVX-512 (the kernels' AVX2 path; AVX-VNNI where the CPU has it); where the Vulkan"
	@echo "                     headers, glslc and SPIRV-Headers are installed, libllama + ggml-vulkan for the offload tests"
	@echo "make lint    - ruff over the whole tree (configured in pyproject.toml)"
	@echo "make mutate  - mutation testing of the core's pure logic, full profile (long; make mutate-ci: the CI subset)"
	@echo "make cross   - cross-build the patched library, reference loop and an installable wheel for $(CROSS)"
	@echo "make cross-kleidiai - the same with KleidiAI's Arm kernels (KLEIDIAI_SRC=archive or folder, offline)"
	@echo "make qemu-sme2 - fetch a qemu-aarch64 that emulates SME2 (for KleidiAI's SME2 kernels) into the cache"
	@echo "make gpu-dry-run - pack the offline CUDA check (bench/gpu_pack.py -> gpu-pack/) and run its run.sh here with"
	@echo "                   a CPU build of the same trimmed tree and short sizes (DRY_RUN=1; logs in gpu-pack-work/dry-run)"

$(VPY):
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip

$(STAMP): pyproject.toml | $(VPY)
	$(VPY) -m pip install -q "numpy>=1.24" "cffi>=1.16" diskcache jinja2 typing-extensions
	$(VPY) -m pip install -q --no-deps -e .
	touch $(STAMP)

venv: $(STAMP)

build: venv
	$(VPY) -m dflash_gguf.build $(if $(FORCE),--force,)

tools: venv
	$(VPY) -m dflash_gguf.build --with-tools $(if $(FORCE),--force,)

# x86: ggml's libraries again without AVX-512, for the AVX2 path of the x86 kernels (patches/0014), and
# where the CPU has AVX-VNNI (Intel Alder Lake and later, AMD Zen 5) for their AVX-VNNI path;
# Vulkan (where its build prerequisites are installed): libllama + ggml-vulkan for tests/test_offload.py,
# which runs them on Mesa's lavapipe (a Vulkan device on the CPU)
ggml-variants: venv
	@if [ "$$(uname -m)" = x86_64 ]; then $(VPY) -m dflash_gguf.build --ggml-variant avx2 $(if $(FORCE),--force,); \
	else echo "not x86-64: no AVX2 build variant"; fi
	@if grep -qw avx_vnni /proc/cpuinfo 2>/dev/null; then $(VPY) -m dflash_gguf.build --ggml-variant avxvnni $(if $(FORCE),--force,); \
	else echo "this CPU has no AVX-VNNI: no AVX-VNNI build variant (its tests will be skipped)"; fi
	@if command -v glslc >/dev/null && [ -f /usr/include/vulkan/vulkan.h ] && [ -d /usr/include/spirv ]; then \
		$(VPY) -m dflash_gguf.build --ggml-variant vulkan $(if $(FORCE),--force,); \
	else echo "no glslc, Vulkan headers or SPIRV-Headers: no Vulkan build variant; the offload tests will be skipped"; fi

# test dependencies: torch CPU (from this machine's disk where available), transformers, server + client; scipy (llama-cpp-python's own tests import it)
$(VENV)/.test-deps: pyproject.toml | $(STAMP)
	$(VPY) -m pip install -q torch==2.13.0
	$(VPY) -m pip install -q "transformers==4.57.6" sentencepiece protobuf safetensors pytest httpx "openai>=1.0" "fastapi>=0.110" "uvicorn>=0.27" "uvloop>=0.19" "httptools>=0.6" matplotlib "huggingface_hub>=0.23" "mutmut==3.8.1" "scipy>=1.10" "anthropic>=0.40"
	touch $@

lint: venv
	$(VPY) -m pip install -q "ruff==0.17.6"
	$(VPY) -m ruff check .

cross: venv
	$(VPY) -m dflash_gguf.build --cross $(CROSS)

cross-kleidiai: venv
	$(VPY) -m dflash_gguf.build --cross $(CROSS) --platform kleidiai $(if $(KLEIDIAI_SRC),--kleidiai-src $(KLEIDIAI_SRC),)

# a qemu-aarch64 >= 10.1 (emulates SME2) fetched once into the cache, beside the system's qemu-user-static
qemu-sme2: venv
	$(VPY) -m dflash_gguf.build.cross --fetch-qemu-sme2

demo: build
	$(VPY) -m dflash_gguf.demo

# the arm64 checks: skipped only where a prerequisite is absent (toolchain, qemu-user, KleidiAI's source);
# a cross build that fails with them present is the project's fault and fails the target
test: tools ggml-variants $(VENV)/.test-deps
	@if ! command -v $(CROSS)-g++ >/dev/null || ! command -v qemu-aarch64-static >/dev/null; then \
		echo "no $(CROSS)-g++ or qemu-aarch64-static: the arm64 checks will be skipped"; \
	elif [ -z "$(KLEIDIAI_SRC)" ]; then \
		echo "no KleidiAI v1.24.0 source archive (vendor/ or ../shared/vendor/): the arm64 checks will be skipped"; \
	else $(MAKE) cross-kleidiai && { $(MAKE) qemu-sme2 || echo "no SME2-capable qemu-user: the SME2 checks will be skipped"; }; fi
	$(PURE_TESTS)
	$(VPY) tests/mutation.py ci
	$(VPY) -m pytest -q

# the pure files (policy, acceptance, sampling rules, stopping) with llama_cpp, the cffi bindings and
# torch made unimportable: make test runs it first, so a native import creeping into them fails CI
PURE_TESTS = $(VPY) -m pytest -q -p no:cacheprovider --pure

test-pure: venv
	@$(VPY) -c "import pytest" 2>/dev/null || $(VPY) -m pip install -q pytest
	$(PURE_TESTS)

test-fast: build $(VENV)/.test-deps
	$(VPY) -m pytest -q -m "not slow"

# mutation testing (tests/mutation.py): every surviving mutant is killed by a test or listed as
# equivalent in tests/mutation-survivors.txt; mutate-ci is the bounded subset make test runs
mutate-ci: build $(VENV)/.test-deps
	$(VPY) tests/mutation.py ci

mutate: build $(VENV)/.test-deps
	$(VPY) tests/mutation.py full

# the offline CUDA check: the pack an NVIDIA machine without network runs (gpu-pack/run.sh OUTDIR), and
# its dry run here (CPU build, 2 jobs, niced)
gpu-dry-run: venv $(VENV)/.test-deps
	$(VPY) bench/gpu_pack.py gpu-pack
	DRY_RUN=1 JOBS=$${JOBS:-2} nice -n 10 bash gpu-pack/run.sh gpu-pack-work/dry-run

clean-cache:
	rm -rf $${DFLASH_GGUF_CACHE:-$$HOME/.cache/dflash-gguf}
