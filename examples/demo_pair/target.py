"""Stage 3: the Qwen3 target (config, batches, evaluation, greedy decoding, training, loading)."""
from __future__ import annotations

import json
import math
import shutil
import time
from pathlib import Path

import numpy as np

from .common import CHECK_PROMPTS, CLOCK, clock, log, lr_at, save_ckpt
from .corpus import encode_split, line_starts, sp_model


# ----------------------------------------------------------------------------- 3 target
def target_config(vocab: int, a):
    import transformers

    return transformers.Qwen3Config(
        vocab_size=vocab, hidden_size=a.hidden, intermediate_size=a.inter, num_hidden_layers=a.layers,
        num_attention_heads=a.heads, num_key_value_heads=a.kv_heads, head_dim=a.hidden // a.heads,
        max_position_embeddings=2048, rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2, torch_dtype="float32", attention_dropout=0.0)



def batch_windows(rng: np.random.Generator, stream: np.ndarray, starts: np.ndarray, bs: int, seq: int, bos: int):
    idx = rng.choice(starts[starts < len(stream) - seq], size=bs)
    rows = [np.concatenate([[bos], stream[i:i + seq - 1]]) for i in idx]
    return np.stack(rows).astype(np.int64)


def eval_target(model, val: np.ndarray, seq: int, bos: int, n: int = 16) -> float:
    import torch

    rng = np.random.default_rng(1234)
    starts = np.arange(0, len(val) - seq, seq)[:n] if len(val) > seq * n else np.arange(0, max(1, len(val) - seq), seq)
    x = torch.from_numpy(np.stack([np.concatenate([[bos], val[i:i + seq - 1]]) for i in starts]).astype(np.int64))
    del rng
    model.eval()
    with torch.no_grad():
        loss = model(input_ids=x, labels=x).loss.item()
    model.train()
    return loss


def greedy(model, ids: list[int], n: int, eos: int | None = None) -> list[int]:
    import torch

    with torch.no_grad():
        x = torch.tensor([ids])
        out = model(input_ids=x, use_cache=True)
        past, gen = out.past_key_values, []
        for _ in range(n):
            t = int(out.logits[0, -1].argmax())
            gen.append(t)
            if t == eos:
                break
            out = model(input_ids=torch.tensor([[t]]), past_key_values=past, use_cache=True)
            past = out.past_key_values
    return gen


def show_samples(model, sp, n: int = 48, k: int = 3) -> None:
    model.eval()
    for p in CHECK_PROMPTS[:k]:
        g = greedy(model, [sp.bos_id()] + sp.encode(p), n, sp.eos_id())
        print("    ---- " + repr(p)[:60] + "\n" + (p + sp.decode(g)).replace("\n", "\n    | ")[:900], flush=True)
    model.train()


def train_target(work: Path, a) -> dict:
    import torch
    import transformers

    torch.manual_seed(a.seed)
    sp = sp_model(work)
    tr, va = encode_split(work, "train"), encode_split(work, "val")
    starts = line_starts(sp, tr)
    log(f"target: {len(tr):,} train tokens, {len(va):,} held-out tokens ({len(starts):,} line starts)")
    cfg = target_config(sp.get_piece_size(), a)
    model = transformers.Qwen3ForCausalLM(cfg)
    model.config._attn_implementation = "sdpa"
    n_params = sum(p.numel() for p in model.parameters())
    log(f"target: Qwen3 {a.layers} layers, hidden {a.hidden}, {a.heads} heads / {a.kv_heads} kv, ffn {a.inter}, "
        f"vocab {cfg.vocab_size}, tied embeddings: {n_params / 1e6:.2f} M parameters")
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr_target, betas=(0.9, 0.95), weight_decay=0.05)
    ck = work / "target.ckpt"
    state = {"step": 0, "elapsed": 0.0, "tokens": 0, "history": []}
    if ck.exists():
        saved = torch.load(ck, weights_only=False)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        state = saved["state"]
        log(f"target: resumed at step {state['step']} ({state['elapsed'] / 60:.1f} min done)")
    budget = a.minutes_target * 60
    rng = np.random.default_rng(a.seed + state["step"])
    t_last_ck = t_last_log = time.time()
    t_seg = clock()
    el0 = state["elapsed"]
    model.train()
    ema = None
    while True:
        elapsed = el0 + clock() - t_seg
        if elapsed >= budget:
            break
        lr = lr_at(elapsed / budget, state["step"], a.lr_target, 30)
        for g in opt.param_groups:
            g["lr"] = lr
        x = torch.from_numpy(batch_windows(rng, tr, starts, a.batch, a.seq, sp.bos_id()))
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        state["step"] += 1
        state["tokens"] += x.numel()
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        now = time.time()
        if now - t_last_log >= a.log_every or state["step"] == 1:
            t_last_log = now
            el = el0 + clock() - t_seg
            log(f"target step {state['step']:5d}  loss {ema:.3f}  lr {lr:.2e}  {state['tokens'] / el:,.0f} tok/s  "
                f"{el / 60:.1f}/{a.minutes_target:g} min ({CLOCK['kind']} clock)")
        if now - t_last_ck >= 60:
            t_last_ck = now
            state["elapsed"] = el0 + clock() - t_seg
            state["history"].append({"step": state["step"], "loss": round(ema, 4), "min": round(state["elapsed"] / 60, 2)})
            save_ckpt({"model": model.state_dict(), "opt": opt.state_dict(), "state": state}, ck)
    state["elapsed"] = el0 + clock() - t_seg
    val = eval_target(model, va, a.seq, sp.bos_id())
    log(f"target done: {state['step']} steps, {state['tokens']:,} tokens, {state['elapsed'] / 60:.1f} min, "
        f"train loss {ema if ema is not None else float('nan'):.3f}, held-out loss {val:.3f} (ppl {math.exp(val):.1f})")
    show_samples(model, sp)
    hf = work / "hf-target"
    model.save_pretrained(hf, safe_serialization=True)
    write_tokenizer_files(hf, work)
    info = {"params": n_params, "steps": state["step"], "tokens": state["tokens"], "minutes": round(state["elapsed"] / 60, 2),
            "train_loss": round(float(ema or 0), 4), "val_loss": round(val, 4), "batch": a.batch, "seq": a.seq,
            "lr": a.lr_target, "history": state["history"]}
    return info


def write_tokenizer_files(dst: Path, work: Path) -> None:
    shutil.copy(work / "tokenizer" / "tokenizer.model", dst / "tokenizer.model")
    (dst / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": True,
        "add_eos_token": False, "model_max_length": 2048}, indent=2))


def load_target(work: Path):
    import torch
    import transformers

    m = transformers.Qwen3ForCausalLM.from_pretrained(work / "hf-target", torch_dtype=torch.float32)
    m.config._attn_implementation = "sdpa"
    m.eval()
    for p in m.parameters():
        p.requires_grad_(False)
    return m


# GGUF (qwen3) tensor names -> Hugging Face Qwen3ForCausalLM names; the qwen3 converter copies them
# without permutation (NeoX RoPE), so the bytes map one to one
_GGUF_TO_HF = {
    "token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}


def target_from_gguf(work: Path, gguf_path: Path, a) -> dict:
    """Stage 3 for a new drafter of an existing target: the Hugging Face folder rebuilt from its GGUF
    (F32/F16 weights, e.g. the shipped demo target), checked against this run's arguments and tokenizer."""
    import gguf
    import torch
    import transformers

    r = gguf.GGUFReader(str(gguf_path))
    arch = bytes(r.fields["general.architecture"].parts[-1]).decode()
    if arch != "qwen3":
        raise SystemExit(f"--target-gguf {gguf_path}: architecture {arch!r}, this script rebuilds qwen3 targets only")

    def kv(key):
        return int(r.fields[f"qwen3.{key}"].parts[-1][0])

    f = r.fields["tokenizer.ggml.tokens"]
    pieces = [bytes(f.parts[i]).decode() for i in f.data]
    sp = sp_model(work)
    if pieces != [sp.id_to_piece(i) for i in range(sp.get_piece_size())]:
        raise SystemExit(f"--target-gguf {gguf_path}: its vocabulary differs from the tokenizer this run trained "
                         "(use the same --vocab, --seed and Python as the run that made the target)")
    got = {"layers": kv("block_count"), "hidden": kv("embedding_length"), "inter": kv("feed_forward_length"),
           "heads": kv("attention.head_count"), "kv_heads": kv("attention.head_count_kv")}
    if got != {k: getattr(a, k) for k in got}:
        raise SystemExit(f"--target-gguf {gguf_path}: shape {got} differs from this run's arguments; pass them")
    model = transformers.Qwen3ForCausalLM(target_config(len(pieces), a))
    sd = {}
    for t in r.tensors:
        if t.tensor_type.name not in ("F32", "F16"):
            raise SystemExit(f"--target-gguf: tensor {t.name} is {t.tensor_type.name}; pass an F32/F16 target")
        parts = t.name.split(".")
        if parts[0] == "blk":
            name = f"model.layers.{parts[1]}.{_GGUF_TO_HF[parts[2]]}.weight"
        else:
            name = f"{_GGUF_TO_HF[parts[0]]}.weight"
        sd[name] = torch.from_numpy(np.array(t.data, dtype=np.float32).reshape([int(x) for x in reversed(t.shape)]))
    missing, unexpected = model.load_state_dict(sd, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise SystemExit(f"--target-gguf: tensors missing {missing} / unexpected {unexpected}")
    model.tie_weights()
    hf = work / "hf-target"
    model.save_pretrained(hf, safe_serialization=True)
    write_tokenizer_files(hf, work)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"target: rebuilt from {gguf_path} ({n_params / 1e6:.2f} M parameters, {len(sd)} tensors)")
    return {"params": n_params, "from_gguf": str(gguf_path.name), "sha256": _sha256(gguf_path)}


def _sha256(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()
