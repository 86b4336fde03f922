#!/usr/bin/env bash
# The CUDA check from a GPU pack (bench/gpu_pack.py), offline, in one short run. Copied into the pack as run.sh.
#
#   bash gpu-pack/run.sh OUTDIR            # on the NVIDIA machine: about 8-9 minutes, see BUDGET below
#   DRY_RUN=1 bash gpu-pack/run.sh OUTDIR  # anywhere: the same steps with a CPU build and short sizes
#
# Needs: Python 3.12 (or 3.11) with numpy and venv, CMake >= 3.18, a C++ compiler, and for the real run
# nvcc and nvidia-smi; ninja if present. No network: every Python package comes from the pack's wheels.
# Steps (STEPS="..." runs some of them): machine setup configure build preflight tests demo bench scale.
# Each step has a time budget and the whole run a deadline (BUDGET seconds, default 540: under the
# 10 minutes one command may take); a step that would start with too little time left is skipped and
# said so. Everything goes to OUTDIR: one log per step and summary.txt. The build and the venv go to
# WORK (default gpu-pack-work/ beside the pack), reused by a second run on the same machine.
# Knobs: CUDA_ARCH=90 (else nvidia-smi's), CMAKE_EXTRA="-D..." (more CMake flags), JOBS, BUDGET, WITH_SERVER=0.
set -uo pipefail
set -a   # every setting below reaches the steps, which run as child shells (bash -c, under timeout)
PACK=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
OUT=${1:?usage: run.sh OUTDIR}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
WORK=${WORK:-$(dirname "$PACK")/gpu-pack-work}
DRY_RUN=${DRY_RUN:-0}
PYTHON=${PYTHON:-python3}
JOBS=${JOBS:-$(nproc)}
STEPS=${STEPS:-machine setup configure build preflight tests demo bench scale}
if [ "$DRY_RUN" = 1 ]; then
    BUDGET=${BUDGET:-3600}
    # step budgets (s): a CPU build on 2 shared cores takes most of the dry run
    B_SETUP=300 B_CONFIGURE=300 B_BUILD=2400 B_SERVER=900 B_PREFLIGHT=120 B_TESTS=300 B_DEMO=180 B_BENCH=300 B_SCALE=600
    DEMO_ARGS="--max-tokens 16 --trials 2" BENCH_ARGS="--trials 1 -n 16" SCALE_ARGS="--shapes 0.6b --profiles demo --tokens 8 --trials 1 --repeats 1 --no-own"
else
    BUDGET=${BUDGET:-540}
    B_SETUP=60 B_CONFIGURE=90 B_BUILD=330 B_SERVER=90 B_PREFLIGHT=60 B_TESTS=180 B_DEMO=40 B_BENCH=60 B_SCALE=150
    DEMO_ARGS="--max-tokens 96 --trials 5" BENCH_ARGS="--trials 3 -n 128" SCALE_ARGS="--shapes 1.7b --profiles demo strong --tokens 128 --trials 2 --repeats 3"
fi
T0=$(date +%s)
SUMMARY=$OUT/summary.txt
: > "$SUMMARY"
say() { echo "$*" | tee -a "$SUMMARY"; }
has() { case " $STEPS " in *" $1 "*) return 0;; *) return 1;; esac; }
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }

# step NAME BUDGET CMD...: runs CMD with its output in OUTDIR/NAME.log, under min(BUDGET, time left)
FAILED=""
step() {
    local name=$1 want=$2; shift 2
    has "$name" || return 0
    local t; t=$(left); [ "$t" -lt "$want" ] || t=$want
    if [ "$t" -lt 15 ]; then say "$(printf '%-10s skipped: %ss left of the %ss budget' "$name" "$(left)" "$BUDGET")"; FAILED="$FAILED $name"; return 1; fi
    local s rc; s=$(date +%s)
    echo "=== $name (limit ${t}s, $(date -u +%T))"
    timeout -k 10 "$t" bash -c "set -o pipefail; $*" > "$OUT/$name.log" 2>&1; rc=$?
    local msg=ok; [ $rc = 0 ] || { msg="FAILED (exit $rc)"; [ $rc = 124 ] || [ $rc = 137 ] && msg="TIMEOUT (${t}s)"; FAILED="$FAILED $name"; }
    say "$(printf '%-10s %-16s %4ss' "$name" "$msg" "$(( $(date +%s) - s ))")"
    [ $rc = 0 ] || tail -15 "$OUT/$name.log"
    return $rc
}

VENV=$WORK/venv
VPY=$VENV/bin/python
TREE=$WORK/llama.cpp
BUILD=$WORK/build
BIN=$BUILD/bin
export DFLASH_GGUF_CACHE=$WORK/cache DFLASH_GGUF_TEST_MODELS=$WORK/test-models
export LLAMA_CPP_LIB_PATH=$BIN DFLASH_GGUF_TOOLS=$BIN DFLASH_GGUF_OFFLOAD=cuda
[ -d /usr/local/cuda/bin ] && export PATH=$PATH:/usr/local/cuda/bin
set +a
mkdir -p "$WORK" "$DFLASH_GGUF_CACHE"
say "GPU pack check ($([ "$DRY_RUN" = 1 ] && echo 'DRY RUN: CPU build, short sizes' || echo CUDA)), $(date -u +%FT%TZ), budget ${BUDGET}s"
say "pack: $(grep -m1 '"patch_series"' "$PACK/MANIFEST.json" | tr -d ' ,')"

machine() {
    nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.total --format=csv,noheader || echo "nvidia-smi: none"
    (command -v nvcc && nvcc --version | tail -2) || echo "nvcc: not found"
    cmake --version | head -1; (ninja --version 2>/dev/null | sed 's/^/ninja /') || echo "ninja: none (make)"
    "$PYTHON" -c "import sys, numpy; print('python', sys.version.split()[0], 'numpy', numpy.__version__)"
    "$PYTHON" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" 2>/dev/null || echo "torch: none"
    lscpu | grep -m1 'Model name'; echo "cores: $(nproc)"; free -g | head -2; df -h "$WORK" | tail -1
}

setup() {   # the venv (system packages: numpy, torch) + the pack's wheels, offline; the tree and test models
    set -e
    # without ensurepip (a distribution's Python without its venv package) the system's pip serves the venv
    [ -x "$VPY" ] || "$PYTHON" -m venv --system-site-packages "$VENV" || "$PYTHON" -m venv --system-site-packages --without-pip "$VENV"
    "$VPY" -m pip install --no-index --no-deps --ignore-installed --disable-pip-version-check -q \
        --find-links "$PACK/wheels" -r "$PACK/requirements.txt"
    tar -xJf "$PACK/llama.cpp.tar.xz" -C "$WORK"   # again on a second run: the files' times say what changed
    [ -d "$DFLASH_GGUF_TEST_MODELS" ] || { mkdir -p "$DFLASH_GGUF_TEST_MODELS"; tar -xJf "$PACK/test-models.tar.xz" -C "$DFLASH_GGUF_TEST_MODELS"; }
    # the installed llama_cpp is the pack's pure-Python one: its lib/ is the build's bin/ (as in a wheel)
    local site; site=$("$VPY" -c "import pathlib, importlib.util as u; print(pathlib.Path(u.find_spec('llama_cpp').origin).parent)")
    ln -sfn "$BIN" "$site/lib"
    # the build cache's pointers: the CUDA variant and the reference tools are this build, the tree this one
    echo "$BIN" > "$DFLASH_GGUF_CACHE/ggml-variant-cuda"; echo "$BIN" > "$DFLASH_GGUF_CACHE/tools-dir"
    echo "$TREE" > "$DFLASH_GGUF_CACHE/upstream-tree"
    "$VPY" -m pip list --disable-pip-version-check 2>/dev/null | grep -iE '^(cffi|dflash-gguf|gguf|jinja2|llama.cpp.python|numpy|pytest|torch) '
}

configure() {
    local gen=() cuda=(-DGGML_CUDA=OFF)
    command -v ninja >/dev/null && gen=(-G Ninja)
    if [ "$DRY_RUN" != 1 ]; then
        local cap; cap=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d ' .')
        [ -n "$cap" ] || { echo "no compute capability from nvidia-smi"; return 1; }
        cuda=(-DGGML_CUDA=ON "-DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCH:-$cap}" -DGGML_CUDA_NCCL=OFF)
    fi
    [ -f "$BUILD/CMakeCache.txt" ] && [ -z "${RECONFIGURE:-}" ] && { echo "configured already: $BUILD"; return 0; }
    cmake -S "$TREE" -B "$BUILD" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON \
        -DLLAMA_BUILD_APP=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF "${cuda[@]}" ${CMAKE_EXTRA:-}
}

# libllama + ggml (ggml-cuda) and the reference loop first; llama-server after, while time is left
build() { cmake --build "$BUILD" -j "$JOBS" --target llama llama-speculative-simple llama-completion; }
build_server() { cmake --build "$BUILD" -j "$JOBS" --target llama-server; }

preflight() {   # every import and file the later steps use, and the devices ggml finds
    "$VPY" - "$PACK/tests" <<'EOF'
import ctypes, sys, time
sys.path.insert(0, sys.argv[1])
import cffi, diskcache, gguf, jinja2, pytest, safetensors.numpy, sentencepiece, yaml  # noqa: F401
import offload_child, test_offload, test_sampling  # noqa: F401  (what the tests import, before a GPU runs them)
from dflash_gguf.bench.scale import synth  # noqa: F401
from dflash_gguf.convert import draft_vocab  # noqa: F401
from dflash_gguf import _bindings, paths
print("library:", _bindings.LIBRARY_PATH, _bindings.BUILD_STAMP)
print("cuda variant:", paths.ggml_variant_dir("cuda"), "tools:", paths.tools_dir(), "tree:", paths.upstream_tree())
assert synth._vocab_source().is_file()   # the scale bench's tokenizer, from the tree
for t in ("llama-speculative-simple", "llama-completion"):
    assert (paths.tools_dir() / t).is_file(), t
g = ctypes.CDLL(str(paths.ggml_variant_dir("cuda") / "libggml.so"))
g.ggml_backend_dev_get.restype = ctypes.c_void_p
g.ggml_backend_dev_description.restype = ctypes.c_char_p
devs = [ctypes.c_void_p(g.ggml_backend_dev_get(i)) for i in range(g.ggml_backend_dev_count())]
print("devices:", [g.ggml_backend_dev_description(d).decode() for d in devs])
from conftest import TinyModels, _models_root   # the hybrid pair of tests/test_offload.py, from the pack
t = time.time()
pair = TinyModels(_models_root()).pair("qwen35", "dflash", 8)
assert pair.target.is_file() and pair.drafter.is_file() and time.time() - t < 10, pair
print("hybrid pair:", pair.target, pair.drafter)
EOF
}

tests() { "$VPY" -m pytest -q -rs -p no:cacheprovider --junitxml "$OUT/tests.xml" "$PACK/tests/test_offload.py"; }
# shellcheck disable=SC2086
demo() { "$VPY" -m dflash_gguf.demo --n-gpu-layers 99 --no-stream --no-scale $DEMO_ARGS; }   # scale: the realistic size
# shellcheck disable=SC2086
bench() { "$VPY" -m dflash_gguf.bench --prompts code $BENCH_ARGS -ngl 99 --out "$OUT" --tag demo-cuda; }
# shellcheck disable=SC2086
scale() { "$VPY" -m dflash_gguf.bench.scale --types q4_0 --draft-vocab off $SCALE_ARGS -ngl 99 --out "$OUT" --tag cuda; }

export -f machine setup configure build build_server preflight tests demo bench scale
step machine 30 machine
step setup "$B_SETUP" setup
step configure "$B_CONFIGURE" configure
if step build "$B_BUILD" build && has build && [ "${WITH_SERVER:-1}" = 1 ]; then
    # not needed by the steps below: built only when the rest keeps most of its time
    if [ "$(left)" -gt $(( B_TESTS + B_DEMO + B_BENCH + B_SCALE )) ]; then STEPS="$STEPS server" step server "$B_SERVER" build_server
    else say "server     skipped: the later steps need the time"; fi
fi
step preflight "$B_PREFLIGHT" preflight
step tests "$B_TESTS" tests
step demo "$B_DEMO" demo
step bench "$B_BENCH" bench
step scale "$B_SCALE" scale

{
    echo; echo "--- results"
    [ -f "$OUT/tests.log" ] && tail -3 "$OUT/tests.log"
    [ -f "$OUT/demo.log" ] && grep -iE 'tok/s|speed|x ' "$OUT/demo.log" | tail -4
    [ -f "$OUT/bench.log" ] && { echo "bench (demo pair):"; tail -12 "$OUT/bench.log"; }
    [ -f "$OUT/scale-cuda.md" ] && { echo "scale-cuda.md:"; cat "$OUT/scale-cuda.md"; }
    echo; echo "total: $(( $(date +%s) - T0 )) s; failed or skipped:${FAILED:- none}"
} | tee -a "$SUMMARY"
[ -z "$FAILED" ]
