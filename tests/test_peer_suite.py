"""llama-cpp-python 0.3.36's own test suite, run against ``dflash_gguf.Llama``.

The suite's ``tests/test_llama*.py`` are read from the pinned sdist the build keeps in its cache
(``~/.cache/dflash-gguf/sdist``), extracted to a temporary folder and loaded as modules whose
``llama_cpp`` is llama_cpp itself except for ``Llama``: that is the class under test, in two
variants, ``plain`` (``dflash_gguf.Llama`` without a drafter) and ``dflash`` (with the drafter
converted for the target the test opens, so generations run the DFlash loop). Nothing else of
llama_cpp is replaced, and the peer modules' own functions run unchanged (but for their thread count:
see ``THREADS``).

The suite downloads five models from the Hugging Face Hub; here its model fixtures are replaced by
local ones of the same kind (``tests/tiny.py``, ``tests/peer_models.py``): Qwen3.5 -> the tiny
``qwen35`` hybrid, the Llama story model -> the tiny ``llama`` target, Falcon-H1 -> the tiny
``qwen3next`` hybrid, Mamba -> a tiny Mamba, bge-small -> a tiny BERT with bge's tokenizer. The
vocab-only GGUF it opens ships in the sdist and is used as it is (its exact token ids hold).

The three tests that assert Qwen3.5-0.8B's exact output are the exceptions: ``test_real_llama`` and
``test_real_llama_repeated_prompt_cache`` run here in a differential form (the same calls on
``llama_cpp.Llama`` and on the class under test, on the same local model, must answer the same), and
``test_real_model`` is skipped (it builds no ``Llama``: only ``llama_cpp._internals`` objects).

Run it alone: ``python -m pytest -q tests/test_peer_suite.py``.
"""
from __future__ import annotations

import atexit
import importlib.util
import shutil
import tarfile
import tempfile
import types
from pathlib import Path

import llama_cpp
import pytest

import peer_models
from dflash_gguf import Llama, paths
from dflash_gguf.build.native import SDIST_FILE, SDIST_VERSION

pytestmark = pytest.mark.slow

pytest.importorskip("scipy", reason="the peer suite imports scipy (llama-cpp-python's [test] extra)")
pytest.importorskip("huggingface_hub", reason="the peer suite imports huggingface_hub (llama-cpp-python's [test] extra)")

SDIST = paths.cache_dir() / "sdist" / SDIST_FILE
if not SDIST.is_file():
    pytest.skip(f"{SDIST} is not in the build cache: `python -m dflash_gguf.build` fetches it (make test does)",
                allow_module_level=True)

# The suite gives llama.cpp one thread per CPU. On the 2-core machines this project is tested on,
# beside other work, llama.cpp's spinning thread pool then slows the run several-fold, so its
# ``multiprocessing.cpu_count()`` answers this (no result depends on the thread count).
THREADS = 1
PEER_FILES = ("test_llama.py", "test_llama_chat_format.py", "test_llama_grammar.py", "test_llama_speculative.py")
VOCAB = "vendor/llama.cpp/models/ggml-vocab-llama-spm.gguf"
# every test function of the pinned suite, so that a test added or renamed there is noticed here
PEER_TESTS = {
    "test_llama.py": {
        "test_llama_cpp_version", "test_llama_cpp_tokenization", "test_real_model", "test_real_llama",
        "test_real_llama_repeated_prompt_cache", "test_recurrent_model_prompt_cache_reset",
        "test_hybrid_model_prompt_cache_reset", "test_exact_cached_prompt_reuse_matches_fresh",
        "test_loaded_exact_cached_prompt_reuse_matches_fresh", "test_ram_cache_exact_prompt_hit_matches_fresh",
        "test_shorter_prompt_prefix_reuse_matches_fresh", "test_real_llama_embeddings"},
    "test_llama_chat_format.py": {"test_mistral_instruct", "test_hf_tokenizer_config_str_to_chat_formatter"},
    "test_llama_grammar.py": {"test_grammar_from_string", "test_composed_pydantic_grammar", "test_grammar_anyof"},
    "test_llama_speculative.py": {"test_find_candidate_pred_tokens"},
}
REPLACED = {"test_real_model", "test_real_llama", "test_real_llama_repeated_prompt_cache"}   # defined below
# the tests that open a Llama: run once per variant
VARIANT_TESTS = PEER_TESTS["test_llama.py"] - {"test_llama_cpp_version", "test_real_model"}

# why the dflash variant does not run on a model (the plain variant does)
NO_DRAFTER = {
    "vocab": "a vocab-only GGUF has no weights: there is no target to draft for",
    "llama_cpp_recurrent_model_path": "no DFlash drafter can serve a Mamba target: llama.cpp's mamba graph "
                                      "exposes none of the target-layer taps a drafter reads (src/models/mamba.cpp)",
    "llama_cpp_embedding_model_path": "an encoder-only embedding model (BERT) generates nothing, so there is "
                                      "nothing to draft; no DFlash drafter exists for it",
}


def _extract() -> Path:
    """The peer test files and the vocab GGUF they open, from the sdist, in a temporary folder."""
    tmp = Path(tempfile.mkdtemp(prefix="llama-cpp-peer-"))
    atexit.register(shutil.rmtree, tmp, True)
    root = f"llama_cpp_python-{SDIST_VERSION}/"
    want = {root + "tests/" + f: tmp / f for f in PEER_FILES} | {root + VOCAB: tmp / Path(VOCAB).name}
    with tarfile.open(SDIST) as tf:
        for m in tf:
            if m.name in want:
                want.pop(m.name).write_bytes(tf.extractfile(m).read())
            if not want:
                break
    assert not want, f"{SDIST} lacks {sorted(want)}"
    return tmp


class PeerLlamaCpp(types.ModuleType):
    """``llama_cpp`` as the peer modules see it: llama_cpp's attributes, but ``Llama`` is the class under test."""

    def __init__(self) -> None:
        super().__init__("llama_cpp")
        self.Llama = Llama

    def __getattr__(self, name: str):
        return getattr(llama_cpp, name)


def _no_hub(*args, **kwargs):
    raise AssertionError(f"the peer suite tried to download {args} {kwargs}: its fixtures are replaced by local ones")


PEER_DIR = _extract()
PEER_LLAMA_CPP = PeerLlamaCpp()


def _load(name: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(f"llama_cpp_peer_{Path(name).stem}", PEER_DIR / name)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    if hasattr(mod, "llama_cpp"):
        mod.llama_cpp = PEER_LLAMA_CPP
    if hasattr(mod, "hf_hub_download"):
        mod.hf_hub_download = _no_hub
    if hasattr(mod, "multiprocessing"):
        mod.multiprocessing = types.SimpleNamespace(cpu_count=lambda: THREADS)
    if hasattr(mod, "MODEL"):
        assert mod.MODEL == "./" + VOCAB, mod.MODEL
        mod.MODEL = str(PEER_DIR / Path(VOCAB).name)
    return mod


PEER = {name: _load(name) for name in PEER_FILES}
for _name, _mod in PEER.items():
    _found = {k for k, v in vars(_mod).items() if k.startswith("test_") and callable(v)}
    assert _found == PEER_TESTS[_name], f"{_name}: the pinned suite's tests changed: {_found ^ PEER_TESTS[_name]}"
    globals().update({k: getattr(_mod, k) for k in _found - REPLACED})


# --------------------------------------------------------------------------- the class under test
class DraftedLlama(Llama):
    """``dflash_gguf.Llama`` opened with the drafter of the target it is given (the peer tests name
    only the target), the speed gate off: the random drafters are rarely right, and the gate would soon
    decode plainly, so every step drafts a full block that the target verifies and rolls back. Keeps
    the statistics of the generations the DFlash loop served."""

    drafters: dict[str, str] = {}
    served: list = []     # the GenerationStats of the generations the DFlash loop served

    def __init__(self, model_path, *args, **kwargs):
        drafter = self.drafters.get(str(model_path))
        assert drafter is not None, f"no drafter for {model_path}: the dflash variant must skip this model"
        kwargs.setdefault("draft_model_path", drafter)
        kwargs.setdefault("draft_adaptive", False)   # full blocks every step: drafting, verifying, rolling back
        super().__init__(model_path, *args, **kwargs)

    def generate(self, *args, **kwargs):
        gen = super().generate(*args, **kwargs)
        if self.last_dflash_stats is not None:
            DraftedLlama.served.append(self.last_dflash_stats)
        return gen


VARIANTS = {"plain": Llama, "dflash": DraftedLlama}


def pytest_generate_tests(metafunc):
    if metafunc.function.__name__ in VARIANT_TESTS:
        metafunc.parametrize("peer_llama", list(VARIANTS), indirect=True)


def _model_of(request) -> str | None:
    """Which of the suite's models a test opens (the fixture name, or "vocab")."""
    params = getattr(request.node, "callspec", None)
    fixture = params.params.get("model_path_fixture") if params else None
    if fixture:
        return fixture
    if request.node.originalname == "test_llama_cpp_tokenization":
        return "vocab"
    return next((f for f in request.fixturenames if f.startswith("llama_cpp_") and f.endswith("_path")), None)


@pytest.fixture(autouse=True)
def peer_llama(request):
    """The variant of the class under test that the peer modules' ``llama_cpp.Llama`` is during a test.
    The dflash variant must have served its generations in the DFlash loop, and drafted in one of them
    where one gave more than a token (a generation's first token comes with the prompt's pass, which drafts
    nothing: a test of one-token completions drafts nowhere)."""
    variant = getattr(request, "param", "plain")
    model = _model_of(request)
    if variant == "dflash" and model in NO_DRAFTER:
        pytest.skip(NO_DRAFTER[model])
    PEER_LLAMA_CPP.Llama = VARIANTS[variant]
    DraftedLlama.served = []
    try:
        yield variant
    finally:
        PEER_LLAMA_CPP.Llama = Llama
    if variant == "dflash":
        served = DraftedLlama.served
        assert served, "the dflash variant served nothing in the DFlash loop"
        longer = [st for st in served if st.n_generated > 1]
        assert any(st.drafted for st in longer) or not longer, "the dflash variant drafted nothing"


# --------------------------------------------------------------------------- local models
@pytest.fixture(scope="module")
def qwen35_pair(models):
    p = models.pair("qwen35", "dflash", 8)
    DraftedLlama.drafters[str(p.target)] = str(p.drafter)
    return p


@pytest.fixture
def llama_cpp_model_path(qwen35_pair):
    return str(qwen35_pair.target)


@pytest.fixture(scope="module")
def llama_cpp_transformer_model_path(models):
    p = models.pair("llama", "dflash", 8)
    DraftedLlama.drafters[str(p.target)] = str(p.drafter)
    return str(p.target)


@pytest.fixture(scope="module")
def llama_cpp_hybrid_model_path(models):
    p = models.pair("qwen3next", "dflash", 8)
    DraftedLlama.drafters[str(p.target)] = str(p.drafter)
    return str(p.target)


@pytest.fixture(scope="module")
def llama_cpp_recurrent_model_path(models):
    return str(peer_models.mamba_gguf(models.root, models.tok))


@pytest.fixture(scope="module")
def llama_cpp_embedding_model_path(models):
    return str(peer_models.bert_gguf(models.root))


# --------------------------------------------------------------------------- the exact-output tests
def test_real_model():
    pytest.skip("builds no Llama (only llama_cpp._internals objects, the same for both classes) and asserts "
                "Qwen3.5-0.8B's exact token ids")


def _answer(out: dict, drafted: bool) -> dict:
    """A response as the differential tests compare it: whole, but for its id and timestamp, and for
    the ``dflash`` object a drafter adds (without a drafter there must be none)."""
    return {k: v for k, v in out.items() if k not in ("id", "created") and not (drafted and k == "dflash")}


def _real_llama(cls, path) -> list[dict]:
    """The calls of the peer's ``test_real_llama``, returning the responses whose texts it asserts."""
    model = cls(path, n_ctx=32, n_batch=32, n_ubatch=32, n_threads=THREADS, n_threads_batch=THREADS,
                logits_all=False, flash_attn=True)
    outs = []
    try:
        outs.append(model.create_completion("The quick brown fox jumps over the lazy dog. The quick brown fox",
                                            max_tokens=6, top_k=50, top_p=0.9, temperature=0.0, seed=1337))
        outs.append(model.create_completion(
            "The capital of france is paris, 'true' or 'false'?:\n", max_tokens=4, top_k=50, top_p=0.9,
            temperature=0.8, seed=1337, grammar=llama_cpp.LlamaGrammar.from_string('root ::= "true" | "false"\n')))
        assert outs[-1]["choices"][0]["text"] in ("true", "false")
        tokens = model.tokenize(b"rot", add_bos=True, special=True)

        def logit_processor_func(input_ids, logits):
            for token in tokens:
                logits[token] *= 1000
            return logits

        outs.append(model.create_completion("The capital of france is par", max_tokens=4, top_k=50, top_p=0.9,
                                            temperature=0.8, seed=1337,
                                            logits_processor=llama_cpp.LogitsProcessorList([logit_processor_func])))
        model.set_seed(1337)
        state = model.save_state()
        numbers = llama_cpp.LlamaGrammar.from_string(
            'root ::= "1" | "2" | "3" | "4" | "5" | "6" | "7" | "8" | "9" | "10"\n')
        for i in range(3):
            if i == 2:
                model.load_state(state)
            outs.append(model.create_completion("Pick a number from 1 to 10?:\n", max_tokens=4, top_k=50,
                                                top_p=0.9, temperature=1.0, grammar=numbers))
        picks = [o["choices"][0]["text"] for o in outs[-3:]]
        assert picks[0] == picks[2], picks      # the restored state gives the first pick again
        return [_answer(o, cls is DraftedLlama) for o in outs]
    finally:
        model.close()


def test_real_llama(peer_llama, llama_cpp_model_path):
    want = _real_llama(llama_cpp.Llama, llama_cpp_model_path)
    assert _real_llama(VARIANTS[peer_llama], llama_cpp_model_path) == want


def _repeated_prompt(cls, path) -> list[dict]:
    model = cls(path, n_ctx=32, n_batch=32, n_ubatch=32, n_threads=THREADS, n_threads_batch=THREADS,
                logits_all=False, flash_attn=True, verbose=False)
    try:
        prompt = "The quick brown fox jumps over the lazy dog. The quick brown fox"
        return [_answer(model.create_completion(prompt, max_tokens=6, temperature=0.0, seed=1337),
                        cls is DraftedLlama) for _ in range(2)]
    finally:
        model.close()


def test_real_llama_repeated_prompt_cache(peer_llama, llama_cpp_model_path):
    want = _repeated_prompt(llama_cpp.Llama, llama_cpp_model_path)
    got = _repeated_prompt(VARIANTS[peer_llama], llama_cpp_model_path)
    assert got == want and got[1] == got[0]
