#!/usr/bin/env bash
# GPU check on an NVIDIA machine, one start, a few minutes on a many-core host:
#   1. build the patched tree's CUDA variant (libllama + ggml-cuda for the local GPU's architecture only,
#      plus upstream's llama-speculative-simple / llama-completion) next to the CPU wheel;
#   2. the offload tests (tests/test_offload.py) on CUDA;
#   3. the demo with every layer on the GPU;
#   4. plain vs DFlash vs upstream on the demo pair, and on one bench.scale pair (Qwen3-1.7B shape, Q4_0),
#      every layer on the GPU.
# Prerequisites: the CUDA toolkit (nvcc), a C++ compiler, CMake >= 3.18, Python 3.10+ with venv; network
# for PyPI (or SDIST=llama_cpp_python-0.3.36.tar.gz and the venv's packages already installed).
# An offline machine (no PyPI, minutes): bench/gpu_pack.py packs the same check, gpu-pack/run.sh runs it.
# Everything goes to $OUT (default bench/results/gpu-check-<date>): logs, bench JSON/markdown, summary.txt.
# Usage: bench/gpu_check.sh            (STEPS="build tests demo bench" to run some of them; default all)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results/gpu-check-$(date -u +%Y%m%d-%H%M%S)}
STEPS=${STEPS:-build tests demo bench}
JOBS=${JOBS:-$(nproc)}
VPY=${VPY:-.venv/bin/python}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/summary.txt") 2>&1
step() { printf '\n=== %s (%s)\n' "$1" "$(date -u +%T)"; }
has() { case " $STEPS " in *" $1 "*) return 0;; *) return 1;; esac; }

step "machine"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || echo "nvidia-smi: none"
(command -v nvcc && nvcc --version | tail -2) || echo "nvcc: not on PATH (CUDACXX=${CUDACXX:-unset})"
lscpu | grep -m1 'Model name' || true
echo "cores: $(nproc)"

if has build; then
    step "build: CPU wheel + CUDA variant (-j$JOBS)"
    make venv >/dev/null
    make .venv/.test-deps
    t0=$(date +%s)
    "$VPY" -m dflash_gguf.build -j "$JOBS" ${SDIST:+--sdist "$SDIST"} --ggml-variant cuda | tee "$OUT/build.json"
    echo "build: $(( $(date +%s) - t0 )) s"
fi
CUDA_BIN=$("$VPY" -c "from dflash_gguf import paths; d = paths.ggml_variant_dir('cuda'); print(d or '')")
[ -n "$CUDA_BIN" ] || { echo "no CUDA build variant: run with STEPS=build first"; exit 1; }
echo "CUDA variant: $CUDA_BIN"

if has tests; then
    step "offload tests on CUDA"
    t0=$(date +%s)
    DFLASH_GGUF_OFFLOAD=cuda "$VPY" -m pytest -q -rs tests/test_offload.py 2>&1 | tee "$OUT/tests.txt" || true
    echo "tests: $(( $(date +%s) - t0 )) s"
fi

if has demo; then
    step "demo, every layer on the GPU"
    LLAMA_CPP_LIB_PATH=$CUDA_BIN "$VPY" -m dflash_gguf.demo -ngl 99 --no-stream -n 96 2>&1 | tee "$OUT/demo.txt"
fi

if has bench; then
    step "bench: demo pair, plain vs DFlash vs upstream, -ngl 99"
    LLAMA_CPP_LIB_PATH=$CUDA_BIN DFLASH_GGUF_TOOLS=$CUDA_BIN "$VPY" -m dflash_gguf.bench --prompts code \
        --trials 3 -n 128 -ngl 99 --out "$OUT" --tag demo-cuda 2>&1 | tee "$OUT/bench-demo.txt"
    step "bench.scale: Qwen3-1.7B shape, Q4_0, -ngl 99"
    LLAMA_CPP_LIB_PATH=$CUDA_BIN DFLASH_GGUF_TOOLS=$CUDA_BIN "$VPY" -m dflash_gguf.bench.scale --shapes 1.7b \
        --types q4_0 --profiles demo strong --draft-vocab off --tokens 128 --trials 2 --repeats 3 -ngl 99 \
        --out "$OUT" --tag scale-cuda 2>&1 | tee "$OUT/bench-scale.txt"
fi
step "done: $OUT"
