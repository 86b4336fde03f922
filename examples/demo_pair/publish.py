"""Stages 6-7: GGUF conversion, verification against plain decoding, the torch/llama.cpp alignment
check, installation and the model card."""
from __future__ import annotations

import contextlib
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

from .common import CHECK_PROMPTS, REPO, log
from .corpus import sp_model
from .dflash2 import greedy_walk
from .drafter import anchor_first, build_drafter_module
from .dspark import greedy_chain
from .target import load_target


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
    from dflash_gguf.native.engine import ContextOptions
    from dflash_gguf.native.logs import set_log_handler
    from dflash_gguf.bench.ours import top2_gap
    from dflash_gguf.bench.window import NEAR_TIE
    from dflash_gguf.pair import compare_with_plain, open_pair
    from dflash_gguf.decoding import GenerationStats, SpecOptions

    set_log_handler()
    sp = sp_model(work)
    gg = work / "gguf"
    opts = ContextOptions(n_ctx=1024, n_batch=64, n_ubatch=64, n_threads=a.threads)
    results, tot = [], GenerationStats()
    tok_mismatch = 0
    with open_pair(gg / "target.gguf", gg / "drafter.gguf", opts) as pair:
        tm = pair.target
        for p in CHECK_PROMPTS:
            ids = tm.tokenize(p.encode())
            if ids[1:] != sp.encode(p):
                tok_mismatch += 1
            c = compare_with_plain(pair, ids, a.verify_tokens,
                                   spec=SpecOptions(n_draft=a.block if anchor_first(a) else a.block - 1))
            tot.merge(c.stats)
            r = {"prompt": p, "equal": c.equal, "tau": round(c.stats.tau, 3), "n": len(c.spec)}
            if not c.equal:
                # plain's own top-2 logit gap where the two part: batched and one-row kernels may pick
                # differently only at a near-tie (README: what "lossless" means); anything else is a bug
                r["gap"] = top2_gap(pair.tctx, list(ids) + list(c.plain[:c.first_mismatch]))
            results.append(r)
            how = "OK " if c.equal else f"DIFF (top-2 gap {r['gap']:.5f})" if r["gap"] is not None else "DIFF"
            log(f"verify: {how} tau {c.stats.tau:.2f}  {p[:40]!r} -> {tm.detokenize(c.spec)[:60]!r}")
    ok = all(r["equal"] for r in results)
    lossless = all(r["equal"] or (r["gap"] is not None and r["gap"] < NEAR_TIE) for r in results)
    log(f"verify: DFlash == plain on {sum(r['equal'] for r in results)}/{len(results)} prompts"
        f"{'' if ok else ', the others part at a near-tie' if lossless else ', NOT at a near-tie'}; "
        f"mean acceptance length {tot.tau:.2f}; tokenizer mismatches vs SentencePiece: {tok_mismatch}")
    return {"all_equal": ok, "lossless": lossless, "tau": round(tot.tau, 3), "prompts": results,
            "tokenizer_mismatch": tok_mismatch, "max_tokens": a.verify_tokens}


def torch_pair(work: Path, a):
    """The torch target and the exported drafter (eval mode), as trained."""
    from safetensors.torch import load_file

    target = load_target(work)
    dr = build_drafter_module(a, target.model.embed_tokens.weight.shape[0])
    dr.load_state_dict(load_file(work / "hf-drafter" / "model.safetensors"))
    dr.eval()
    return target, dr


def align_check(work: Path, a, mask_id: int) -> dict:
    """Same drafter, same held-out greedy sequences, two implementations: the torch drafter replayed
    the way the runtime drafts (anchor after each accepted prefix) and llama.cpp's DFlash. An
    alignment error (a tap, a position, a norm off by one) shows as a gap between the two."""
    import torch

    target, dr = torch_pair(work, a)
    W = target.model.embed_tokens.weight
    z = np.load(work / "samples-val.npz")
    feats, toks, amax, P = torch.from_numpy(z["feats"]).float(), z["toks"], z["amax"], int(z["prompt_len"])
    B, L = a.block, toks.shape[1]
    first = anchor_first(a)
    n = B if first else B - 1                       # tokens a block drafts
    steps = acc = 0
    with torch.no_grad():
        for i in range(len(toks)):
            pos = P - 1
            while pos + B <= L:
                ids = torch.tensor([[int(toks[i, pos])] + [mask_id] * (B - 1)])
                h = dr(feats[i:i + 1, :pos], torch.arange(pos)[None], target.model.embed_tokens(ids),
                       (pos + torch.arange(B))[None], torch.ones(1, 1, B, pos + B, dtype=torch.bool))
                logits = h[0, B - n:] @ W.T
                if a.kind == "dspark":      # the runtime's greedy chain through the Markov head
                    prop = np.array(greedy_chain(dr, logits, h[0, B - n:], int(toks[i, pos]))[0])
                elif a.kind == "dflash2":   # the runtime's T = 0 walk through the selector's lattice
                    prop = np.array(greedy_walk(dr.candidate_selector, logits, h[0, 1:], int(toks[i, pos]),
                                                a.selector_top_k))
                else:
                    prop = logits.argmax(-1).numpy()
                ok = (prop == amax[i, pos:pos + n]).astype(int)
                k = int(np.cumprod(ok).sum())
                steps, acc = steps + 1, acc + k
                pos += k + 1
    tau_torch = (acc + steps) / steps

    sys.path.insert(0, str(REPO))
    from dflash_gguf.native.engine import Context, ContextOptions, Model
    from dflash_gguf.native.logs import set_log_handler
    from dflash_gguf.decoding import DFlashDecoder, GenerationStats

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
    out = {"tau_torch_replay": round(tau_torch, 3), "tau_llama_cpp": round(tot.tau, 3),
           "greedy_equal_torch": f"{same}/{len(toks)}", "sequences": len(toks), "tokens_each": L - P}
    if a.kind == "dflash2":
        out["lattice"] = lattice_check(work, a, mask_id)
    if a.kind == "dspark":
        out["blocks"] = dspark_check(work, a, mask_id)
    return out


def install(work: Path, dest: Path, info: dict, with_target: bool = True) -> None:
    """Copy the pair (or, for a drafter of an existing target, the drafter alone) with its card."""
    dest.mkdir(parents=True, exist_ok=True)
    files = ("target.gguf", "drafter.gguf", "pair.json") if with_target else ("drafter.gguf",)
    for f in files:
        src = work / "gguf" / f
        if src.exists():
            shutil.copy(src, dest / f)
    slim = {k: v for k, v in info.items()}
    (dest / "training.json").write_text(json.dumps(slim, indent=2) + "\n")
    card = model_card(info, dest) if with_target else (
        dspark_card if info["args"]["kind"] == "dspark" else drafter_card)(info, dest)
    (dest / "MODEL_CARD.md").write_text(card)
    log(f"installed {', '.join(files)}, training.json and MODEL_CARD.md into {dest}")


def model_card(info: dict, dest: Path) -> str:
    a, c, t, d, v = info["args"], info["corpus"], info["target"], info["drafter"], info["verify"]
    cv, s, al = info["convert"], info["samples"], info["align"]
    tb, db = (dest / "target.gguf").stat().st_size, (dest / "drafter.gguf").stat().st_size
    per = " ".join(f"{x:.2f}" for x in d["val_per_position"])
    wall = sum(x.get("stage_seconds", 0) for x in info.values() if isinstance(x, dict)) / 60
    rows = "\n".join(f"| `{r['prompt'].splitlines()[0][:48]}` | {_same(r)} | {r['tau']:.2f} |" for r in v["prompts"])
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
  (F16 was chosen when ggml's AMX Q8_0 matmul crashed on Intel AMX CPUs; `patches/0006` fixes that crash.)

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


def _same(r: dict) -> str:
    if r["equal"]:
        return "yes"
    gap = r.get("gap")
    return "NO" if gap is None else f"parts at a near-tie (top-2 gap {gap:.5f})"


def drafter_card(info: dict, dest: Path) -> str:
    """The card of a drafter trained for an existing target (``--target-gguf``), e.g. the DFlash2 demo drafter."""
    a, t, d, v, al, s = info["args"], info["target"], info["drafter"], info["verify"], info["align"], info["samples"]
    db = (dest / "drafter.gguf").stat().st_size
    per = " ".join(f"{x:.2f}" for x in d["val_per_position"])
    kind = "DFlash2" if a["kind"] == "dflash2" else "DFlash"
    extra = (f"; grouped dynamic causal conv (kernel {a['conv_kernel']}, {a['conv_group']} channels per coefficient) "
             f"around both sublayers, candidate selector (rank {a['selector_rank']}, top-{a['selector_top_k']})"
             if a["kind"] == "dflash2" else "")
    labels = (f"the target's {a['soft_labels']} most likely tokens with their probabilities (soft labels)"
              if a["soft_labels"] else "the target's greedy token")
    rows = "\n".join(f"| `{r['prompt'].splitlines()[0][:48]}` | {_same(r)} | {r['tau']:.2f} |" for r in v["prompts"])
    lat = al.get("lattice")
    lattice = (f" The selector lattice of the torch drafter and of llama.cpp for {lat['rows']} block rows: candidate "
               f"sets equal on {lat['same_candidate_sets']}, transition scores within {lat['max_score_diff']:.4f} "
               f"(largest {lat['max_abs_score']:.1f})." if lat else "")
    return f"""# dflash-gguf demo: a {kind} drafter for the demo target

`drafter.gguf` ({db / 1e6:.1f} MB, {info['convert']['outtype'].upper()}): a {kind} drafter for the demo
target `dflash_gguf/data/demo/target.gguf` (sha256 `{t['sha256'][:16]}...`), {a['d_layers']} layers,
block size {a['block']}, taps on target layers {a['taps']} (HF `target_layer_ids`){extra};
{d['params'] / 1e6:.2f} M parameters + the target's embeddings / LM head.

```
python -m dflash_gguf.bench.sampling          # acceptance at temperature > 0: lattice proposals vs one-hot
```

## How it was made

```
python examples/train_demo_pair.py --kind {a['kind']} --target-gguf dflash_gguf/data/demo/target.gguf \\
    --work out/demo2-train --dest {a['dest']} --minutes-drafter {a['minutes_drafter']:g}
```

The target was not retrained: stage 3 rebuilt its Hugging Face folder from the GGUF (the tokenizer
retrained from the same corpus and seed came out identical to the GGUF's vocabulary, which the
script checks). Training data: {s['train']['n']} sequences of a corpus prompt ({s['train']['prompt_len']} tokens)
plus {s['train']['gen_len']} tokens of the target's own continuation at temperatures
{s['train']['temperatures']} (cycled per batch of 32), with the tapped hidden states; labels are
{labels}. The rest is the DFlash recipe of the demo pair (random anchors, `[anchor, <|mask|> x
{a['block'] - 1}]`, context injected as K/V, CE weighted by exp(-(k-1)/{a['gamma']:g}), frozen embeddings
and LM head){'; the selector adds a K-way CE over the detached top-k of each row, with the true previous token as predecessor (`examples/demo_pair/dflash2.py`)' if a['kind'] == 'dflash2' else ''}.
{d['steps']} steps of {d['batch_seqs']} sequences, {d['minutes']:.1f} min; held-out (greedy sequences)
teacher-forced acceptance length {d['val_tau_torch']:.2f} (per-position prefix acceptance {per}).

## Measured

llama.cpp (this package's patched build), greedy, {v['max_tokens']} tokens per prompt, compared token by
token with plain decoding:

| prompt | DFlash == plain | acceptance length |
|---|---|---|
{rows}

Alignment cross-check on {al['sequences']} held-out greedy sequences: torch replay {al['tau_torch_replay']:.2f},
llama.cpp {al['tau_llama_cpp']:.2f}. Mean acceptance length over the check prompts: **{v['tau']:.2f}**.{lattice}

At temperature > 0 (DFlash2): acceptance with drafts sampled from the selector's distribution vs
one-hot drafts, measured with `python -m dflash_gguf.bench.sampling`: `BENCHMARKS.md` section 8.
"""


@contextlib.contextmanager
def _drafter_at(tm, dm, opts, prompt: list[int]):
    """A drafter context (on a target context of its own) holding the features of ``prompt[:-1]``, ready
    to draft the block after ``prompt[-1]``; both contexts are closed on leaving."""
    from dflash_gguf.decoding import DFlashDecoder
    from dflash_gguf.native.engine import Context

    tctx = Context(tm, opts)
    dctx = Context(dm, opts, other=tctx)
    spec = DFlashDecoder(tctx, dctx)
    try:
        spec.feed(prompt[:-1])
        spec.features.flush()
        yield dctx
    finally:
        del spec
        dctx.close()
        tctx.close()


def _torch_block_hidden(target, dr, taps: list[int], prompt: list[int], mask_id: int, Bk: int):
    """The torch drafter's final hidden states [Bk, H] for the block ``[prompt[-1], mask x (Bk - 1)]``
    after the target's tapped hidden states of ``prompt[:-1]``."""
    import torch

    pos, last = len(prompt) - 1, prompt[-1]
    with torch.no_grad():
        hs = target(input_ids=torch.tensor([prompt]), output_hidden_states=True).hidden_states
        feats = torch.cat([hs[t + 1] for t in taps], -1)[:, :pos]
        blk = torch.tensor([[last] + [mask_id] * (Bk - 1)])
        return dr(feats, torch.arange(pos)[None], target.model.embed_tokens(blk), (pos + torch.arange(Bk))[None],
                  torch.ones(1, 1, Bk, pos + Bk, dtype=torch.bool))[0]


def lattice_check(work: Path, a, mask_id: int, n_prompts: int = 4) -> dict:
    """DFlash2 only: the selector lattice of the torch drafter and of llama.cpp for the same contexts.

    For the last token of a few held-out greedy prefixes both sides draft one block; per row the
    candidate sets must agree and so must the transition scores (compared candidate by candidate,
    since the two top-k routines may list them in different orders). A conv or selector tensor laid
    out differently from what llama.cpp reads shows up here even when acceptance looks plausible."""
    import torch

    sys.path.insert(0, str(REPO))
    from dflash_gguf.native import _bindings as B
    from dflash_gguf.native.engine import ContextOptions, Model
    from dflash_gguf.native.logs import set_log_handler

    target, dr = torch_pair(work, a)
    W = target.model.embed_tokens.weight
    z = np.load(work / "samples-val.npz")
    toks, P, K, Bk = z["toks"], int(z["prompt_len"]), a.selector_top_k, a.block
    set_log_handler()
    tm, dm = Model(work / "gguf" / "target.gguf"), Model(work / "gguf" / "drafter.gguf")
    opts = ContextOptions(n_ctx=1024, n_batch=256, n_ubatch=256, n_threads=a.threads)
    same_sets = rows = 0
    worst = 0.0
    scale = 0.0
    for i in range(min(n_prompts, len(toks))):
        prompt = toks[i, :P + 8 * i].tolist()
        pos, last = len(prompt) - 1, prompt[-1]
        buf = np.zeros((Bk - 1, K + K * K), dtype=np.float32)
        with _drafter_at(tm, dm, opts, prompt) as dctx:
            got = B.check(B.lib.llama_dflash_draft_lattice(dctx.cptr, 0, pos, last, Bk - 1,
                                                           B.ffi.from_buffer("float[]", buf), buf.size), "lattice")
        h = _torch_block_hidden(target, dr, a.taps, prompt, mask_id, Bk)[1:]
        with torch.no_grad():
            logits = h @ W.T
            cand = logits.topk(K, -1).indices
            sel = dr.candidate_selector
            for r in range(got):
                ours = buf[r, :K].astype(np.int64)
                theirs = cand[r].numpy()
                rows += 1
                if set(ours.tolist()) != set(theirs.tolist()):
                    continue
                same_sets += 1
                order = [int(np.nonzero(theirs == t)[0][0]) for t in ours]     # llama.cpp's order in torch's
                preds = torch.tensor([last]) if r == 0 else (
                    torch.from_numpy(buf[r - 1, :K].astype(np.int64)))
                for pi, p in enumerate(preds):
                    ref = sel.scores(logits[r], h[r], p, cand[r]).numpy()[order]
                    mine = buf[r, K + pi * K:K + (pi + 1) * K]
                    worst = max(worst, float(np.abs(ref - mine).max()))
                    scale = max(scale, float(np.abs(ref).max()))
    log(f"lattice: candidate sets equal on {same_sets}/{rows} rows; transition scores differ by at most "
        f"{worst:.4f} (largest score {scale:.2f}; F16 weights in llama.cpp, F32 in torch)")
    return {"rows": rows, "same_candidate_sets": same_sets, "max_score_diff": round(worst, 5),
            "max_abs_score": round(scale, 3)}


def dspark_check(work: Path, a, mask_id: int, n_prompts: int = 8) -> dict:
    """DSpark only: one block drafted by the torch drafter and by llama.cpp for the same contexts.

    For the last token of a few held-out greedy prefixes both sides draft a block (the Markov chain
    from that token) with its confidences. A Markov or confidence tensor laid out differently from
    what llama.cpp reads (markov_w1 transposed, the bias of the confidence projection dropped, the
    confidence input taken before the final norm) shows up here even where acceptance looks plausible."""
    import torch

    sys.path.insert(0, str(REPO))
    from dflash_gguf.native import _bindings as B
    from dflash_gguf.native.engine import ContextOptions, Model
    from dflash_gguf.native.logs import set_log_handler

    target, dr = torch_pair(work, a)
    W = target.model.embed_tokens.weight
    z = np.load(work / "samples-val.npz")
    toks, P, Bk = z["toks"], int(z["prompt_len"]), a.block
    set_log_handler()
    tm, dm = Model(work / "gguf" / "target.gguf"), Model(work / "gguf" / "drafter.gguf")
    opts = ContextOptions(n_ctx=1024, n_batch=256, n_ubatch=256, n_threads=a.threads)
    rows = same_rows = same_blocks = 0
    worst = 0.0
    i32 = "int32_t[]"
    for i in range(min(n_prompts, len(toks))):
        prompt = toks[i, :P + 8 * i].tolist()
        pos, last = len(prompt) - 1, prompt[-1]
        ids = np.zeros(Bk, np.int32)
        conf = np.zeros(Bk, np.float32)
        with _drafter_at(tm, dm, opts, prompt) as dctx:
            args = (dctx.cptr, 1, B.ffi.from_buffer(i32, np.zeros(1, np.int32)),
                    B.ffi.from_buffer(i32, np.array([pos], np.int32)), B.ffi.from_buffer(i32, np.array([last], np.int32)),
                    Bk, B.ffi.from_buffer("llama_token[]", ids))
            if a.confidence:
                got = B.check(B.lib.llama_dflash_draft_seqs_conf(*args, B.ffi.from_buffer("float[]", conf)), "draft")
            else:
                got = B.check(B.lib.llama_dflash_draft_seqs(*args), "draft")
        h = _torch_block_hidden(target, dr, a.taps, prompt, mask_id, Bk)
        with torch.no_grad():
            want, want_conf = greedy_chain(dr, h @ W.T, h, last)
        # rows after the first difference follow another chain: compare up to it
        k = next((j for j in range(got) if int(ids[j]) != want[j]), got)
        rows += got
        same_rows += k
        same_blocks += k == got
        if a.confidence:
            worst = max([worst] + [abs(float(conf[j]) - want_conf[j]) for j in range(min(k + 1, got))])
    log(f"dspark: llama.cpp's blocks equal torch's on {same_blocks}/{min(n_prompts, len(toks))} contexts "
        f"({same_rows}/{rows} rows before any difference); confidences differ by at most {worst:.4f} "
        "(F16 weights in llama.cpp, F32 in torch)")
    return {"contexts": min(n_prompts, len(toks)), "same_blocks": same_blocks, "rows": rows, "same_rows": same_rows,
            "max_confidence_diff": round(worst, 5) if a.confidence else None}


def dspark_card(info: dict, dest: Path) -> str:
    """The card of the DSpark demo drafter; with ``traces.json`` beside it (``demo_pair/traces.py``) also
    its comparison with the other demo drafters and the calibration of its confidence."""
    a, t, d, v, al, s = info["args"], info["target"], info["drafter"], info["verify"], info["align"], info["samples"]
    db = (dest / "drafter.gguf").stat().st_size
    per = " ".join(f"{x:.2f}" for x in d["val_per_position"])
    rows = "\n".join(f"| `{r['prompt'].splitlines()[0][:48]}` | {_same(r)} | {r['tau']:.2f} |" for r in v["prompts"])
    blk = al["blocks"]
    conf_line = ""
    if d.get("val_confidence_mean"):
        conf_line = ("\nHeld-out, teacher-forced, per row: mean confidence "
                     + " ".join(f"{x:.2f}" for x in d["val_confidence_mean"]) + " vs the share of rows whose token was "
                     "the target's " + " ".join(f"{x:.2f}" for x in d["val_row_accuracy"]) + ".")
    labels = (f"the target's {a['soft_labels']} most likely tokens with their probabilities (soft labels)"
              if a["soft_labels"] else "the target's greedy token")
    against = ("whether the row's greedy token is the target's" if a["confidence_target"] == "greedy"
               else "1 - TV(draft, target)")
    conf_txt = (f"its confidence head is trained with BCE (weight {a['confidence_weight']:g}, the same row weights) "
                f"against {against}" if a["confidence"] else "no confidence head")
    card = f"""# dflash-gguf demo: a DSpark drafter for the demo target

`drafter.gguf` ({db / 1e6:.1f} MB, {info['convert']['outtype'].upper()}): a DSpark drafter for the demo
target `dflash_gguf/data/demo/target.gguf` (sha256 `{t['sha256'][:16]}...`): the DFlash drafter's backbone
({a['d_layers']} layers, taps on target layers {a['taps']}, HF `target_layer_ids`) plus DeepSpec's vanilla
Markov head (rank {a['markov_rank']}: `markov_w2 @ markov_w1[prev]` added to each block row's logits, chained
greedily from the anchor){' and confidence head (`sigmoid(proj @ [h; markov_w1[prev]] + b)`)' if a['confidence'] else ''};
block size {a['block']} in the anchor-first layout (DeepSpec's `sample_from_anchor`: block `[anchor, <|mask|> x
{a['block'] - 1}]`, row k drafts the token after the anchor's k-th successor), so it drafts {a['block']} tokens a
step where the DFlash demo drafters draft {a['block'] - 1}. {d['params'] / 1e6:.2f} M parameters + the target's
embeddings / LM head.

## How it was made

```
OMP_WAIT_POLICY=PASSIVE python examples/train_demo_pair.py --kind dspark \\
    --target-gguf dflash_gguf/data/demo/target.gguf --work out/dspark-train --dest {a['dest']} \\
    --minutes-drafter {a['minutes_drafter']:g}
python examples/demo_pair/traces.py {a['dest']}
```

`OMP_WAIT_POLICY=PASSIVE`: the budget counts this process's CPU time, and on a shared, overloaded
machine OpenMP threads spinning at each barrier for a descheduled partner burn it without training.

Same target (not retrained; rebuilt from the GGUF) and the same kind of data as the DFlash2 demo
drafter: {s['train']['n']} sequences of a corpus prompt ({s['train']['prompt_len']} tokens) plus
{s['train']['gen_len']} tokens of the target's own continuation at temperatures {s['train']['temperatures']},
with the tapped hidden states; labels are {labels}. DFlash's recipe for the backbone (random anchors,
context injected as K/V, frozen embeddings and LM head), with the CE taken on the Markov-biased
logits and weighted by exp(-k/{a['gamma']:g}) over rows k = 0..{a['block'] - 1}, teacher-forced (the previous token
of row k is the sequence's own: the anchor for row 0); {conf_txt}
(`examples/demo_pair/dspark.py`, which says what of DeepSpec's recipe it follows).
{d['steps']} steps of {d['batch_seqs']} sequences, {d['minutes']:.1f} min on {a['threads']} threads (CPU clock);
held-out (greedy sequences) teacher-forced acceptance length {d['val_tau_torch']:.2f} (per-position prefix
acceptance {per}).{conf_line}

## Measured

llama.cpp (this package's patched build), greedy, {v['max_tokens']} tokens per prompt, compared token by
token with plain decoding:

| prompt | DSpark == plain | acceptance length |
|---|---|---|
{rows}

Mean acceptance length over these prompts: **{v['tau']:.2f}**. Alignment cross-check on {al['sequences']}
held-out greedy sequences: torch replay {al['tau_torch_replay']:.2f}, llama.cpp {al['tau_llama_cpp']:.2f}. One block
drafted by both for {blk['contexts']} contexts: the same tokens in {blk['same_blocks']} blocks ({blk['same_rows']}/{blk['rows']}
rows before any difference){'' if blk['max_confidence_diff'] is None else f", confidences within {blk['max_confidence_diff']:.4f}"}.
"""
    tf = dest / "traces.json"
    versus = ""
    if tf.is_file():
        tr = json.loads(tf.read_text())
        card += _traces_section(tr)
        c = tr["compare"]
        for k, name in (("dflash2", "DFlash2"), ("dflash", "DFlash")):
            if k in c and "prompt_tau" in c[k]:
                mine, theirs = c["dspark"]["prompt_tau"], c[k]["prompt_tau"]
                wins = sum(x > y for x, y in zip(mine, theirs))
                versus += (f"\n- {'Above' if c['dspark']['tau'] > c[k]['tau'] else 'Below'} the {name} demo drafter over the "
                           f"benchmark prompts ({c['dspark']['tau']:.2f} vs {c[k]['tau']:.2f}), with a longer acceptance on "
                           f"{wins} of its {len(mine)} prompts.")
    return card + f"""
## Limitations

- Trained for minutes on the demo target's own continuations: it drafts the demo target's Python
  and little else.{versus}
- The confidence head was trained for greedy verification (is the row's argmax the target's?); at
  temperature > 0 its scores are not the acceptance probabilities of speculative sampling.
"""


def _traces_section(tr: dict) -> str:
    names = {"dflash": "DFlash (`data/demo`)", "dflash2": "DFlash2 (`data/demo-dflash2`)",
             "dspark": "DSpark (this one)"}
    cmp_rows = "\n".join(
        f"| {names.get(k, k)} | {r['n_draft']} | {r['tau']:.2f} | {'yes' if r['all_equal'] else 'NO'} | "
        + " ".join(f"{x:.2f}" for x in r["per_position_acceptance"]) + " |" for k, r in tr["compare"].items())
    n_prompts = len(tr["prompts"])
    out = f"""
### Against the other demo drafters

The benchmark prompts (`bench/prompts`: {', '.join(tr['prompt_sets'])}; {n_prompts} prompts), greedy,
{tr['max_tokens']} tokens each, every drafted block verified whole (no speed gate):

| drafter | drafted per step | acceptance length | == plain | P(accepted >= i), i = 1.. |
|---|---|---|---|---|
{cmp_rows}
"""
    cal = tr.get("calibration")
    if cal:
        pos = "\n".join(f"| {r['position']} | {r['reached']} | {r['mean_confidence']:.3f} | {r['acceptance_rate']:.3f} |"
                        for r in cal["by_position"])
        bins = "\n".join(f"| {b['confidence'][0]:.1f}-{b['confidence'][1]:.1f} | {b['rows']} | {b['mean_confidence']:.3f} | "
                         f"{b['acceptance_rate']:.3f} |" for b in cal["by_confidence"])
        out += f"""
### Calibration of the confidence head

Same runs. A row is *reached* when every drafted token before it was accepted (what its confidence
is conditioned on); its acceptance rate is the share of reached rows the target accepted.

| row | reached | mean confidence | acceptance rate |
|---|---|---|---|
{pos}

| confidence | rows | mean confidence | acceptance rate |
|---|---|---|---|
{bins}

Brier score {cal['brier']:.4f} over all reached rows (a constant forecast of the overall rate: {cal['brier_constant']:.4f}).
The decoder does not take the raw scores at their word: it learns what the target accepted at each
score (`dflash_gguf/decoding/confidence.py`).
"""
    out += """
### `traces.json`

Written by `examples/demo_pair/traces.py`. Top level: `target`, `drafter`, `prompt_sets`, `max_tokens`,
`greedy`, `n_draft` (tokens drafted per step), `tau` (acceptance length), `per_position_acceptance`
(P(accepted >= i) for i = 1..n_draft over all steps: the file is an acceptance profile for
`python -m dflash_gguf.bench.scale --profiles`), `calibration` (the tables above), `compare` (each demo
drafter's `kind`, `n_draft`, `tau`, `steps`, `all_equal`, `per_position_acceptance` and `prompt_tau`, the
acceptance length per prompt in the order of `prompts`) and `prompts`: per
prompt `set`, `name`, `equal` (output == plain decoding), `tau`, `n` (tokens generated) and `steps`,
one `[drafted, accepted, [confidence of row 1, ..., row drafted]]` per drafting step in order: the
first `accepted` drafted tokens were kept, row `accepted + 1` (if drafted) was rejected, later rows
were never judged.
"""
    return out
