"""What a drafter's confidence buys: verify lengths chosen per step from the confidence head, against
fixed lengths, the history gate alone and the oracle, at a real model shape.

A pair of real shape (``bench.scale``'s random-weight GGUFs: the drafter runs every step and its cost is
paid) replays recorded DSpark steps: each step's per-position confidences and how many drafted tokens
the target accepted with the whole block verified. The proposal is the target's own continuation, made
wrong at the recorded position, so a policy that verifies ``k`` rows keeps ``min(accepted, k)`` of them,
as it would have. Policies, one decoder each on the same contexts, interleaved per trial:

* ``plain``: no drafting;
* ``fixed k``: k tokens drafted and verified every step, k = 1..n;
* ``history``: the speed gate on acceptance history alone (today's policy for drafters without a head);
* ``confidence``: the same gate, each step's block cut to the rows worth verifying by the calibrated
  confidence (:mod:`dflash_gguf.decoding.confidence`);
* ``oracle``: verifies exactly the accepted tokens plus one row: the ceiling for any verify length.

Each policy's first call (trial 0: a fresh gate) is also reported against its warmed-up median, and so
is the first call of a new decoder whose gate starts from what the warmed-up one kept
(``history (kept)``, ``confidence (kept)``: what a new ``Llama`` of the pair gets from
:mod:`dflash_gguf.decoding.history`).

``--sequences B`` decodes B requests together instead (a server's slots without HTTP: the batch's gates
and the confidence's allocation of rows across sequences; the oracle verifies each sequence's accepted
tokens plus one row), without the first calls.

    python -m dflash_gguf.bench.confidence --shape 1.7b --type q4_0 --traces demo-dspark -t 2
    python -m dflash_gguf.bench.confidence --shape 1.7b --type q4_0 --draft-vocab 32768 --sequences 2 -t 2
"""
from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from dflash_gguf.bench.scale.replay import block_right_for, reference_for
from dflash_gguf.decoding.proposer import DrafterProposer

log = logging.getLogger("dflash_gguf.bench.confidence")
SHIPPED = Path(__file__).resolve().parents[1] / "data" / "demo-dspark" / "traces.json"


def load_traces(spec: str) -> tuple[str, list[tuple[list[float], int]]]:
    """``demo-dspark`` (the shipped DSpark demo drafter's recorded steps: its ``traces.json``, each prompt's
    steps as ``[drafted, accepted, confidences]``), a JSON file of steps (``[{"accepted": a, "confidence":
    [c1, ...]}, ...]`` or ``{"steps": [...]}``), or ``synthetic``
    (easy and hard stretches of text, the head calibrated: labelled as such)."""
    if spec == "synthetic":
        rng = np.random.default_rng(0)
        steps = []
        for _ in range(4000):
            p = np.clip(rng.beta(2, 2) + rng.normal(0, 0.05, 8), 0.02, 0.98) * np.linspace(1, 0.8, 8)
            a = 0
            while a < 8 and rng.random() < p[a]:
                a += 1
            steps.append((p.tolist(), a))
        return "synthetic", steps
    path = SHIPPED if spec == "demo-dspark" else Path(spec)
    doc = json.loads(path.read_text())
    if isinstance(doc, dict) and "prompts" in doc:     # a drafter's recorded traces: [drafted, accepted, confidences]
        steps = [([float(c) for c in conf], int(a)) for p in doc["prompts"] for _n, a, conf in p["steps"]]
    else:
        rows = doc["steps"] if isinstance(doc, dict) else doc
        steps = [([float(c) for c in r["confidence"]], int(r["accepted"])) for r in rows]
    if not steps or any(not c or a < 0 or a > len(c) for c, a in steps):
        raise ValueError(f"{path}: every step needs a confidence per drafted token and 0 <= accepted <= their count")
    return path.stem if spec != "demo-dspark" else "demo-dspark", steps


class TraceBook(DrafterProposer):
    """Recorded steps replayed over several references (a server's requests: each a prompt followed by its
    plain continuation), for any number of sequences at once. Runs the drafter (its cost is paid), then
    gives each sequence the next recorded step: the continuation of the reference its context is a prefix
    of, made wrong at the step's accepted count, with the step's confidences (``confidence=False``: none,
    for the history-only policy).
    A context no reference starts with (another prompt) gets a wrong block, counted in ``diverged``.
    ``oracle``: each sequence's step will accept (``accepted[seq]``), which :func:`verify_accepted` cuts
    its block to."""

    def __init__(self, references: list[list[int]], steps, n_vocab: int, start: int = 0, confidence: bool = True,
                 oracle: bool = False):
        self.refs = [[int(t) for t in r] for r in references]
        self.steps, self.n_vocab = steps, n_vocab
        self.i = start
        self.confidence = confidence
        self.oracle = oracle
        self.accepted: dict[int, int] = {}
        self.blocks = 0
        self.diverged = 0

    def propose(self, drafter, seqs, pos, pending, n, out, context, conf=None):
        n = super().propose(drafter, seqs, pos, pending, n, out, context)
        for j in range(len(seqs)):
            c, a = self.steps[self.i % len(self.steps)]
            self.i += 1
            self.blocks += 1
            a = min(a, n)
            ctx = context(j) + [int(pending[j])]
            ref = reference_for(self.refs, ctx)
            if ref is None:
                self.diverged += 1
                out[j, :n] = (ctx[-1] + 1) % self.n_vocab
            else:
                out[j, :n] = block_right_for(ref, len(ctx), n, a, self.n_vocab)
            if conf is not None and self.confidence:
                conf[j, :n] = (c + [c[-1]] * n)[:n]
            if self.oracle:
                self.accepted[int(seqs[j])] = a if ref is not None else 0
        return n


def verify_accepted(dec, book: TraceBook) -> None:
    """Make ``dec`` verify, per sequence and step, exactly the drafted tokens ``book`` (an oracle) says the
    target keeps: accepted + 1 rows, the fewest that give what the whole block gives - the ceiling for any
    choice of verify lengths, drafter call included. The book must be ``dec``'s proposer."""
    def verify_rows(seqs, plan, scores, padded):
        for i, s in enumerate(seqs):
            plan.lengths[i] = min(plan.lengths[i], book.accepted.get(s.slot, 0))
    assert book.oracle and dec.proposer is book
    dec.policy.verify_rows = verify_rows


class TraceReplay(TraceBook):
    """:class:`TraceBook` of one reference (prompt + plain continuation)."""

    def __init__(self, reference: list[int], steps, n_vocab: int, start: int = 0, confidence: bool = True,
                 oracle: bool = False):
        super().__init__([reference], steps, n_vocab, start, confidence, oracle)


def measure(target: Path, drafter: Path, steps, *, tokens: int, trials: int, threads: int | None,
            n_draft: int) -> dict:
    from dflash_gguf.bench.scale.run import PROMPT, _gen
    from dflash_gguf.decoding import DFlashDecoder, SpecOptions
    from dflash_gguf.decoding.history import kept
    from dflash_gguf.native.engine import Context, ContextOptions, Model

    tm = Model(target)
    ids = tm.tokenize(PROMPT.encode(), add_bos=False)
    opts = ContextOptions(n_ctx=len(ids) + tokens + 64, n_batch=512, n_ubatch=512, n_threads=threads)
    tctx, pctx = Context(tm, opts), Context(tm, opts)
    dm = Model(drafter)
    dctx = Context(dm, opts, other=tctx)
    plain = DFlashDecoder(pctx, None)
    ref, _ = _gen(plain, ids, tokens)
    reference = ids + ref
    fixed = {f"fixed {k}": DFlashDecoder(tctx, dctx, SpecOptions(n_draft=k)) for k in range(1, n_draft + 1)}
    history = DFlashDecoder(tctx, dctx, SpecOptions(n_draft=n_draft, adaptive=True),
                            TraceReplay(reference, steps, tm.n_vocab, confidence=False))
    confident = DFlashDecoder(tctx, dctx, SpecOptions(n_draft=n_draft, adaptive=True),
                              TraceReplay(reference, steps, tm.n_vocab))
    oracle = DFlashDecoder(tctx, dctx, SpecOptions(n_draft=n_draft), TraceReplay(reference, steps, tm.n_vocab,
                                                                                 confidence=False, oracle=True))
    verify_accepted(oracle, oracle.proposer)
    decs = {"plain": plain, **fixed, "history": history, "confidence": confident, "oracle": oracle}
    tps: dict[str, list[float]] = {k: [] for k in decs}
    tau: dict[str, list[float]] = {k: [] for k in decs}
    cold: dict[str, float] = {}               # trial 0: each decoder's first call (no history yet)
    exact = True
    for trial in range(trials + 1):            # trial 0 warms the gates (a Llama's first call): not counted
        start = trial * 997
        for name, dec in decs.items():
            if isinstance(dec.proposer, TraceReplay):
                dec.proposer.i = start
            elif name != "plain":
                dec.proposer = TraceReplay(reference, steps, tm.n_vocab, start=start, confidence=False)
            got, st = _gen(dec, ids, tokens)
            exact = exact and got == ref
            if trial:
                tps[name].append(st.tokens_per_second)
                tau[name].append(st.tau if st.steps else 1.0)
            else:
                cold[name] = st.tokens_per_second
    # a new decoder of the pair, as a new Llama makes it: its gate starts from what the warmed-up one
    # kept (decoding.history); its first call is compared with the warmed-up decoder's median
    for name in ("history", "confidence"):
        dec = DFlashDecoder(tctx, dctx, SpecOptions(n_draft=n_draft, adaptive=True),
                            TraceReplay(reference, steps, tm.n_vocab, start=(trials + 1) * 997,
                                        confidence=name == "confidence"))
        dec.gate.start_from(*kept(decs[name].gate))
        got, st = _gen(dec, ids, tokens)
        exact = exact and got == ref
        cold[f"{name} (kept)"] = st.tokens_per_second
    for c in (dctx, tctx, pctx):
        c.close()
    dm.close()
    tm.close()
    med = {k: statistics.median(v) for k, v in tps.items()}
    best = max((k for k in med if k.startswith("fixed")), key=med.get)
    return {"tokens_per_second": {k: round(v, 2) for k, v in med.items()},
            "spread": {k: [round(min(v), 2), round(max(v), 2)] for k, v in tps.items()},
            "tau": {k: round(statistics.median(v), 2) for k, v in tau.items()},
            "best_fixed": best, "all_equal_plain": exact,
            "confidence_over_history": round(med["confidence"] / med["history"], 3),
            "confidence_over_best_fixed": round(med["confidence"] / med[best], 3),
            "of_oracle": {k: round(v / med["oracle"], 3) for k, v in med.items()},
            "first_call_of_warm": {k: round(cold[k] / med[k.removesuffix(" (kept)")], 3) for k in cold},
            "over_plain": {k: round(v / med["plain"], 3) for k, v in med.items()}}


def measure_batch(target: Path, drafter: Path, steps, *, sequences: int, tokens: int, trials: int,
                  threads: int | None, n_draft: int) -> dict:
    """The policies at ``sequences`` sequences decoded together (a server's slots, without HTTP): each a
    prompt of ``bench.serve``'s, its recorded steps replayed (:class:`TraceBook`); plain decoding, fixed
    lengths, the history gate and the confidence, the same batch of requests in turn, medians over
    ``trials`` rounds (round 0 warms the gates up and is not counted) and each round's ratio to its plain."""
    from dflash_gguf.bench.serve import PROMPTS
    from dflash_gguf.decoding import DFlashDecoder, GenerationStats, Request, SpecOptions
    from dflash_gguf.native.engine import Context, ContextOptions, Model

    tm, dm = Model(target), Model(drafter)
    prompts = [tm.tokenize(PROMPTS[i % len(PROMPTS)].encode()) for i in range(sequences)]
    opts = ContextOptions(n_ctx=max(map(len, prompts)) + tokens + n_draft + 64, n_batch=512, n_ubatch=512,
                          n_threads=threads, n_seq=sequences)
    tctx = Context(tm, opts)
    dctx = Context(dm, opts, other=tctx)
    plain = DFlashDecoder(tctx, None)
    outs = plain.generate_batch([Request(p, tokens + n_draft + 1, stop_tokens=[]) for p in prompts])
    refs = [p + o for p, o in zip(prompts, outs)]
    lengths = sorted({1, 2, 3, 4, n_draft // 2, n_draft} - {0})
    decs = {"plain": plain}
    for k in lengths:
        decs[f"fixed {k}"] = DFlashDecoder(tctx, dctx, SpecOptions(n_draft=k),
                                           TraceBook(refs, steps, tm.n_vocab, confidence=False))
    decs["history"] = DFlashDecoder(tctx, dctx, SpecOptions(n_draft=n_draft, adaptive=True),
                                    TraceBook(refs, steps, tm.n_vocab, confidence=False))
    decs["confidence"] = DFlashDecoder(tctx, dctx, SpecOptions(n_draft=n_draft, adaptive=True),
                                       TraceBook(refs, steps, tm.n_vocab))
    decs["oracle"] = DFlashDecoder(tctx, dctx, SpecOptions(n_draft=n_draft),
                                   TraceBook(refs, steps, tm.n_vocab, confidence=False, oracle=True))
    verify_accepted(decs["oracle"], decs["oracle"].proposer)
    tps: dict[str, list[float]] = {k: [] for k in decs}
    tau: dict[str, list[float]] = {k: [] for k in decs}
    exact = True
    try:
        for trial in range(trials + 1):
            for name, dec in decs.items():
                if isinstance(dec.proposer, TraceBook):
                    dec.proposer.i = trial * 997
                dec.reset()          # the decoders share the contexts: each starts from empty caches
                reqs = [Request(p, tokens, stop_tokens=[]) for p in prompts]
                for r in reqs:
                    r.stats = GenerationStats()
                t0 = time.perf_counter()
                got = dec.generate_batch(reqs)
                wall = time.perf_counter() - t0
                exact = exact and all(g == r[len(p):len(p) + tokens] for g, r, p in zip(got, refs, prompts))
                st = GenerationStats()
                for r in reqs:
                    st.merge(r.stats)
                if trial:
                    tps[name].append(sum(map(len, got)) / wall)
                    tau[name].append(st.n_generated / st.passes if st.passes else 1.0)
    finally:
        for c in (dctx, tctx):
            c.close()
        dm.close()
        tm.close()
    ratio = {k: [x / b for x, b in zip(v, tps["plain"])] for k, v in tps.items()}
    med = {k: statistics.median(v) for k, v in ratio.items()}
    best = max((k for k in med if k.startswith("fixed")), key=med.get)
    return {"sequences": sequences,
            "tokens_per_second": {k: round(statistics.median(v), 2) for k, v in tps.items()},
            "over_plain": {k: round(v, 3) for k, v in med.items()},
            "over_plain_spread": {k: [round(min(v), 3), round(max(v), 3)] for k, v in ratio.items()},
            "tau": {k: round(statistics.median(v), 2) for k, v in tau.items()},
            "best_fixed": best, "all_equal_plain": exact,
            "confidence_over_history": round(med["confidence"] / med["history"], 3),
            "confidence_over_best_fixed": round(med["confidence"] / med[best], 3),
            "of_oracle": {k: round(v / med["oracle"], 3) for k, v in med.items()}}


def main(argv: list[str] | None = None) -> int:
    from dflash_gguf.bench.scale.synth import make_pair
    from dflash_gguf.kernels.cpu import cpu_model

    ap = argparse.ArgumentParser(prog="python -m dflash_gguf.bench.confidence", description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="1.7b", help="bench.scale shape (0.6b, 1.7b, ...)")
    ap.add_argument("--type", default="q4_0", help="weight type of the scale pair")
    ap.add_argument("--traces", default="demo-dspark", help="demo-dspark, synthetic, or a JSON file of steps")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("--n-draft", type=int, default=8, help="tokens a block drafts (the DSpark demo drafter: 8)")
    ap.add_argument("--sequences", type=int, default=1,
                    help="decode this many sequences together (a server's slots: fixed lengths, the history gate "
                         "and the confidence against plain decoding of as many; no first calls)")
    ap.add_argument("--draft-vocab", type=int, default=None, metavar="N",
                    help="the drafter with a reduced head of N rows (the converter's default: 32768)")
    ap.add_argument("--json", type=Path, help="also write the result here")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    name, steps = load_traces(a.traces)
    pair = make_pair(a.shape, a.type)
    if a.draft_vocab:
        from dflash_gguf.bench.scale.synth import reduced_pair
        pair = reduced_pair(pair, a.draft_vocab)
    t0 = time.perf_counter()
    if a.sequences > 1:
        r = measure_batch(pair / "target.gguf", pair / "drafter.gguf", steps, sequences=a.sequences,
                          tokens=a.tokens, trials=a.trials, threads=a.threads, n_draft=a.n_draft)
        r.update(shape=a.shape, type=a.type, draft_vocab=a.draft_vocab, traces=name, cpu=cpu_model(),
                 threads=a.threads, seconds=round(time.perf_counter() - t0, 1))
        print(f"{a.shape} {a.type}{f' dv{a.draft_vocab}' if a.draft_vocab else ''}, {name} traces, {a.sequences} "
              f"sequences together, {r['cpu']}, {a.threads} threads (synthetic weights, replayed steps)")
        print(f"{'policy':<12} {'tok/s':>7} {'x plain':>8} {'min-max':>12} {'tok/pass':>8} {'of oracle':>10}")
        for k, v in r["tokens_per_second"].items():
            lo, hi = r["over_plain_spread"][k]
            print(f"{k:<12} {v:>7.2f} {r['over_plain'][k]:>8.3f} {lo:>5.2f}-{hi:<6.2f} {r['tau'][k]:>8.2f} "
                  f"{r['of_oracle'][k]:>10.3f}")
        print(f"confidence / history {r['confidence_over_history']}x, / best fixed ({r['best_fixed']}) "
              f"{r['confidence_over_best_fixed']}x; every output equal to plain decoding: {r['all_equal_plain']}")
        if a.json:
            a.json.write_text(json.dumps(r, indent=2))
        return 0 if r["all_equal_plain"] else 1
    r = measure(pair / "target.gguf", pair / "drafter.gguf", steps, tokens=a.tokens, trials=a.trials,
                threads=a.threads, n_draft=a.n_draft)
    r.update(shape=a.shape, type=a.type, traces=name, n_steps=len(steps), cpu=cpu_model(), threads=a.threads,
             seconds=round(time.perf_counter() - t0, 1),
             label="synthetic random weights at a real shape, replayed DSpark steps")
    print(f"{a.shape} {a.type}, {name} traces ({len(steps)} steps), {r['cpu']}, {a.threads} threads "
          f"(synthetic weights, replayed steps)")
    print(f"{'policy':<12} {'tok/s':>7} {'x plain':>8} {'of oracle':>10} {'tau':>5}")
    for k, v in r["tokens_per_second"].items():
        print(f"{k:<12} {v:>7.2f} {r['over_plain'][k]:>8.3f} {r['of_oracle'][k]:>10.3f} {r['tau'][k]:>5.2f}")
    print("first call / warmed up: " + ", ".join(f"{k} {v:.2f}" for k, v in r["first_call_of_warm"].items()))
    print(f"confidence / history {r['confidence_over_history']}x, / best fixed ({r['best_fixed']}) "
          f"{r['confidence_over_best_fixed']}x; every output equal to plain decoding: {r['all_equal_plain']}")
    if a.json:
        a.json.write_text(json.dumps(r, indent=2))
    return 0 if r["all_equal_plain"] else 1


if __name__ == "__main__":
    sys.exit(main())
