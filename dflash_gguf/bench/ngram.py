"""Prompt lookup (n-gram drafting) on input-grounded prompts: plain decoding vs our engine copying from
the prompt vs llama-cpp-python's ``LlamaPromptLookupDecoding``, on the same prompts, in one run.

``python -m dflash_gguf.bench.ngram [--target T.gguf] [--drafter D.gguf] [-n 128] [--max-ngram 2] [--n-pred 10]``

Without paths it uses the shipped demo target (a small code model) and its DFlash drafter. The prompts
ask for text that restates its input (a function given, then edited; a docstring that quotes the code).
Columns, each greedy and token for token the same text (checked): ``plain`` (our decoder, no drafter),
``ngram`` (prompt lookup alone, every match copied whole), ``ngram+gate`` (the speed gate decides per
step), ``dflash`` (the drafter alone, whole blocks), ``dflash+ngram`` (both: per step the one expected to
give more tokens), the same two with the speed gate (``+gate``), and llama-cpp-python's own ``Llama``
plain and with ``draft_model=LlamaPromptLookupDecoding``, and upstream's ``llama-speculative-simple`` with its
drafter-free n-gram modes (``--spec-type ngram-simple`` / ``ngram-map-k`` with the same lookup and draft
lengths, ``ngram-mod`` with its defaults; ``--no-upstream`` leaves them out). For ours: target passes, tokens per target
pass, copied / kept tokens; for every column decode tokens/s and its ratio to plain measured in the same
run (counts are exact on any machine, times only on a quiet one).

``--replay-shape 1.7b:q4_0`` adds the same lookup at a real model's shape (``bench.scale``'s random-weight
target, no drafter): the demo target's greedy texts say what the lookup proposes after every token (how long
a match and how much of it is right, :func:`copy_table`), and the scale target's requests copy exactly that
much, right as often (:class:`CopyBook`: the target's own continuation, made wrong where the demo's match
was), so the verify rows cost what they cost at that shape. Columns: plain, whole matches, the speed gate,
and the speed gate with every copy wrong (what lookup costs where copying does not pay), over ``--trials``
interleaved rounds.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

_DEMO = Path(__file__).resolve().parent.parent / "data" / "demo"

PROMPTS = [
    # an edit of a given function
    "def total_price(items, tax):\n    subtotal = 0\n    for item in items:\n        subtotal += item.price * item.count\n"
    "    return subtotal * (1 + tax)\n\n\n# the same function, with the loop variable renamed to entry\n"
    "def total_price(items, tax):\n",
    # a summary that quotes its source
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"
    "        self.items.append(item)\n\n    def pop(self):\n        return self.items.pop()\n\n\n"
    "# Stack, documented: every method again with a docstring\nclass Stack:\n",
    # code that repeats its names
    "import json\n\n\ndef load(path):\n    with open(path) as f:\n        return json.load(f)\n\n\n"
    "def save(path, data):\n",
]


def _ours(target: str, drafter: str | None, prompts: list[list[int]], n: int, ngram, threads) -> dict:
    from dflash_gguf.decoding import DFlashDecoder, GenerationStats, SpecOptions
    from dflash_gguf.decoding.ngram import NgramOptions
    from dflash_gguf.native.engine import Context, ContextOptions, Model

    out: dict = {}
    with Model(target) as tm:
        dm = Model(drafter) if drafter else None
        n_ctx = max(map(len, prompts)) + n + 32
        opts = ContextOptions(n_ctx=n_ctx, n_batch=256, n_ubatch=256, n_threads=threads)
        ng = NgramOptions(max_ngram=ngram[0], n_pred=ngram[1])
        modes = {"plain": (False, {}), "ngram": (False, dict(ngram=ng)), "ngram+gate": (False, dict(ngram=ng, adaptive=True))}
        if dm is not None:
            modes.update({"dflash": (True, {}), "dflash+ngram": (True, dict(ngram=ng)),
                          "dflash+gate": (True, dict(adaptive=True)),
                          "dflash+ngram+gate": (True, dict(adaptive=True, ngram=ng))})
        try:
            for mode, (pair, spec) in modes.items():
                with Context(tm, opts) as tc:
                    dc = Context(dm, opts, other=tc) if pair else None
                    try:
                        dec = DFlashDecoder(tc, dc, SpecOptions(**spec))
                        list(dec.generate(prompts[0], 8, stop_tokens=[]))       # warm-up
                        tot, texts, secs = GenerationStats(), [], 0.0
                        for p in prompts:
                            dec.reset()
                            st = GenerationStats()
                            texts.append(list(dec.generate(p, n, stats=st, stop_tokens=[])))
                            secs += st.t_decode
                            tot.merge(st)
                    finally:
                        if dc is not None:
                            dc.close()
                out[mode] = dict(texts=texts, passes=tot.passes, generated=tot.n_generated, copied=tot.copied,
                                 copy_accepted=tot.copy_accepted, copy_steps=tot.copy_steps, drafted=tot.drafted,
                                 accepted=tot.accepted, seconds=secs)
        finally:
            if dm is not None:
                dm.close()
    return out


def copy_table(prompt: list[int], ref: list[int], max_ngram: int, n_pred: int) -> list[tuple[int, int]]:
    """What prompt lookup proposes along a greedy text: for ``k = 0, 1, ...`` tokens of ``ref`` generated
    after ``prompt``, ``(m, a)``: the match's length and how many of its first tokens are ``ref``'s next."""
    from dflash_gguf.decoding.ngram import NgramIndex

    idx = NgramIndex(max_ngram, 1, prompt)
    out = []
    for k in range(len(ref)):
        match = idx.propose(n_pred)
        a = 0
        while a < len(match) and k + a < len(ref) and match[a] == ref[k + a]:
            a += 1
        out.append((len(match), a))
        idx.extend([ref[k]])
    return out


class CopyBook:
    """Recorded lookups replayed on another target: a decoder's ``copy_index`` (called per request as
    ``NgramIndex`` is). A request whose prompt starts reference ``i`` (prompt + the target's own greedy
    continuation) gets, after ``k`` generated tokens, a match as long as ``tables[i][k]`` says, right for as
    many tokens (``never_right``: none), then wrong; other prompts find no match."""

    def __init__(self, refs: list[list[int]], n_prompt: list[int], tables: list[list[tuple[int, int]]], n_vocab: int,
                 never_right: bool = False):
        self.refs, self.n_prompt, self.tables = refs, n_prompt, tables
        self.n_vocab, self.never_right = n_vocab, never_right

    def __call__(self, max_ngram: int, min_ngram: int, prompt) -> "_Replayed":
        prompt = [int(t) for t in prompt]
        for ref, n_p, table in zip(self.refs, self.n_prompt, self.tables):
            if len(prompt) == n_p and ref[:n_p] == prompt:
                return _Replayed(self, ref, n_p, table, prompt)
        return _Replayed(self, [], len(prompt), [], prompt)


class _Replayed:
    def __init__(self, book: CopyBook, ref: list[int], n_prompt: int, table: list[tuple[int, int]], tokens: list[int]):
        self.book, self.ref, self.n_prompt, self.table, self.tokens = book, ref, n_prompt, table, tokens

    def extend(self, tokens) -> None:
        self.tokens.extend(int(t) for t in tokens)

    def propose(self, n: int) -> list[int]:
        from dflash_gguf.bench.scale.replay import block_right_for

        k = len(self.tokens) - self.n_prompt
        if n <= 0 or not 0 <= k < len(self.table):
            return []
        m, a = self.table[k]
        m = min(m, n)
        return block_right_for(self.ref, len(self.tokens), m, 0 if self.book.never_right else min(a, m),
                               self.book.n_vocab) if m else []


def _replayed(shape: str, demo_prompts: list[list[int]], demo_texts: list[list[int]], n: int, ngram,
              threads, trials: int) -> dict:
    """The demo target's lookups (:func:`copy_table`) replayed on ``shape``'s scale target: plain decoding,
    whole matches, the speed gate, the speed gate with every copy wrong; ``trials`` interleaved rounds."""
    import statistics

    from dflash_gguf.bench.scale.synth import make_pair
    from dflash_gguf.decoding import DFlashDecoder, GenerationStats, SpecOptions
    from dflash_gguf.decoding.ngram import NgramOptions
    from dflash_gguf.native.engine import Context, ContextOptions, Model

    name, _, wtype = shape.partition(":")
    pair = make_pair(name, wtype or "q4_0")
    tables = [copy_table(p, t, ngram[0], ngram[1]) for p, t in zip(demo_prompts, demo_texts)]
    ng = NgramOptions(max_ngram=ngram[0], n_pred=ngram[1])
    with Model(pair / "target.gguf") as tm:
        prompts = [tm.tokenize(p.encode()) for p in PROMPTS]
        opts = ContextOptions(n_ctx=max(map(len, prompts)) + n + ngram[1] + 64, n_batch=256, n_ubatch=256,
                              n_threads=threads)
        with Context(tm, opts) as tc:
            plain = DFlashDecoder(tc, None)
            refs = []
            for p in prompts:
                plain.reset()
                refs.append(p + list(plain.generate(p, n + ngram[1] + 1, stop_tokens=[])))
            modes = {"plain": plain}
            for mode, spec, wrong in (("ngram", {}, False), ("ngram+gate", dict(adaptive=True), False),
                                      ("ngram+gate, copies wrong", dict(adaptive=True), True)):
                modes[mode] = DFlashDecoder(tc, None, SpecOptions(ngram=ng, **spec))
                modes[mode].copy_index = CopyBook(refs, list(map(len, prompts)), tables, tm.n_vocab, wrong)
            rates: dict[str, list[float]] = {m: [] for m in modes}
            out = {m: dict(generated=0, passes=0, copied=0, copy_accepted=0, same=True) for m in modes}
            for trial in range(trials + 1):              # round 0 warms every decoder up: not counted
                tot = {m: GenerationStats() for m in modes}
                secs = dict.fromkeys(modes, 0.0)
                for p, ref in zip(prompts, refs):        # the modes in turn on each prompt: a swing of the
                    for mode, dec in modes.items():      # machine's speed falls on all of them alike
                        dec.reset()
                        st = GenerationStats()
                        got = list(dec.generate(p, n, stats=st, stop_tokens=[]))
                        out[mode]["same"] &= got == ref[len(p):len(p) + n]
                        secs[mode] += st.t_decode
                        tot[mode].merge(st)
                if trial:
                    for mode, t in tot.items():
                        rates[mode].append(t.n_generated / secs[mode])
                        out[mode].update(generated=t.n_generated, passes=t.passes, copied=t.copied,
                                         copy_accepted=t.copy_accepted)
    for mode, r in out.items():
        ratios = [x / base for x, base in zip(rates[mode], rates["plain"])]     # each round against its own plain
        r.update(tok_s=statistics.median(rates[mode]), x_plain=statistics.median(ratios),
                 x_plain_spread=[min(ratios), max(ratios)])
    return out


def _llama_cpp(target: str, prompts: list[list[int]], n: int, ngram, threads) -> dict:
    from dflash_gguf.native.llama import llama_cpp
    from dflash_gguf.native.llama import llama_speculative

    out = {}
    for mode, draft in (("llama_cpp", None), ("llama_cpp+lookup", (ngram[0], ngram[1]))):
        kw = dict(n_ctx=max(map(len, prompts)) + n + 32, n_batch=256, verbose=False, flash_attn=True, seed=0)
        if threads:
            kw.update(n_threads=threads, n_threads_batch=threads)
        if draft:
            kw["draft_model"] = llama_speculative.LlamaPromptLookupDecoding(max_ngram_size=draft[0], num_pred_tokens=draft[1])
        llm = llama_cpp.Llama(target, **kw)
        texts, secs, passes = [], 0.0, [0]
        evaluate = llm.eval

        def counted(tokens, evaluate=evaluate, passes=passes):
            passes[0] += 1              # one target pass (llama_cpp evaluates a draft with its token at once)
            return evaluate(tokens)
        try:
            for p in prompts:
                llm.reset()
                evaluate(p[:-1])           # the prompt outside the timed part (generate reuses it), as t_decode
                llm.eval = counted
                toks, t0 = [], time.perf_counter()
                for t in llm.generate(p, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0):
                    toks.append(int(t))
                    if len(toks) == n:
                        break
                secs += time.perf_counter() - t0
                llm.eval = evaluate
                texts.append(toks)
        finally:
            llm.close()
        # (its generator evaluates each token it yields before it hands over the next: the last one too)
        out[mode] = dict(texts=texts, generated=sum(map(len, texts)), seconds=secs, passes=passes[0])
    return out


# upstream's drafter-free n-gram modes, with the lookup and draft lengths of ours where they have them
def _upstream_modes(ngram) -> dict[str, tuple[str, ...]]:
    n, m = str(ngram[0]), str(ngram[1])
    return {"upstream ngram-simple": ("--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", n,
                                      "--spec-ngram-simple-size-m", m),
            "upstream ngram-map-k": ("--spec-type", "ngram-map-k", "--spec-ngram-map-k-size-n", n,
                                     "--spec-ngram-map-k-size-m", m),
            "upstream ngram-mod": ("--spec-type", "ngram-mod")}


def _upstream(target: str, texts: list[str], echoes: list[bytes], plain: list[bytes], n: int, ngram, threads) -> dict:
    """Upstream's ``llama-speculative-simple`` with its n-gram modes on the same prompts (no drafter).
    Target passes: each pass commits its accepted tokens plus one, so passes = predicted - accepted."""
    from dflash_gguf import paths
    from dflash_gguf.bench.upstream import run_upstream_one, upstream_generated

    tools = paths.tools_dir()
    exe = tools / "llama-speculative-simple" if tools else None
    if exe is None or not exe.exists():
        print("upstream's llama-speculative-simple is not built (python -m dflash_gguf.build --with-tools): "
              "its columns are left out", file=sys.stderr)
        return {}
    out = {}
    for mode, extra in _upstream_modes(ngram).items():
        texts_out, secs, gen, passes = [], 0.0, 0, 0
        for text, echo, ref in zip(texts, echoes, plain):
            got, stdout = run_upstream_one(exe, Path(target), None, text, n, ngram[1], threads or 2, extra=extra)
            raw = upstream_generated(stdout, echo)
            texts_out.append(raw.startswith(ref) or ref.startswith(raw))   # it may run past -n by a block
            secs += got["t_decode"]
            gen += got["n_decoded"]
            passes += got.get("n_predict", 0) - got.get("n_accept", 0)
        out[mode] = dict(same=all(texts_out), generated=gen, seconds=secs, passes=passes)
    return out


def main(argv: list[str] | None = None) -> int:
    from dflash_gguf.native.logs import set_log_handler

    ap = argparse.ArgumentParser(prog="python -m dflash_gguf.bench.ngram", description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default=str(_DEMO / "target.gguf"))
    ap.add_argument("--drafter", default=str(_DEMO / "drafter.gguf"), help="'' for none")
    ap.add_argument("-n", "--n-gen", type=int, default=128)
    ap.add_argument("--max-ngram", type=int, default=2)
    ap.add_argument("--n-pred", type=int, default=10)
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("--no-llama-cpp", action="store_true", help="leave out llama-cpp-python's columns")
    ap.add_argument("--no-upstream", action="store_true", help="leave out upstream's n-gram modes")
    ap.add_argument("--replay-shape", metavar="SHAPE:TYPE",
                    help="also replay the demo target's lookups on this bench.scale target (e.g. 1.7b:q4_0)")
    ap.add_argument("--trials", type=int, default=3, help="interleaved rounds of the replay (--replay-shape)")
    ap.add_argument("--json", help="write the rows here")
    a = ap.parse_args(argv)
    set_log_handler()
    from dflash_gguf.native.engine import Model
    with Model(a.target) as tm:
        prompts = [tm.tokenize(p.encode()) for p in PROMPTS]
    ngram = (a.max_ngram, a.n_pred)
    res = _ours(a.target, a.drafter or None, prompts, a.n_gen, ngram, a.threads)
    if not a.no_llama_cpp:
        res.update(_llama_cpp(a.target, prompts, a.n_gen, ngram, a.threads))
    ref = res["plain"]["texts"]
    if not a.no_upstream:
        with Model(a.target) as tm:   # its stdout echoes the prompt's tokens, then the generated text
            plain = [tm.detokenize(t) for t in ref]
            echoes = [tm.detokenize(p, special=True) for p in prompts]
        res.update(_upstream(a.target, PROMPTS, echoes, plain, a.n_gen, ngram, a.threads))
    base = res["plain"]["generated"] / res["plain"]["seconds"]
    print(f"{len(prompts)} prompts x {a.n_gen} tokens, n-grams of up to {a.max_ngram}, {a.n_pred} copied at most")
    print(f"{'mode':22s} {'same':>4s} {'passes':>6s} {'tok/pass':>8s} {'copied':>6s} {'kept':>5s} {'tok/s':>8s} {'x plain':>7s}")
    for mode, r in res.items():
        same = "yes" if r.get("same", r.get("texts") == ref) else "NO"
        tps = r["generated"] / r["seconds"] if r["seconds"] else 0.0
        # upstream's C++ loop has no plain mode to set it against: its own timer, no ratio to our plain loop
        ratio = "-" if mode.startswith("upstream") else f"{tps / base:.2f}"
        passes = r.get("passes")
        print(f"{mode:22s} {same:>4s} {passes if passes is not None else '-':>6} "
              f"{(r['generated'] / passes) if passes else float('nan'):8.2f} {r.get('copied', '-'):>6} "
              f"{r.get('copy_accepted', '-'):>5} {tps:8.1f} {ratio:>7}")
    same = all(r.get("same", r.get("texts") == ref) for r in res.values())
    doc = {k: {x: y for x, y in v.items() if x != "texts"} for k, v in res.items()}
    if a.replay_shape:
        rep = _replayed(a.replay_shape, prompts, ref, a.n_gen, ngram, a.threads, a.trials)
        print(f"\nthe demo target's lookups replayed on the {a.replay_shape} scale target (random weights, no "
              f"drafter), medians of {a.trials} interleaved rounds (x plain: each round against its own plain)")
        print(f"{'mode':26s} {'same':>4s} {'passes':>6s} {'tok/pass':>8s} {'copied':>6s} {'kept':>5s} {'tok/s':>8s} "
              f"{'x plain':>7s} {'min-max':>9s}")
        for mode, r in rep.items():
            lo, hi = r["x_plain_spread"]
            print(f"{mode:26s} {'yes' if r['same'] else 'NO':>4s} {r['passes']:>6} {r['generated'] / r['passes']:8.2f} "
                  f"{r['copied']:>6} {r['copy_accepted']:>5} {r['tok_s']:8.2f} {r['x_plain']:7.2f} {lo:4.2f}-{hi:4.2f}")
        same = same and all(r["same"] for r in rep.values())
        doc["replay"] = {"shape": a.replay_shape, "trials": a.trials, "modes": rep}
    if a.json:
        Path(a.json).write_text(json.dumps(doc, indent=1))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
