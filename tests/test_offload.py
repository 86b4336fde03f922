"""DFlash with the target's and the drafter's layers in GPU memory (``n_gpu_layers``).

On the CPU backend every tensor is in host memory. Offloaded, the taps (patches 0010/0011) are read
from tensors in device memory, host-kept features are injected into a drafter on the device (0007),
the drafter's argmax runs on the device (0013) and the drafter borrows the target's embeddings and
LM head from wherever the target put them. Each backend is a build variant of the same patched tree
(``python -m dflash_gguf.build --ggml-variant vulkan|cuda``: libllama + ggml with that backend),
loaded in child processes (``tests/offload_child.py``) with ``LLAMA_CPP_LIB_PATH``
(``DFLASH_GGUF_OFFLOAD_LIB=DIR``: another libllama folder of the same patch series). Here Vulkan runs
on Mesa's lavapipe (a Vulkan device on the CPU: correct results, no GPU speed); the same tests run
on CUDA with ``DFLASH_GGUF_OFFLOAD=cuda`` (bench/gpu_check.sh). The CPU reference is the same
library with its GPU devices hidden (``GGML_VK_VISIBLE_DEVICES=`` / ``CUDA_VISIBLE_DEVICES=``).

What is checked: greedy DFlash == plain decoding (the same library) with the target fully and partly
offloaded (tapped layers on both sides of the CPU/GPU split), the drafter on the device or not, for
DFlash, DFlash2, a hybrid target and a reduced draft head; acceptance as high as on the CPU (taps
or injection gone wrong keep DFlash lossless but drafts go bad); sampled requests keep the target's
distribution; and the C API's taps, argmax ids, injection and draft ids against the CPU build.
"""
from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dflash_gguf import paths
from dflash_gguf.demo import DEMO_DIR

pytestmark = pytest.mark.slow

CHILD = Path(__file__).with_name("offload_child.py")
DEMO_T, DEMO_D = DEMO_DIR / "target.gguf", DEMO_DIR / "drafter.gguf"
DEMO_D2 = DEMO_DIR.parent / "demo-dflash2" / "drafter.gguf"
PROMPT = "def read_lines(path):\n    \"\"\"Return the lines of a text file.\"\"\"\n"
LAVAPIPE = sorted(Path("/usr/share/vulkan/icd.d").glob("lvp_icd.*.json"))
# the demo target has 6 layers, the drafters tap the inputs of layers 1, 3 and 4; n_gpu_layers = k puts
# the output layer and the last k - 1 layers on the device: k = 4 (layers 3-5) computes tap 1 on the
# CPU, tap 3 at the split (layer 2's output, on the CPU, is layer 3's input on the device) and tap 4 on
# the device; k = 3 (layers 4-5) computes taps 1 and 3 on the CPU and tap 4 at the split
SPLIT = 4
FULL = 99
N = 16   # tokens per greedy run (lavapipe, the CPU behind Vulkan, is slow: about 0.2 s per DFlash step)


def _backends() -> list[str]:
    want = os.environ.get("DFLASH_GGUF_OFFLOAD")
    return [b.strip() for b in want.split(",") if b.strip()] if want else ["vulkan"]


# the environment variable that lists a backend's visible devices (empty: none, the CPU reference)
VISIBLE = {"vulkan": "GGML_VK_VISIBLE_DEVICES", "cuda": "CUDA_VISIBLE_DEVICES"}


def _env(backend: str, lib: Path, cpu: bool = False) -> dict[str, str]:
    env = dict(os.environ, LLAMA_CPP_LIB_PATH=str(lib))
    if backend == "vulkan":
        if LAVAPIPE and "VK_ICD_FILENAMES" not in env:
            env["VK_ICD_FILENAMES"] = str(LAVAPIPE[0])   # the same device everywhere: lavapipe
        # ggml-vulkan skips devices of type CPU (lavapipe) unless they are asked for by index
        env.setdefault("GGML_VK_VISIBLE_DEVICES", "0")
    if cpu:
        env[VISIBLE[backend]] = ""
    return env


@functools.cache
def _devices(backend: str, lib: Path) -> list[str]:
    """The GPU devices ggml's backend registry lists in a child with that library (name: description)."""
    code = ("import ctypes,sys; g=ctypes.CDLL(sys.argv[1]+'/libggml.so'); g.ggml_backend_dev_get.restype=ctypes.c_void_p; "
            "g.ggml_backend_dev_name.restype=ctypes.c_char_p; g.ggml_backend_dev_description.restype=ctypes.c_char_p; "
            "d=[g.ggml_backend_dev_get(i) for i in range(g.ggml_backend_dev_count())]; "
            "print('\\n'.join(g.ggml_backend_dev_name(ctypes.c_void_p(x)).decode()+': '+"
            "g.ggml_backend_dev_description(ctypes.c_void_p(x)).decode() for x in d "
            "if g.ggml_backend_dev_type(ctypes.c_void_p(x)) in (1, 2)))")
    p = subprocess.run([sys.executable, "-c", code, str(lib)], env=_env(backend, lib), capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    return [line for line in p.stdout.splitlines() if line.strip()]


@pytest.fixture(scope="module", params=_backends())
def backend(request) -> tuple[str, Path]:
    name = request.param
    if name not in VISIBLE:
        pytest.fail(f"DFLASH_GGUF_OFFLOAD: unknown backend {name!r} (vulkan, cuda)")
    lib = Path(os.environ["DFLASH_GGUF_OFFLOAD_LIB"]) if os.environ.get("DFLASH_GGUF_OFFLOAD_LIB") else \
        paths.ggml_variant_dir(name)
    if lib is None:
        how = ("`make test` builds it where the Vulkan headers, glslc and SPIRV-Headers are installed"
               if name == "vulkan" else "bench/gpu_check.sh builds it on a machine with the CUDA toolkit")
        pytest.skip(f"no {name} build variant in the build cache ({how}: python -m dflash_gguf.build "
                    f"--ggml-variant {name})")
    devs = _devices(name, lib)
    if not devs:
        pytest.skip(f"the {name} build finds no GPU device here" +
                    (" (Vulkan on the CPU: apt-get install mesa-vulkan-drivers, for lavapipe)" if name == "vulkan" else ""))
    return name, lib


def child(backend: str, lib: Path, spec: dict, tmp: Path, timeout: int = 600, cpu: bool = False) -> tuple[dict, dict]:
    """Run offload_child.py with ``spec`` on ``lib`` (``cpu``: its GPU devices hidden); its JSON and arrays."""
    spec = {"prompt": PROMPT, "n": N, **{k: str(v) if isinstance(v, Path) else v for k, v in spec.items()}}
    tmp.mkdir(parents=True, exist_ok=True)
    sf, of = tmp / "spec.json", tmp / "out.npz"
    sf.write_text(json.dumps(spec))
    p = subprocess.run([sys.executable, str(CHILD), str(sf), str(of)], env=_env(backend, lib, cpu),
                       capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        sig = -p.returncode if p.returncode < 0 else None
        raise AssertionError(f"{'CPU' if cpu else backend} child " + (f"died (signal {sig})" if sig else
                             f"exited {p.returncode}") + f":\n{p.stderr[-4000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1]), dict(np.load(of))


def long_check(backend: str) -> None:
    """The sampled and hybrid checks take minutes of CPU under lavapipe: there only on request."""
    if backend == "vulkan" and not os.environ.get("DFLASH_GGUF_OFFLOAD_LONG"):
        pytest.skip("several CPU-minutes under lavapipe (a Vulkan device on the CPU); DFLASH_GGUF_OFFLOAD_LONG=1 "
                    "runs it (on CUDA it always runs)")


def gpu_buffer(backend: str) -> str:
    return {"vulkan": "Vulkan0", "cuda": "CUDA0"}.get(backend, backend)


def check_placed(backend: str, run: dict, n_layer: int) -> None:
    """llama.cpp's load log says the layers went where the run asked (buffers on the device or not)."""
    dev = gpu_buffer(backend)
    for who, ngl in (("target", run["ngl"]), ("drafter", run["dngl"])):
        w = run["where"][who]
        if who == "target":   # "offloaded k/n layers": n counts every block (a hybrid's MTP one too) + the output
            (got, total), = [map(int, o.split("/")) for o in w["offloaded"]]
            assert got == min(ngl, total) and total >= n_layer + 1, (who, w)
        assert (dev in w["buffers"]) == (ngl > 0), (who, ngl, w)


def check_lossless(backend: str, out: dict, n_layer: int) -> None:
    for run in out["runs"]:
        check_placed(backend, run, n_layer)
        assert run["dflash"] == run["plain"], (run["ngl"], run["dngl"])
        assert all(len(t) == N for t in run["plain"])


@pytest.fixture(scope="module")
def cpu_demo(backend, tmp_path_factory) -> tuple[dict, dict]:
    """The reference: greedy runs and C API probes on the demo DFlash pair, the same library on the CPU."""
    name, lib = backend
    out = child(name, lib, {"target": DEMO_T, "drafter": DEMO_D, "runs": [{"ngl": 0, "dngl": 0}],
                            "capi": [{"ngl": 0, "dngl": 0}]}, tmp_path_factory.mktemp("cpu-demo"), cpu=True)
    for where in out[0]["runs"][0]["where"].values():
        assert where["buffers"] and not any(b.startswith(gpu_buffer(name)[:-1]) for b in where["buffers"]), where
    return out


@pytest.fixture(scope="module")
def gpu_demo(backend, tmp_path_factory) -> tuple[dict, dict]:
    name, lib = backend
    runs = [{"ngl": FULL, "dngl": FULL}, {"ngl": 0, "dngl": FULL}, {"ngl": SPLIT, "dngl": 0},
            {"ngl": 3, "dngl": FULL}]
    return child(name, lib, {"target": DEMO_T, "drafter": DEMO_D, "runs": runs,
                             "capi": [{"ngl": FULL, "dngl": FULL}, {"ngl": SPLIT, "dngl": 0}]},
                 tmp_path_factory.mktemp(f"{name}-demo"))


def test_dflash_greedy_offloaded_equals_plain(backend, gpu_demo, cpu_demo):
    """Target on the device, partly (taps on both sides of the split) or not, the drafter on the device
    or not: DFlash's tokens are plain decoding's, and drafts are accepted as often as on the CPU."""
    out, _ = gpu_demo
    check_lossless(backend[0], out, 6)
    tau_cpu = cpu_demo[0]["runs"][0]["tau"]
    assert tau_cpu > 2.0
    for run in out["runs"]:
        assert run["tau"] >= 0.85 * tau_cpu, (run["ngl"], run["dngl"], run["tau"], tau_cpu)


# relative tolerances of the device against the CPU (max |device - CPU| / max |CPU|): the device sums in
# another order and ggml-vulkan's matrix products take the F16 weights times F16-rounded activations.
# Measured on lavapipe with the demo pair: taps 0.59% (target fully offloaded) and 0.10% (split),
# logits 0.75% / 0.82% (the largest logit is 11.9): the bounds leave about 4x
TAP_RTOL = 2.5e-2
LOGIT_RTOL = 3e-2


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-30))


def test_c_api_on_the_device_reads_what_the_cpu_reads(backend, gpu_demo, cpu_demo):
    """llama_dflash_decode's argmax ids, the taps (copied to the output buffer, and straight from the
    graph with a row cap), llama_dflash_inject of those rows and llama_dflash_inject_features of the same
    features kept on the host, and the drafter's argmax ids: on the device as on the CPU, up to rounding."""
    out, arr = gpu_demo
    ref_out, ref = cpu_demo
    margin_of = np.sort(ref["0-copy-logits"], axis=1)
    margin = margin_of[:, -1] - margin_of[:, -2]
    for i, run in enumerate(out["capi"]):
        check_placed(backend[0], run, 6)
        for mode, m in run["modes"].items():
            got = {k.split("-", 2)[2]: v for k, v in arr.items() if k.startswith(f"{i}-{mode}-")}
            want = {k.split("-", 2)[2]: v for k, v in ref.items() if k.startswith(f"0-{mode}-")}
            ctx = (run["ngl"], run["dngl"], mode)
            assert m == ref_out["capi"][0]["modes"][mode], ctx   # rows decoded, rows readable
            assert got["taps"].shape == want["taps"].shape and np.isfinite(got["taps"]).all(), ctx
            assert _rel(got["taps"], want["taps"]) < TAP_RTOL, (ctx, _rel(got["taps"], want["taps"]))
            assert _rel(got["logits"], want["logits"]) < LOGIT_RTOL, (ctx, _rel(got["logits"], want["logits"]))
            # argmax ids: the CPU's wherever its best logit leads by more than twice the largest logit
            # difference between device and CPU (no rounding within that can reorder the top two)
            clear = margin > 2 * float(np.max(np.abs(got["logits"] - want["logits"])))
            assert clear.sum() >= len(clear) // 2 and (got["argmax"] == want["argmax"])[clear].all(), ctx
            # the same features through either injection: the same draft, bit for bit, on the device
            assert got["draft"].tolist() == got["draft_features"].tolist(), ctx
            assert got["draft"].tolist() == want["draft"].tolist(), ctx
        # the capped taps straight from the graph are the copied taps' last rows, byte for byte
        copy, direct = arr[f"{i}-copy-taps"], arr[f"{i}-direct-taps"]
        assert np.array_equal(copy[-len(direct):], direct), (run["ngl"], run["dngl"])


def test_dflash2_offloaded_equals_plain_and_samples_the_target_distribution(backend, tmp_path):
    """The trained DFlash2 demo drafter: greedy on the device == plain, with the target fully and partly
    offloaded; sampled requests (its selector's lattice read back from the device) keep the target's
    distribution of the first two tokens (chi-square over 4 outcomes, as tests/test_sampling.py)."""
    from test_sampling import ALPHA, chi2_pvalue

    name, lib = backend
    runs = [{"ngl": FULL, "dngl": FULL}, {"ngl": SPLIT, "dngl": 0}]
    out, _ = child(name, lib, {"target": DEMO_T, "drafter": DEMO_D2, "runs": runs}, tmp_path)
    check_lossless(name, out, 6)
    assert all(r["tau"] > 2.0 for r in out["runs"]), [r["tau"] for r in out["runs"]]
    long_check(name)
    runs = [{"ngl": FULL, "dngl": FULL, "seeds": list(range(N_SAMPLED)), "n": 2, "top_k": 2}]
    sampled = child(name, lib, {"target": DEMO_T, "drafter": DEMO_D2, "runs": runs}, tmp_path / "sampled")[0]["runs"][0]
    from collections import Counter
    counts = Counter(tuple(t) for t in sampled["dflash"])
    exact = {tuple(k): v for k, v in sampled["exact"]}
    assert abs(sum(exact.values()) - 1) < 1e-5
    assert sampled["accepted"] > 0.2 * sampled["drafted"] and sampled["accepted"] < sampled["drafted"]
    p = chi2_pvalue(counts, exact)
    assert p > ALPHA, f"DFlash2 samples on {name} do not follow the target distribution (p={p:.2e}): {counts} vs {exact}"


# sampled requests: fewer than tests/test_sampling.py's 1,500 (each costs a prefill and a block on
# lavapipe); at 150 a sampler that ignored the rejection rule, or drew from the wrong row, still fails
N_SAMPLED = 150


def test_reduced_draft_head_offloaded(backend, tmp_path):
    """A drafter with its own reduced head and the d2t map (--draft-vocab): lossless and drafting well
    with the target and the drafter on the device, and with the target split and the drafter on the CPU."""
    from dflash_gguf.convert import draft_vocab as dv

    name, lib = backend
    red = tmp_path / "drafter-dv1024.gguf"
    dv.write_reduced_drafter(DEMO_D, DEMO_T, dv.choose(dv.read_vocab(DEMO_T), 1024).ids, red)
    runs = [{"ngl": FULL, "dngl": FULL}, {"ngl": SPLIT, "dngl": 0}]
    out, _ = child(name, lib, {"target": DEMO_T, "drafter": red, "runs": runs}, tmp_path / "run")
    check_lossless(name, out, 6)
    assert all(r["tau"] > 1.5 for r in out["runs"]), [r["tau"] for r in out["runs"]]


def test_hybrid_target_offloaded(backend, models, tmp_path):
    """Qwen3.5 (gated delta-net + attention): recurrent state on the device, rolled back by snapshots
    (n_rs_seq; fully offloaded) and by checkpoints (split, the drafter on the CPU)."""
    name, lib = backend
    long_check(name)
    pair = models.pair("qwen35", "dflash", 8)
    # 4 layers (3 delta-net, 1 attention); n_gpu_layers 3: layers 2-3 and the output on the device
    runs = [{"ngl": FULL, "dngl": FULL, "n_rs_seq": 7, "rollback": "snapshot"},
            {"ngl": 3, "dngl": 0, "rollback": "checkpoint"}]
    out, _ = child(name, lib, {"target": pair.target, "drafter": pair.drafter, "runs": runs, "n": 8}, tmp_path)
    for run in out["runs"]:
        check_placed(name, run, 4)
        assert run["dflash"] == run["plain"] and run["drafted"] > 0, run


def test_changing_the_tap_cap_after_a_decode(backend, tmp_path):
    """A tap cap set after the context's first decode (uncapped direct taps, then
    llama_dflash_set_tap_rows_max: llama.cpp reserves its scheduler again, freeing the old compute
    buffer), with the target in device memory, then a decode whose taps are trimmed, back and forth.
    ggml-vulkan reuses its descriptor sets from graph to graph and wrote only the bindings of the
    pipeline at hand, so a set keeps bindings from an earlier, wider write, naming the freed buffer;
    lavapipe (Mesa 22.3) takes a reference to every binding of a set it binds: a use after free in
    its queue thread (SIGSEGV, or glibc's "corrupted size vs. prev_size" later), in most runs of this
    test and every run under libefence. Patch 0023 pads such bindings with a live buffer. The decoder
    sets its cap once, before the first decode; a C API user may not."""
    name, lib = backend
    run = {"ngl": FULL, "dngl": 0, "same_context": True}
    out, arr = child(name, lib, {"target": DEMO_T, "drafter": DEMO_D, "n": 8,
                                 "capi": [{**run, "modes": ["uncapped", "direct"]},
                                          {**run, "modes": ["uncapped", "direct"] * 2, "rows": 64}]}, tmp_path)
    for tag in ("0", "1"):
        a, d = arr[f"{tag}-uncapped-taps"], arr[f"{tag}-direct-taps"]
        assert len(d) == 16 and np.array_equal(a[-len(d):], d), tag
        assert np.array_equal(arr[f"{tag}-uncapped-argmax"], arr[f"{tag}-direct-argmax"]), tag
