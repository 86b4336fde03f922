"""Tiny synthetic Hugging Face checkpoints (targets and DFlash/DFlash2/DSpark drafters) for the tests.

Everything is made here from fixed seeds: a SentencePiece BPE tokenizer trained on a few
Python standard-library files, random Qwen3 / Llama targets built with transformers, and
drafters written in the z-lab checkpoint layout (bare tensor names, no embeddings or LM head,
``architectures: ["DFlashDraftModel"]``, ``dflash_config``).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np

MASK_PIECE = "<|mask|>"
VOCAB_SIZE = 512


def _corpus(max_bytes: int = 400_000) -> str:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    parts, size = [], 0
    for name in ("textwrap.py", "argparse.py", "json/decoder.py", "json/encoder.py", "dataclasses.py",
                 "functools.py", "heapq.py", "bisect.py", "string.py", "fnmatch.py", "shlex.py"):
        p = stdlib / name
        if p.exists():
            t = p.read_text(encoding="utf-8", errors="replace")
            parts.append(t)
            size += len(t)
        if size > max_bytes:
            break
    return "\n".join(parts)


def make_tokenizer(out_dir: Path, vocab_size: int = VOCAB_SIZE) -> Path:
    """Train a byte-fallback SentencePiece BPE model with a control piece for the mask token."""
    import sentencepiece as spm

    out_dir.mkdir(parents=True, exist_ok=True)
    model = out_dir / "tokenizer.model"
    if model.exists():
        return model
    corpus = out_dir / "corpus.txt"
    corpus.write_text(_corpus(), encoding="utf-8")
    spm.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(out_dir / "tokenizer"), vocab_size=vocab_size,
        model_type="bpe", byte_fallback=True, normalization_rule_name="identity",
        remove_extra_whitespaces=False, split_digits=True, control_symbols=[MASK_PIECE],
        bos_id=1, eos_id=2, unk_id=0, pad_id=-1, num_threads=1, minloglevel=2,
        allow_whitespace_only_pieces=True, input_sentence_size=0, max_sentence_length=20000)
    corpus.unlink()
    (out_dir / "tokenizer.vocab").unlink(missing_ok=True)
    return model


def mask_token_id(tokenizer_model: Path) -> int:
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(tokenizer_model))
    return sp.piece_to_id(MASK_PIECE)


def _tokenizer_files(dst: Path, tok_dir: Path) -> None:
    (dst / "tokenizer.model").write_bytes((tok_dir / "tokenizer.model").read_bytes())
    (dst / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": True,
        "model_max_length": 4096}))


def _spice_up(model, seed: int, scale: float) -> None:
    """Random targets at the default init collapse into one repeated token; widen the weights."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * scale / p.shape[-1] ** 0.5)


def make_target(out_dir: Path, tok_dir: Path, arch: str = "qwen3", *, hidden: int = 64, layers: int = 4,
                heads: int = 4, kv_heads: int = 2, head_dim: int = 16, inter: int = 128, seed: int = 0,
                scale: float = 3.0) -> Path:
    """A random Qwen3 or Llama causal LM saved as a Hugging Face folder."""
    if arch in HYBRID_ARCHS:
        return make_hybrid_target(out_dir, tok_dir, arch, hidden=hidden, layers=layers, heads=heads,
                                  kv_heads=kv_heads, head_dim=head_dim, inter=inter, seed=seed, scale=scale)
    import torch
    import transformers

    out_dir.mkdir(parents=True, exist_ok=True)
    if (out_dir / "config.json").exists():
        return out_dir
    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB_SIZE, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=4096,
                  rms_norm_eps=1e-6, rope_theta=10000.0, bos_token_id=1, eos_token_id=2, torch_dtype="float32")
    if arch == "qwen3":
        cfg = transformers.Qwen3Config(head_dim=head_dim, tie_word_embeddings=True, **common)
        model = transformers.Qwen3ForCausalLM(cfg)
    elif arch == "llama":
        cfg = transformers.LlamaConfig(head_dim=head_dim, tie_word_embeddings=False, **common)
        model = transformers.LlamaForCausalLM(cfg)
    else:
        raise ValueError(arch)
    _spice_up(model, seed, scale)
    model.save_pretrained(out_dir, safe_serialization=True)
    _tokenizer_files(out_dir, tok_dir)
    return out_dir


def make_drafter(out_dir: Path, target_dir: Path, *, kind: str = "dflash", layers: int = 1, block_size: int = 8,
                 target_layer_ids: list[int] | None = None, seed: int = 1, inter: int = 128,
                 top_k: int = 4, rank: int = 16, conv_kernel: int = 2, conv_group: int = 16,
                 zero_blocks: bool = False, markov_rank: int = 8, confidence: bool = True,
                 anchor: bool = True) -> Path:
    """A random DFlash (v1), DFlash2 or DSpark drafter in the z-lab layout for the given target.

    DSpark (``kind="dspark"``): the DFlash backbone plus DeepSpec's vanilla Markov head
    (``markov_head.markov_w1`` an embedding ``[vocab, rank]``, ``markov_w2`` a bias-free linear
    ``rank -> vocab``), with ``confidence`` its confidence head (``confidence_head.proj``, a linear
    ``hidden + rank -> 1``), in the anchor-first layout (``anchor``, DeepSpec's
    ``sample_from_anchor``) or the 1+N bonus-anchor one.
    """
    from safetensors.numpy import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    if (out_dir / "config.json").exists():
        return out_dir
    tcfg = json.loads((target_dir / "config.json").read_text())
    H = tcfg["hidden_size"]
    n_t = tcfg["num_hidden_layers"]
    heads, kv = tcfg["num_attention_heads"], tcfg["num_key_value_heads"]
    hd = tcfg.get("head_dim") or H // heads
    ids = target_layer_ids if target_layer_ids is not None else [0, n_t - 2]
    mask = mask_token_id(target_dir / "tokenizer.model")
    rng = np.random.default_rng(seed)

    def w(*shape, s=1.0):
        return (rng.standard_normal(shape) * s / np.sqrt(shape[-1])).astype(np.float32)

    t = {"fc.weight": w(H, len(ids) * H), "hidden_norm.weight": np.ones(H, np.float32),
         "norm.weight": np.ones(H, np.float32)}
    for i in range(layers):
        p = f"layers.{i}."
        t.update({
            p + "input_layernorm.weight": np.ones(H, np.float32),
            p + "post_attention_layernorm.weight": np.ones(H, np.float32),
            p + "self_attn.q_proj.weight": w(heads * hd, H), p + "self_attn.k_proj.weight": w(kv * hd, H),
            p + "self_attn.v_proj.weight": w(kv * hd, H), p + "self_attn.o_proj.weight": w(H, heads * hd),
            p + "self_attn.q_norm.weight": np.ones(hd, np.float32), p + "self_attn.k_norm.weight": np.ones(hd, np.float32),
            p + "mlp.gate_proj.weight": w(inter, H), p + "mlp.up_proj.weight": w(inter, H),
            p + "mlp.down_proj.weight": w(H, inter),
        })
        if zero_blocks:   # the block output is the token embedding itself: proposes its input
            t[p + "self_attn.o_proj.weight"][:] = 0
            t[p + "mlp.down_proj.weight"][:] = 0
        if kind == "dflash2":
            for side in ("attention_conv", "mlp_conv"):
                t[p + f"{side}.base_kernel"] = (rng.standard_normal((2, conv_kernel, H)) * 0.1).astype(np.float32)
                t[p + f"{side}.kernel_projection.weight"] = w(2 * conv_kernel * H // conv_group, H, s=0.1)
    dcfg = {"block_size": block_size, "mask_token_id": mask, "target_layer_ids": ids}
    if kind == "dspark":
        V = tcfg["vocab_size"]
        # the bias is a large share of the logits, so the chain visibly steers the block's tokens
        t["markov_head.markov_w1.weight"] = (rng.standard_normal((V, markov_rank)) * 2.0).astype(np.float32)
        t["markov_head.markov_w2.weight"] = w(V, markov_rank, s=6.0)
        if confidence:
            t["confidence_head.proj.weight"] = w(1, H + markov_rank)
    if kind == "dflash2":
        V = tcfg["vocab_size"]
        t["candidate_selector.hidden_projection.weight"] = w(rank, H)
        t["candidate_selector.predecessor_codebook"] = w(V, rank)
        t["candidate_selector.successor_codebook"] = w(V, rank)
        dcfg.update({"conv_group_size": conv_group, "conv_kernel_size": conv_kernel, "selector_rank": rank,
                     "selector_top_k": top_k})
    save_file(t, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    arch_name = {"dflash": "DFlashDraftModel", "dflash2": "DFlash2DraftModel", "dspark": "DSparkDraftModel"}[kind]
    cfg = {
        "architectures": [arch_name],
        "model_type": "qwen3", "hidden_size": H, "intermediate_size": inter, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": hd,
        "vocab_size": tcfg["vocab_size"], "rms_norm_eps": 1e-6, "rope_theta": tcfg.get("rope_theta", 10000.0),
        "max_position_embeddings": 4096, "hidden_act": "silu", "tie_word_embeddings": False,
        "block_size": block_size, "num_target_layers": n_t, "dflash_config": dcfg, "torch_dtype": "float32",
    }
    if kind == "dflash2":
        cfg["is_causal"] = False
    if kind == "dspark":
        cfg.update({"markov_rank": markov_rank, "markov_head_type": "vanilla", "sample_from_anchor": anchor,
                    "enable_confidence_head": confidence, "confidence_head_with_markov": True})
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    return out_dir


def upstream_convert(hf_dir: Path, out_file: Path, target_dir: Path | None = None, outtype: str = "f32") -> Path:
    """Convert with the pinned sdist's convert_hf_to_gguf.py (kept by the build)."""
    from dflash_gguf import paths

    if out_file.exists():
        return out_file
    tree = paths.upstream_tree()
    # written under a private name and renamed into place: an interrupted or concurrent run never
    # leaves a partial file that a later run would take for a finished one
    part = out_file.with_name(f".{out_file.name}.{os.getpid()}.part")
    cmd = [sys.executable, str(tree / "convert_hf_to_gguf.py"), str(hf_dir), "--outfile", str(part),
           "--outtype", outtype]
    if target_dir is not None:
        cmd += ["--target-model-dir", str(target_dir)]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"conversion of {hf_dir} failed:\n{r.stderr[-3000:]}")
        os.replace(part, out_file)
    finally:
        part.unlink(missing_ok=True)
    return out_file


# ---------------------------------------------------------------------------------------------
# Hybrid (gated delta-net) targets: Qwen3.5 (llama.cpp arch ``qwen35``) and Qwen3-Next (``qwen3next``).
#
# Written directly as config.json + model.safetensors: transformers 4.57.6 has no qwen3_5 classes
# (the converter then falls back to reading config.json), and writing both the same way keeps the
# tensor layout explicit. Names and shapes follow the pinned converter (conversion/qwen.py:
# Qwen3NextModel, _LinearAttentionVReorderBase, Qwen3_5TextModel, _QwenMtpMixin), gguf-py's
# tensor_mapping.py and llama.cpp's loaders (src/models/qwen35.cpp, qwen3next.cpp).
#
# Tokenizer: both converter classes take TextModel.set_vocab, i.e. the GPT-2 BPE path with the
# pre-tokenizer hash check, so the SentencePiece model of the other targets cannot be used (a
# custom BPE fails the hash check). The hybrids therefore use GPT-2's byte-level BPE (50,257
# tokens), rebuilt exactly from the vendored ``models/ggml-vocab-gpt-2.gguf``; the converter
# recognises it as ``gpt-2``. The SentencePiece ``tokenizer.model`` is copied alongside only so
# that ``make_drafter`` (which reads the mask id from it) works unchanged: the drafter's mask id
# is then an ordinary GPT-2 token, which is fine for a random drafter.
# ---------------------------------------------------------------------------------------------

HYBRID_ARCHS = ("qwen35", "qwen3next")
GPT2_VOCAB_SIZE = 50257


def _gpt2_tokenizer_json(cache_dir: Path) -> Path:
    """GPT-2's tokenizer.json rebuilt from the vendored vocab GGUF (cached)."""
    out = cache_dir / "tokenizer.json"
    if out.exists():
        return out
    import gguf
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    from dflash_gguf import paths

    r = gguf.GGUFReader(str(paths.upstream_tree() / "models" / "ggml-vocab-gpt-2.gguf"))

    def strings(key: str) -> list[str]:
        f = r.fields[key]
        return [bytes(f.parts[i]).decode("utf-8") for i in f.data]

    tokens, merges = strings("tokenizer.ggml.tokens"), strings("tokenizer.ggml.merges")
    assert len(tokens) == GPT2_VOCAB_SIZE and tokens[-1] == "<|endoftext|>"
    tk = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)},
                              merges=[tuple(m.split(" ")) for m in merges]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.post_processor = processors.ByteLevel(trim_offsets=False)
    tk.add_special_tokens([AddedToken("<|endoftext|>", special=True)])
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = cache_dir / "tokenizer.json.tmp"
    tk.save(str(tmp))
    tmp.replace(out)
    return out


def _gpt2_tokenizer_files(dst: Path, tok_dir: Path) -> None:
    (dst / "tokenizer.json").write_bytes(_gpt2_tokenizer_json(tok_dir / "gpt2").read_bytes())
    (dst / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "GPT2TokenizerFast", "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>",
        "unk_token": "<|endoftext|>", "add_bos_token": False, "model_max_length": 4096}))
    # only for make_drafter's mask-token lookup; the converter reads tokenizer.json
    (dst / "tokenizer.model").write_bytes((tok_dir / "tokenizer.model").read_bytes())


def _mrope_section(rot_dims: int) -> list[int]:
    """Split rot_dims/2 frequency pairs over (t, h, w) like Qwen3.5's [11, 11, 10] for 64 dims."""
    half = rot_dims // 2
    return [half // 3 + (half % 3 > 0), half // 3 + (half % 3 > 1), half // 3]


def _hybrid_weights(cfg: dict, seed: int, scale: float) -> dict[str, np.ndarray]:
    """Random weights in the HF layout of Qwen3.5 (dense MLP) or Qwen3-Next (MoE + shared expert).

    Zero-centred RMSNorm weights (Qwen3-Next style: the converter adds 1) get small random values;
    the gated-delta-net norm is a plain RMSNorm (1 + noise). A_log/dt_bias give decays
    exp(-A*softplus(a+dt_bias)) mostly around 0.7-0.97 per token, so the recurrent state carries
    information over many tokens and a wrong rollback shows in the output.
    """
    rng = np.random.default_rng(seed)
    H, V = cfg["hidden_size"], cfg["vocab_size"]
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv, K = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"], cfg["linear_conv_kernel_dim"]
    key_dim, value_dim = nk * dk, nv * dv
    moe = "num_experts" in cfg

    def w(*shape, s=scale):
        return (rng.standard_normal(shape) * s / np.sqrt(shape[-1])).astype(np.float32)

    def znorm(n):   # zero-centred: effective weight 1 + w
        return (0.1 * rng.standard_normal(n)).astype(np.float32)

    def attn(p: str) -> dict:
        return {p + "self_attn.q_proj.weight": w(nh * hd * 2, H),   # per head [query, gate]
                p + "self_attn.k_proj.weight": w(nkv * hd, H), p + "self_attn.v_proj.weight": w(nkv * hd, H),
                p + "self_attn.o_proj.weight": w(H, nh * hd),
                p + "self_attn.q_norm.weight": znorm(hd), p + "self_attn.k_norm.weight": znorm(hd)}

    def linear_attn(p: str) -> dict:
        p += "linear_attn."
        t = {p + "conv1d.weight": w(key_dim * 2 + value_dim, 1, K),
             p + "A_log": np.log(rng.uniform(0.05, 0.5, nv)).astype(np.float32),
             p + "dt_bias": rng.uniform(-2.0, 0.0, nv).astype(np.float32),
             p + "norm.weight": (1.0 + 0.1 * rng.standard_normal(dv)).astype(np.float32),
             p + "out_proj.weight": w(H, value_dim)}
        if moe:   # Qwen3-Next: fused projections, grouped per key head
            t[p + "in_proj_qkvz.weight"] = w(2 * key_dim + 2 * value_dim, H)
            t[p + "in_proj_ba.weight"] = w(2 * nv, H, s=1.0)
        else:     # Qwen3.5: separate projections
            t[p + "in_proj_qkv.weight"] = w(2 * key_dim + value_dim, H)
            t[p + "in_proj_z.weight"] = w(value_dim, H)
            t[p + "in_proj_b.weight"] = w(nv, H, s=1.0)
            t[p + "in_proj_a.weight"] = w(nv, H, s=1.0)
        return t

    def mlp(p: str) -> dict:
        p += "mlp."
        if not moe:
            I = cfg["intermediate_size"]
            return {p + "gate_proj.weight": w(I, H), p + "up_proj.weight": w(I, H), p + "down_proj.weight": w(H, I)}
        E, I, Is = cfg["num_experts"], cfg["moe_intermediate_size"], cfg["shared_expert_intermediate_size"]
        t = {p + "gate.weight": w(E, H, s=1.0), p + "shared_expert_gate.weight": w(1, H, s=1.0),
             p + "shared_expert.gate_proj.weight": w(Is, H), p + "shared_expert.up_proj.weight": w(Is, H),
             p + "shared_expert.down_proj.weight": w(H, Is)}
        for e in range(E):
            t.update({p + f"experts.{e}.gate_proj.weight": w(I, H), p + f"experts.{e}.up_proj.weight": w(I, H),
                      p + f"experts.{e}.down_proj.weight": w(H, I)})
        return t

    def block(p: str, kind: str) -> dict:
        t = {p + "input_layernorm.weight": znorm(H), p + "post_attention_layernorm.weight": znorm(H)}
        t.update(attn(p) if kind == "full_attention" else linear_attn(p))
        t.update(mlp(p))
        return t

    t = {"model.embed_tokens.weight": rng.standard_normal((V, H)).astype(np.float32), "model.norm.weight": znorm(H)}
    for i, kind in enumerate(cfg["layer_types"]):
        t.update(block(f"model.layers.{i}.", kind))
    if not cfg.get("tie_word_embeddings", False):
        t["lm_head.weight"] = w(V, H, s=1.0)
    # one MTP block (real checkpoints ship it, and the converter's MTP wiring expects it unless
    # --no-mtp is given); llama.cpp loads it with TENSOR_SKIP and never runs it in the main graph
    for i in range(cfg.get("mtp_num_hidden_layers", 1)):
        t.update(block(f"mtp.layers.{i}.", "full_attention"))
    t.update({"mtp.fc.weight": w(H, 2 * H), "mtp.pre_fc_norm_embedding.weight": znorm(H),
              "mtp.pre_fc_norm_hidden.weight": znorm(H), "mtp.norm.weight": znorm(H)})
    return t


def make_hybrid_target(out_dir: Path, tok_dir: Path, arch: str = "qwen35", *, hidden: int = 64, layers: int = 4,
                       heads: int = 4, kv_heads: int = 2, head_dim: int = 16, inter: int = 128, seed: int = 0,
                       scale: float = 3.0, linear_head_dim: int = 32, linear_k_heads: int = 2,
                       linear_v_heads: int = 4, conv_kernel: int = 4, full_attention_interval: int = 4,
                       n_experts: int = 4, n_experts_used: int = 2) -> Path:
    """A random Qwen3.5 (``qwen35``) or Qwen3-Next (``qwen3next``) causal LM as a Hugging Face folder.

    Every ``full_attention_interval``-th layer is gated full attention, the others gated delta-net
    linear attention (default 4 layers: 3 linear + 1 full).
    """
    from safetensors.numpy import save_file

    if arch not in HYBRID_ARCHS:
        raise ValueError(arch)
    out_dir.mkdir(parents=True, exist_ok=True)
    if (out_dir / "config.json").exists():
        return out_dir
    rot = int(head_dim * 0.25)
    layer_types = ["full_attention" if (i + 1) % full_attention_interval == 0 else "linear_attention"
                   for i in range(layers)]
    cfg = {
        "vocab_size": GPT2_VOCAB_SIZE, "hidden_size": hidden, "intermediate_size": inter,
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "head_dim": head_dim, "hidden_act": "silu", "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True, "attention_bias": False, "attention_dropout": 0.0,
        "linear_conv_kernel_dim": conv_kernel, "linear_key_head_dim": linear_head_dim,
        "linear_value_head_dim": linear_head_dim, "linear_num_key_heads": linear_k_heads,
        "linear_num_value_heads": linear_v_heads, "layer_types": layer_types,
        "full_attention_interval": full_attention_interval, "mtp_num_hidden_layers": 1,
        "bos_token_id": GPT2_VOCAB_SIZE - 1, "eos_token_id": GPT2_VOCAB_SIZE - 1, "torch_dtype": "float32",
    }
    if arch == "qwen35":
        cfg.update({
            "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", "attn_output_gate": True,
            "mtp_use_dedicated_embeddings": False,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                                "mrope_section": _mrope_section(rot), "mrope_interleaved": True},
        })
    else:
        cfg.update({
            "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "rope_theta": 10000.0,
            "partial_rotary_factor": 0.25, "decoder_sparse_step": 1, "mlp_only_layers": [],
            "num_experts": n_experts, "num_experts_per_tok": n_experts_used, "norm_topk_prob": True,
            "moe_intermediate_size": inter // 2, "shared_expert_intermediate_size": inter // 2,
            "output_router_logits": False, "router_aux_loss_coef": 0.001,
        })
    tensors = _hybrid_weights(cfg, seed, scale)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    _gpt2_tokenizer_files(out_dir, tok_dir)
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2))   # last: marks the folder complete
    return out_dir
