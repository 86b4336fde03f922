"""dflash_gguf.Llama against llama_cpp.Llama: same text on every entry point, stats, fallbacks, state."""
from __future__ import annotations

import json
import subprocess
import sys

import llama_cpp
import numpy as np
import pytest
from llama_cpp.llama_chat_format import Jinja2ChatFormatter

from dflash_gguf import Llama

from support import KW, Oracle, assert_served, both, fast, oracle, pair, plain  # noqa: F401 (fixtures)

PROMPTS = ["def main(", "import os\n", "class Foo:\n    def"]




def assert_consistent(llm: Llama) -> None:
    """llama_cpp's view of the context equals the decoder's."""
    assert llm.n_tokens == len(llm.decoder.cache)
    assert llm.input_ids[: llm.n_tokens].tolist() == llm.decoder.cache


def assert_sane(stats: dict | None, n_generated: int) -> None:
    assert stats is not None
    assert stats["steps"] > 0 or n_generated <= 1
    assert stats["drafted"] >= stats["accepted"] >= 0
    assert stats["acceptance_length"] >= 1.0 or stats["steps"] == 0
    assert stats["tokens_per_second"] >= 0
    json.dumps(stats)


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("max_tokens", [1, 6, 13, 40])
def test_completion_matches_plain(plain, fast, oracle, prompt, max_tokens):
    a, b = both(plain, fast, oracle, "create_completion", prompt, max_tokens=max_tokens, temperature=0)
    assert b["choices"][0]["text"] == a["choices"][0]["text"]
    assert b["choices"][0]["finish_reason"] == a["choices"][0]["finish_reason"]
    assert b["usage"] == a["usage"]
    assert_sane(b["dflash"], max_tokens)
    assert fast.last_dflash_stats is not None
    assert_consistent(fast)


def test_blocks_commit_several_tokens(plain, fast, oracle):
    a, b = both(plain, fast, oracle, "__call__", "def main(", max_tokens=48, temperature=0)
    assert b["choices"][0]["text"] == a["choices"][0]["text"]
    st = b["dflash"]
    assert st["accepted"] > st["steps"], st          # the oracle makes most blocks commit > 2 tokens
    assert 0 < st["accepted"] < st["drafted"], st     # ...and plants rejections
    assert st["acceptance_length"] > 2.0


@pytest.mark.parametrize("offset", [3, 9, 17, 30])
def test_stop_string_mid_block(plain, fast, oracle, offset):
    full = plain("import os\n", max_tokens=40, temperature=0)["choices"][0]["text"]
    stop = full[offset: offset + 2]
    if not stop.strip():
        stop = full[offset: offset + 3]
    a, b = both(plain, fast, oracle, "create_completion", "import os\n", max_tokens=40, temperature=0, stop=[stop])
    assert b["choices"][0]["text"] == a["choices"][0]["text"]
    assert b["choices"][0]["finish_reason"] == a["choices"][0]["finish_reason"] == "stop"
    assert b["dflash"]["finish"] == "stop"
    assert_consistent(fast)


@pytest.mark.parametrize("prompt", PROMPTS[:2])
def test_streaming_matches(plain, fast, oracle, prompt):
    kw = dict(max_tokens=33, temperature=0, stop=["xyz"])
    a, b = both(plain, fast, oracle, "create_completion", prompt, stream=True, **kw)
    text_a = "".join(c["choices"][0]["text"] for c in a)
    text_b = "".join(c["choices"][0]["text"] for c in b)
    assert text_b == text_a
    assert text_b == fast.create_completion(prompt, **kw)["choices"][0]["text"]
    assert b[-1]["choices"][0]["finish_reason"] == a[-1]["choices"][0]["finish_reason"]
    assert_sane(b[-1]["dflash"], 33)
    assert all("dflash" not in c for c in b[:-1])
    assert all(c["object"] == "text_completion" for c in b)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_matches(plain, fast, oracle, stream):
    msgs = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def add(a, b):"}]
    a, b = both(plain, fast, oracle, "create_chat_completion", msgs, max_tokens=30, temperature=0, stream=stream)
    if stream:
        ca = "".join(c["choices"][0]["delta"].get("content", "") for c in a)
        cb = "".join(c["choices"][0]["delta"].get("content", "") for c in b)
        assert cb == ca
        assert [c["object"] for c in b] == [c["object"] for c in a]
        assert b[0]["choices"][0]["delta"] == {"role": "assistant"}
        assert_sane(b[-1]["dflash"], 30)
        assert b[-1]["choices"][0]["finish_reason"] == a[-1]["choices"][0]["finish_reason"]
    else:
        assert b["choices"][0]["message"] == a["choices"][0]["message"]
        assert b["object"] == "chat.completion"
        assert b["usage"] == a["usage"]
        assert_sane(b["dflash"], 30)


def test_chat_openai_v1_shape(fast):
    out = fast.create_chat_completion_openai_v1(messages=[{"role": "user", "content": "x = "}], max_tokens=5,
                                                temperature=0)
    assert out.choices[0].message.role == "assistant"


def test_chat_template_kwargs(pair):
    template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                "{% if enable_thinking is defined and not enable_thinking %}/no_think\n{% endif %}assistant:")
    handler = Jinja2ChatFormatter(template=template, eos_token="</s>", bos_token="<s>").to_chat_handler()
    llm = Llama(str(pair.target), draft_model_path=str(pair.drafter), **{**KW, "chat_format": None},
                chat_handler=handler)
    msgs = [{"role": "user", "content": "def f():"}]
    on = llm.create_chat_completion(msgs, max_tokens=8, temperature=0)
    off = llm.create_chat_completion(msgs, max_tokens=8, temperature=0, chat_template_kwargs={"enable_thinking": False})
    assert off["usage"]["prompt_tokens"] > on["usage"]["prompt_tokens"]
    assert_served(off["dflash"], drafted=False)   # the random pair's drafter is never right: the gate may go plain
    with pytest.raises(ValueError, match="repeat request parameters"):
        llm.create_chat_completion(msgs, chat_template_kwargs={"temperature": 1})
    llm.close()


def _reads_logits(input_ids, logits) -> bool:
    """A stopping criterion that reads more than token ids (DFlash cannot serve it): never stops."""
    return False


READS_LOGITS = "stopping_criteria that read more than token ids (use dflash_gguf.StopOnTokens)"


@pytest.mark.parametrize("how", ["per_call_off", "reads_logits"])
def test_fallback_is_plain_then_dflash_resumes(plain, fast, oracle, how):
    kw: dict = dict(max_tokens=20, temperature=0)
    a = plain("def main(", **kw)
    b = fast("def main(", dflash=False, **kw) if how == "per_call_off" else \
        fast("def main(", stopping_criteria=llama_cpp.StoppingCriteriaList([_reads_logits]), **kw)
    assert b["choices"][0]["text"] == a["choices"][0]["text"]
    reasons = {"per_call_off": "dflash disabled for this call", "reads_logits": READS_LOGITS}
    assert b["dflash"] == {"enabled": False, "reason": reasons[how]}   # a fallback says exactly why
    assert fast.last_dflash_stats is None
    # the plain path evaluated tokens the drafter never saw: the next DFlash call must still be exact
    prompt = "def main(" + b["choices"][0]["text"][:5]
    a2, b2 = both(plain, fast, oracle, "create_completion", prompt, max_tokens=20, temperature=0)
    assert b2["choices"][0]["text"] == a2["choices"][0]["text"]
    assert_served(b2["dflash"])
    assert_consistent(fast)


def test_mirostat_is_served_with_the_requests_parameters(plain, fast):
    """mirostat v2 with a tiny tau keeps only the best token at every step (its state starts at 2 tau and
    grows by eta * tau per certain token): sampled, it is greedy decoding, in llama_cpp and through DFlash
    alike; a Llama that dropped mode or tau would sample."""
    greedy = plain("def main(", max_tokens=20, temperature=0)["choices"][0]["text"]
    kw = dict(max_tokens=20, temperature=0.9, top_k=0, top_p=1.0, min_p=0.0, mirostat_mode=2, mirostat_tau=0.01,
              seed=3)
    assert plain("def main(", **kw)["choices"][0]["text"] == greedy
    b = fast("def main(", **kw)
    assert b["choices"][0]["text"] == greedy
    assert_served(b["dflash"])
    b = fast("def main(", **{**kw, "mirostat_tau": 8.0})      # a tau that keeps many tokens samples
    assert_served(b["dflash"])
    assert b["choices"][0]["text"] != greedy


def test_second_call_reuses_prefix(plain, fast, oracle):
    a1, b1 = both(plain, fast, oracle, "create_completion", "class Foo:\n", max_tokens=20, temperature=0)
    assert b1["choices"][0]["text"] == a1["choices"][0]["text"]
    prompt = "class Foo:\n" + a1["choices"][0]["text"] + "\n"
    a2, b2 = both(plain, fast, oracle, "create_completion", prompt, max_tokens=20, temperature=0)
    assert b2["choices"][0]["text"] == a2["choices"][0]["text"]
    assert b2["dflash"]["n_reused"] > 10
    assert_consistent(fast)


def test_plain_call_after_dflash_reuses_llama_state(plain, fast):
    """llama_cpp's own path (here: for a stopping criterion that reads logits) must see a correct
    n_tokens/input_ids after DFlash."""
    fast("import os\n", max_tokens=25, temperature=0)
    n_before = fast.n_tokens
    assert n_before > 0
    kw = dict(max_tokens=10, temperature=0.7, seed=4)
    a = plain("import os\n", **kw)
    b = fast("import os\n", stopping_criteria=llama_cpp.StoppingCriteriaList([_reads_logits]), **kw)
    assert b["dflash"]["reason"] == READS_LOGITS
    assert b["choices"][0]["text"] == a["choices"][0]["text"]


def test_abandoned_stream_leaves_state_consistent(plain, fast, oracle):
    plain("def main(", max_tokens=40, temperature=0)
    oracle.learn(plain)
    stream = fast.create_completion("def main(", max_tokens=40, temperature=0, stream=True)
    next(stream), next(stream)
    del stream                       # abandoned mid-block: the generator is closed and rolls back
    assert_consistent(fast)
    a, b = both(plain, fast, oracle, "create_completion", "def main(", max_tokens=25, temperature=0)
    assert b["choices"][0]["text"] == a["choices"][0]["text"]


def test_generate_directly(plain, fast):
    toks = plain.tokenize(b"def main(")
    ga, gb = plain.generate(toks, temp=0), fast.generate(toks, temp=0)
    a = [next(ga) for _ in range(15)]
    b = [next(gb) for _ in range(15)]
    ga.close(), gb.close()
    assert a == b
    assert_consistent(fast)
    assert fast.n_tokens == len(toks) + 14


def test_greedy_with_penalties_matches(plain, fast, oracle):
    kw = dict(max_tokens=30, temperature=0, repeat_penalty=1.3, frequency_penalty=0.2, presence_penalty=0.1)
    a, b = both(plain, fast, oracle, "create_completion", "def main(", **kw)
    assert b["choices"][0]["text"] == a["choices"][0]["text"]
    assert_served(b["dflash"])


def test_sampling_is_seeded(fast):
    kw = dict(max_tokens=20, temperature=0.8, top_k=20, seed=1234)
    t1 = fast("def main(", **kw)
    t2 = fast("def main(", **kw)
    assert t1["choices"][0]["text"] == t2["choices"][0]["text"]
    assert_served(t1["dflash"])


def test_sampled_requests_are_gated_and_a_users_seed_repeats_the_text():
    """With the speed gate on (the default), sampled requests are gated, those with a seed the user chose
    too: per call (completion or chat), for the instance (``Llama(seed=...)``) or with ``set_seed``, the
    text repeats whatever the gate drafts. llama_cpp's own per-call seeds (each derived from the last) do
    not count as the user's. Shipped demo target with its trained DFlash2 drafter."""
    from dflash_gguf.demo import DEMO_DIR

    target, drafter = str(DEMO_DIR / "target.gguf"), str(DEMO_DIR.parent / "demo-dflash2" / "drafter.gguf")
    kw = dict(max_tokens=40, temperature=0.8)
    llm = Llama(target, draft_model_path=drafter, n_ctx=512, verbose=False)
    try:
        llm.create_completion("def main(", **kw)
        gate = llm._decoder.gate_sampled
        assert gate.steps > 0 and llm._decoder.gate.steps == 0       # gated, with the sampled requests' gate
        steps = gate.steps
        llm.create_completion("import os\n", **kw)                 # llama_cpp set a per-call seed: still gated
        assert gate.steps > steps
        assert not llm._seed_given      # llama_cpp's own set_seed calls (one per completion) are not the user's
        steps = gate.steps

        def text(**extra):
            return llm.create_completion("class Stack:\n", **kw, **extra)["choices"][0]["text"]
        assert text(seed=5) == text(seed=5)
        msgs = [{"role": "user", "content": "def f():"}]
        chat = [llm.create_chat_completion(msgs, max_tokens=24, temperature=0.8, seed=8)["choices"][0]["message"]
                for _ in range(2)]
        assert chat[0] == chat[1]
        llm.set_seed(9)
        assert llm._seed_given
        first = text()
        llm.set_seed(9)
        assert text() == first
        assert gate.steps > steps                                    # the seeded requests were gated too
    finally:
        llm.close()
    llm = Llama(target, draft_model_path=drafter, n_ctx=512, verbose=False, seed=7)
    try:
        llm.create_completion("def main(", **kw)
        assert llm._decoder.gate_sampled.steps > 0   # gated like any sampled request (what it drafts: the machine's costs)
    finally:
        llm.close()


def test_save_and_load_state(plain, fast, oracle):
    fast("class Foo:\n", max_tokens=10, temperature=0)
    state = fast.save_state()
    fast("import os\n", max_tokens=10, temperature=0)
    fast.load_state(state)
    a, b = both(plain, fast, oracle, "create_completion", "class Foo:\n", max_tokens=15, temperature=0)
    assert b["choices"][0]["text"] == a["choices"][0]["text"]
    fast.reset()
    a, b = both(plain, fast, oracle, "create_completion", "def main(", max_tokens=15, temperature=0)
    assert b["choices"][0]["text"] == a["choices"][0]["text"]
    assert b["dflash"]["n_reused"] == 0


def test_tokenize_detokenize_match(plain, fast):
    t = fast.tokenize(b"def f(x):\n    return x")
    assert t == plain.tokenize(b"def f(x):\n    return x")
    assert fast.detokenize(t) == plain.detokenize(t)


def test_context_overflow_is_value_error(fast):
    with pytest.raises(ValueError):
        fast("x " * 600, max_tokens=4)
    b = fast("def main(", max_tokens=4, temperature=0)
    assert_served(b["dflash"])


def test_draft_n_max_is_clamped(pair):
    llm = Llama(str(pair.target), draft_model_path=str(pair.drafter), draft_n_max=100, **KW)
    assert llm.dflash_info["n_draft"] == llm.dflash_info["block_size"] - 1 == 7
    llm.close()
    llm = Llama(str(pair.target), draft_model_path=str(pair.drafter), draft_n_max=3, **KW)
    assert llm.dflash_info["n_draft"] == 3
    out = llm("def main(", max_tokens=12, temperature=0)
    assert out["dflash"]["drafted"] <= 3 * out["dflash"]["steps"]
    llm.close()


def test_without_drafter_is_plain_llama(pair, plain):
    llm = Llama(str(pair.target), **KW)
    assert llm.decoder is None and llm.dflash_info is None
    out = llm("def main(", max_tokens=10, temperature=0)
    assert "dflash" not in out and set(out) == set(plain("def main(", max_tokens=10, temperature=0))
    assert out["choices"][0]["text"] == plain("def main(", max_tokens=10, temperature=0)["choices"][0]["text"]
    llm.close()


def test_dflash_off_by_default_flag(pair):
    llm = Llama(str(pair.target), draft_model_path=str(pair.drafter), dflash=False, **KW)
    assert llm("def main(", max_tokens=5, temperature=0)["dflash"] == {"enabled": False, "reason": "dflash=False"}
    assert llm("def main(", max_tokens=5, temperature=0, dflash=True)["dflash"]["enabled"] is True
    llm.close()


def test_context_rebuilt_with_rs_snapshots(pair, plain):
    """The hybrid-target path (target context re-made with n_rs_seq) on a plain target."""
    class Hybridish(Llama):
        def _open_drafter(self):
            self._is_hybrid = True           # pretend: exercises _recreate_context
            super()._open_drafter()

    llm = Hybridish(str(pair.target), draft_model_path=str(pair.drafter), **KW)
    out = llm("def main(", max_tokens=12, temperature=0)
    assert out["choices"][0]["text"] == plain("def main(", max_tokens=12, temperature=0)["choices"][0]["text"]
    llm.close()


def test_from_pair(pair, plain, tmp_path):
    d = tmp_path / "pair"
    d.mkdir()
    (d / "target-q.gguf").symlink_to(pair.target)
    (d / "drafter-q.gguf").symlink_to(pair.drafter)
    llm = Llama.from_pair(d, **KW)     # no manifest: the single target*/drafter* files
    assert llm.decoder is not None
    llm.close()
    doc = {"format": "dflash-gguf-pair", "format_version": 1, "kind": "dflash", "block_size": 8, "mask_token_id": 3,
           "target_layers": [1, 3],
           "target": {"file": "target-q.gguf", "size": pair.target.stat().st_size, "sha256": "-", "type": "F32"},
           "drafter": {"file": "drafter-q.gguf", "size": pair.drafter.stat().st_size, "sha256": "-", "type": "F32"}}
    (d / "pair.json").write_text(json.dumps(doc))
    llm = Llama.from_pair(d / "pair.json", **KW)
    out = llm("def main(", max_tokens=8, temperature=0)
    assert out["choices"][0]["text"] == plain("def main(", max_tokens=8, temperature=0)["choices"][0]["text"]
    llm.close()
    with pytest.raises(FileNotFoundError):
        Llama.from_pair(tmp_path / "missing")


def test_import_is_light():
    code = ("import sys, dflash_gguf; assert 'llama_cpp' not in sys.modules; from dflash_gguf import Llama; "
            "bad = [m for m in ('fastapi', 'torch', 'uvicorn') if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_multibyte_text_across_blocks(plain, fast, oracle):
    """Multi-byte characters made of byte-fallback tokens split across blocks: same chunks as plain.

    (llama_cpp's own streaming drops such characters when they end a stream of single-byte
    tokens; the DFlash path reproduces llama_cpp exactly, chunk for chunk.)
    """
    for prompt in ["x = '\u00fc", "s = '\u00e9\u00e8\u4e2d\u6587' + '", "caf\u00e9 "]:
        if any(ord(ch) > 127 for ch in plain(prompt, max_tokens=90, temperature=0)["choices"][0]["text"]):
            break
    else:
        pytest.skip("the tiny target emits no multi-byte characters for these prompts")
    a, b = both(plain, fast, oracle, "create_completion", prompt, max_tokens=90, temperature=0)
    assert b["choices"][0]["text"] == a["choices"][0]["text"]
    assert any(ord(ch) > 127 for ch in b["choices"][0]["text"])
    assert b["dflash"]["accepted"] > 0
    a, b = both(plain, fast, oracle, "create_completion", prompt, max_tokens=90, temperature=0, stream=True)
    assert [c["choices"][0]["text"] for c in b] == [c["choices"][0]["text"] for c in a]


def test_invalid_grammar_is_value_error_not_a_crash(fast):
    bad = llama_cpp.LlamaGrammar.from_string("root ::= (", verbose=False)
    with pytest.raises(ValueError, match="invalid grammar"):
        fast("def main(", max_tokens=4, grammar=bad)
    assert_served(fast("def main(", max_tokens=4, temperature=0)["dflash"])


def test_resumes_when_llama_cpp_reads_past_max_tokens(plain, fast, oracle):
    """llama_cpp keeps reading past max_tokens while a UTF-8 character is incomplete."""
    for prompt in PROMPTS + ["x = '\u00fc", "caf\u00e9 "]:
        for n in (1, 2, 3, 5):
            a = plain(prompt, max_tokens=n, temperature=0)
            if a["usage"]["completion_tokens"] > n:
                oracle.learn(plain)
                b = fast(prompt, max_tokens=n, temperature=0)
                assert b["choices"][0]["text"] == a["choices"][0]["text"]
                assert b["usage"] == a["usage"]
                assert_consistent(fast)
                return
    pytest.skip("no prompt here makes the tiny target end max_tokens inside a UTF-8 character")


def test_pickle_round_trip(pair, plain):
    import pickle

    llm = Llama(str(pair.target), draft_model_path=str(pair.drafter), draft_n_max=5, **KW)
    copy = pickle.loads(pickle.dumps(llm))
    assert copy.dflash_info["n_draft"] == 5 and copy.draft_model_path == llm.draft_model_path
    want = plain("def main(", max_tokens=10, temperature=0)["choices"][0]["text"]
    assert copy("def main(", max_tokens=10, temperature=0)["choices"][0]["text"] == want
    copy.close()
    llm.close()


def test_low_memory_drafter_cache_is_512_cells_whatever_the_block(pair):
    """The preset's drafter cache is 512 cells: window 512 - block (504 for this block-8 drafter)."""
    kw = dict(KW, n_ctx=2048)
    llm = Llama(str(pair.target), draft_model_path=str(pair.drafter), low_memory=True, **kw)
    try:
        dc = llm.decoder.drafter
        assert dc.window == 512 - 8 and dc.n_ctx == 512 and llm.n_ctx() == 2048
    finally:
        llm.close()


@pytest.mark.parametrize("settings", [dict(low_memory=True), dict(draft_window=5), dict(draft_window=0)],
                         ids=["low_memory", "window5", "unbounded"])
def test_memory_settings_keep_the_text(pair, oracle, settings):
    """low_memory=True (weights read, not mapped; small batches; flash attention; Q8_0 KV; a small
    drafter cache) and drafter windows: the text is plain decoding's on the same settings, and the
    drafter's context is sized as documented."""
    from dflash_gguf.native.memory import LOW_MEMORY
    from dflash_gguf.decoding import OverrideProposer

    llm = Llama(str(pair.target), draft_model_path=str(pair.drafter), draft_adaptive=False, **settings, **KW)
    try:
        llm.decoder.proposer = OverrideProposer(oracle)
        dc = llm.decoder.drafter
        assert dc.n_ubatch == dc.n_batch == 8                    # the block, not the target's batch
        if settings.get("low_memory"):
            # the tiny target's 16-value heads cannot hold a Q8_0 KV cache: it stays f16
            assert llm.context_params.n_ubatch == LOW_MEMORY["n_ubatch"] and llm.context_params.type_k == 1
            assert llm.model_params.load_mode == llama_cpp.LLAMA_LOAD_MODE_NONE
            # a 512-cell drafter cache (window 512 - block 8): the target's whole 512-token context
            # fits it, so no window is needed
            assert dc.n_ctx == 512 and dc.window == 0 and llm.n_ctx() == 512
        elif settings["draft_window"]:
            assert dc.window == 5 and dc.n_ctx == 256             # 5 + 8 cells, padded by llama.cpp
        else:
            assert dc.window == 0 and dc.n_ctx == llm.n_ctx()
        for prompt in PROMPTS:
            ref = llm(prompt, max_tokens=40, temperature=0, dflash=False)["choices"][0]["text"]
            oracle.learn(llm)          # blocks then commit several tokens
            out = llm(prompt, max_tokens=40, temperature=0)
            assert out["choices"][0]["text"] == ref
            assert out["dflash"]["steps"] > 0
    finally:
        llm.close()
    with pytest.raises(ValueError, match="draft_window"):
        Llama(str(pair.target), draft_model_path=str(pair.drafter), draft_window=-1, **KW)


def test_low_memory_on_the_demo_pair_quantizes_the_kv_and_keeps_the_text():
    """On a target whose heads hold Q8_0 blocks (the demo pair: 64-value heads) the preset's KV cache
    is Q8_0; DFlash's text equals plain decoding's on the same context."""
    from dflash_gguf.demo import demo_pair

    target, drafter = demo_pair()
    llm = Llama(str(target), draft_model_path=str(drafter), low_memory=True, draft_adaptive=False,
                n_ctx=1024, n_threads=1, n_threads_batch=1, verbose=False)
    try:
        assert llm.context_params.type_k == llm.context_params.type_v == 8
        for prompt in ("def fibonacci(n):\n", "The history of the city"):
            ref = llm(prompt, max_tokens=48, temperature=0, dflash=False)["choices"][0]["text"]
            out = llm(prompt, max_tokens=48, temperature=0)
            assert out["choices"][0]["text"] == ref
            assert out["dflash"]["acceptance_length"] > 1.5      # the trained drafter still drafts well
    finally:
        llm.close()


def test_the_advertised_init_signature_lists_every_keyword_init_takes():
    """``inspect.signature(Llama)`` (IDEs, help()) shows llama_cpp's parameters plus ours: every keyword-only
    parameter of ``Llama.__init__`` must be there with its real default."""
    import inspect

    code = Llama.__init__.__code__
    ours = code.co_varnames[code.co_argcount:code.co_argcount + code.co_kwonlyargcount]
    shown = inspect.signature(Llama.__init__).parameters
    defaults = Llama.__init__.__kwdefaults__
    missing = [k for k in ours if k not in shown]
    assert not missing, f"Llama.__init__.__signature__ omits {missing}"
    assert {k: shown[k].default for k in ours} == {k: defaults[k] for k in ours}



def test_a_new_llama_of_a_pair_starts_from_its_kept_acceptance(monkeypatch, tmp_path):
    """The speed gate's acceptance history is kept per pair (decoding.history): a new Llama of the same
    pair (another process, here another instance) plans from it on its first call instead of probing
    from scratch, and its output is plain decoding's. The gate is charged a cost model in which drafting
    pays (measured costs differ between machines). Shipped demo target with its trained DFlash drafter."""
    from dflash_gguf.decoding import calibration
    from dflash_gguf.demo import DEMO_DIR
    from dflash_gguf.decoding.gate import DraftLength

    monkeypatch.setenv("DFLASH_GGUF_CACHE", str(tmp_path))
    monkeypatch.setattr(calibration, "step_costs",
                        lambda dec: np.array([1e-3 * (1 + 0.1 * n) for n in range(dec.n_draft + 1)]))
    monkeypatch.setattr(calibration, "check_prior", lambda *a: True)
    target, drafter = str(DEMO_DIR / "target.gguf"), str(DEMO_DIR / "drafter.gguf")
    ref = llama_cpp.Llama(target, n_ctx=512, verbose=False)
    want = ref.create_completion("def main(", max_tokens=64, temperature=0)["choices"][0]["text"]
    ref.close()
    first = Llama(target, draft_model_path=drafter, n_ctx=512, verbose=False)
    try:
        assert first._decoder.gate.tries.sum() == 0                      # nothing kept yet
        assert first.create_completion("def main(", max_tokens=64, temperature=0)["choices"][0]["text"] == want
        learned = first._decoder.gate
        assert learned.tries[0] >= DraftLength.FEW_DRAWS
    finally:
        first.close()
    assert len(list((tmp_path / "acceptance").glob("*.json"))) == 1
    second = Llama(target, draft_model_path=drafter, n_ctx=512, verbose=False)
    try:
        gate = second._decoder.gate
        assert gate.tries[0] >= DraftLength.FEW_DRAWS
        np.testing.assert_allclose(gate.hits[0] / gate.tries[0], learned.hits[0] / learned.tries[0], atol=0.01)
        out = second.create_completion("def main(", max_tokens=64, temperature=0)
        assert out["choices"][0]["text"] == want and out["dflash"]["drafted"] > 0
        assert gate.steps > 0 and gate.tries[0] >= DraftLength.FEW_DRAWS
    finally:
        second.close()


def test_proposals_not_the_drafters_own_start_the_gates_afresh_and_are_not_kept(monkeypatch, tmp_path):
    """A replay or an oracle in place of the drafter (``decoder.proposer = ...``) is not the pair's acceptance:
    the gates drop what was recalled of the drafter's and the pair's kept history is left as it was."""
    from dflash_gguf.decoding import calibration
    from dflash_gguf.decoding.proposer import OverrideProposer
    from dflash_gguf.demo import DEMO_DIR

    monkeypatch.setenv("DFLASH_GGUF_CACHE", str(tmp_path))
    monkeypatch.setattr(calibration, "step_costs",
                        lambda dec: np.array([1e-3 * (1 + 0.1 * n) for n in range(dec.n_draft + 1)]))
    monkeypatch.setattr(calibration, "check_prior", lambda *a: True)
    target, drafter = str(DEMO_DIR / "target.gguf"), str(DEMO_DIR / "drafter.gguf")
    first = Llama(target, draft_model_path=drafter, n_ctx=512, verbose=False)
    try:
        first.create_completion("def main(", max_tokens=64, temperature=0)
    finally:
        first.close()
    (kept,) = (tmp_path / "acceptance").glob("*.json")
    before = kept.read_bytes()
    second = Llama(target, draft_model_path=drafter, n_ctx=512, verbose=False)
    try:
        assert second._decoder.gate.tries.sum() > 0                      # recalled
        second._decoder.proposer = OverrideProposer(lambda ctx, n: [0] * n)   # never right
        assert second._decoder.gate.tries.sum() == 0
        second.create_completion("def add(", max_tokens=64, temperature=0)
        assert second._decoder.gate.tries.sum() > 0
    finally:
        second.close()
    assert kept.read_bytes() == before
