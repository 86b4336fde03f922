"""``python -m dflash_gguf.bench.structured``: structured output under DFlash, beside ``llama_cpp.Llama``.

Two parts:

* **rows** - what a grammar costs per verify row on a real-size vocabulary (a ``bench.scale`` target:
  151,936 tokens): asking llama.cpp's grammar sampler about the row's argmax alone (the usual case:
  the argmax is allowed), about the 256 best tokens, and about the whole vocabulary; for llama.cpp's
  JSON grammar at a few states.
* **requests** - on the demo pair, greedy, each constraint of the prompt set (JSON mode, a JSON schema,
  a tool call, a GBNF grammar) through ``llama_cpp.Llama`` (plain), ``dflash_gguf.Llama`` with its
  defaults (the speed gate), with fixed full blocks (``draft_adaptive=False``: what the drafter gets
  right under the grammar), and fixed blocks without cutting a block at a drafted token the grammar
  forbids: tokens per second (median of ``--repeats``), acceptance length, tokens verified after the
  cut, and whether the texts are equal.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import statistics
import sys
import time
from pathlib import Path

import numpy as np

log = logging.getLogger("dflash_gguf.bench.structured")

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "args": {"type": "array", "items": {"type": "integer"}, "maxItems": 4}},
          "required": ["name", "args"]}
TOOL = {"type": "function", "function": {"name": "run", "description": "run a Python function",
                                         "parameters": SCHEMA}}
GBNF = r'''root ::= "def " name "(" params "):\n    return " expr "\n"
name ::= [a-z_]+
params ::= (name (", " name)*)?
expr ::= [a-z_ +*()0-9,.]+'''
CASES = {
    "json_object": dict(chat=True, kw=dict(response_format={"type": "json_object"})),
    "json_schema": dict(chat=True, kw=dict(response_format={"type": "json_object", "schema": SCHEMA})),
    "tool_call": dict(chat=True, kw=dict(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "run"}})),
    "gbnf": dict(chat=False, kw=dict(grammar=GBNF)),
}
MESSAGES = [[{"role": "user", "content": "Describe a call of a Python function as JSON."}],
            [{"role": "user", "content": "Give the function name and integer arguments of add(2, 3)."}]]
PROMPTS = ["# add two numbers\n", "# the square of x\n"]


def _grammar(kw: dict):
    from dflash_gguf.native.llama import llama_cpp

    out = dict(kw)
    if "grammar" in out:
        out["grammar"] = llama_cpp.LlamaGrammar.from_string(out["grammar"], verbose=False)
    return out


def _run(llm, case: dict, i: int, n_tokens: int):
    kw = dict(_grammar(case["kw"]), max_tokens=n_tokens, temperature=0)
    t0 = time.perf_counter()
    if case["chat"]:
        out = llm.create_chat_completion(MESSAGES[i % len(MESSAGES)], **kw)
        msg = out["choices"][0]["message"]
        calls = msg.get("tool_calls")   # their ids are random: compare the calls' names and arguments
        text = msg.get("content") or json.dumps([c["function"] for c in calls or []])
    else:
        out = llm.create_completion(PROMPTS[i % len(PROMPTS)], **kw)
        text = out["choices"][0]["text"]
    return time.perf_counter() - t0, text, out["usage"]["completion_tokens"], out.get("dflash")


@contextlib.contextmanager
def _no_cut():
    from dflash_gguf.decoding.constraints import Constraints

    real = Constraints.allowed_prefix
    Constraints.allowed_prefix = lambda self, draft: len(draft)
    try:
        yield
    finally:
        Constraints.allowed_prefix = real


def requests(n_tokens: int, repeats: int, threads: int) -> list[dict]:
    from dflash_gguf.native.llama import llama_cpp

    from dflash_gguf import Llama
    from dflash_gguf.demo import DEMO_DIR

    target, drafter = DEMO_DIR / "target.gguf", DEMO_DIR / "drafter.gguf"
    kw = dict(n_ctx=1024, n_threads=threads, n_threads_batch=threads, seed=0, verbose=False)
    plain = llama_cpp.Llama(str(target), **kw)
    fast = Llama(str(target), draft_model_path=str(drafter), **kw)
    fixed = Llama(str(target), draft_model_path=str(drafter), draft_adaptive=False, **kw)
    llms = {"plain": plain, "dflash": fast, "fixed": fixed, "fixed-no-cut": fixed}
    rows = []
    try:
        for name, case in CASES.items():
            for i in range(len(PROMPTS)):
                res: dict = {}
                for _ in range(repeats):      # interleaved, so a slow spell falls on every mode
                    for mode, llm in llms.items():
                        with _no_cut() if mode == "fixed-no-cut" else contextlib.nullcontext():
                            res.setdefault(mode, []).append(_run(llm, case, i, n_tokens))
                ref = res["plain"][0][1]
                row = {"case": name, "prompt": i}
                for mode, runs in res.items():
                    secs = statistics.median(r[0] for r in runs)
                    info = runs[-1][3] or {}
                    row[mode] = {"tok_s": round(runs[-1][2] / secs, 1), "tokens": runs[-1][2],
                                 "same_text": all(r[1] == ref for r in runs),
                                 "tau": info.get("acceptance_length"), "drafted": info.get("drafted"),
                                 "enabled": info.get("enabled")}
                rows.append(row)
                log.info("%s #%d: %s", name, i, {m: row[m]["tok_s"] for m in res})
    finally:
        fixed.close()
        fast.close()
        plain.close()
    return rows


def row_costs(shape: str, wtype: str, repeats: int) -> list[dict]:
    """Grammar questions per verify row on a bench.scale target's vocabulary."""
    from dflash_gguf.native.llama import llama_cpp
    from dflash_gguf.native.llama import llama_grammar

    from dflash_gguf.bench.scale import synth
    from dflash_gguf.decoding.constraints import Grammar

    target = synth.make_pair(shape, wtype) / "target.gguf"
    llm = llama_cpp.Llama(str(target), n_ctx=64, vocab_only=True, verbose=False)
    n = llm.n_vocab()
    rng = np.random.default_rng(0)
    prefixes = {"start": "", "in a key": '{"na', "after a value": '{"name": 12'}
    rows = []
    for state, text in prefixes.items():
        g = Grammar(llm._model.vocab, llama_grammar.JSON_GBNF)
        for t in llm.tokenize(text.encode(), add_bos=False) if text else []:
            g.accept(t)
        allowed_all = g.allowed(np.arange(n, dtype=np.int32))
        ok_ids = np.nonzero(allowed_all)[0]
        one = np.array([ok_ids[0]], dtype=np.int32)
        walk = rng.choice(n, 256, replace=False).astype(np.int32)
        full = np.arange(n, dtype=np.int32)
        cost = {}
        for label, ids in (("argmax (1 id)", one), ("walk (256 ids)", walk), ("whole vocabulary", full)):
            ts = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                g.allowed(ids)
                ts.append(time.perf_counter() - t0)
            cost[label] = round(1e3 * min(ts), 4)
        rows.append({"state": state, "n_vocab": n, "allowed": int(allowed_all.sum()), "ms": cost})
        g.close()
        log.info("%s: %s", state, cost)
    llm.close()
    return rows


def report(cost_rows: list[dict], req_rows: list[dict], cmd: str, cpu: str) -> str:
    out = [f"Structured output. `{cmd}`\n\nMachine: {cpu}.\n"]
    if cost_rows:
        out += ["Grammar cost per verify row (llama.cpp's JSON grammar, fastest of the repeats, ms):\n",
                "| state | vocabulary | allowed tokens | argmax (1 id) | walk (256 ids) | whole vocabulary |",
                "|---|---|---|---|---|---|"]
        for r in cost_rows:
            m = r["ms"]
            out.append(f"| {r['state']} | {r['n_vocab']:,} | {r['allowed']:,} | {m['argmax (1 id)']} | "
                       f"{m['walk (256 ids)']} | {m['whole vocabulary']} |")
        out.append("")
    if req_rows:
        out += ["Demo pair, greedy: tok/s (tau: acceptance length; rows: tokens verified after the grammar's cut)\n",
                "| constraint | prompt | plain | DFlash, defaults | fixed blocks (tau, rows) | fixed, no cut (tau, rows) "
                "| defaults / plain | same text |", "|---|---|---|---|---|---|---|---|"]
        for r in req_rows:
            p, d, f, n = r["plain"], r["dflash"], r["fixed"], r["fixed-no-cut"]
            same = all(r[m]["same_text"] for m in ("dflash", "fixed", "fixed-no-cut"))
            out.append(f"| {r['case']} | {r['prompt']} | {p['tok_s']} | {d['tok_s']} | {f['tok_s']} ({f['tau']}, "
                       f"{f['drafted']}) | {n['tok_s']} ({n['tau']}, {n['drafted']}) | {d['tok_s'] / p['tok_s']:.2f}x "
                       f"| {same} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dflash_gguf.bench.structured", description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", nargs="+", default=["rows", "requests"], choices=["rows", "requests"])
    ap.add_argument("--shape", default="0.6b", help="bench.scale target whose vocabulary the rows part uses")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None, help="write TAG.json and TAG.md here")
    ap.add_argument("--tag", default="structured")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    cost = row_costs(a.shape, "q4_0", max(a.repeats, 5)) if "rows" in a.parts else []
    reqs = requests(a.tokens, a.repeats, a.threads) if "requests" in a.parts else []
    from dflash_gguf.bench.serve import cpu_name

    cmd = "python -m dflash_gguf.bench.structured " + " ".join(argv if argv is not None else sys.argv[1:])
    md = report(cost, reqs, cmd, cpu_name())
    print(md)
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / f"{a.tag}.json").write_text(json.dumps({"rows": cost, "requests": reqs}, indent=1))
        (a.out / f"{a.tag}.md").write_text(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
