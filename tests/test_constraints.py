"""Grammars and logits processors (logit_bias) under DFlash: every verify row judged as llama_cpp judges
the next token, the same text as ``llama_cpp.Llama`` with the same constraint, blocks cut at a token
the grammar forbids (the constrained chain as pure functions: tests/test_sampling_rules.py)."""
from __future__ import annotations

import json
import re
from collections import Counter

import llama_cpp
import numpy as np
import pytest
from llama_cpp.llama_grammar import JSON_GBNF

from dflash_gguf.decoding.constraints import Constraints, Grammar
from dflash_gguf.errors import InvalidArgumentError
from dflash_gguf.decoding.sampling import SamplingParams, distribution

from support import KW, assert_served, both, fast, oracle, pair, plain  # noqa: F401 (fixtures)

LOWER = 'root ::= [a-z ]+'


# ---------------------------------------------------------------------- llama.cpp's grammar sampler
def test_grammar_state_follows_the_kept_tokens(plain):
    """allowed() answers for the state after the kept tokens plus a row's earlier tokens; rejected rows
    leave nothing behind; allowed_prefix cuts a block at the first forbidden token."""
    vocab = plain._model.vocab
    a, b = (next(i for i in range(plain.n_vocab()) if plain.detokenize([i]) == t) for t in (b"a", b"b"))
    c = Constraints(grammar=Grammar(vocab, 'root ::= "a" "b" "a"'))
    ids = np.array([a, b], dtype=np.int32)
    assert c.allowed([])(ids).tolist() == [True, False]
    assert c.allowed([a])(ids).tolist() == [False, True]
    assert c.allowed([a, b])(ids).tolist() == [True, False]
    assert c.allowed_prefix(np.array([a, b, b, a], np.int32)) == 2
    assert c.allowed_prefix(np.array([b], np.int32)) == 0
    c.accept([a])                                      # a step kept one token of its rows
    assert c.allowed([])(ids).tolist() == [False, True]
    c.accept([b, a])
    assert not c.allowed([])(ids).any()
    c.close()
    with pytest.raises(InvalidArgumentError, match="invalid grammar"):
        Grammar(vocab, "root ::= (")


# ---------------------------------------------------------------------- end to end, against llama_cpp
def _grammar(text):
    return llama_cpp.LlamaGrammar.from_string(text, verbose=False)


@pytest.mark.parametrize("prompt", ["def main(", "import os\n", "x = "])
def test_grammar_greedy_equals_llama_cpp(plain, fast, oracle, prompt):
    a, b = both(plain, fast, oracle, "create_completion", prompt, max_tokens=24, temperature=0,
                grammar=_grammar(LOWER))
    text = b["choices"][0]["text"]
    assert text == a["choices"][0]["text"] and re.fullmatch(r"[a-z ]*", text)
    assert_served(b["dflash"])
    assert b["dflash"]["accepted"] > 0, "blocks of the oracle's (grammar-valid) proposals are accepted"


def test_json_grammar_and_chat_json_mode_equal_llama_cpp(plain, fast, oracle):
    a, b = both(plain, fast, oracle, "create_completion", '{"name": ', max_tokens=30, temperature=0,
                grammar=_grammar(JSON_GBNF))
    assert b["choices"][0]["text"] == a["choices"][0]["text"]
    assert_served(b["dflash"])
    msgs = [{"role": "user", "content": "a JSON object, please"}]
    a, b = both(plain, fast, oracle, "create_chat_completion", msgs, max_tokens=30, temperature=0,
                response_format={"type": "json_object"})
    assert b["choices"][0]["message"] == a["choices"][0]["message"]
    assert_served(b["dflash"])


def test_a_json_schema_equals_llama_cpp(plain, fast, oracle):
    schema = {"type": "object", "properties": {"id": {"type": "integer"}, "tag": {"type": "string", "maxLength": 6}},
              "required": ["id", "tag"]}
    msgs = [{"role": "user", "content": "x"}]
    a, b = both(plain, fast, oracle, "create_chat_completion", msgs, max_tokens=40, temperature=0,
                response_format={"type": "json_object", "schema": schema})
    assert b["choices"][0]["message"] == a["choices"][0]["message"]
    assert_served(b["dflash"])
    if b["choices"][0]["finish_reason"] == "stop":
        assert set(json.loads(b["choices"][0]["message"]["content"])) == {"id", "tag"}


def test_a_tool_call_equals_llama_cpp(plain, fast, oracle):
    """tools + tool_choice: llama_cpp's chat handler constrains the reply with the function's schema."""
    tool = {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
    msgs = [{"role": "user", "content": "add 2 and 3"}]
    a, b = both(plain, fast, oracle, "create_chat_completion", msgs, max_tokens=40, temperature=0, tools=[tool],
                tool_choice={"type": "function", "function": {"name": "add"}})
    ca, cb = a["choices"][0]["message"], b["choices"][0]["message"]
    assert [c["function"] for c in cb["tool_calls"]] == [c["function"] for c in ca["tool_calls"]]
    assert cb["tool_calls"][0]["function"]["name"] == "add"
    assert_served(b["dflash"])


def test_logit_bias_and_processors_equal_llama_cpp(plain, fast, oracle):
    """logit_bias (which llama_cpp turns into a processor) and a processor of ids and scores change the
    text; DFlash serves them with llama_cpp's output."""
    out = plain.create_completion("def main(", max_tokens=12, temperature=0)
    base, n_prompt = out["choices"][0]["text"], out["usage"]["prompt_tokens"]
    toks = plain.input_ids[n_prompt:plain.n_tokens].tolist()     # the ids it generated
    bias = {str(toks[2]): -100.0, str(toks[0]): 5.0}
    a, b = both(plain, fast, oracle, "create_completion", "def main(", max_tokens=12, temperature=0, logit_bias=bias)
    assert b["choices"][0]["text"] == a["choices"][0]["text"] != base
    assert_served(b["dflash"])

    def no_repeat(ids, scores):
        out = scores.copy()
        out[ids[-1]] = -np.inf
        return out

    procs = llama_cpp.LogitsProcessorList([no_repeat])
    a, b = both(plain, fast, oracle, "create_completion", "import os\n", max_tokens=16, temperature=0,
                logits_processor=procs)
    assert b["choices"][0]["text"] == a["choices"][0]["text"]
    assert_served(b["dflash"])


def test_a_forbidden_draft_is_cut_before_the_verify(fast, plain, oracle):
    """The oracle plants a wrong token now and then; under a grammar that forbids it the block is cut
    there, so fewer rows are verified than drafted by the proposer."""
    calls = Counter()
    real = Constraints.allowed_prefix

    def counting(self, draft):
        k = real(self, draft)
        calls["rows"] += len(draft)
        calls["kept"] += k
        return k

    Constraints.allowed_prefix = counting
    try:
        a, b = both(plain, fast, oracle, "create_completion", "class Foo:\n", max_tokens=30, temperature=0,
                    grammar=_grammar(LOWER))
    finally:
        Constraints.allowed_prefix = real
    assert b["choices"][0]["text"] == a["choices"][0]["text"]
    assert calls["rows"] > 0 and calls["kept"] < calls["rows"], calls
    assert b["dflash"]["drafted"] == calls["kept"], "only the grammar-valid prefix is drafted and verified"


def test_a_sampled_grammar_request_is_served_and_stays_in_the_grammar(fast):
    out = fast.create_completion("def main(", max_tokens=20, temperature=0.9, seed=5, grammar=_grammar(LOWER))
    assert re.fullmatch(r"[a-z ]*", out["choices"][0]["text"])
    assert_served(out["dflash"], drafted=False)      # gated: whether it drafts follows this machine's costs


def _exact_constrained(pc, vocab, prompt, sp) -> dict:
    """P(t1, t2, t3) of the chain under the LOWER grammar, one prefix at a time from the target's logits
    (the grammar advanced along the prefix)."""
    import itertools

    def dist_after(gen):
        prefix = prompt + list(gen)
        pc.clear()
        pc.decode(np.array(prefix, np.int32), 0, out_row0=len(prefix) - 1)
        g = Grammar(vocab, LOWER)
        for t in gen:
            g.accept(t)
        ids, p = distribution(pc.logits_row(len(prefix) - 1).copy(), sp, g.allowed)
        g.close()
        return dict(zip(ids.tolist(), p.tolist()))

    exact: dict = {}
    for path in itertools.product(range(sp.top_k), repeat=3):
        prob, gen = 1.0, []
        for j in path:
            d = dist_after(gen)
            if j >= len(d):
                break
            tok = sorted(d, key=lambda t: -d[t])[j]
            prob *= d[tok]
            gen.append(tok)
        else:
            exact[tuple(gen)] = exact.get(tuple(gen), 0.0) + prob
    assert abs(sum(exact.values()) - 1) < 1e-6 and len(exact) > 2
    return exact


SAMPLED = SamplingParams(temperature=1.0, top_k=2, top_p=1.0, min_p=0.0)


def test_sampling_under_a_grammar_keeps_the_target_distribution(models):
    """DFlash at temperature 1 under a grammar: the first three tokens follow the exact distribution of
    the constrained chain, with an oracle proposing the greedy constrained text (blocks accepted,
    rejected, and cut where a planted token is forbidden); the same chain also matches llama_cpp's own
    sampler with that grammar."""
    from dflash_gguf.decoding import DFlashDecoder, GenerationStats, OverrideProposer, SpecOptions
    from dflash_gguf.native.engine import Context, ContextOptions, Model
    from test_sampling import ALPHA, chi2_pvalue

    sp = SAMPLED
    pair = models.pair("qwen3", "dflash", 8)
    tm, dm = Model(pair.target), Model(pair.drafter)
    opts = ContextOptions(n_ctx=256, n_batch=64, n_ubatch=64)
    pc, tc = Context(tm, opts), Context(tm, opts)
    dc = Context(dm, opts, other=tc)
    prompt = tm.tokenize(b"def main(argv):\n    parser = ")
    limits = lambda: Constraints(grammar=Grammar(tm.vocab, LOWER))   # noqa: E731
    try:
        exact = _exact_constrained(pc, tm.vocab, prompt, sp)
        greedy = list(DFlashDecoder(pc, None).generate(prompt, 8, stop_tokens=[], constraints=limits()))
        calls = [0]

        def oracle_hook(ctx, n):
            calls[0] += 1
            out = greedy[len(ctx) - len(prompt):][:n]
            if calls[0] % 4 == 0 and out:
                out = [tm.tokenize(b"(", add_bos=False)[0]] + out[1:]   # forbidden by the grammar
            return out

        dec = DFlashDecoder(tc, dc, SpecOptions(), OverrideProposer(oracle_hook))
        counts, st = Counter(), GenerationStats()
        for seed in range(700):
            run = SamplingParams(**{**sp.__dict__, "seed": seed})
            counts[tuple(dec.generate(prompt, 3, sampling=run, stats=st, stop_tokens=[], constraints=limits()))] += 1
        assert st.drafted > 0 and 0 < st.accepted < st.drafted
        p = chi2_pvalue(counts, exact)
        assert p > ALPHA, f"samples under the grammar do not follow the constrained distribution (p={p:.2e})"

        llm = llama_cpp.Llama(model_path=str(pair.target), n_ctx=256, n_batch=64, verbose=False, seed=0,
                              flash_attn=True)
        ref = Counter()
        for seed in range(400):
            llm.set_seed(seed)
            out = []
            for t in llm.generate(prompt, temp=1.0, top_k=2, top_p=1.0, min_p=0.0, repeat_penalty=1.0,
                                  grammar=_grammar(LOWER)):
                out.append(t)
                if len(out) == 3:
                    break
            ref[tuple(out)] += 1
        llm.close()
        p = chi2_pvalue(ref, exact)
        assert p > ALPHA, f"llama_cpp's grammar sampler disagrees with the constrained chain (p={p:.2e})"
    finally:
        dc.close()
        tc.close()
        pc.close()
        dm.close()
        tm.close()


def test_dflash2_lattice_under_a_grammar_keeps_the_target_distribution():
    """DFlash2 at temperature 1 under a grammar (the trained demo target and DFlash2 drafter): each
    lattice row draws only among the candidates the grammar allows after the tokens drawn before it, and
    the samples keep the exact constrained distribution."""
    from dflash_gguf.decoding import GenerationStats
    from test_sampling import ALPHA, TRAINED_DFLASH2, TRAINED_TARGET, chi2_pvalue, dflash2_decoder
    from dflash_gguf.decoding import SpecOptions

    if not TRAINED_DFLASH2.is_file():
        pytest.skip(f"the trained DFlash2 demo drafter is not built here ({TRAINED_DFLASH2})")
    with dflash2_decoder(TRAINED_TARGET, TRAINED_DFLASH2, SpecOptions()) as (dec, _prompt, _exact):
        vocab = dec.target.model.vocab
        prompt = dec.target.model.tokenize(b"def main(argv):\n    parser = ")
        pc = dec.target    # the decoder is idle between generations: its context serves the reference too
        exact = _exact_constrained(pc, vocab, prompt, SAMPLED)
        dec.reset()
        counts, st = Counter(), GenerationStats()
        for seed in range(500):   # (seeded streams, not repeatable requests: those draft point masses)
            run = SamplingParams(**{**SAMPLED.__dict__, "seed": seed, "repeatable": False})
            limits = Constraints(grammar=Grammar(vocab, LOWER))
            counts[tuple(dec.generate(prompt, 3, sampling=run, stats=st, stop_tokens=[], constraints=limits))] += 1
        assert st.drafted > 0 and st.accepted > 0, st.as_dict()
        p = chi2_pvalue(counts, exact)
        assert p > ALPHA, f"DFlash2 lattice samples under the grammar are off the constrained distribution (p={p:.2e})"


def test_structured_chat_with_a_released_chat_template(pair, tmp_path):
    """JSON mode and a tool call through the Qwen3 chat template a released GGUF carries (the chat
    handler llama_cpp builds from it): the same replies as llama_cpp.Llama, served by DFlash."""
    from chat_templates import QWEN3, with_chat_template

    from dflash_gguf import Llama
    from dflash_gguf.decoding import OverrideProposer
    from support import Oracle

    target = with_chat_template(pair.target, tmp_path / "qwen3-chat.gguf", QWEN3)
    kw = {**KW, "chat_format": None}
    plain_llm = llama_cpp.Llama(str(target), **kw)
    orc = Oracle()
    fast_llm = Llama(str(target), draft_model_path=str(pair.drafter), draft_adaptive=False, **kw)
    fast_llm.decoder.proposer = OverrideProposer(orc)
    tool = {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}
    msgs = [{"role": "user", "content": "add one"}]
    try:
        for extra in (dict(response_format={"type": "json_object"}),
                      dict(tools=[tool], tool_choice={"type": "function", "function": {"name": "add"}})):
            a, b = both(plain_llm, fast_llm, orc, "create_chat_completion", msgs, max_tokens=30, temperature=0, **extra)
            ma, mb = a["choices"][0]["message"], b["choices"][0]["message"]
            if "tools" in extra:
                assert [c["function"] for c in mb["tool_calls"]] == [c["function"] for c in ma["tool_calls"]]
            else:
                assert mb == ma
            assert_served(b["dflash"])
            assert b["usage"]["prompt_tokens"] > 10, "the GGUF's template formatted the prompt"
    finally:
        fast_llm.close()
        plain_llm.close()
