"""Tiny local stand-ins for the models llama-cpp-python's own tests download from the Hub.

``tests/test_peer_suite.py`` runs that suite against ``dflash_gguf.Llama``; its fixtures fetch a
Qwen3.5 GGUF, a Llama-architecture story model, a BERT embedding model, a Mamba model and a
Falcon-H1 hybrid. Here each gets a random model of the same kind, made once from fixed seeds:

* Mamba and Mamba2: built with transformers and converted by the pinned upstream converter (which
  writes ``attention.head_count = 0`` for them, as for the released models);
* BERT: written directly with gguf-py around the tokenizer of the vendored
  ``models/ggml-vocab-bert-bge.gguf`` (bge-small's WordPiece vocabulary), so that no tokenizer has
  to pass the converter's pre-tokenizer check; random weights at 32 dimensions, CLS pooling.

The attention and hybrid targets are ``tests/tiny.py``'s (Llama, Qwen3, Qwen3.5) with their drafters.
Files are cached under the test-model root in a folder keyed by this file's content.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

import tiny

_KEY = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:12]


def root(models_root: Path) -> Path:
    d = models_root / f"peer-{_KEY}"
    d.mkdir(parents=True, exist_ok=True)
    return d


def _randomize(model, seed: int, scale: float = 2.0) -> None:
    """Wider random weights (a default-initialised tiny SSM repeats one token); A, D and the time
    step bias keep their initialisation, which is what keeps the recurrence stable."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("A_log", ".D", "dt_proj.bias", "dt_bias")):
                continue
            if name.endswith("norm.weight") or name.endswith("norm_f.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif "embeddings" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            elif p.ndim > 1:
                p.copy_(torch.randn(p.shape, generator=g) * scale / p.shape[-1] ** 0.5)


def make_mamba(out_dir: Path, tok_dir: Path, version: int = 1, *, hidden: int = 64, layers: int = 2,
               seed: int = 3) -> Path:
    """A random Mamba (``version=1``) or Mamba2 causal LM with the tiny SentencePiece tokenizer."""
    import torch
    import transformers

    out_dir.mkdir(parents=True, exist_ok=True)
    if (out_dir / "config.json").exists():
        return out_dir
    torch.manual_seed(seed)
    common = dict(vocab_size=tiny.VOCAB_SIZE, hidden_size=hidden, num_hidden_layers=layers, state_size=16,
                  conv_kernel=4, expand=2, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                  tie_word_embeddings=version == 1)   # transformers' Mamba2 cannot save tied weights
    if version == 1:
        model = transformers.MambaForCausalLM(transformers.MambaConfig(**common))
    else:
        cfg = transformers.Mamba2Config(head_dim=32, num_heads=2 * hidden // 32, n_groups=1, **common)
        model = transformers.Mamba2ForCausalLM(cfg)
    _randomize(model, seed)
    model.save_pretrained(out_dir, safe_serialization=True)
    (out_dir / "tokenizer.model").write_bytes((tok_dir / "tokenizer.model").read_bytes())
    return out_dir


def mamba_gguf(models_root: Path, tok_dir: Path, version: int = 1) -> Path:
    d = root(models_root)
    name = "mamba" if version == 1 else "mamba2"
    return tiny.upstream_convert(make_mamba(d / f"hf-{name}", tok_dir, version), d / f"{name}.gguf")


def bert_gguf(models_root: Path, *, hidden: int = 32, layers: int = 2, heads: int = 2, ff: int = 64,
              seed: int = 4) -> Path:
    """A random BERT embedding model (CLS pooling) with bge-small's tokenizer."""
    import gguf

    from dflash_gguf import paths

    out = root(models_root) / "bert.gguf"
    if out.exists():
        return out
    vocab = gguf.GGUFReader(str(paths.upstream_tree() / "models" / "ggml-vocab-bert-bge.gguf"))
    tokens = [bytes(vocab.fields["tokenizer.ggml.tokens"].parts[i]) for i in vocab.fields["tokenizer.ggml.tokens"].data]
    types = [int(vocab.fields["tokenizer.ggml.token_type"].parts[i][0])
             for i in vocab.fields["tokenizer.ggml.token_type"].data]

    def scalar(key: str) -> int:
        f = vocab.fields[key]
        return int(f.parts[f.data[0]][0])

    n_ctx = 512
    tmp = out.with_suffix(".tmp")
    w = gguf.GGUFWriter(str(tmp), "bert")
    w.add_name("tiny-bert")
    w.add_block_count(layers)
    w.add_context_length(n_ctx)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ff)
    w.add_head_count(heads)
    w.add_layer_norm_eps(1e-12)
    w.add_causal_attention(False)
    w.add_pooling_type(gguf.PoolingType.CLS)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model("bert")
    w.add_tokenizer_pre("bert-bge")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_type_count(2)
    w.add_unk_token_id(scalar("tokenizer.ggml.unknown_token_id"))
    w.add_sep_token_id(scalar("tokenizer.ggml.seperator_token_id"))
    w.add_pad_token_id(scalar("tokenizer.ggml.padding_token_id"))
    w.add_uint32("tokenizer.ggml.cls_token_id", scalar("tokenizer.ggml.cls_token_id"))
    w.add_mask_token_id(scalar("tokenizer.ggml.mask_token_id"))
    rng = np.random.default_rng(seed)

    def mat(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    def norm(prefix: str) -> None:
        w.add_tensor(f"{prefix}.weight", (1.0 + 0.1 * rng.standard_normal(hidden)).astype(np.float32))
        w.add_tensor(f"{prefix}.bias", (0.1 * rng.standard_normal(hidden)).astype(np.float32))

    w.add_tensor("token_embd.weight", rng.standard_normal((len(tokens), hidden)).astype(np.float32))
    w.add_tensor("token_types.weight", rng.standard_normal((2, hidden)).astype(np.float32))
    w.add_tensor("position_embd.weight", (0.1 * rng.standard_normal((n_ctx, hidden))).astype(np.float32))
    norm("token_embd_norm")
    for i in range(layers):
        p = f"blk.{i}"
        for t in ("attn_q", "attn_k", "attn_v", "attn_output"):
            w.add_tensor(f"{p}.{t}.weight", mat(hidden, hidden))
        norm(f"{p}.attn_output_norm")
        w.add_tensor(f"{p}.ffn_up.weight", mat(ff, hidden))
        w.add_tensor(f"{p}.ffn_down.weight", mat(hidden, ff))
        norm(f"{p}.layer_output_norm")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.replace(out)
    return out


def split_gguf(hf_dir: Path, out_dir: Path, max_tensors: int) -> list[Path]:
    """``hf_dir`` converted by the pinned upstream converter into a split GGUF of at most
    ``max_tensors`` tensors per shard (``NAME-0000i-of-0000n.gguf`` with ``split.*`` keys)."""
    import subprocess
    import sys

    from dflash_gguf import paths

    have = sorted(out_dir.glob("split-*-of-*.gguf"))
    if have:
        return have
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / "tmp"
    tmp.mkdir(exist_ok=True)
    cmd = [sys.executable, str(paths.upstream_tree() / "convert_hf_to_gguf.py"), str(hf_dir), "--outfile",
           str(tmp / "split.gguf"), "--outtype", "f32", "--split-max-tensors", str(max_tensors)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"split conversion of {hf_dir} failed:\n{r.stderr[-3000:]}")
    for f in tmp.glob("*.gguf"):
        f.replace(out_dir / f.name)
    tmp.rmdir()
    return sorted(out_dir.glob("split-*-of-*.gguf"))
