"""Every target architecture the pinned graphs can tap: one list, right rollback, lossless DFlash.

The library's list (``_bindings.tappable_archs``) is checked against the pinned tree's sources, so
it cannot drift when llama.cpp moves. Each tappable architecture gets a tiny random target made by
the pinned library itself (tests/tiny_archs.py) and the tiny Qwen3 drafter (hidden 64, 512
tokens, taps 1 and 3): greedy DFlash must equal plain greedy decoding with the real (random)
drafter, which rejects almost every block, and with an oracle proposer, which makes blocks accept
0..n tokens. The rollback follows what the loaded model says it is (attention: ``seq_rm``;
recurrent or hybrid: recurrent-state snapshots or checkpoints).
"""
from __future__ import annotations

import hashlib
import re
from pathlib import Path

import pytest

import tiny_archs
from dflash_gguf.native import _bindings as B
from dflash_gguf import paths
from dflash_gguf.native import gguf_check
from dflash_gguf.decoding import DFlashDecoder, GenerationStats, OverrideProposer, SpecOptions
from dflash_gguf.native.engine import Context, ContextOptions, Model, check_compatible
from dflash_gguf.errors import UnsupportedError
from support import llama_cpp_greedy
from test_hybrid import PATTERN, oracle

PROMPT = b"def main(argv):\n    parser = argparse.ArgumentParser("
N_GEN = 40
BLOCK = 8
# tappable architectures made and decoded here; the others are named with the reason below
TESTED = ["gpt-oss", "gemma4", "minimax-m2", "qwen3moe", "qwen35moe", "lfm2", "nemotron_h", "nemotron_h_moe",
          "nanbeige", "muse-glimmer", "minimax-01", "mimo2", "hunyuan_vl", "hunyuan-dense", "bailingmoe3", "deepseek4"]
# covered by the other test modules with converted transformers / hand-written checkpoints
ELSEWHERE = {"llama": "tests/test_spec.py", "qwen3": "tests/test_spec.py", "qwen35": "tests/test_hybrid.py",
             "qwen3next": "tests/test_hybrid.py"}


# --------------------------------------------------------------------------- the one list
def _pinned_tappable() -> tuple[set[str], set[str]]:
    """(architectures whose own graph records ``t_layer_inp``, architectures reusing such a graph)
    from the pinned sources: src/models/*.cpp, models.h, llama-model.cpp's factory, llama-arch.cpp."""
    src = paths.upstream_tree() / "src"
    classes = set()
    for f in sorted((src / "models").glob("*.cpp")):
        text = f.read_text()
        if "res->t_layer_inp[" in text:
            classes |= set(re.findall(r"\b(llama_model_\w+)::graph(?:<\w+>)?::", text))
    header = (src / "models" / "models.h").read_text()
    reusing = set()
    for sub, base in re.findall(r"struct (llama_model_\w+) : public (llama_model_\w+) \{", header):
        body = header[header.index(f"struct {sub} :"):]
        body = body[:body.index("\n};")]
        if base in classes and re.search(rf"using graph = {base}::graph\b", body):
            reusing.add(sub)
    factory = (src / "llama-model.cpp").read_text()
    by_class: dict[str, list[str]] = {}
    for cases, cls in re.findall(r"((?:case LLM_ARCH_\w+:\s*)+)return new (llama_model_\w+)\(", factory):
        by_class.setdefault(cls, []).extend(re.findall(r"LLM_ARCH_\w+", cases))
    names = dict(re.findall(r"\{\s*(LLM_ARCH_\w+)\s*,\s*\"([^\"]+)\"\s*\}", (src / "llama-arch.cpp").read_text()))

    def archs(cs):
        return {names[a] for c in cs for a in by_class.get(c, [])}
    return archs(classes), archs(reusing)


# Graphs reused by another architecture's class (``using graph = ...::graph``) record the taps too:
# nemotron_h_moe runs nemotron_h's, hunyuan-dense hunyuan_vl's (both listed); llama-embed is an
# embedding model (no generation, not listed). qwen4exp's graph records its hyper-connection residual
# ([n_embd, hc, n_tokens]) as the layer input, not one row per token: not listed, refused below.
REUSED = {"llama-embed", "nemotron_h_moe", "hunyuan-dense"}
REUSED_UNLISTED = {"llama-embed"}
WIDE_TAP = {"qwen4exp"}


def test_library_list_is_what_the_pinned_graphs_record():
    own, reused = _pinned_tappable()
    lib = B.tappable_archs()
    assert len(lib) == len(set(lib))
    assert reused == REUSED, f"architectures reusing a tapping graph changed: {sorted(reused)}"
    want = (own - WIDE_TAP) | (reused - REUSED_UNLISTED)
    assert set(lib) == want, f"library list and the pinned graphs disagree: {sorted(set(lib) ^ want)}"
    assert set(TESTED) | set(ELSEWHERE) == set(lib)


def _arch_set(fn: str) -> set[str]:
    """The architectures a ``bool fn(const llm_arch & arch)`` switch of llama-arch.cpp returns true for."""
    text = (paths.upstream_tree() / "src" / "llama-arch.cpp").read_text()
    names = dict(re.findall(r"\{\s*(LLM_ARCH_\w+)\s*,\s*\"([^\"]+)\"\s*\}", text))
    body = text[text.index(f"bool {fn}(const llm_arch & arch)"):]
    body = body[:body.index("\n}\n")]
    return {names[a] for a in re.findall(r"case (LLM_ARCH_\w+):", body)}


def test_rollback_kind_per_architecture():
    """The pre-load table of architectures with recurrent layers is llama.cpp's, so the tappable
    hybrids (qwen3next, qwen35, qwen35moe, lfm2, nemotron_h, nemotron_h_moe, bailingmoe3, deepseek4,
    minimax-01) are told apart from the attention-only ones before a file is loaded; after loading
    the decoder asks the model (llama_model_is_recurrent / is_hybrid, checked per arch below)."""
    hybrid = _arch_set("llm_arch_is_hybrid") & set(B.tappable_archs())
    assert hybrid == {"qwen3next", "qwen35", "qwen35moe", "lfm2", "nemotron_h", "nemotron_h_moe", "bailingmoe3",
                      "deepseek4", "minimax-01"}
    assert not _arch_set("llm_arch_is_recurrent") & set(B.tappable_archs())
    assert all(gguf_check.has_recurrent_layers(a) for a in hybrid)
    assert not any(gguf_check.has_recurrent_layers(a) for a in set(B.tappable_archs()) - hybrid)
    # recurrent-state snapshots (rollback in place) where llama.cpp keeps them; host checkpoints otherwise
    assert hybrid - _arch_set("llm_arch_supports_rs_rollback") == {"minimax-01"}


# --------------------------------------------------------------------------- tiny pairs
@pytest.fixture(scope="module")
def drafter(models):
    return models.pair("qwen3", "dflash", BLOCK)


def _archs_dir(models):
    """Where the models of tiny_archs.py are cached: keyed by its source too."""
    key = hashlib.sha256(Path(tiny_archs.__file__).read_bytes()).hexdigest()[:12]
    return models.root / f"archs-{key}"


def _target(models, drafter, arch: str):
    return tiny_archs.make_target(arch, drafter.target, _archs_dir(models) / f"{arch}.gguf")


def _opts(n_rs_seq: int = 0) -> ContextOptions:
    return ContextOptions(n_ctx=256, n_batch=64, n_ubatch=64, n_rs_seq=n_rs_seq, n_threads=1)


def _run(dec, prompt, n):
    st = GenerationStats()
    return list(dec.generate(prompt, n, stop_tokens=[], stats=st)), st


def test_wide_tap_target_is_refused(models, drafter):
    """qwen4exp (its graph records the hyper-connection residual as the layer input) is refused before a
    context is paired, with the list of what is supported."""
    with Model(_target(models, drafter, "qwen4exp")) as tm, Model(drafter.drafter) as dm:
        with pytest.raises(UnsupportedError, match="'qwen4exp' exposes no layer taps; supported: .*gpt-oss"):
            check_compatible(tm, dm)


@pytest.mark.parametrize("arch", TESTED)
def test_greedy_dflash_equals_plain(models, drafter, arch):
    _check_lossless(arch, _target(models, drafter, arch), drafter.drafter)


def test_gpt_oss_from_transformers(models):
    """A transformers GptOssForCausalLM and a DFlash drafter for it go through this project's
    converter (validation included: gpt-oss is accepted from the converter's registry) and run
    losslessly: the path a user of z-lab's gpt-oss drafters takes."""
    from dflash_gguf.convert import convert_pair, load_manifest

    import tiny

    out = _archs_dir(models) / "gpt-oss-pair"
    if not (out / "pair.json").exists():
        t_hf = tiny_archs.make_gpt_oss_hf(_archs_dir(models) / "hf-gpt-oss", models.tok)
        d_hf = tiny.make_drafter(_archs_dir(models) / "hf-gpt-oss-drafter", t_hf, block_size=BLOCK)
        convert_pair(t_hf, d_hf, out, outtype="f32", draft_vocab=None)
    pair = load_manifest(out)
    assert pair.data["target"]["arch"] == "gpt-oss" and pair.data["target"]["hf_architecture"] == "GptOssForCausalLM"
    _check_lossless("gpt-oss", pair.target.path, pair.drafter.path)


def _check_lossless(arch: str, path, drafter_path) -> None:
    tm, dm = Model(path), Model(drafter_path)
    ctxs: list[Context] = []

    def ctx(o, model=tm, other=None):
        c = Context(model, o, other=other)
        ctxs.append(c)
        return c
    try:
        assert tm.arch == arch and tm.n_embd == 64
        hybrid = gguf_check.has_recurrent_layers(arch)
        assert (tm.is_hybrid or tm.is_recurrent) == hybrid
        prompt = tm.tokenize(PROMPT)
        ref = list(DFlashDecoder(ctx(_opts()), None).generate(prompt, N_GEN + BLOCK, stop_tokens=[]))
        assert len(set(ref)) >= 8, f"random {arch} target collapsed into repetition: {ref}"
        assert llama_cpp_greedy(path, prompt, N_GEN) == ref[:N_GEN]
        full = prompt + ref
        if not hybrid:
            modes = [("seq_rm", 0)]
        elif arch in _arch_set("llm_arch_supports_rs_rollback"):
            modes = [("snapshot", BLOCK - 1), ("checkpoint", 0)]
        else:   # llama.cpp keeps no snapshots for it (n_rs_seq clamped to 0): checkpoints only
            modes = [("checkpoint", BLOCK - 1)]
        for mode, n_rs in modes:
            tc = ctx(_opts(n_rs))
            assert tc.n_rs_seq == (n_rs if mode == "snapshot" else 0) or mode == "seq_rm"
            dc = ctx(_opts(), dm, other=tc)
            dec = DFlashDecoder(tc, dc, SpecOptions(rollback=mode))
            assert dec.rollback == mode and DFlashDecoder(tc, dc).rollback == mode   # also the automatic choice
            out, st = _run(dec, prompt, N_GEN)
            assert out == ref[:N_GEN], f"{arch} ({mode}), random drafter"
            assert st.steps > 0
            dec = DFlashDecoder(tc, dc, SpecOptions(rollback=mode), OverrideProposer(oracle(full, PATTERN)))
            out, st = _run(dec, prompt, N_GEN)
            assert out == ref[:N_GEN], f"{arch} ({mode}), oracle proposer"
            assert st.accepted > st.steps and st.accepted_per_pos[-1] > 0     # accepted blocks, full ones too
            assert st.accepted < st.drafted                                     # and rejections
    finally:
        for c in reversed(ctxs):
            c.close()
        dm.close()
        tm.close()


def test_untappable_target_is_refused(models, drafter):
    """qwen2 records no layer inputs (nor does deepseek2, Kimi-K2.5's): the pair is refused, naming the list."""
    path = tiny_archs.make_target("qwen2", drafter.target, _archs_dir(models) / "qwen2.gguf")
    tm, dm = Model(path), Model(drafter.drafter)
    try:
        with pytest.raises(UnsupportedError, match=r"'qwen2' exposes no layer taps; supported: .*gpt-oss"):
            check_compatible(tm, dm)
    finally:
        dm.close()
        tm.close()


# --------------------------------------------------------------------------- converter side
def test_converter_accepts_the_tappable_targets(tmp_path):
    """The converter's Hugging Face architectures follow the same list: every tappable architecture
    has HF names in the pinned converter's registry, and only those validate as targets."""
    import numpy as np
    from safetensors.numpy import save_file

    from dflash_gguf.convert import targets, validate
    from dflash_gguf.convert.errors import PairError
    from dflash_gguf.convert.hf import read_checkpoint

    sup = targets.supported_targets()
    assert set(sup.values()) == set(B.tappable_archs())
    for hf, arch in (("GptOssForCausalLM", "gpt-oss"), ("Gemma4ForConditionalGeneration", "gemma4"),
                     ("Gemma4ForCausalLM", "gemma4"), ("MiniMaxM2ForCausalLM", "minimax-m2"),
                     ("Qwen3_5MoeForConditionalGeneration", "qwen35moe"), ("LlamaForCausalLM", "llama"),
                     ("NemotronHForCausalLM", "nemotron_h"), ("Lfm2ForCausalLM", "lfm2")):
        assert sup[hf] == arch
    assert targets.gguf_arch("DeepseekV2ForCausalLM") == "deepseek2" and "DeepseekV2ForCausalLM" not in sup

    def target(hf_arch):
        d = tmp_path / hf_arch
        d.mkdir()
        (d / "config.json").write_text('{"architectures": ["%s"], "hidden_size": 64}' % hf_arch)
        (d / "tokenizer.json").write_text("{}")
        save_file({"model.norm.weight": np.ones(64, np.float32)}, str(d / "model.safetensors"))
        return read_checkpoint(d, "target")
    assert validate._check_target(target("GptOssForCausalLM")) == "gpt-oss"
    assert validate._check_target(target("MiniMaxM2ForCausalLM")) == "minimax-m2"
    with pytest.raises(PairError, match=r"'deepseek2', whose graph records no layer inputs.*gpt-oss \(GptOssForCausalLM\)"):
        validate._check_target(target("DeepseekV2ForCausalLM"))
    with pytest.raises(PairError, match=r"not one the pinned llama.cpp converter knows.*gemma4 \(Gemma4"):
        validate._check_target(target("NoSuchModelForCausalLM"))
