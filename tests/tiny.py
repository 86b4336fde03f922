"""Tiny synthetic Hugging Face checkpoints (targets and DFlash/DFlash2 drafters) for the tests.

Everything is made here from fixed seeds: a SentencePiece BPE tokenizer trained on a few
Python standard-library files, random Qwen3 / Llama targets built with transformers, and
drafters written in the z-lab checkpoint layout (bare tensor names, no embeddings or LM head,
``architectures: ["DFlashDraftModel"]``, ``dflash_config``).
"""
from __future__ import annotations

import json
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
                 zero_blocks: bool = False) -> Path:
    """A random DFlash (v1) or DFlash2 drafter in the z-lab layout for the given target."""
    from safetensors.numpy import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    if (out_dir / "config.json").exists():
        return out_dir
    tcfg = json.loads((target_dir / "config.json").read_text())
    H = tcfg["hidden_size"]
    n_t = tcfg["num_hidden_layers"]
    heads, kv, hd = tcfg["num_attention_heads"], tcfg["num_key_value_heads"], tcfg.get("head_dim") or H // tcfg["num_attention_heads"]
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
    if kind == "dflash2":
        V = tcfg["vocab_size"]
        t["candidate_selector.hidden_projection.weight"] = w(rank, H)
        t["candidate_selector.predecessor_codebook"] = w(V, rank)
        t["candidate_selector.successor_codebook"] = w(V, rank)
        dcfg.update({"conv_group_size": conv_group, "conv_kernel_size": conv_kernel, "selector_rank": rank,
                     "selector_top_k": top_k})
    save_file(t, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    cfg = {
        "architectures": ["DFlash2DraftModel" if kind == "dflash2" else "DFlashDraftModel"],
        "model_type": "qwen3", "hidden_size": H, "intermediate_size": inter, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": hd,
        "vocab_size": tcfg["vocab_size"], "rms_norm_eps": 1e-6, "rope_theta": tcfg.get("rope_theta", 10000.0),
        "max_position_embeddings": 4096, "hidden_act": "silu", "tie_word_embeddings": False,
        "block_size": block_size, "num_target_layers": n_t, "dflash_config": dcfg, "torch_dtype": "float32",
    }
    if kind == "dflash2":
        cfg["is_causal"] = False
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    return out_dir


def upstream_convert(hf_dir: Path, out_file: Path, target_dir: Path | None = None, outtype: str = "f32") -> Path:
    """Convert with the pinned sdist's convert_hf_to_gguf.py (kept by the build)."""
    from dflash_gguf import paths

    if out_file.exists():
        return out_file
    tree = paths.upstream_tree()
    cmd = [sys.executable, str(tree / "convert_hf_to_gguf.py"), str(hf_dir), "--outfile", str(out_file),
           "--outtype", outtype]
    if target_dir is not None:
        cmd += ["--target-model-dir", str(target_dir)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"conversion of {hf_dir} failed:\n{r.stderr[-3000:]}")
    return out_file
