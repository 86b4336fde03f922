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

DFlash2 (``--kind dflash2``) adds the grouped dynamic causal conv and the candidate selector
(``demo_pair/dflash2.py``) and, by default, trains on continuations at temperatures 0, 0.7 and 1
with the target's own distribution as soft labels, so that the selector's distribution is a usable
proposal at temperature > 0. ``--target-gguf`` rebuilds stage 3 from an existing F16/F32 target
instead of training one (the tokenizer must come out the same: same --vocab, --seed and Python):

    .venv/bin/python examples/train_demo_pair.py --kind dflash2 --target-gguf dflash_gguf/data/demo/target.gguf \
        --work out/demo2-train --dest dflash_gguf/data/demo-dflash2

DSpark (``--kind dspark``) puts DeepSpec's Markov and confidence heads on the DFlash drafter in the
anchor-first layout (every block row drafts: block 8 drafts 8 tokens; ``demo_pair/dspark.py``), on the
same data as DFlash2. Then ``demo_pair/traces.py`` measures it against the shipped DFlash and DFlash2
drafters on the benchmark prompts and records its per-step traces:

    .venv/bin/python examples/train_demo_pair.py --kind dspark --target-gguf dflash_gguf/data/demo/target.gguf \
        --work out/dspark-train --dest dflash_gguf/data/demo-dspark
    .venv/bin/python examples/demo_pair/traces.py dflash_gguf/data/demo-dspark
"""
from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))   # the demo_pair package next to this script

from demo_pair.common import CLOCK, MASK_PIECE, REPO, done, log, mark  # noqa: E402
from demo_pair.corpus import build_corpus, sp_model, train_tokenizer  # noqa: E402
from demo_pair.drafter import make_samples, train_drafter  # noqa: E402
from demo_pair.publish import align_check, convert, install, verify  # noqa: E402
from demo_pair.target import target_from_gguf, train_target  # noqa: E402


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
    ap.add_argument("--kind", choices=("dflash", "dflash2", "dspark"), default="dflash",
                    help="drafter kind (default dflash)")
    ap.add_argument("--target-gguf", type=Path, default=None,
                    help="use this F16/F32 qwen3 GGUF as the target instead of training one (its drafter only)")
    ap.add_argument("--conv-kernel", type=int, default=2, help="DFlash2 conv taps (default 2)")
    ap.add_argument("--conv-group", type=int, default=16, help="DFlash2 channels per dynamic coefficient (default 16)")
    ap.add_argument("--selector-rank", type=int, default=64, help="DFlash2 token code size (default 64)")
    ap.add_argument("--selector-top-k", type=int, default=15,
                    help="DFlash2 candidates per row (default 15; llama.cpp needs top_k * (top_k + 1) <= hidden)")
    ap.add_argument("--selector-weight", type=float, default=1.0, help="weight of the selector's loss (default 1)")
    ap.add_argument("--markov-rank", type=int, default=64, help="DSpark Markov head rank (default 64)")
    ap.add_argument("--confidence", action=argparse.BooleanOptionalAction, default=True,
                    help="DSpark confidence head (default on)")
    ap.add_argument("--confidence-weight", type=float, default=1.0, help="DSpark confidence BCE weight (default 1)")
    ap.add_argument("--confidence-target", choices=("greedy", "tv"), default="greedy",
                    help="what the DSpark confidence learns: greedy acceptance of the row's argmax (default) or "
                         "DeepSpec's 1 - TV(draft, target), the acceptance probability of speculative sampling")
    ap.add_argument("--l1-weight", type=float, default=0.0,
                    help="DSpark: weight of DeepSpec's L1(draft probs, target probs) term (needs --soft-labels; "
                         "default 0: the block loss is the CE alone)")
    ap.add_argument("--soft-labels", type=int, default=None,
                    help="train on the target's J most likely tokens and their probabilities instead of its greedy "
                         "token (default: 0 = greedy for dflash, 32 for dflash2 and dspark)")
    ap.add_argument("--sample-temps", type=lambda s: tuple(float(x) for x in s.split(",")), default=None,
                    help="temperatures of the training continuations, cycled per batch of 32 (default: 0 for dflash, "
                         "0,0.7,1 for dflash2 and dspark); the held-out ones are always greedy")
    ap.add_argument("--outtype", default="f16", help="GGUF weight type (f16, bf16, f32, q8_0)")
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
    v2 = a.kind == "dflash2"
    mixed = a.kind in ("dflash2", "dspark")      # DFlash2's data: sampled continuations, soft labels
    a.soft_labels = (32 if mixed else 0) if a.soft_labels is None else a.soft_labels
    a.sample_temps = ((0.0, 0.7, 1.0) if mixed else (0.0,)) if a.sample_temps is None else a.sample_temps
    if a.kind == "dspark" and a.markov_rank < 1:
        ap.error("--markov-rank must be at least 1 (the confidence head reads markov_w1 of the previous token)")
    if a.kind == "dspark" and (a.l1_weight > 0 or a.confidence_target == "tv") and not a.soft_labels:
        ap.error("--l1-weight and --confidence-target tv need the target's distribution: --soft-labels J > 0")
    if v2 and a.selector_top_k * (a.selector_top_k + 1) > a.hidden:
        ap.error(f"--selector-top-k {a.selector_top_k}: llama.cpp packs top_k * (top_k + 1) scores per row into "
                 f"the hidden size {a.hidden}; use at most {int(((4 * a.hidden + 1) ** 0.5 - 1) / 2)}")
    if v2 and a.hidden % a.conv_group:
        ap.error(f"--conv-group {a.conv_group} must divide the hidden size {a.hidden}")
    if a.soft_labels < 0 or any(t < 0 for t in a.sample_temps):
        ap.error("--soft-labels and --sample-temps must not be negative")
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
    stage("target", lambda: target_from_gguf(work, a.target_gguf, a) if a.target_gguf else train_target(work, a))
    stage("samples", lambda: {"train": make_samples(work, a, "train", a.train_seqs, a.seed + 11, a.sample_temps),
                              "val": make_samples(work, a, "val", a.val_seqs, a.seed + 12)})
    stage("drafter", lambda: train_drafter(work, a, mask_id))
    stage("convert", lambda: convert(work, a))
    stage("verify", lambda: verify(work, a))
    stage("align", lambda: align_check(work, a, mask_id))
    info["total_minutes_this_run"] = round((time.time() - T0) / 60, 2)
    infof.write_text(json.dumps(info, indent=2))
    install(work, a.dest, info, with_target=a.target_gguf is None)
    if not info["verify"]["lossless"]:
        log("WARNING: DFlash output differed from plain output; do not ship this pair")
        return 1
    log(f"all done in {(time.time() - T0) / 60:.1f} min (this run)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
