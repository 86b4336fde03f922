"""Where ``dflash_gguf.Llama`` must answer as ``llama_cpp.Llama`` does: recurrent GGUFs, the context
bound of a padded ``n_ctx``, and the responses' keys without a drafter (what running
llama-cpp-python's own suite against the class checks, ``tests/test_peer_suite.py``, pinned down
here one case at a time)."""
from __future__ import annotations

import re

import llama_cpp
import pytest

import peer_models
from dflash_gguf import Llama, paths
from dflash_gguf.native import gguf_check
from dflash_gguf.errors import ModelFileError
from support import KW, pair, plain  # noqa: F401 (fixtures)


def _greedy(llm, prompt: str, n: int = 12) -> str:
    return llm(prompt, max_tokens=n, temperature=0)["choices"][0]["text"]


# --------------------------------------------------------------------------- recurrent architectures
def test_recurrent_and_hybrid_archs_are_llama_cpp_s():
    """gguf_check's architectures with recurrent layers are llm_arch_is_recurrent's and
    llm_arch_is_hybrid's of the pinned llama.cpp (src/llama-arch.cpp)."""
    src = (paths.upstream_tree() / "src" / "llama-arch.cpp").read_text()
    names = dict(re.findall(r'\{\s*(LLM_ARCH_\w+),\s*"([^"]+)"\s*\}', src))
    for fn, table in (("llm_arch_is_recurrent", gguf_check.RECURRENT_ARCHS),
                      ("llm_arch_is_hybrid", gguf_check.HYBRID_ARCHS)):
        body = re.search(fn + r"\(const llm_arch & arch\)\s*\{(.*?)\n\}", src, re.S).group(1)
        assert {names[c] for c in re.findall(r"case (LLM_ARCH_\w+):", body)} == table, fn


def test_ggml_type_sizes_are_gguf_py_s():
    """gguf_check's block sizes per ggml type are the vendored gguf-py's (kept as a table of its own:
    importing gguf-py loads the whole package), every type of it."""
    from gguf.constants import GGML_QUANT_SIZES
    assert gguf_check.ggml_type_sizes() == {int(k): (int(v[0]), int(v[1])) for k, v in GGML_QUANT_SIZES.items()}


@pytest.mark.parametrize("version", [1, 2])
def test_mamba_loads_without_a_drafter(models, version):
    """Upstream's converter writes attention.head_count = 0 for Mamba and Mamba2: llama.cpp loads them,
    and so must this class (the same greedy text as llama_cpp)."""
    path = peer_models.mamba_gguf(models.root, models.tok, version)
    arch = "mamba" if version == 1 else "mamba2"
    h = gguf_check.check_gguf(path)
    assert h.arch == arch and h.get(f"{arch}.attention.head_count") == 0
    ref = llama_cpp.Llama(str(path), **KW)
    llm = Llama(str(path), **KW)
    try:
        assert llm._is_recurrent and not llm._is_hybrid
        assert _greedy(llm, "def main(") == _greedy(ref, "def main(")
    finally:
        llm.close()
        ref.close()


def test_zero_heads_still_refused_for_attention_archs(pair, tmp_path):
    from dflash_gguf.reliability.mutate import kv_raw, rebuild

    h = gguf_check.parse_gguf(pair.target)
    data = pair.target.read_bytes()
    key = f"{h.arch}.attention.head_count"
    kvs = [kv_raw(key, gguf_check.T_UINT32, 0) if kv.key == key else data[kv.start:kv.end] for kv in h.kv_list]
    bad = tmp_path / "zero-heads.gguf"
    bad.write_bytes(rebuild(data, h, kvs, [data[t.start:t.end] for t in h.tensors]))
    with pytest.raises(ModelFileError, match="head_count is 0"):
        gguf_check.check_gguf(bad)
    assert not gguf_check.has_recurrent_layers("qwen3") and gguf_check.has_recurrent_layers("mamba2")


# --------------------------------------------------------------------------- a padded n_ctx
def test_generation_bounded_as_llama_cpp_bounds_it(pair):
    """llama.cpp pads n_ctx (1000 -> 1024) and llama_cpp bounds a completion by the padded size, but
    sizes input_ids by the 1000 asked for, storing no token past them. With a drafter a completion
    that runs into the end of the context must end where llama_cpp's does, leave the same views of
    the cache, and the next requests must answer as llama_cpp's do."""
    n_ctx = 1000
    kw = dict(KW, n_ctx=n_ctx, n_batch=512)
    ref = llama_cpp.Llama(str(pair.target), **kw)
    llm = Llama(str(pair.target), draft_model_path=str(pair.drafter), **kw)
    try:
        assert llm._n_ctx == ref._n_ctx > n_ctx and len(llm.input_ids) == len(ref.input_ids) == n_ctx
        prompt = ref.tokenize(b"def main(")
        prompt = (prompt * (n_ctx // len(prompt) + 1))[: n_ctx - 6]
        outs = [m.create_completion(prompt, max_tokens=None, temperature=0) for m in (ref, llm)]
        assert outs[0]["usage"]["total_tokens"] == ref._n_ctx          # the padded size bounds it
        assert outs[1]["dflash"]["enabled"] is True
        assert [(o["choices"][0]["text"], o["choices"][0]["finish_reason"], o["usage"]) for o in outs[1:]] == \
            [(o["choices"][0]["text"], o["choices"][0]["finish_reason"], o["usage"]) for o in outs[:1]]
        assert llm.input_ids.tolist() == ref.input_ids.tolist()
        # the cache still serves: a prefix of the prompt, then another prompt, as llama_cpp answers them
        for p in (prompt[:200], ref.tokenize(b"class A:")):
            assert llm.create_completion(p, max_tokens=8, temperature=0)["choices"][0]["text"] == \
                ref.create_completion(p, max_tokens=8, temperature=0)["choices"][0]["text"]
    finally:
        llm.close()
        ref.close()


# --------------------------------------------------------------------------- responses without a drafter
def _shape(x):
    """A response with its run-dependent values (ids, timestamps) blanked: keys, types, texts."""
    if isinstance(x, dict):
        return {k: ("*" if k in ("id", "created") else _shape(v)) for k, v in x.items()}
    if isinstance(x, list):
        return [_shape(v) for v in x]
    return x


def test_without_a_drafter_responses_are_llama_cpp_s(pair, plain):
    llm = Llama(str(pair.target), **KW)
    msgs = [{"role": "user", "content": "Write a loop."}]
    try:
        for call in (lambda m: m("def main(", max_tokens=8, temperature=0),
                     lambda m: list(m("def main(", max_tokens=8, temperature=0, stream=True)),
                     lambda m: m.create_chat_completion(msgs, max_tokens=8, temperature=0),
                     lambda m: list(m.create_chat_completion(msgs, max_tokens=8, temperature=0, stream=True))):
            assert _shape(call(llm)) == _shape(call(plain))
    finally:
        llm.close()


def test_with_a_drafter_responses_keep_the_dflash_object(pair):
    llm = Llama(str(pair.target), draft_model_path=str(pair.drafter), **KW)
    try:
        assert llm("def main(", max_tokens=8, temperature=0)["dflash"]["enabled"] is True
        *_, last = llm("def main(", max_tokens=8, temperature=0, stream=True)
        assert last["dflash"]["enabled"] is True and last["usage"]["completion_tokens"] > 0
        chat = llm.create_chat_completion([{"role": "user", "content": "hi"}], max_tokens=8, temperature=0)
        assert chat["dflash"]["enabled"] is True
    finally:
        llm.close()


# --------------------------------------------------------------------------- signatures
def test_public_signatures_are_llama_cpp_s():
    """Every public method of llama_cpp.Llama (and the constructor, ``__call__``) takes the same
    parameters here, in the same order, with the same kinds and defaults; what this class adds is
    keyword-only (a positional call written for llama_cpp means the same here)."""
    import inspect

    P = inspect.Parameter
    checked = []
    for name in sorted(n for n in dir(llama_cpp.Llama) if not n.startswith("_") or n in ("__init__", "__call__")):
        theirs = getattr(llama_cpp.Llama, name)
        if not callable(theirs) or isinstance(theirs, type):
            continue
        try:
            t = [p for p in inspect.signature(theirs).parameters.values() if p.kind is not P.VAR_KEYWORD]
        except (TypeError, ValueError):   # a builtin without a signature
            continue
        o = list(inspect.signature(getattr(Llama, name)).parameters.values())
        assert [(p.name, p.kind, p.default) for p in o[: len(t)]] == [(p.name, p.kind, p.default) for p in t], name
        assert all(p.kind in (P.KEYWORD_ONLY, P.VAR_KEYWORD) for p in o[len(t):]), name
        checked.append(name)
    assert {"__init__", "__call__", "create_completion", "create_chat_completion", "generate",
            "from_pretrained", "tokenize", "embed"} <= set(checked)
