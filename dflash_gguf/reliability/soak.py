"""Divergence soak: DFlash vs plain greedy decoding, token for token, over many configurations.

    python -m dflash_gguf.reliability.soak                      # CI size: the demo pair, 600 tokens
    python -m dflash_gguf.reliability.soak --make-tiny --full   # 4 targets x DFlash/DFlash2 x blocks 4/8/16, 10k tokens each

Each configuration is a target + drafter opened through :class:`dflash_gguf.Llama`, driven through
seeded conversations with prompts this tool generates (never the tests' prompts):

* a fresh prompt; then **warm continuations** (history + generated text + new text, so the
  decoder reuses its caches); a **prefix reuse** (a prompt sharing only part of the cached
  history); a **state round trip** (``save_state`` mid-conversation, another turn, ``load_state``,
  then a different turn from the saved point);
* every turn's tokens are compared with plain greedy decoding by ``llama_cpp.Llama`` on the same
  target, reset before every reference (a fresh evaluation of the whole prompt).

Tiny test pairs have random drafters that almost never agree with their random targets, so on
them the proposal is replaced (``SpecOptions.proposer``) by the reference continuation with a
wrong token planted at a random offset in a quarter of the blocks: blocks then commit 0..n
drafted tokens and every rollback path runs. The drafter still runs and receives every
injection. The demo pair uses its own trained drafter.

At a divergence the tool recomputes the reference logits at that position (the whole prefix in
one batch) and reports the gap between the two tokens' logits; a divergence counts as a near-tie
when plain decoding's pick won by at most ``--tie`` (default 1e-3) or ``--rel-tie`` (default
2e-4) times the largest |logit| there - as the reference ran (prompt in one batch, then one token
a step) or recomputed with the whole prefix in one batch - or when the one-batch recomputation of
plain decoding itself prefers DFlash's token. Batched and one-row matrix kernels round
differently (float32 sums in another order), so two ways of running the same target can pick
different tokens where the two best logits (almost) tie; DFlash verifies blocks in batches.
Every divergence is reported with both gaps and the logit scale.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from dflash_gguf import paths

log = logging.getLogger("dflash_gguf.reliability.soak")

DEMO_DIR = paths.DEMO_DIR
ARCHS = ("llama", "qwen3", "qwen35", "qwen3next")
KINDS = ("dflash", "dflash2")
BLOCKS = (4, 8, 16)
N_CTX = 1024

_WORDS = ("alpha beta gamma delta value index count total result items key data node tree list dict "
          "buffer stream token parser config options state cache block layer model error path file "
          "name size width height left right first last next prev self other args kwargs return yield "
          "import from class def if else elif for while with try except finally lambda not and or in is "
          "None True False print len range sorted enumerate zip map filter sum min max open read write").split()
_PUNCT = ["(", ")", ":", ",", ".", " = ", " + ", " - ", "[", "]", "\n", "\n    ", "\n        ", " == ", "'", '"',
          "_", "0", "1", "2", "42", "#", " -> ", "{", "}"]
_EXTRA = ["é", "ß", "→", "日本", "😀", "\t", "Ω", "ø"]


def gen_text(rng: random.Random, n_words: int) -> str:
    """Seeded code-like text (words, punctuation, a little non-ASCII)."""
    out = []
    for _ in range(n_words):
        r = rng.random()
        if r < 0.6:
            out.append((" " if rng.random() < 0.5 else "") + rng.choice(_WORDS))
        elif r < 0.97:
            out.append(rng.choice(_PUNCT))
        else:
            out.append(rng.choice(_EXTRA))
    return "".join(out)


@dataclass
class Config:
    name: str
    target: str
    drafter: str
    oracle: bool           # replace proposals by the reference with planted mistakes


@dataclass
class Divergence:
    config: str
    turn: str
    position: int          # index in the generated tokens
    plain_token: int
    dflash_token: int
    gap: float             # logit(plain) - logit(dflash) under the reference logits at that position
    top2_gap: float        # top-1 minus top-2 logit there
    gap_incremental: float  # the same gap with the prefix decoded as the reference did (prompt, then 1 token a step)
    scale: float           # largest |logit| there (rounding differences grow with it)
    near_tie: bool


@dataclass
class ConfigResult:
    config: str
    tokens: int = 0
    turns: int = 0
    turn_kinds: dict = field(default_factory=dict)
    divergences: list = field(default_factory=list)
    drafted: int = 0
    accepted: int = 0
    steps: int = 0
    seconds: float = 0.0

    @property
    def near_ties(self) -> int:
        return sum(d.near_tie for d in self.divergences)

    @property
    def other(self) -> int:
        return sum(not d.near_tie for d in self.divergences)


def is_near_tie(d: dict, tie: float, rel_tie: float) -> bool:
    """A divergence explained by rounding: plain decoding's own pick won by at most the tie margin
    (as the reference ran, or recomputed in one batch), or plain decoding itself, with the prefix
    recomputed in one batch, prefers DFlash's token by at most that margin (two plain computations
    disagree there). A larger gap either way is not rounding."""
    lim = max(tie, rel_tie * d["scale"])
    return abs(d["gap"]) <= lim or 0 <= d["gap_incremental"] <= lim


class Oracle:
    """Proposes the known reference continuation, with a wrong token planted in some blocks."""

    def __init__(self, seed: int, p_wrong: float = 0.25):
        self.rng = random.Random(seed)
        self.known: list[int] = []
        self.p_wrong = p_wrong
        self.n_vocab = 2

    def __call__(self, ctx: list[int], n: int) -> list[int]:
        k = self.known
        out = [0] * n
        if len(k) > len(ctx) and k[:len(ctx)] == ctx:
            got = k[len(ctx):len(ctx) + n]
            out[:len(got)] = got
        if n and self.rng.random() < self.p_wrong:
            i = self.rng.randrange(n)
            out[i] = (out[i] + 1 + self.rng.randrange(self.n_vocab - 1)) % self.n_vocab
        return out


class Soak:
    def __init__(self, cfg: Config, *, seed: int, tie: float, rel_tie: float = 2e-4, n_ctx: int = N_CTX):
        from dflash_gguf.native.llama import llama_cpp

        from dflash_gguf.api import Llama

        self.cfg, self.tie, self.rel_tie, self.n_ctx = cfg, tie, rel_tie, n_ctx
        kw = dict(n_ctx=n_ctx, n_batch=128, n_threads=1, n_threads_batch=1, verbose=False, seed=0)
        self.llm = Llama(cfg.target, draft_model_path=cfg.drafter, draft_adaptive=False, **kw)   # blocks every step
        self.ref = llama_cpp.Llama(cfg.target, **kw)
        self.oracle = None
        if cfg.oracle:
            from dflash_gguf.decoding.proposer import OverrideProposer

            self.oracle = Oracle(seed)
            self.oracle.n_vocab = self.llm.n_vocab()
            self.llm.decoder.proposer = OverrideProposer(self.oracle)
        self.rng = random.Random(seed)
        self.res = ConfigResult(cfg.name)
        self.eog = set(int(t) for t in self.llm.decoder.target.model.eog_tokens)

    def close(self):
        self.llm.close()
        self.ref.close()

    # ------------------------------------------------------------------ decoding
    @staticmethod
    def _take(gen, n: int) -> list[int]:
        out = []
        try:
            for t in gen:
                out.append(int(t))
                if len(out) >= n:
                    break
        finally:
            gen.close()
        return out

    def _greedy(self, llm, tokens: list[int], n: int) -> list[int]:
        return self._take(llm.generate(tokens, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0), n)

    def reference(self, prompt: list[int], n: int) -> list[int]:
        """Plain greedy tokens, up to and including the first end-of-generation token (as DFlash)."""
        self.ref.reset()
        out = self._greedy(self.ref, prompt, n)
        for i, t in enumerate(out):
            if t in self.eog:
                return out[:i + 1]
        return out

    def _logits_after(self, tokens: list[int], steps: list[int] = ()) -> np.ndarray:
        """Logits after ``tokens`` in one batch, then ``steps`` one token at a time."""
        from dflash_gguf.native.llama import llama_cpp

        self.ref.reset()
        self.ref.eval(tokens)   # without logits_all only the last row has logits, and scores stay empty
        for t in steps:
            self.ref.eval([t])
        ptr = llama_cpp.llama_get_logits_ith(self.ref._ctx.ctx, -1)
        return np.ctypeslib.as_array(ptr, shape=(self.ref.n_vocab(),)).astype(np.float64)

    # ------------------------------------------------------------------ one turn
    def turn(self, kind: str, prompt: list[int], n: int) -> list[int]:
        ref = self.reference(prompt, n)
        if self.oracle is not None:
            self.oracle.known = prompt + ref
        got = self._greedy(self.llm, prompt, n)
        st = self.llm.last_dflash_stats
        if st is not None:
            self.res.drafted += st.drafted
            self.res.accepted += st.accepted
            self.res.steps += st.steps
        m = min(len(ref), len(got))
        j = next((i for i in range(m) if ref[i] != got[i]), None)
        self.res.turns += 1
        self.res.turn_kinds[kind] = self.res.turn_kinds.get(kind, 0) + 1
        if j is None:
            if len(ref) != len(got):   # one stopped (EOS) where the other did not: a divergence at m
                j = m
            else:
                self.res.tokens += m
                return got
        self.res.tokens += j + 1
        logits = self._logits_after(prompt + ref[:j])
        a = ref[j] if j < len(ref) else -1
        b = got[j] if j < len(got) else -1
        top = np.sort(logits)[-2:]
        gap = float(logits[a] - logits[b]) if a >= 0 and b >= 0 else float("inf")
        scale = float(np.max(np.abs(logits)))
        inc = self._logits_after(prompt, ref[:j])
        gap_inc = float(inc[a] - inc[b]) if a >= 0 and b >= 0 else float("inf")
        d = Divergence(self.cfg.name, kind, j, a, b, gap, float(top[1] - top[0]), gap_inc, scale, False)
        d.near_tie = is_near_tie(asdict(d), self.tie, self.rel_tie)
        self.res.divergences.append(d)
        log.warning("%s: divergence in a %s turn at token %d: plain %d, dflash %d, logit gap %.2e (one batch) / %.2e "
                    "(as the reference ran), largest |logit| %.1f: %s", self.cfg.name, kind, j, a, b, gap, gap_inc, scale,
                    "near-tie" if d.near_tie else "NOT a near-tie")
        return got

    # ------------------------------------------------------------------ conversations
    def tok(self, text: str, bos: bool = False) -> list[int]:
        return self.llm.tokenize(text.encode(), add_bos=bos, special=False)

    def conversation(self, budget: int) -> None:
        """One seeded conversation of several turns, until ``budget`` tokens or the context fills."""
        rng = self.rng
        n = lambda: rng.choice([8, 16, 24, 32, 48, 64, 96])   # noqa: E731
        hist = self.tok(gen_text(rng, rng.randint(3, 40)), bos=True) or [0]
        start = self.res.tokens
        hist = hist + self.turn("fresh", hist, n())
        saved = None
        while self.res.tokens - start < budget:
            room = self.n_ctx - len(hist) - 120
            if room < 100:
                break
            r = rng.random()
            if r < 0.45:                                 # warm continuation
                prompt = hist + self.tok(gen_text(rng, rng.randint(1, 12)))
                hist = prompt + self.turn("warm", prompt, n())
            elif r < 0.65:                               # prefix reuse: keep part of the history
                cut = rng.randint(1, max(1, len(hist) - 1))
                prompt = hist[:cut] + self.tok(gen_text(rng, rng.randint(1, 8)))
                self.turn("prefix", prompt, n())
            elif r < 0.8 and saved is None:              # save the state mid-conversation
                saved = (self.llm.save_state(), list(hist))
                prompt = hist + self.tok(gen_text(rng, rng.randint(1, 6)))
                hist = prompt + self.turn("warm", prompt, n())
            elif saved is not None:                      # restore it and take another branch
                state, at = saved
                saved = None
                self.llm.load_state(state)
                prompt = at + self.tok(gen_text(rng, rng.randint(1, 6)))
                hist = prompt + self.turn("state", prompt, n())
            else:                                        # an unrelated request in between
                prompt = self.tok(gen_text(rng, rng.randint(2, 20)), bos=True) or [0]
                self.turn("fresh", prompt, n())

    def run(self, tokens: int) -> ConfigResult:
        t0 = time.monotonic()
        while self.res.tokens < tokens:
            self.conversation(tokens - self.res.tokens)
        self.res.seconds = round(time.monotonic() - t0, 1)
        return self.res


# --------------------------------------------------------------------------- configurations
def demo_config() -> Config:
    return Config("demo-qwen3-dflash-b8", str(DEMO_DIR / "target.gguf"), str(DEMO_DIR / "drafter.gguf"), False)


def tiny_configs(root: Path, archs=ARCHS, kinds=KINDS, blocks=BLOCKS) -> list[Config]:
    out = []
    for arch in archs:
        for kind in kinds:
            for b in blocks:
                t, d = root / f"{arch}.gguf", root / f"{arch}-{kind}-b{b}.gguf"
                if t.is_file() and d.is_file():
                    out.append(Config(f"{arch}-{kind}-b{b}", str(t), str(d), True))
    return out


def tests_dir() -> Path:
    return Path(__file__).resolve().parents[2] / "tests"


def tiny_root() -> Path:
    """The tests' tiny-model cache folder (same key as tests/conftest.py)."""

    tiny = tests_dir() / "tiny.py"
    key = hashlib.sha256(tiny.read_bytes() + paths.patch_series_hash().encode()).hexdigest()[:16]
    return Path(os.environ.get("DFLASH_GGUF_TEST_MODELS") or paths.cache_dir() / "test-models") / key


def make_tiny(archs=ARCHS, kinds=KINDS, blocks=BLOCKS) -> Path:
    """Build (or find cached) the tests' tiny pairs for every configuration (needs the test deps)."""
    sys.path.insert(0, str(tests_dir()))
    import tiny  # noqa: E402  (tests/tiny.py of a source checkout)

    root = tiny_root()
    root.mkdir(parents=True, exist_ok=True)
    tok = tiny.make_tokenizer(root / "tokenizer").parent
    for arch in archs:
        t_hf = tiny.make_target(root / f"hf-{arch}", tok, arch)
        tiny.upstream_convert(t_hf, root / f"{arch}.gguf")
        for kind in kinds:
            for b in blocks:
                tag = f"{arch}-{kind}-b{b}"
                d_hf = tiny.make_drafter(root / f"hf-{tag}", t_hf, kind=kind, block_size=b)
                tiny.upstream_convert(d_hf, root / f"{tag}.gguf", target_dir=t_hf)
    return root


def run(configs: list[Config], tokens: int, *, seed: int = 0, tie: float = 1e-3, rel_tie: float = 2e-4) -> dict:
    results = []
    for i, cfg in enumerate(configs):
        s = Soak(cfg, seed=seed + i, tie=tie, rel_tie=rel_tie)
        try:
            r = s.run(tokens)
        finally:
            s.close()
        tau = (r.accepted + r.steps) / r.steps if r.steps else 0.0
        log.info("%s: %d tokens in %d turns, %d divergences (%d near-ties), tau %.2f, %.1f s",
                 cfg.name, r.tokens, r.turns, len(r.divergences), r.near_ties, tau, r.seconds)
        results.append(r)
    total = sum(r.tokens for r in results)
    ties = sum(r.near_ties for r in results)
    return {"seed": seed, "tie_threshold": tie, "rel_tie_threshold": rel_tie, "tokens_per_config": tokens, "tokens": total,
            "near_ties": ties, "other_divergences": sum(r.other for r in results),
            "near_ties_per_10k": round(ties * 10_000 / total, 3) if total else 0.0,
            "configs": [{**{k: v for k, v in asdict(r).items() if k != "divergences"},
                         "near_ties": r.near_ties, "other_divergences": r.other,
                         "tau": round((r.accepted + r.steps) / r.steps, 3) if r.steps else 0.0,
                         "divergences": [asdict(d) for d in r.divergences]} for r in results]}


def reclassify(rep: dict) -> dict:
    """Apply :func:`is_near_tie` to every divergence of a report (e.g. one written by an older run)."""
    ties = other = 0
    for c in rep["configs"]:
        for d in c["divergences"]:
            d["near_tie"] = is_near_tie(d, rep["tie_threshold"], rep.get("rel_tie_threshold", 2e-4))
        c["near_ties"] = sum(d["near_tie"] for d in c["divergences"])
        c["other_divergences"] = len(c["divergences"]) - c["near_ties"]
        ties += c["near_ties"]
        other += c["other_divergences"]
    rep["near_ties"], rep["other_divergences"] = ties, other
    rep["near_ties_per_10k"] = round(ties * 10_000 / rep["tokens"], 3) if rep["tokens"] else 0.0
    return rep


def summary(rep: dict) -> str:
    lines = [f"{rep['tokens']} tokens compared over {len(rep['configs'])} configurations "
             f"({rep['tokens_per_config']} each): {rep['near_ties']} near-tie divergences "
             f"({rep['near_ties_per_10k']} per 10k tokens), {rep['other_divergences']} other divergences"]
    for c in rep["configs"]:
        kinds = ", ".join(f"{k} {v}" for k, v in sorted(c["turn_kinds"].items()))
        lines.append(f"  {c['config']:<22} {c['tokens']:>6} tokens {c['turns']:>4} turns ({kinds}) tau {c['tau']:.2f} "
                     f"div {len(c['divergences'])} (ties {c['near_ties']}) {c['seconds']} s")
        for d in c["divergences"]:
            lines.append(f"      {d['turn']} turn, token {d['position']}: plain {d['plain_token']} dflash "
                         f"{d['dflash_token']} gap {d['gap']:.2e} / {d['gap_incremental']:.2e} as run (top-2 gap "
                         f"{d['top2_gap']:.2e}, largest |logit| "
                         f"{d['scale']:.1f}) {'near-tie' if d['near_tie'] else 'NOT A NEAR-TIE'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dflash_gguf.reliability.soak", description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=600, help="tokens compared per configuration (default 600)")
    ap.add_argument("--full", action="store_true", help="10,000 tokens per configuration, every tiny configuration")
    ap.add_argument("--tiny-dir", type=Path, default=None, help="folder with the tests' tiny GGUFs")
    ap.add_argument("--make-tiny", action="store_true", help="build the tiny pairs first (needs the test deps)")
    ap.add_argument("--archs", default=",".join(ARCHS))
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--blocks", default=",".join(map(str, BLOCKS)))
    ap.add_argument("--no-demo", action="store_true", help="leave out the demo pair")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tie", type=float, default=1e-3, help="logit gap below which a divergence is a near-tie")
    ap.add_argument("--rel-tie", type=float, default=2e-4,
                    help="... or below this fraction of the largest |logit| at that position (default 2e-4)")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--report", type=Path, default=None, help="only re-classify and summarize a saved --json report")
    args = ap.parse_args(argv)
    if args.report:
        print(summary(reclassify(json.loads(args.report.read_text()))))
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    from dflash_gguf.native.logs import set_log_handler
    set_log_handler()
    archs, kinds = args.archs.split(","), args.kinds.split(",")
    blocks = [int(b) for b in args.blocks.split(",")]
    root = args.tiny_dir
    if args.make_tiny:
        root = make_tiny(archs, kinds, blocks)
    configs = [] if args.no_demo else [demo_config()]
    if root is not None:
        configs += tiny_configs(root, archs, kinds, blocks)
    rep = run(configs, 10_000 if args.full else args.tokens, seed=args.seed, tie=args.tie, rel_tie=args.rel_tie)
    print(summary(rep))
    if args.json:
        args.json.write_text(json.dumps(rep, indent=1))
    return 1 if rep["other_divergences"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
