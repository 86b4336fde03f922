#!/usr/bin/env python
"""Train the shipped demo pair on this CPU: a tiny Qwen3 target and its DFlash drafter.

Everything comes from the Python standard library's own source code (no download) and fixed
seeds. Stages, each resumable (a finished stage leaves a marker in --work and is skipped on a
re-run; target and drafter training checkpoint every minute and continue where they stopped):

1. tokenizer   SentencePiece BPE (byte fallback, identity normalisation, whitespace kept) with a
               control piece ``<|mask|>`` for the drafter's mask token;
2. corpus      stdlib ``*.py`` files minus tests, at most --cap-bytes from any one file, ~3% of the
               files held out for validation and the demo prompts;
3. target      a Qwen3ForCausalLM (transformers) trained for --minutes-target;
4. samples     the target's own greedy continuations of corpus prompts, with the hidden states of
               the tapped layers (HF ``hidden_states[t + 1]`` = output of layer t) and its argmax;
5. drafter     a DFlash drafter in the z-lab layout trained the DFlash way for --minutes-drafter:
               random anchors, block ``[anchor, mask x (B-1)]``, slot k predicts the target's greedy
               token at a+k, context = ``hidden_norm(fc(taps))`` of positions strictly before the
               anchor injected as extra K/V (k_norm + rope at the true positions), non-causal within
               the block, CE weighted by exp(-(k-1)/gamma); embeddings and LM head are the target's,
               frozen;
6. export      Hugging Face folders, then GGUF (``python -m dflash_gguf.convert`` when importable,
               else upstream's ``convert_hf_to_gguf.py``), copied to --dest with a model card;
7. verify      llama.cpp DFlash greedy output == plain output on held-out prompts; acceptance length.

    .venv/bin/python examples/train_demo_pair.py                       # the shipped pair (~30 CPU-min on 2 cores)
    .venv/bin/python examples/train_demo_pair.py --smoke --work out/smoke --dest out/smoke/demo
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import platform
import random
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np

MASK_PIECE = "<|mask|>"
REPO = Path(__file__).resolve().parents[1]
EXCLUDE_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__", "dist-packages"}

# prompts for the eyeball check and the verification (the demo's built-in prompt is the first)
CHECK_PROMPTS = [
    "def read_lines(path):\n    \"\"\"Return the lines of a text file.\"\"\"\n",
    "class Stack:\n    def __init__(self):\n",
    "import os\nimport sys\n\n\ndef main(argv=None):\n",
    "    def __repr__(self):\n",
    "    for key, value in sorted(items.items()):\n",
    "def _check_type(obj, expected):\n    if not isinstance(obj, expected):\n",
]


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


CLOCK = {"kind": "cpu", "threads": 2}


def clock() -> float:
    """Seconds on the budget clock. ``cpu``: this process's CPU time / threads, so a budget buys the
    same training on a busy machine as on an idle one (wall time stretches instead); ``wall``: wall time."""
    if CLOCK["kind"] == "wall":
        return time.time()
    return time.process_time() / CLOCK["threads"]


def done(work: Path, stage: str) -> bool:
    return (work / f".done-{stage}").exists()


def mark(work: Path, stage: str, info: dict | None = None) -> None:
    (work / f".done-{stage}").write_text(json.dumps(info or {}, indent=2))


# ----------------------------------------------------------------------------- 1-2 corpus/tokenizer
def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for f in sorted(root.rglob("*.py")):
        rel = f.relative_to(root).parts
        if any(p in EXCLUDE_DIRS for p in rel) or f.name.startswith("test_") or f.name.endswith("_test.py"):
            continue
        if f.name.startswith("bad"):
            continue
        out.append(f)
    return out


def read_capped(f: Path, cap: int) -> str | None:
    try:
        t = f.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None
    t = t.replace("\r\n", "\n").replace("\t", "    ")
    if len(t) > cap:
        cut = t.rfind("\n", 0, cap)
        t = t[:cut + 1 if cut > 0 else cap]
    return t if len(t) > 200 else None


def is_heldout(f: Path) -> bool:
    rel = f.relative_to(sysconfig.get_paths()["stdlib"]).as_posix()
    return int(hashlib.sha256(rel.encode()).hexdigest(), 16) % 32 == 0


def build_corpus(work: Path, cap: int) -> dict:
    train, val = [], []
    for f in stdlib_files():
        t = read_capped(f, cap)
        if t is not None:
            (val if is_heldout(f) else train).append(t)
    (work / "corpus-train.txt").write_text("\n\x00\n".join(train), encoding="utf-8")
    (work / "corpus-val.txt").write_text("\n\x00\n".join(val), encoding="utf-8")
    info = {"files_train": len(train), "files_val": len(val), "bytes_train": sum(map(len, train)),
            "bytes_val": sum(map(len, val)), "cap_bytes_per_file": cap,
            "stdlib": sysconfig.get_paths()["stdlib"], "python": platform.python_version()}
    log(f"corpus: {info['files_train']} train files ({info['bytes_train'] / 1e6:.2f} MB), "
        f"{info['files_val']} held-out files ({info['bytes_val'] / 1e6:.2f} MB), cap {cap} bytes per file")
    return info


def load_docs(work: Path, split: str) -> list[str]:
    return (work / f"corpus-{split}.txt").read_text(encoding="utf-8").split("\n\x00\n")


def train_tokenizer(work: Path, vocab: int, seed: int) -> Path:
    import sentencepiece as spm

    tok_dir = work / "tokenizer"
    tok_dir.mkdir(exist_ok=True)
    lines = (work / "corpus-train.txt").read_text(encoding="utf-8").split("\n")
    lines = [ln for ln in lines if ln.strip() and ln != "\x00"]
    random.Random(seed).shuffle(lines)
    src = tok_dir / "lines.txt"
    src.write_text("\n".join(lines), encoding="utf-8")
    t0 = time.time()
    spm.SentencePieceTrainer.train(
        input=str(src), model_prefix=str(tok_dir / "tokenizer"), vocab_size=vocab, model_type="bpe",
        byte_fallback=True, normalization_rule_name="identity", remove_extra_whitespaces=False,
        split_digits=True, allow_whitespace_only_pieces=True, control_symbols=[MASK_PIECE],
        bos_id=1, eos_id=2, unk_id=0, pad_id=-1, num_threads=2, minloglevel=2, character_coverage=1.0,
        input_sentence_size=0, max_sentence_length=8192, shuffle_input_sentence=False, seed_sentencepiece_size=200_000)
    src.unlink()
    (tok_dir / "tokenizer.vocab").unlink(missing_ok=True)
    log(f"tokenizer: SentencePiece BPE, vocab {vocab}, trained in {time.time() - t0:.0f} s")
    return tok_dir / "tokenizer.model"


def sp_model(work: Path):
    import sentencepiece as spm

    return spm.SentencePieceProcessor(model_file=str(work / "tokenizer" / "tokenizer.model"))


def encode_split(work: Path, split: str) -> np.ndarray:
    """One token stream: doc tokens separated by EOS (each doc encoded on its own)."""
    cache = work / f"tokens-{split}.npy"
    if cache.exists():
        return np.load(cache)
    sp = sp_model(work)
    out = []
    for d in load_docs(work, split):
        out.extend(sp.encode(d))
        out.append(sp.eos_id())
    arr = np.asarray(out, dtype=np.int32)
    np.save(cache, arr)
    return arr


def line_starts(sp, stream: np.ndarray) -> np.ndarray:
    """Indices of tokens that follow a newline byte token (or an EOS): window start points."""
    nl = sp.piece_to_id("<0x0A>")
    prev = np.concatenate([[sp.eos_id()], stream[:-1]])
    return np.nonzero((prev == nl) | (prev == sp.eos_id()))[0]


# ----------------------------------------------------------------------------- 3 target
def target_config(vocab: int, a):
    import transformers

    return transformers.Qwen3Config(
        vocab_size=vocab, hidden_size=a.hidden, intermediate_size=a.inter, num_hidden_layers=a.layers,
        num_attention_heads=a.heads, num_key_value_heads=a.kv_heads, head_dim=a.hidden // a.heads,
        max_position_embeddings=2048, rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2, torch_dtype="float32", attention_dropout=0.0)


def lr_at(frac: float, step: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))


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


def save_ckpt(obj, path: Path) -> None:
    """Atomic checkpoint (a run stopped mid-write keeps the previous one)."""
    import torch

    tmp = path.with_suffix(".tmp")
    torch.save(obj, tmp)
    tmp.replace(path)


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


# ----------------------------------------------------------------------------- 4 samples
def make_samples(work: Path, a, split: str, n_seqs: int, seed: int) -> dict:
    """Greedy continuations of corpus prompts + tap features + the target's argmax per position."""
    import torch

    sp = sp_model(work)
    model = load_target(work)
    stream = encode_split(work, split)
    starts = line_starts(sp, stream)
    rng = np.random.default_rng(seed)
    taps = a.taps
    P, G = a.prompt_len, a.gen_len
    L = P + G
    feats = np.zeros((n_seqs, L, len(taps) * a.hidden), dtype=np.float16)
    toks = np.zeros((n_seqs, L), dtype=np.int32)
    amax = np.zeros((n_seqs, L), dtype=np.int32)
    t0 = time.time()
    bs = 32
    for b0 in range(0, n_seqs, bs):
        nb = min(bs, n_seqs - b0)
        # prompts: BOS + a window from a line start (length varies through where it is cut)
        idx = rng.choice(starts[starts < len(stream) - P], size=nb)
        prompt = np.stack([np.concatenate([[sp.bos_id()], stream[i:i + P - 1]]) for i in idx]).astype(np.int64)
        with torch.no_grad():
            x = torch.from_numpy(prompt)
            out = model(input_ids=x, use_cache=True)
            past = out.past_key_values
            seq = [x]
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            for _ in range(G):
                seq.append(nxt)
                out = model(input_ids=nxt, past_key_values=past, use_cache=True)
                past = out.past_key_values
                nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            full = torch.cat(seq, 1)
            out = model(input_ids=full, output_hidden_states=True)
            hs = out.hidden_states
            f = torch.cat([hs[t + 1] for t in taps], -1)   # HF target_layer_ids t -> hidden_states[t + 1]
            feats[b0:b0 + nb] = f.numpy().astype(np.float16)
            toks[b0:b0 + nb] = full.numpy()
            amax[b0:b0 + nb] = out.logits.argmax(-1).numpy()
        if (b0 // bs) % 4 == 0:
            log(f"samples[{split}]: {b0 + nb}/{n_seqs} sequences ({time.time() - t0:.0f} s)")
    # how often the teacher-forced argmax agrees with the cached greedy token (numerics)
    agree = float((amax[:, P - 1:L - 1] == toks[:, P:]).mean())
    np.savez(work / f"samples-{split}.npz", feats=feats, toks=toks, amax=amax, prompt_len=P)
    log(f"samples[{split}]: {n_seqs} x ({P} prompt + {G} greedy) tokens in {time.time() - t0:.0f} s; "
        f"argmax/greedy agreement {agree:.4f}")
    return {"n": n_seqs, "prompt_len": P, "gen_len": G, "seconds": round(time.time() - t0, 1), "agree": agree}


# ----------------------------------------------------------------------------- 5 drafter
def build_drafter_module(a, vocab: int):
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    H, nh, nkv = a.hidden, a.heads, a.kv_heads
    hd = H // nh
    eps = 1e-6

    class RMSNorm(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(d))

        def forward(self, x):
            xf = x.float()
            return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps))

    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj = nn.Linear(H, nh * hd, bias=False)
            self.k_proj = nn.Linear(H, nkv * hd, bias=False)
            self.v_proj = nn.Linear(H, nkv * hd, bias=False)
            self.o_proj = nn.Linear(nh * hd, H, bias=False)
            self.q_norm = RMSNorm(hd)
            self.k_norm = RMSNorm(hd)

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_proj = nn.Linear(H, a.d_inter, bias=False)
            self.up_proj = nn.Linear(H, a.d_inter, bias=False)
            self.down_proj = nn.Linear(a.d_inter, H, bias=False)

        def forward(self, x):
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.input_layernorm = RMSNorm(H)
            self.post_attention_layernorm = RMSNorm(H)
            self.self_attn = Attn()
            self.mlp = MLP()

    def rope(x, pos):   # x [..., T, n, hd], pos [..., T]; HF/NEOX rotate_half
        inv = 1.0 / (10000.0 ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
        ang = pos.float()[..., None] * inv           # [..., T, hd/2]
        cos = torch.cat([ang.cos(), ang.cos()], -1)[..., None, :]
        sin = torch.cat([ang.sin(), ang.sin()], -1)[..., None, :]
        x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    class Drafter(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(len(a.taps) * H, H, bias=False)
            self.hidden_norm = RMSNorm(H)
            self.layers = nn.ModuleList([Layer() for _ in range(a.d_layers)])
            self.norm = RMSNorm(H)

        def forward(self, feats, ctx_pos, noise_emb, noise_pos, mask):
            """feats [S, L, nT*H]; noise_emb [S, Q, H]; mask [S, 1, Q, L + Q] (True = attend)."""
            S, L = feats.shape[:2]
            Q = noise_emb.shape[1]
            ctx = self.hidden_norm(self.fc(feats))
            h = noise_emb
            for lyr in self.layers:
                at = lyr.self_attn
                x = lyr.input_layernorm(h)
                q = rope(at.q_norm(at.q_proj(x).view(S, Q, nh, hd)), noise_pos)
                kn = rope(at.k_norm(at.k_proj(x).view(S, Q, nkv, hd)), noise_pos)
                vn = at.v_proj(x).view(S, Q, nkv, hd)
                kc = rope(at.k_norm(at.k_proj(ctx).view(S, L, nkv, hd)), ctx_pos)   # no input norm on ctx
                vc = at.v_proj(ctx).view(S, L, nkv, hd)
                k = torch.cat([kc, kn], 1).transpose(1, 2)
                v = torch.cat([vc, vn], 1).transpose(1, 2)
                k = k.repeat_interleave(nh // nkv, 1)
                v = v.repeat_interleave(nh // nkv, 1)
                o = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask)
                h = h + at.o_proj(o.transpose(1, 2).reshape(S, Q, nh * hd))
                h = h + lyr.mlp(lyr.post_attention_layernorm(h))
            return self.norm(h)

    return Drafter()


class DrafterData:
    def __init__(self, path: Path, a, mask_id: int):
        import torch

        z = np.load(path)
        self.feats = torch.from_numpy(z["feats"])   # fp16
        self.toks = torch.from_numpy(z["toks"].astype(np.int64))
        self.amax = torch.from_numpy(z["amax"].astype(np.int64))
        self.P = int(z["prompt_len"])
        self.B = a.block
        self.mask_id = mask_id
        self.n, self.L = self.toks.shape

    def batch(self, rng: np.random.Generator, seqs: np.ndarray, n_anchor: int, embed):
        """Anchors a in [P-1, L-B]: every slot label is a greedy token of the target."""
        import torch

        S, L, B = len(seqs), self.L, self.B
        anchors = np.stack([np.sort(rng.choice(np.arange(self.P - 1, L - B + 1), size=n_anchor, replace=False))
                            for _ in seqs])
        A = torch.from_numpy(anchors)                                   # [S, nb]
        sidx = torch.from_numpy(seqs)
        feats = self.feats[sidx].float()
        toks, amax = self.toks[sidx], self.amax[sidx]
        nb = n_anchor
        ids = torch.full((S, nb, B), self.mask_id, dtype=torch.long)
        ids[:, :, 0] = torch.gather(toks, 1, A)
        offs = torch.arange(B)
        pos = A[..., None] + offs                                       # [S, nb, B]
        # slot k (1..B-1) predicts the target's greedy token at a+k = argmax at position a+k-1
        lab = torch.gather(amax, 1, (A[..., None] + offs[1:] - 1).reshape(S, -1)).reshape(S, nb, B - 1)
        noise = embed(ids.reshape(S, nb * B))
        ctx_pos = torch.arange(L).expand(S, L)
        cmask = torch.arange(L)[None, None, :] < A[..., None]           # [S, nb, L] ctx strictly before anchor
        cmask = cmask[:, :, None, :].expand(S, nb, B, L).reshape(S, nb * B, L)
        blk = torch.arange(nb).repeat_interleave(B)
        nmask = (blk[:, None] == blk[None, :]).expand(S, nb * B, nb * B)  # non-causal within the block only
        mask = torch.cat([cmask, nmask], -1)[:, None]
        return feats, ctx_pos, noise, pos.reshape(S, -1), mask, lab


def accept_len(pred, lab):
    """Longest agreeing prefix per block (greedy acceptance) -> mean accepted drafts per block."""
    ok = (pred == lab).long()
    return ok.cumprod(-1).sum(-1).float()


def train_drafter(work: Path, a, mask_id: int) -> dict:
    import torch
    import torch.nn.functional as F

    torch.manual_seed(a.seed + 1)
    target = load_target(work)
    emb = target.model.embed_tokens
    W = emb.weight                                  # tied: also the LM head (frozen)
    vocab = W.shape[0]
    model = build_drafter_module(a, vocab)
    n_params = sum(p.numel() for p in model.parameters())
    tr = DrafterData(work / "samples-train.npz", a, mask_id)
    va = DrafterData(work / "samples-val.npz", a, mask_id)
    B = a.block
    wk = torch.exp(-torch.arange(B - 1).float() / a.gamma)
    log(f"drafter: {a.d_layers} layers, block {B}, taps {a.taps}, hidden {a.hidden}, ffn {a.d_inter}: "
        f"{n_params / 1e6:.2f} M parameters (+ the target's frozen embeddings / LM head); "
        f"{tr.n} train / {va.n} held-out greedy sequences; loss weights exp(-(k-1)/{a.gamma:g})")
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr_drafter, betas=(0.9, 0.95), weight_decay=0.01)
    ck = work / "drafter.ckpt"
    state = {"step": 0, "elapsed": 0.0, "history": []}
    if ck.exists():
        saved = torch.load(ck, weights_only=False)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        state = saved["state"]
        log(f"drafter: resumed at step {state['step']} ({state['elapsed'] / 60:.1f} min done)")

    def run(data, seqs, rng, n_anchor):
        feats, ctx_pos, noise, pos, mask, lab = data.batch(rng, seqs, n_anchor, emb)
        h = model(feats, ctx_pos, noise, pos, mask)
        S = h.shape[0]
        h = h.view(S, n_anchor, B, -1)[:, :, 1:]
        logits = h @ W.T
        ce = F.cross_entropy(logits.reshape(-1, vocab), lab.reshape(-1), reduction="none").view_as(lab).float()
        loss = (ce * wk).sum(-1).mean() / wk.sum()
        return loss, logits.argmax(-1), lab

    def evaluate():
        model.eval()
        with torch.no_grad():
            rng = np.random.default_rng(99)
            lens, per = [], torch.zeros(B - 1)
            losses = []
            for s0 in range(0, va.n, 8):
                seqs = np.arange(s0, min(va.n, s0 + 8))
                loss, pred, lab = run(va, seqs, rng, a.anchors)
                losses.append(loss.item())
                lens.append(accept_len(pred, lab).flatten())
                per += (pred == lab).cumprod(-1).float().mean((0, 1))
        model.train()
        acc = torch.cat(lens)
        return float(np.mean(losses)), 1.0 + acc.mean().item(), (per / len(lens)).tolist()

    budget = a.minutes_drafter * 60
    rng = np.random.default_rng(a.seed + 7 + state["step"])
    t_seg, el0 = clock(), state["elapsed"]
    t_last_ck = t_last_log = t_last_eval = time.time()
    ema = emal = None
    model.train()
    while True:
        el = el0 + clock() - t_seg
        if el >= budget:
            break
        lr = lr_at(el / budget, state["step"], a.lr_drafter, 30)
        for g in opt.param_groups:
            g["lr"] = lr
        seqs = rng.choice(tr.n, size=a.d_batch, replace=False)
        loss, pred, lab = run(tr, seqs, rng, a.anchors)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        state["step"] += 1
        al = 1.0 + accept_len(pred, lab).mean().item()
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        emal = al if emal is None else 0.95 * emal + 0.05 * al
        now = time.time()
        if now - t_last_log >= a.log_every or state["step"] == 1:
            t_last_log = now
            log(f"drafter step {state['step']:5d}  loss {ema:.3f}  train tau~{emal:.2f}  lr {lr:.2e}  "
                f"{(el0 + clock() - t_seg) / 60:.1f}/{a.minutes_drafter:g} min ({CLOCK['kind']} clock)")
        if now - t_last_eval >= 180:
            t_last_eval = now
            c0 = clock()
            vl, vt, _ = evaluate()
            log(f"drafter held-out: loss {vl:.3f}, acceptance length (teacher-forced, block {B}) {vt:.2f}")
            state["history"].append({"step": state["step"], "val_loss": round(vl, 4), "val_tau": round(vt, 3),
                                     "min": round((el0 + c0 - t_seg) / 60, 2)})
            t_seg += clock() - c0   # evaluation does not count against the budget
        if now - t_last_ck >= 60:
            t_last_ck = now
            state["elapsed"] = el0 + clock() - t_seg
            save_ckpt({"model": model.state_dict(), "opt": opt.state_dict(), "state": state}, ck)
    state["elapsed"] = el0 + clock() - t_seg
    vl, vt, per = evaluate()
    log(f"drafter done: {state['step']} steps, {state['elapsed'] / 60:.1f} min; held-out loss {vl:.3f}, "
        f"acceptance length {vt:.2f}; per-position (cumulative) " + " ".join(f"{p:.2f}" for p in per))
    export_drafter(work, a, model, mask_id)
    return {"params": n_params, "steps": state["step"], "minutes": round(state["elapsed"] / 60, 2),
            "train_loss": round(float(ema or 0), 4), "val_loss": round(vl, 4), "val_tau_torch": round(vt, 3),
            "val_per_position": [round(p, 4) for p in per], "batch_seqs": a.d_batch, "anchors_per_seq": a.anchors,
            "gamma": a.gamma, "lr": a.lr_drafter, "history": state["history"]}


def export_drafter(work: Path, a, model, mask_id: int) -> None:
    from safetensors.torch import save_file

    out = work / "hf-drafter"
    out.mkdir(exist_ok=True)
    sd = {k: v.detach().contiguous().float() for k, v in model.state_dict().items()}
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    tcfg = json.loads((work / "hf-target" / "config.json").read_text())
    cfg = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
        "hidden_size": a.hidden, "intermediate_size": a.d_inter, "num_hidden_layers": a.d_layers,
        "num_attention_heads": a.heads, "num_key_value_heads": a.kv_heads, "head_dim": a.hidden // a.heads,
        "vocab_size": tcfg["vocab_size"], "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "max_position_embeddings": 2048, "hidden_act": "silu", "tie_word_embeddings": False,
        "attention_bias": False, "block_size": a.block, "num_target_layers": a.layers,
        "dflash_config": {"mask_token_id": mask_id, "target_layer_ids": list(a.taps)},
        "torch_dtype": "float32",
    }
    (out / "config.json").write_text(json.dumps(cfg, indent=2))


# ----------------------------------------------------------------------------- 6 convert
def convert(work: Path, a) -> dict:
    import importlib.util

    gg = work / "gguf"
    gg.mkdir(exist_ok=True)
    tgt, dft = gg / "target.gguf", gg / "drafter.gguf"
    for f in (tgt, dft):
        f.unlink(missing_ok=True)
    how = None
    if importlib.util.find_spec("dflash_gguf.convert") is not None and not a.upstream_convert:
        cmd = [sys.executable, "-m", "dflash_gguf.convert", str(work / "hf-target"), str(work / "hf-drafter"),
               "-o", str(gg), "--force"]
        if a.outtype:
            cmd += ["--outtype", a.outtype]
        log("convert: " + " ".join(cmd))
        r = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
        if r.returncode == 0:
            how = "python -m dflash_gguf.convert"
        else:
            log("dflash_gguf.convert failed, falling back to upstream's converter:\n" + r.stderr[-2000:])
            for f in gg.glob("*"):
                f.unlink()
    if how is None:
        from dflash_gguf import paths

        script = paths.upstream_tree() / "convert_hf_to_gguf.py"
        for src, dst, extra in ((work / "hf-target", tgt, []),
                                (work / "hf-drafter", dft, ["--target-model-dir", str(work / "hf-target")])):
            cmd = [sys.executable, str(script), str(src), "--outfile", str(dst), "--outtype", a.outtype or "f16"] + extra
            log("convert: " + " ".join(cmd[1:]))
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                raise SystemExit(f"conversion failed:\n{r.stderr[-3000:]}")
        how = ("upstream convert_hf_to_gguf.py (" + ("python -m dflash_gguf.convert failed" if importlib.util.find_spec(
            "dflash_gguf.convert") is not None and not a.upstream_convert else "dflash_gguf.convert not importable or not asked for") + ")")
    else:
        _pick_pair(gg, tgt, dft)
    info = {"how": how, "outtype": a.outtype or "f16", "target_bytes": tgt.stat().st_size,
            "drafter_bytes": dft.stat().st_size}
    log(f"convert: target {tgt.stat().st_size / 1e6:.2f} MB, drafter {dft.stat().st_size / 1e6:.2f} MB ({how})")
    return info


def _pick_pair(gg: Path, tgt: Path, dft: Path) -> None:
    """Rename the converter's outputs to target.gguf / drafter.gguf and point pair.json at them."""
    pj = gg / "pair.json"
    d = json.loads(pj.read_text()) if pj.exists() else None
    if d and isinstance(d.get("target"), dict) and isinstance(d.get("drafter"), dict):
        for role, dst in (("target", tgt), ("drafter", dft)):
            src = gg / d[role]["file"]
            if src != dst:
                src.replace(dst)
            d[role]["file"] = dst.name
            d[role].pop("source", None)   # a path on the training machine
        pj.write_text(json.dumps(d, indent=2) + "\n")
        return
    for f in sorted(gg.glob("*.gguf")):   # no manifest: tell them apart by architecture
        if f not in (tgt, dft):
            f.replace(dft if b"dflash" in f.read_bytes()[:1 << 16] else tgt)


# ----------------------------------------------------------------------------- 7 verify
def verify(work: Path, a) -> dict:
    sys.path.insert(0, str(REPO))
    from dflash_gguf.engine import Context, ContextOptions, Model
    from dflash_gguf.logs import set_log_handler
    from dflash_gguf.spec import DFlashDecoder, GenerationStats, SpecOptions

    set_log_handler()
    sp = sp_model(work)
    gg = work / "gguf"
    tm = Model(gg / "target.gguf")
    dm = Model(gg / "drafter.gguf")
    opts = ContextOptions(n_ctx=1024, n_batch=64, n_ubatch=64, n_threads=a.threads)
    tctx = Context(tm, opts)
    dctx = Context(dm, opts, other=tctx)
    plain = DFlashDecoder(tctx, None)
    results, tot = [], GenerationStats()
    tok_mismatch = 0
    for p in CHECK_PROMPTS:
        ids = tm.tokenize(p.encode())
        if ids[1:] != sp.encode(p):
            tok_mismatch += 1
        ref = list(plain.generate(ids, a.verify_tokens))
        spec = DFlashDecoder(tctx, dctx, SpecOptions(n_draft=a.block - 1))
        st = GenerationStats()
        got = list(spec.generate(ids, a.verify_tokens, stats=st))
        same = got == ref
        for k in ("steps", "drafted", "accepted"):
            setattr(tot, k, getattr(tot, k) + getattr(st, k))
        results.append({"prompt": p, "equal": same, "tau": round(st.tau, 3), "n": len(got)})
        log(f"verify: {'OK ' if same else 'DIFF'} tau {st.tau:.2f}  {p[:40]!r} -> {tm.detokenize(got)[:60]!r}")
        plain = DFlashDecoder(tctx, None)
    ok = all(r["equal"] for r in results)
    log(f"verify: DFlash == plain on {sum(r['equal'] for r in results)}/{len(results)} prompts; "
        f"mean acceptance length {tot.tau:.2f}; tokenizer mismatches vs SentencePiece: {tok_mismatch}")
    return {"all_equal": ok, "tau": round(tot.tau, 3), "prompts": results, "tokenizer_mismatch": tok_mismatch,
            "max_tokens": a.verify_tokens}


def align_check(work: Path, a, mask_id: int) -> dict:
    """Same drafter, same held-out greedy sequences, two implementations: the torch drafter replayed
    the way the runtime drafts (anchor after each accepted prefix) and llama.cpp's DFlash. An
    alignment error (a tap, a position, a norm off by one) shows as a gap between the two."""
    import torch
    from safetensors.torch import load_file

    target = load_target(work)
    W = target.model.embed_tokens.weight
    dr = build_drafter_module(a, W.shape[0])
    dr.load_state_dict(load_file(work / "hf-drafter" / "model.safetensors"))
    dr.eval()
    z = np.load(work / "samples-val.npz")
    feats, toks, amax, P = torch.from_numpy(z["feats"]).float(), z["toks"], z["amax"], int(z["prompt_len"])
    B, L = a.block, toks.shape[1]
    steps = acc = 0
    with torch.no_grad():
        for i in range(len(toks)):
            pos = P - 1
            while pos + B <= L:
                ids = torch.tensor([[int(toks[i, pos])] + [mask_id] * (B - 1)])
                h = dr(feats[i:i + 1, :pos], torch.arange(pos)[None], target.model.embed_tokens(ids),
                       (pos + torch.arange(B))[None], torch.ones(1, 1, B, pos + B, dtype=torch.bool))
                ok = ((h[0, 1:] @ W.T).argmax(-1).numpy() == amax[i, pos:pos + B - 1]).astype(int)
                k = int(np.cumprod(ok).sum())
                steps, acc = steps + 1, acc + k
                pos += k + 1
    tau_torch = (acc + steps) / steps

    sys.path.insert(0, str(REPO))
    from dflash_gguf.engine import Context, ContextOptions, Model
    from dflash_gguf.logs import set_log_handler
    from dflash_gguf.spec import DFlashDecoder, GenerationStats

    set_log_handler()
    tm, dm = Model(work / "gguf" / "target.gguf"), Model(work / "gguf" / "drafter.gguf")
    opts = ContextOptions(n_ctx=1024, n_batch=256, n_ubatch=256, n_threads=a.threads)
    tctx = Context(tm, opts)
    dctx = Context(dm, opts, other=tctx)
    spec = DFlashDecoder(tctx, dctx)
    tot, same = GenerationStats(), 0
    for i in range(len(toks)):
        st = GenerationStats()
        got = list(spec.generate(toks[i, :P].tolist(), L - P, stats=st))
        same += got == toks[i, P:].tolist()
        for k in ("steps", "drafted", "accepted"):
            setattr(tot, k, getattr(tot, k) + getattr(st, k))
    log(f"align: acceptance length on {len(toks)} held-out greedy sequences: torch replay {tau_torch:.2f}, "
        f"llama.cpp {tot.tau:.2f}; llama.cpp greedy == torch greedy on {same}/{len(toks)} sequences")
    return {"tau_torch_replay": round(tau_torch, 3), "tau_llama_cpp": round(tot.tau, 3),
            "greedy_equal_torch": f"{same}/{len(toks)}", "sequences": len(toks), "tokens_each": L - P}


def install(work: Path, dest: Path, info: dict) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    for f in ("target.gguf", "drafter.gguf", "pair.json"):
        src = work / "gguf" / f
        if src.exists():
            shutil.copy(src, dest / f)
    slim = {k: v for k, v in info.items()}
    (dest / "training.json").write_text(json.dumps(slim, indent=2) + "\n")
    (dest / "MODEL_CARD.md").write_text(model_card(info, dest))
    log(f"installed the pair into {dest} (target.gguf, drafter.gguf, pair.json, training.json, MODEL_CARD.md)")


def model_card(info: dict, dest: Path) -> str:
    a, c, t, d, v = info["args"], info["corpus"], info["target"], info["drafter"], info["verify"]
    cv, s, al = info["convert"], info["samples"], info["align"]
    tb, db = (dest / "target.gguf").stat().st_size, (dest / "drafter.gguf").stat().st_size
    per = " ".join(f"{x:.2f}" for x in d["val_per_position"])
    wall = sum(x.get("stage_seconds", 0) for x in info.values() if isinstance(x, dict)) / 60
    rows = "\n".join(f"| `{r['prompt'].splitlines()[0][:48]}` | {'yes' if r['equal'] else 'NO'} | {r['tau']:.2f} |"
                     for r in v["prompts"])
    return f"""# dflash-gguf demo pair: a tiny Python-code model and its DFlash drafter

Two GGUF files for trying DFlash speculative decoding offline, on any CPU, in seconds:

| file | what | size |
|---|---|---|
| `target.gguf` | Qwen3-architecture causal LM, {a['layers']} layers, hidden {a['hidden']}, {a['heads']} heads / {a['kv_heads']} KV heads, FFN {a['inter']}, vocab {info['tokenizer']['vocab']}, tied embeddings, {t['params'] / 1e6:.2f} M parameters, {cv['outtype'].upper()} | {tb / 1e6:.1f} MB |
| `drafter.gguf` | DFlash drafter (z-lab layout), {a['d_layers']} layers, block size {a['block']}, taps on target layers {a['taps']} (HF `target_layer_ids`), {d['params'] / 1e6:.2f} M parameters + the target's embeddings / LM head, {cv['outtype'].upper()} | {db / 1e6:.1f} MB |

It is a toy: the target writes plausible-looking Python in the style of the standard library, often
wrong and sometimes repetitive. Its job is to make the DFlash mechanics visible (block drafting,
one-pass verification, acceptance) with output that is recognisably code.

```
python -m dflash_gguf.demo                    # streams a completion, then plain vs DFlash tokens/s
python -m dflash_gguf.bench --prompts code    # side by side with upstream llama.cpp
```

## How it was made

Everything by `examples/train_demo_pair.py` on a CPU, from fixed seeds (seed {a['seed']}), no download:

```
python examples/train_demo_pair.py --minutes-target {a['minutes_target']:g} --minutes-drafter {a['minutes_drafter']:g} --train-seqs {a['train_seqs']}
```

Budgets count CPU time / threads ({a['threads']} threads), so a busy machine gives the same training,
only later (this run: {wall:.0f} min of wall time for all stages on a shared 2-core machine). Versions: Python {info['versions']['python']}, torch {info['versions']['torch']}, transformers
{info['versions']['transformers']}, sentencepiece {info['versions']['sentencepiece']}.

- **Corpus**: the `*.py` files of the Python {c['python']} standard library on the training machine,
  without test folders/files, at most {c['cap_bytes_per_file']:,} bytes from any one file (so no single
  large module dominates); {c['files_train']} files / {c['bytes_train'] / 1e6:.2f} MB for training,
  {c['files_val']} files held out (by a hash of the path) for validation and the check prompts.
  The corpus is Python Software Foundation licensed source code.
- **Tokenizer**: SentencePiece BPE, vocab {info['tokenizer']['vocab']}, byte fallback, identity
  normalisation, whitespace kept (whitespace-only pieces allowed, digits split); BOS `<s>`, EOS `</s>`;
  control piece `<|mask|>` = id {info['tokenizer']['mask_token_id']} is the drafter's mask token.
- **Target**: {t['steps']} AdamW steps of {a['batch']} x {a['seq']} tokens ({t['tokens'] / 1e6:.2f} M tokens),
  peak LR {a['lr_target']:g}, warm-up then cosine, {t['minutes']:.1f} min; final train loss {t['train_loss']:.2f},
  held-out loss {t['val_loss']:.2f} (perplexity {math.exp(t['val_loss']):.1f}).
- **Drafter data**: {s['train']['n']} training and {s['val']['n']} held-out sequences of a corpus prompt
  ({s['train']['prompt_len']} tokens) plus {s['train']['gen_len']} tokens of the target's own greedy
  continuation, with the target's hidden states at the taps (HF `hidden_states[t + 1]`, the output of
  layer t) and its argmax at every position.
- **Drafter training** (the DFlash recipe): {d['anchors_per_seq']} random anchors per sequence, block
  `[anchor, <|mask|> x {a['block'] - 1}]` at positions a..a+{a['block'] - 1}; slot k predicts the target's
  greedy token at a+k; context = `hidden_norm(fc(concat taps))` of positions strictly before the
  anchor, injected as extra K/V in every layer (k_norm and RoPE at the true positions, no per-layer
  input norm on the context); non-causal attention within the block; CE weighted by
  exp(-(k-1)/{a['gamma']:g}); embeddings and LM head are the target's, frozen. {d['steps']} steps of
  {d['batch_seqs']} sequences, {d['minutes']:.1f} min; held-out loss {d['val_loss']:.2f}, teacher-forced
  acceptance length {d['val_tau_torch']:.2f} (per-position prefix acceptance {per}).
- **Conversion**: {cv['how']}, `--outtype {cv['outtype']}`.
  (Q8_0 is avoided on purpose: on CPUs with Intel AMX, ggml's AMX Q8_0 matmul crashed on this model.)

## Measured

llama.cpp (this package's patched build), greedy, {v['max_tokens']} tokens per prompt, DFlash output
compared token by token with plain decoding:

| prompt | DFlash == plain | acceptance length |
|---|---|---|
{rows}

Alignment cross-check on the {al['sequences']} held-out greedy sequences ({al['tokens_each']} tokens each): the
torch drafter replayed the way the runtime drafts reaches an acceptance length of {al['tau_torch_replay']:.2f},
llama.cpp's DFlash {al['tau_llama_cpp']:.2f} (llama.cpp's F16 greedy text equals torch's F32 greedy text on
{al['greedy_equal_torch']} of them). The teacher-forced figure at random anchors above ({d['val_tau_torch']:.2f}) is
higher because at run time a block starts right after a rejected, i.e. hard, token.

Mean acceptance length over the check prompts: **{v['tau']:.2f}** tokens per target pass (block size
{a['block']}). Re-measure (also against upstream llama.cpp's own DFlash) with
`python -m dflash_gguf.bench --prompts code -n {v['max_tokens']}`. Speed on a 2-core CPU: see `BENCHMARKS.md` at the repository root (on such tiny models
the fixed per-call overheads dominate; read the numbers as mechanics, not as a forecast for 4B+
models).

## Limitations

- Trained for minutes on {t['tokens'] / 1e6:.1f} M tokens: it knows Python's surface syntax and stdlib idioms, not how to
  program. Outside Python code (prose, other languages) it produces noise, and acceptance drops.
- Greedy continuations of weak models fall into loops, which inflate acceptance; the check prompts
  were chosen to avoid that, yours may not.
- The files are rebuilt bit-for-bit only with the same Python (the corpus is its stdlib), library
  versions and CPU-time budgets.
"""


# ----------------------------------------------------------------------------- main
def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=REPO / "out" / "demo-train", help="scratch folder (resumable)")
    ap.add_argument("--dest", type=Path, default=REPO / "dflash_gguf" / "data" / "demo", help="where the GGUF pair goes")
    ap.add_argument("--minutes-target", type=float, default=15.0)
    ap.add_argument("--minutes-drafter", type=float, default=8.0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                    help="what the --minutes-* budgets count: CPU time / threads (default; the same training on "
                         "a busy machine, it just takes longer) or wall time")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--cap-bytes", type=int, default=16_000, help="most bytes any one source file contributes")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr-target", type=float, default=2e-3)
    ap.add_argument("--block", type=int, default=8)
    ap.add_argument("--taps", type=lambda s: [int(x) for x in s.split(",")], default=[1, 3, 4],
                    help="HF target_layer_ids (output of layer t; never the last layer)")
    ap.add_argument("--d-layers", type=int, default=2)
    ap.add_argument("--d-inter", type=int, default=768)
    ap.add_argument("--d-batch", type=int, default=8, help="sequences per drafter step")
    ap.add_argument("--anchors", type=int, default=16, help="anchors (blocks) per sequence per step")
    ap.add_argument("--gamma", type=float, default=4.0)
    ap.add_argument("--lr-drafter", type=float, default=2e-3)
    ap.add_argument("--prompt-len", type=int, default=96)
    ap.add_argument("--gen-len", type=int, default=160)
    ap.add_argument("--train-seqs", type=int, default=512)
    ap.add_argument("--val-seqs", type=int, default=32)
    ap.add_argument("--outtype", default="f16", help="GGUF weight type (f16, bf16, f32; q8_0 crashes in ggml's AMX kernels on AMX CPUs)")
    ap.add_argument("--upstream-convert", action="store_true", help="use upstream's converter even if ours exists")
    ap.add_argument("--verify-tokens", type=int, default=96)
    ap.add_argument("--log-every", type=float, default=30.0, help="seconds between progress lines")
    ap.add_argument("--smoke", action="store_true", help="tiny budgets and sizes: checks the pipeline in ~2 min")
    a = ap.parse_args(argv)
    if a.smoke:
        a.minutes_target, a.minutes_drafter = min(a.minutes_target, 0.4), min(a.minutes_drafter, 0.3)
        a.vocab, a.cap_bytes = min(a.vocab, 1024), min(a.cap_bytes, 3000)
        a.train_seqs, a.val_seqs, a.gen_len, a.prompt_len = 32, 8, 48, 32
        a.verify_tokens, a.log_every = 32, 5
    if max(a.taps) >= a.layers - 1:
        ap.error(f"--taps {a.taps}: never tap the last layer ({a.layers - 1}); llama.cpp has no input there")
    return a


def main(argv=None) -> int:
    a = parse(argv)
    import torch

    torch.set_num_threads(a.threads)
    CLOCK.update(kind=a.clock, threads=a.threads)
    random.seed(a.seed)
    np.random.seed(a.seed)
    torch.manual_seed(a.seed)
    work = a.work
    work.mkdir(parents=True, exist_ok=True)
    infof = work / "info.json"
    info = json.loads(infof.read_text()) if infof.exists() else {}
    def _rel(v):
        try:
            return str(Path(v).resolve().relative_to(REPO))
        except ValueError:
            return str(v)

    info["args"] = {k: (_rel(v) if isinstance(v, Path) else v) for k, v in vars(a).items()}
    info["versions"] = {"python": platform.python_version(), "torch": torch.__version__,
                        "transformers": __import__("transformers").__version__,
                        "sentencepiece": __import__("sentencepiece").__version__}
    log(f"work folder {work}, threads {a.threads}, seed {a.seed}{' (SMOKE RUN)' if a.smoke else ''}")
    T0 = time.time()

    def stage(name, fn):
        if done(work, name):
            log(f"stage {name}: already done, skipped")
            return
        t = time.time()
        log(f"stage {name} ...")
        res = fn()
        res = dict(res or {}, stage_seconds=round(time.time() - t, 1))
        info[name] = res
        infof.write_text(json.dumps(info, indent=2))
        mark(work, name, res)

    stage("corpus", lambda: build_corpus(work, a.cap_bytes))
    stage("tokenizer", lambda: (train_tokenizer(work, a.vocab, a.seed), {"vocab": a.vocab})[1])
    mask_id = sp_model(work).piece_to_id(MASK_PIECE)
    info.setdefault("tokenizer", {})["mask_token_id"] = mask_id
    stage("target", lambda: train_target(work, a))
    stage("samples", lambda: {"train": make_samples(work, a, "train", a.train_seqs, a.seed + 11),
                              "val": make_samples(work, a, "val", a.val_seqs, a.seed + 12)})
    stage("drafter", lambda: train_drafter(work, a, mask_id))
    stage("convert", lambda: convert(work, a))
    stage("verify", lambda: verify(work, a))
    stage("align", lambda: align_check(work, a, mask_id))
    info["total_minutes_this_run"] = round((time.time() - T0) / 60, 2)
    infof.write_text(json.dumps(info, indent=2))
    install(work, a.dest, info)
    if not info["verify"]["all_equal"]:
        log("WARNING: DFlash output differed from plain output; do not ship this pair")
        return 1
    log(f"all done in {(time.time() - T0) / 60:.1f} min (this run)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
