"""Stages 4-5: the target's greedy samples with tap features, and the DFlash drafter (module, data,
training, export)."""
from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from .common import CLOCK, clock, log, lr_at, save_ckpt
from .corpus import encode_split, line_starts, sp_model
from .dflash2 import selector_loss
from .dspark import dspark_loss
from .target import load_target


# ----------------------------------------------------------------------------- 4 samples
def make_samples(work: Path, a, split: str, n_seqs: int, seed: int, temps: tuple[float, ...] = (0.0,)) -> dict:
    """Continuations of corpus prompts + tap features + the target's argmax per position.

    Batch b continues at temperature ``temps[b % len(temps)]`` (0: greedy). With ``a.soft_labels`` = J
    the target's J most likely tokens and their probabilities (temperature 1) are kept per position too.
    """
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
    J = a.soft_labels
    soft_ids = np.zeros((n_seqs, L, J), dtype=np.int32)
    soft_p = np.zeros((n_seqs, L, J), dtype=np.float16)
    gen = torch.Generator().manual_seed(seed)
    t0 = time.time()
    bs = 32
    for b0 in range(0, n_seqs, bs):
        nb = min(bs, n_seqs - b0)
        temp = temps[(b0 // bs) % len(temps)]

        def pick(logits, temp=temp):
            if temp <= 0:
                return logits.argmax(-1, keepdim=True)
            return torch.multinomial(torch.softmax(logits / temp, -1), 1, generator=gen)

        # prompts: BOS + a window from a line start (length varies through where it is cut)
        idx = rng.choice(starts[starts < len(stream) - P], size=nb)
        prompt = np.stack([np.concatenate([[sp.bos_id()], stream[i:i + P - 1]]) for i in idx]).astype(np.int64)
        with torch.no_grad():
            x = torch.from_numpy(prompt)
            out = model(input_ids=x, use_cache=True)
            past = out.past_key_values
            seq = [x]
            nxt = pick(out.logits[:, -1])
            for _ in range(G):
                seq.append(nxt)
                out = model(input_ids=nxt, past_key_values=past, use_cache=True)
                past = out.past_key_values
                nxt = pick(out.logits[:, -1])
            full = torch.cat(seq, 1)
            out = model(input_ids=full, output_hidden_states=True)
            hs = out.hidden_states
            f = torch.cat([hs[t + 1] for t in taps], -1)   # HF target_layer_ids t -> hidden_states[t + 1]
            feats[b0:b0 + nb] = f.numpy().astype(np.float16)
            toks[b0:b0 + nb] = full.numpy()
            amax[b0:b0 + nb] = out.logits.argmax(-1).numpy()
            if J:
                top = torch.softmax(out.logits.float(), -1).topk(J, -1)
                soft_ids[b0:b0 + nb], soft_p[b0:b0 + nb] = top.indices.numpy(), top.values.numpy()
        if (b0 // bs) % 4 == 0:
            log(f"samples[{split}]: {b0 + nb}/{n_seqs} sequences ({time.time() - t0:.0f} s)")
    # how often the teacher-forced argmax agrees with the cached greedy token (numerics)
    agree = float((amax[:, P - 1:L - 1] == toks[:, P:]).mean())
    extra = {"soft_ids": soft_ids, "soft_p": soft_p} if J else {}
    np.savez(work / f"samples-{split}.npz", feats=feats, toks=toks, amax=amax, prompt_len=P, **extra)
    log(f"samples[{split}]: {n_seqs} x ({P} prompt + {G} generated) tokens at temperatures {list(temps)} in "
        f"{time.time() - t0:.0f} s; argmax/continuation agreement {agree:.4f}")
    return {"n": n_seqs, "prompt_len": P, "gen_len": G, "temperatures": list(temps), "soft_labels": J,
            "seconds": round(time.time() - t0, 1), "agree": agree}


# ----------------------------------------------------------------------------- 5 drafter
def build_drafter_module(a, vocab: int):
    """The drafter in the z-lab layout; ``a.kind == "dflash2"`` adds the conv and the selector,
    ``"dspark"`` the Markov and confidence heads."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    from .dflash2 import conv_modules, selector_module

    v2 = a.kind == "dflash2"
    Conv = conv_modules(a.hidden, a.conv_kernel, a.conv_group) if v2 else None

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
            if v2:
                self.attention_conv = Conv()
                self.mlp_conv = Conv()

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
            if v2:
                self.candidate_selector = selector_module(H, vocab, a.selector_rank)()
            if a.kind == "dspark":
                from .dspark import heads_module

                self.markov_head, self.confidence_head = heads_module(H, vocab, a.markov_rank, a.confidence)

        def forward(self, feats, ctx_pos, noise_emb, noise_pos, mask):
            """feats [S, L, nT*H]; noise_emb [S, Q, H]; mask [S, 1, Q, L + Q] (True = attend)."""
            S, L = feats.shape[:2]
            Q = noise_emb.shape[1]
            ctx = self.hidden_norm(self.fc(feats))
            h = noise_emb
            B = a.block
            for lyr in self.layers:
                at = lyr.self_attn
                x = lyr.input_layernorm(h)
                if v2:
                    dyn = lyr.attention_conv.coefficients(x)
                    x = lyr.attention_conv(x, dyn, 0, B)
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
                o = at.o_proj(o.transpose(1, 2).reshape(S, Q, nh * hd))
                if v2:
                    o = lyr.attention_conv(o, dyn, 1, B)
                h = h + o
                y = lyr.post_attention_layernorm(h)
                if v2:
                    dyn = lyr.mlp_conv.coefficients(y)
                    h = h + lyr.mlp_conv(lyr.mlp(lyr.mlp_conv(y, dyn, 0, B)), dyn, 1, B)
                else:
                    h = h + lyr.mlp(y)
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
        self.soft = (torch.from_numpy(z["soft_ids"].astype(np.int64)), torch.from_numpy(z["soft_p"])) \
            if a.soft_labels and "soft_ids" in z else None
        self.B = a.block
        self.first = anchor_first(a)      # row 0 predicts too (DSpark), else row 0 is the anchor's slot
        self.mask_id = mask_id
        self.n, self.L = self.toks.shape

    def batch(self, rng: np.random.Generator, seqs: np.ndarray, n_anchor: int, embed):
        """Anchors a in [P-1, L-B]: every slot label is a greedy token of the target.

        Also returns the tokens before each slot (``prev``: the anchor, then the sequence's tokens) and,
        with soft labels, the target's top tokens and probabilities for each slot (else None). Labels
        are for the predicting rows: 1..B-1, or 0..B-1 anchor-first (row k: the token at a+k+1)."""
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
        # slot k (1..B-1) predicts the target's greedy token at a+k = argmax at position a+k-1;
        # anchor-first, row k (0..B-1) the one at a+k+1 = argmax at a+k
        R = B if self.first else B - 1
        at = (A[..., None] + (offs if self.first else offs[1:] - 1)).reshape(S, -1)
        lab = torch.gather(amax, 1, at).reshape(S, nb, R)
        prev = torch.gather(toks, 1, at).reshape(S, nb, R)
        soft = None
        if self.soft is not None:
            sid, sp = self.soft[0][sidx], self.soft[1][sidx]
            J = sid.shape[-1]
            soft = (torch.gather(sid, 1, at[..., None].expand(-1, -1, J)).reshape(S, nb, R, J),
                    torch.gather(sp, 1, at[..., None].expand(-1, -1, J)).reshape(S, nb, R, J).float())
        noise = embed(ids.reshape(S, nb * B))
        ctx_pos = torch.arange(L).expand(S, L)
        cmask = torch.arange(L)[None, None, :] < A[..., None]           # [S, nb, L] ctx strictly before anchor
        cmask = cmask[:, :, None, :].expand(S, nb, B, L).reshape(S, nb * B, L)
        blk = torch.arange(nb).repeat_interleave(B)
        nmask = (blk[:, None] == blk[None, :]).expand(S, nb * B, nb * B)  # non-causal within the block only
        mask = torch.cat([cmask, nmask], -1)[:, None]
        return feats, ctx_pos, noise, pos.reshape(S, -1), mask, lab, prev, soft


def anchor_first(a) -> bool:
    """DSpark's layout here (DeepSpec's ``sample_from_anchor``): every block row drafts."""
    return a.kind == "dspark"


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
    first = anchor_first(a)
    R = B if first else B - 1                       # predicting rows per block
    wk = torch.exp(-torch.arange(R).float() / a.gamma)
    log(f"drafter: {a.d_layers} layers, block {B}, taps {a.taps}, hidden {a.hidden}, ffn {a.d_inter}: "
        f"{n_params / 1e6:.2f} M parameters (+ the target's frozen embeddings / LM head); "
        f"{tr.n} train / {va.n} held-out greedy sequences; loss weights exp(-{'k' if first else '(k-1)'}/{a.gamma:g})")
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
        feats, ctx_pos, noise, pos, mask, lab, prev, soft = data.batch(rng, seqs, n_anchor, emb)
        h = model(feats, ctx_pos, noise, pos, mask)
        S = h.shape[0]
        h = h.view(S, n_anchor, B, -1)[:, :, 0 if first else 1:]
        logits = h @ W.T

        def ce_of(logits):
            if soft is None:
                return F.cross_entropy(logits.reshape(-1, vocab), lab.reshape(-1),
                                       reduction="none").view_as(lab).float()
            ids, probs = soft
            return -(torch.log_softmax(logits.float(), -1).gather(-1, ids) * probs).sum(-1) / probs.sum(-1)

        if a.kind == "dspark":
            loss, pred, conf, parts = dspark_loss(model, logits, h, prev, lab, wk, ce=ce_of,
                                                  conf_weight=a.confidence_weight, l1_weight=a.l1_weight, soft=soft,
                                                  conf_target=a.confidence_target)
            if conf is not None:
                parts["conf_mean"] = conf.mean((0, 1))
                parts["conf_hit"] = (pred == lab).float().mean((0, 1))
            return loss, pred, lab, parts
        loss = (ce_of(logits) * wk).sum(-1).mean() / wk.sum()
        if a.kind != "dflash2":
            return loss, logits.argmax(-1), lab, {}
        sel = model.candidate_selector
        sl, covered, pred = selector_loss(sel, logits, h, prev, lab, a.selector_top_k, soft)
        return loss + a.selector_weight * sl, pred, lab, {"sel": sl.item(), "covered": covered}

    def evaluate():
        model.eval()
        with torch.no_grad():
            rng = np.random.default_rng(99)
            lens, per = [], torch.zeros(R)
            losses = []
            conf = {"mean": torch.zeros(R), "hit": torch.zeros(R)}
            for s0 in range(0, va.n, 8):
                seqs = np.arange(s0, min(va.n, s0 + 8))
                loss, pred, lab, parts = run(va, seqs, rng, a.anchors)
                losses.append(loss.item())
                lens.append(accept_len(pred, lab).flatten())
                per += (pred == lab).cumprod(-1).float().mean((0, 1))
                if "conf_mean" in parts:
                    conf["mean"] += parts["conf_mean"]
                    conf["hit"] += parts["conf_hit"]
        model.train()
        acc = torch.cat(lens)
        held["confidence"] = {k: (v / len(lens)).tolist() for k, v in conf.items()} if a.kind == "dspark" else None
        return float(np.mean(losses)), 1.0 + acc.mean().item(), (per / len(lens)).tolist()

    held = {}          # what evaluate() measured besides the loss and acceptance (DSpark: confidence)
    budget = a.minutes_drafter * 60
    rng = np.random.default_rng(a.seed + 7 + state["step"])
    t_seg, el0 = clock(), state["elapsed"]
    t_last_ck = t_last_log = t_last_eval = time.time()
    ema = emal = esel = None
    model.train()
    while True:
        el = el0 + clock() - t_seg
        if el >= budget:
            break
        lr = lr_at(el / budget, state["step"], a.lr_drafter, 30)
        for g in opt.param_groups:
            g["lr"] = lr
        seqs = rng.choice(tr.n, size=a.d_batch, replace=False)
        loss, pred, lab, parts = run(tr, seqs, rng, a.anchors)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        state["step"] += 1
        al = 1.0 + accept_len(pred, lab).mean().item()
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        emal = al if emal is None else 0.95 * emal + 0.05 * al
        aux = parts.get("sel", parts.get("conf"))
        if aux is not None:
            esel = aux if esel is None else 0.95 * esel + 0.05 * aux
        now = time.time()
        if now - t_last_log >= a.log_every or state["step"] == 1:
            t_last_log = now
            sel_txt = f"  selector loss {esel:.3f} (top-{a.selector_top_k} holds the label: {parts['covered']:.2f})" \
                if "sel" in parts else f"  confidence BCE {esel:.3f}" if "conf" in parts else ""
            log(f"drafter step {state['step']:5d}  loss {ema:.3f}{sel_txt}  train tau~{emal:.2f}  lr {lr:.2e}  "
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
    return {"kind": a.kind, "params": n_params, "steps": state["step"], "minutes": round(state["elapsed"] / 60, 2),
            "train_loss": round(float(ema or 0), 4), "val_loss": round(vl, 4), "val_tau_torch": round(vt, 3),
            "selector_loss": round(float(esel), 4) if esel is not None and a.kind == "dflash2" else None,
            "val_per_position": [round(p, 4) for p in per], "batch_seqs": a.d_batch, "anchors_per_seq": a.anchors,
            "gamma": a.gamma, "lr": a.lr_drafter, "history": state["history"], **_dspark_summary(a, esel, held)}


def _dspark_summary(a, esel, held) -> dict:
    if a.kind != "dspark":
        return {}
    c = held.get("confidence")
    return {"markov_rank": a.markov_rank, "confidence_head": a.confidence, "confidence_weight": a.confidence_weight,
            "confidence_target": a.confidence_target, "l1_weight": a.l1_weight,
            "confidence_loss": round(float(esel), 4) if esel is not None and a.confidence else None,
            # held-out, teacher-forced: mean confidence per row vs how often that row's token was the target's
            "val_confidence_mean": [round(x, 4) for x in c["mean"]] if c else None,
            "val_row_accuracy": [round(x, 4) for x in c["hit"]] if c else None}


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
    if a.kind == "dspark":
        cfg["architectures"] = ["DSparkDraftModel"]
        cfg.update({"markov_rank": a.markov_rank, "markov_head_type": "vanilla", "sample_from_anchor": True,
                    "enable_confidence_head": a.confidence, "confidence_head_with_markov": True})
    if a.kind == "dflash2":
        cfg["architectures"] = ["DFlash2DraftModel"]
        cfg["is_causal"] = False    # non-causal within the block (a sliding layer would default to causal)
        cfg["dflash_config"].update({"conv_kernel_size": a.conv_kernel, "conv_group_size": a.conv_group,
                                     "selector_rank": a.selector_rank, "selector_top_k": a.selector_top_k})
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
