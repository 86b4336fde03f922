"""Tiny random targets of every tappable architecture, laid out by the pinned llama.cpp itself.

Most of these architectures cannot be built by transformers 4.57.6 (gemma4, minimax-m2, deepseek4,
...), and hand-writing their tensor lists would copy the loader's layout by eye. Instead the
pinned library makes them: ``llama_model_init_from_user`` takes GGUF metadata, creates every tensor
its ``load_arch_tensors`` asks for (shapes included) and fills it through a callback, and
``llama_model_save_to_file`` writes the model out. The metadata follows the pinned tree's own
random-model fixture (``tests/test-llama-archs.cpp`` ``get_gguf_ctx``: a superset of keys, each
loader reads what it needs) at the tiny shape of tests/tiny.py: hidden 64, 4 heads of 16, 4
layers, the 512-token SentencePiece vocabulary of the tiny Qwen3 target, so the tiny Qwen3
drafter (hidden 64, taps 1 and 3) fits every one of them.

Each model is made in a child process (a loader assertion aborts the process) and cached.
Run as ``python tiny_archs.py ARCH TOKENIZER_GGUF OUT`` (what :func:`make_target` does).
"""
from __future__ import annotations

import ctypes
import re
import subprocess
import sys
from pathlib import Path

import numpy as np

N_EMBD, N_HEAD, N_FF, N_LAYER, N_CTX = 64, 4, 128, 4, 4096
N_EXPERT, N_EXPERT_USED = 4, 2
# architectures the fixture gives experts (test-llama-archs.cpp moe_mandatory, among the tappable)
MOE = {"qwen3moe", "qwen3next", "qwen35moe", "qwen4exp", "deepseek4", "bailingmoe3", "gpt-oss", "minimax-01",
       "minimax-m2", "mimo2", "nemotron_h_moe"}
# linear-attention layers every FULL_ATTENTION_INTERVAL-th layer is full attention (qwen35 & co.)
FULL_ATTENTION_INTERVAL = 2
# weight scale (x 1/sqrt(fan-in)); 3 keeps most random targets from collapsing into one repeated
# token, these two collapse at 3 and not at 1
SCALE = {"nemotron_h": 1.0, "nemotron_h_moe": 1.0, "hunyuan_vl": 1.0, "hunyuan-dense": 1.0}


def _names(tree: Path, table: str, prefix: str) -> dict[str, str]:
    src = (tree / "src" / "llama-arch.cpp").read_text()
    body = src[src.index(f"{table} = {{"):]
    body = body[:body.index("};")]
    return dict(re.findall(r"\{\s*(" + prefix + r"\w+)\s*,\s*\"([^\"]*)\"\s*\}", body))


def metadata(arch: str, tree: Path) -> list[tuple[str, str, object]]:
    """(GGUF key, type, value) for ``arch``: get_gguf_ctx of test-llama-archs.cpp at the tiny shape."""
    kv_names = _names(tree, "LLM_KV_NAMES", "LLM_KV_")
    n_embd, n_head, n_ff, n_layer = N_EMBD, N_HEAD, N_FF, N_LAYER
    if arch == "gemma4":
        n_layer = 5          # the fixture's sliding-window pattern: every 5th layer is full attention
    if arch == "bailingmoe3":
        n_head = 1           # the fixture's MLA shape
    n_head_kv = 2 if arch in ("qwen3", "muse-glimmer") else n_head
    head = n_embd // n_head
    out: list[tuple[str, str, object]] = []

    def add(key: str, typ: str, value) -> None:
        out.append((kv_names[key].replace("%s", arch), typ, value))

    add("LLM_KV_GENERAL_ARCHITECTURE", "str", arch)
    add("LLM_KV_CONTEXT_LENGTH", "u32", N_CTX)
    add("LLM_KV_EMBEDDING_LENGTH", "u32", n_embd)
    add("LLM_KV_BLOCK_COUNT", "u32", n_layer)
    add("LLM_KV_LEADING_DENSE_BLOCK_COUNT", "u32", 1)
    hybrid_heads = arch in ("nemotron_h", "nemotron_h_moe", "lfm2", "bailingmoe3")
    if arch in ("nemotron_h", "nemotron_h_moe"):   # 0: attention, 1: mamba2, 2: MLP (MoE), 3: attention
        add("LLM_KV_FEED_FORWARD_LENGTH", "u32[]", [n_ff if il == 2 else 0 for il in range(n_layer)])
    else:
        add("LLM_KV_FEED_FORWARD_LENGTH", "u32", n_ff)
    add("LLM_KV_USE_PARALLEL_RESIDUAL", "bool", False)
    add("LLM_KV_LOGIT_SCALE", "f32", 1.0)
    add("LLM_KV_FULL_ATTENTION_INTERVAL", "u32", FULL_ATTENTION_INTERVAL)
    if hybrid_heads:            # layer 1 has no attention (recurrent / short-conv / linear)
        per = [0 if il == 1 else n_head for il in range(n_layer)]
        add("LLM_KV_ATTENTION_HEAD_COUNT", "u32[]", per)
        add("LLM_KV_ATTENTION_HEAD_COUNT_KV", "u32[]", per)
    else:
        add("LLM_KV_ATTENTION_HEAD_COUNT", "u32", n_head)
        add("LLM_KV_ATTENTION_HEAD_COUNT_KV", "u32", 1 if arch == "deepseek4" else n_head_kv)
    if arch == "deepseek4":
        add("LLM_KV_ATTENTION_KEY_LENGTH", "u32", head)
        add("LLM_KV_ATTENTION_VALUE_LENGTH", "u32", head)
        add("LLM_KV_ROPE_DIMENSION_COUNT", "u32", head // 2)
    elif arch == "bailingmoe3":
        add("LLM_KV_ATTENTION_KEY_LENGTH", "u32", 576)
        add("LLM_KV_ATTENTION_VALUE_LENGTH", "u32", 512)
        add("LLM_KV_ROPE_DIMENSION_COUNT", "u32", 64)
        add("LLM_KV_ATTENTION_KEY_LENGTH_MLA", "u32", 192)
        add("LLM_KV_ATTENTION_VALUE_LENGTH_MLA", "u32", 128)
    add("LLM_KV_ATTENTION_LAYERNORM_EPS", "f32", 1e-5)
    add("LLM_KV_ATTENTION_LAYERNORM_RMS_EPS", "f32", 1e-5)
    add("LLM_KV_ATTENTION_GROUPNORM_EPS", "f32", 1e-5)
    add("LLM_KV_ATTENTION_GROUPNORM_GROUPS", "u32", 8)
    add("LLM_KV_ATTENTION_Q_LORA_RANK", "u32", 64 if arch == "deepseek4" else 512)
    add("LLM_KV_ATTENTION_KV_LORA_RANK", "u32", 512)
    add("LLM_KV_ATTENTION_SLIDING_WINDOW", "u32", 32)   # short: generations run past the window
    if arch == "gemma4":
        add("LLM_KV_EMBEDDING_LENGTH_PER_LAYER", "u32", 0)   # no per-layer embeddings (26B-A4B, 31B)
        add("LLM_KV_ATTENTION_SHARED_KV_LAYERS", "u32", 0)
        add("LLM_KV_ATTENTION_KEY_LENGTH_SWA", "u32", head)
        add("LLM_KV_ATTENTION_VALUE_LENGTH_SWA", "u32", head)
        add("LLM_KV_ROPE_FREQ_BASE_SWA", "f32", 10000.0)
        add("LLM_KV_ATTENTION_SLIDING_WINDOW_PATTERN", "bool[]", [(il + 1) % 5 != 0 for il in range(n_layer)])
        add("LLM_KV_ATTENTION_KEY_LENGTH", "u32", head)
        add("LLM_KV_ATTENTION_VALUE_LENGTH", "u32", head)
        add("LLM_KV_FINAL_LOGIT_SOFTCAPPING", "f32", 30.0)
    elif arch in ("mimo2", "muse-glimmer"):
        add("LLM_KV_ATTENTION_SLIDING_WINDOW_PATTERN", "u32[]", [il % 2 for il in range(n_layer)])
    else:
        add("LLM_KV_ATTENTION_SLIDING_WINDOW_PATTERN", "u32", 2)
    if arch == "qwen4exp":
        add("LLM_KV_HYPER_CONNECTION_COUNT", "u32", 4)
        add("LLM_KV_HYPER_CONNECTION_SINKHORN_ITERATIONS", "u32", 2)
        add("LLM_KV_HYPER_CONNECTION_EPSILON", "f32", 1e-6)
        add("LLM_KV_HYPER_CONNECTION_LOW_RANK", "u32", 8)
        add("LLM_KV_ATTENTION_COMPRESS_RATIOS", "u32[]", [4] * n_layer)
        ngram, per_ngram = 3, 2
        ple_heads = (ngram - 1) * per_ngram
        add("LLM_KV_PLE_LAYERS", "u32[]", [0])
        add("LLM_KV_PLE_NGRAM_SIZE", "u32", ngram)
        add("LLM_KV_PLE_HEADS_PER_NGRAM", "u32", per_ngram)
        add("LLM_KV_PLE_CONV_KERNEL", "u32", 4)
        add("LLM_KV_PLE_EOS_TOKEN_ID", "u32", 0)
        add("LLM_KV_EMBEDDING_LENGTH_PER_LAYER", "u32", n_embd // ple_heads)
        add("LLM_KV_PLE_LAYER_MULTIPLIERS", "u64[]", [1, 3, 5])
        add("LLM_KV_PLE_HEAD_OFFSETS", "u64[]", [h * 512 for h in range(ple_heads)])
        add("LLM_KV_PLE_HEAD_VOCAB_SIZES", "u64[]", [512] * ple_heads)
    add("LLM_KV_ATTENTION_INDEXER_HEAD_COUNT", "u32", 64)
    add("LLM_KV_ATTENTION_INDEXER_KEY_LENGTH", "u32", head if arch == "qwen4exp" else 128)
    add("LLM_KV_ATTENTION_INDEXER_TOP_K", "u32", 131072)
    add("LLM_KV_ATTENTION_INDEXER_BLOCK_SIZE", "u32", 4)
    add("LLM_KV_ATTENTION_INDEXER_KPOOL", "u32", 4)
    add("LLM_KV_ATTENTION_INDEXER_KPOOL_SELECT_TAIL", "bool", True)
    add("LLM_KV_ATTENTION_INDEXER_LOCAL_BLOCKS", "u32", 1)
    if arch == "bailingmoe3":
        add("LLM_KV_ROPE_DIMENSION_SECTIONS", "u32[]", [8, 12, 12, 0])
    else:
        add("LLM_KV_ROPE_DIMENSION_SECTIONS", "u32[]", [head // 4] * 4)
    if arch == "deepseek4":
        add("LLM_KV_ATTENTION_OUTPUT_GROUP_COUNT", "u32", n_head)
        add("LLM_KV_ATTENTION_OUTPUT_LORA_RANK", "u32", 32)
        add("LLM_KV_ATTENTION_COMPRESS_RATIOS", "u32[]", [0, 0, 4, 128])
        add("LLM_KV_ATTENTION_COMPRESS_ROPE_FREQ_BASE", "f32", 160000.0)
        add("LLM_KV_HYPER_CONNECTION_COUNT", "u32", 4)
        add("LLM_KV_HYPER_CONNECTION_SINKHORN_ITERATIONS", "u32", 2)
        add("LLM_KV_HYPER_CONNECTION_EPSILON", "f32", 1e-6)
        add("LLM_KV_HASH_LAYER_COUNT", "u32", 0)
        add("LLM_KV_SWIGLU_CLAMP_EXP", "f32", 10.0)
        add("LLM_KV_EXPERT_WEIGHTS_SCALE", "f32", 1.0)
        add("LLM_KV_EXPERT_WEIGHTS_NORM", "bool", True)
    if arch in MOE:
        add("LLM_KV_EXPERT_FEED_FORWARD_LENGTH", "u32", n_ff)
        add("LLM_KV_EXPERT_SHARED_FEED_FORWARD_LENGTH", "u32", n_ff // 2)
        add("LLM_KV_EXPERT_LATENT_LENGTH", "u32", n_ff)
        add("LLM_KV_INTERLEAVE_MOE_LAYER_STEP", "u32", 2)
        add("LLM_KV_EXPERT_COUNT", "u32", N_EXPERT)
        add("LLM_KV_EXPERT_USED_COUNT", "u32", N_EXPERT_USED)
        add("LLM_KV_EXPERT_SHARED_COUNT", "u32", 1)
        add("LLM_KV_EXPERT_GATING_FUNC", "u32", 4 if arch == "deepseek4" else 2)
        add("LLM_KV_EXPERT_GROUP_SCALE", "f32", 1.0)
        add("LLM_KV_EXPERTS_PER_GROUP", "u32", 1)
    # gated delta-net: d_inner = value heads (time_step_rank) x head size (state_size)
    add("LLM_KV_SSM_INNER_SIZE", "u32", 16 * n_head if arch in ("qwen3next", "qwen35", "qwen35moe", "qwen4exp")
        else 2 * n_embd)
    add("LLM_KV_SSM_CONV_KERNEL", "u32", 4)
    add("LLM_KV_SSM_STATE_SIZE", "u32", 16)
    add("LLM_KV_SSM_TIME_STEP_RANK", "u32", n_head)
    add("LLM_KV_SSM_GROUP_COUNT", "u32", 2)
    if arch == "bailingmoe3":
        add("LLM_KV_SWIGLU_CLAMP_EXP", "f32[]", [0.0] + [4.0] * (n_layer - 1))
        add("LLM_KV_SWIGLU_CLAMP_SHEXP", "f32[]", [0.0] + [5.0] * (n_layer - 1))
    add("LLM_KV_KDA_HEAD_DIM", "u32", 128)
    add("LLM_KV_KDA_SAFE_GATE", "bool", True)
    add("LLM_KV_KDA_GATE_LOWER_BOUND", "f32", -5.0)
    add("LLM_KV_SHORTCONV_L_CACHE", "u32", 3)
    add("LLM_KV_WKV_HEAD_SIZE", "u32", head)
    add("LLM_KV_RESIDUAL_SCALE", "f32", 3.5565588200778455)
    add("LLM_KV_ATTN_RES_BLOCK_SIZE", "u32", 12)
    return out


def _gguf(tree: Path):
    sys.path.insert(0, str(tree / "gguf-py"))
    import gguf
    return gguf


def _add_kvs(w, items) -> None:
    gguf = sys.modules["gguf"]
    typed = {"u32": gguf.GGUFValueType.UINT32, "f32": gguf.GGUFValueType.FLOAT32,
             "bool": gguf.GGUFValueType.BOOL, "str": gguf.GGUFValueType.STRING}
    arrays = {"u32[]": gguf.GGUFValueType.UINT32, "u64[]": gguf.GGUFValueType.UINT64,
              "f32[]": gguf.GGUFValueType.FLOAT32, "bool[]": gguf.GGUFValueType.BOOL}
    for key, typ, value in items:
        if typ in arrays:
            w.add_key_value(key, list(value), gguf.GGUFValueType.ARRAY, sub_type=arrays[typ])
        else:
            w.add_key_value(key, value, typed[typ])


def _copy_fields(w, r, keep) -> None:
    """Copy the key/values of reader ``r`` that ``keep(name)`` selects into writer ``w``."""
    gguf = sys.modules["gguf"]
    for name, field in r.fields.items():
        if name.startswith("GGUF.") or not keep(name):
            continue
        vt = field.types[0]
        if vt == gguf.GGUFValueType.ARRAY:
            if not len(field.data):
                continue     # gguf-py writes no empty arrays (the saver writes e.g. no classifier labels so)
            sub = field.types[-1]
            if sub == gguf.GGUFValueType.STRING:
                vals = [bytes(field.parts[i]).decode("utf-8") for i in field.data]
            else:
                vals = [field.parts[i].tolist()[0] for i in field.data]
            w.add_key_value(name, vals, vt, sub_type=sub)
        elif vt == gguf.GGUFValueType.STRING:
            w.add_key_value(name, bytes(field.parts[-1]).decode("utf-8"), vt)
        else:
            w.add_key_value(name, field.parts[-1].tolist()[0], vt)


def _complete(path: Path, arch: str, tree: Path) -> None:
    """Add the metadata keys ``llama_model_save_to_file`` left out (gemma4's per-layer embedding
    length, which its loader requires: the saver writes the hparams it knows generically)."""
    gguf = _gguf(tree)
    r = gguf.GGUFReader(str(path))
    missing = [kv for kv in metadata(arch, tree) if kv[0] not in r.fields]
    if not missing:
        return
    tmp = path.with_suffix(".fix.gguf")
    w = gguf.GGUFWriter(str(tmp), arch=arch, use_temp_file=False)
    _copy_fields(w, r, lambda name: name != "general.architecture")
    _add_kvs(w, missing)
    for t in r.tensors:
        w.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    del r
    tmp.replace(path)


def _write_meta(path: Path, arch: str, tree: Path, tokenizer_gguf: Path) -> None:
    """A GGUF with the metadata only (no tensors): the architecture's keys and the tiny tokenizer's."""
    gguf = _gguf(tree)
    w = gguf.GGUFWriter(str(path), arch=arch, use_temp_file=False)
    w.kv_data[0].pop("general.architecture", None)
    _add_kvs(w, metadata(arch, tree))
    _copy_fields(w, gguf.GGUFReader(str(tokenizer_gguf)), lambda name: name.startswith("tokenizer."))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


class _GGUFInitParams(ctypes.Structure):
    _fields_ = [("no_alloc", ctypes.c_bool), ("ctx", ctypes.c_void_p)]


def _build(arch: str, tokenizer_gguf: Path, out: Path) -> None:
    """In this process: metadata -> llama_model_init_from_user (random weights) -> save."""
    import llama_cpp.llama_cpp as C

    from dflash_gguf import paths

    tree = paths.upstream_tree()
    meta = out.with_suffix(".meta.gguf")
    _write_meta(meta, arch, tree, tokenizer_gguf)
    libdir = Path(C._lib._name).parent
    ggml = ctypes.CDLL(str(libdir / "libggml-base.so"))
    ggml.gguf_init_from_file.restype = ctypes.c_void_p
    ggml.gguf_init_from_file.argtypes = [ctypes.c_char_p, _GGUFInitParams]
    ggml.gguf_free.argtypes = [ctypes.c_void_p]
    ggml.ggml_get_name.restype = ctypes.c_char_p
    ggml.ggml_get_name.argtypes = [ctypes.c_void_p]
    ggml.ggml_nelements.restype = ctypes.c_int64
    ggml.ggml_nelements.argtypes = [ctypes.c_void_p]
    ggml.ggml_nbytes.restype = ctypes.c_size_t
    ggml.ggml_nbytes.argtypes = [ctypes.c_void_p]
    ggml.ggml_backend_tensor_set.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
    lib = ctypes.CDLL(C._lib._name)
    lib.llama_model_init_from_user.restype = ctypes.c_void_p
    cb_type = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p)
    lib.llama_model_init_from_user.argtypes = [ctypes.c_void_p, cb_type, ctypes.c_void_p,
                                               C.llama_model_params]
    lib.llama_model_save_to_file.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    lib.llama_model_free.argtypes = [ctypes.c_void_p]

    failures: list[str] = []

    def fill(tensor, _ud):
        try:
            name = ggml.ggml_get_name(tensor).decode()
            n = ggml.ggml_nelements(tensor)
            gtype = ctypes.c_int32.from_address(tensor).value                 # ggml_tensor.type
            ne0 = ctypes.c_int64.from_address(tensor + 16).value              # ggml_tensor.ne[0]
            rng = np.random.default_rng(_seed(name))
            v = rng.standard_normal(n).astype(np.float32)
            if "norm" in name:
                v = 1.0 + 0.1 * v
            elif name.startswith("token_embd") or name.endswith("per_layer_token_embd.weight"):
                pass
            elif "ssm_a" in name:
                v = -np.abs(v)
            elif "ssm_d" in name or name.endswith(".bias") or "exp_probs_b" in name or "sinks" in name:
                v = 0.1 * v
            else:
                v *= SCALE.get(arch, 3.0) / max(ne0, 1) ** 0.5
            if gtype == 1:
                v = v.astype(np.float16)
            elif gtype != 0:
                raise ValueError(f"tensor {name} has ggml type {gtype}")
            ggml.ggml_backend_tensor_set(tensor, v.ctypes.data, 0, ggml.ggml_nbytes(tensor))
        except Exception as e:   # noqa: BLE001 - reported after the call
            failures.append(f"{e!r}")

    cb = cb_type(fill)
    gctx = ggml.gguf_init_from_file(str(meta).encode(), _GGUFInitParams(True, None))
    if not gctx:
        raise RuntimeError(f"gguf_init_from_file failed on {meta}")
    params = C.llama_model_default_params()
    model = lib.llama_model_init_from_user(gctx, cb, None, params)
    ggml.gguf_free(gctx)
    meta.unlink()
    if not model or failures:
        raise RuntimeError(f"llama_model_init_from_user failed for {arch}: {failures[:3]}")
    tmp = out.with_suffix(".tmp.gguf")
    lib.llama_model_save_to_file(model, str(tmp).encode())
    lib.llama_model_free(model)
    _complete(tmp, arch, tree)
    tmp.replace(out)


def _seed(name: str) -> int:
    import hashlib

    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "little")


def make_target(arch: str, tokenizer_gguf: Path, out: Path) -> Path:
    """A tiny random ``arch`` target GGUF at ``out`` (cached), made in a child process."""
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    r = subprocess.run([sys.executable, __file__, arch, str(tokenizer_gguf), str(out)], capture_output=True,
                       text=True, stdin=subprocess.DEVNULL)
    if r.returncode != 0 or not out.exists():
        raise RuntimeError(f"making a tiny {arch} target failed (exit {r.returncode}):\n{r.stderr[-4000:]}")
    return out


if __name__ == "__main__":
    _build(sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]))


def make_gpt_oss_hf(out_dir: Path, tok_dir: Path, *, seed: int = 0) -> Path:
    """A random transformers ``GptOssForCausalLM`` (hidden 64, 4 layers alternating sliding and full
    attention, 4 experts, unquantised experts) with GPT-2's tokenizer (the converter's gpt-oss
    vocabulary path is the GPT-2 BPE one), saved as a Hugging Face folder."""
    import torch
    import transformers

    import tiny

    out_dir.mkdir(parents=True, exist_ok=True)
    if (out_dir / "config.json").exists():
        return out_dir
    torch.manual_seed(seed)
    cfg = transformers.GptOssConfig(
        vocab_size=tiny.GPT2_VOCAB_SIZE, hidden_size=N_EMBD, intermediate_size=N_FF, num_hidden_layers=N_LAYER,
        num_attention_heads=N_HEAD, num_key_value_heads=2, head_dim=N_EMBD // N_HEAD, num_local_experts=N_EXPERT,
        num_experts_per_tok=N_EXPERT_USED, sliding_window=32, max_position_embeddings=4096,
        layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(N_LAYER)],
        rope_scaling=None, rope_theta=10000.0, tie_word_embeddings=False,
        bos_token_id=tiny.GPT2_VOCAB_SIZE - 1, eos_token_id=tiny.GPT2_VOCAB_SIZE - 1, torch_dtype="float32")
    model = transformers.GptOssForCausalLM(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            elif name.endswith("bias") or "sinks" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            else:
                fan_in = p.shape[-2] if "experts" in name else p.shape[-1]   # experts store [E, in, out]
                p.copy_(torch.randn(p.shape, generator=g) * 3.0 / fan_in ** 0.5)
    model.save_pretrained(out_dir, safe_serialization=True)
    tiny._gpt2_tokenizer_files(out_dir, tok_dir)
    return out_dir
