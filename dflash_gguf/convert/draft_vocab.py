"""Reduced draft vocabulary: give the drafter its own LM head over ``N`` chosen tokens plus a ``d2t`` map.

A DFlash drafter normally borrows the target's LM head, so every draft call multiplies each block row
by the whole vocabulary (151,936 rows for Qwen3): on a CPU that head is most of a drafter call. With
``--draft-vocab N`` the drafter GGUF gets

* ``output.weight`` ``[n_embd, N]``: the target's LM-head rows of the N chosen tokens (tied embeddings:
  the ``token_embd`` rows), copied byte for byte, so in the target's own quantization;
* ``d2t`` (I64, ``[N]``): the absolute target token id of each head row.

llama.cpp's dflash graph (``src/models/dflash.cpp``) reads both: it loads ``output.weight`` with
``n_vocab_draft = d2t.ne[0]`` rows and scatters the draft logits back to the full vocabulary through
``d2t`` (the other ids get ``-inf``), before the DFlash argmax and before DFlash2's selector top-k.
The target still verifies over its whole vocabulary, so the output stays the target's: a token the
drafter cannot propose only costs acceptance.

Which tokens (the only thing that matters for acceptance):

* ``--vocab-corpus FILE...``: token frequencies counted over that text with the target's own tokenizer
  (FR-Spec's recipe), ties and unseen tokens ordered by the default below;
* default, offline: the tokenizer's own frequency proxy. A BPE tokenizer (GPT-2 style ``merges`` or
  SentencePiece BPE ``scores`` = minus the merge order) learns merges in order of pair frequency in its
  training corpus, so a token made by an earlier merge is more frequent. A base symbol (byte or single
  character) is at least as frequent as the most frequent merged token that contains it, so it takes
  that token's rank; this matters for SentencePiece, which lists its character alphabet (``▁``, ``e``,
  ``(``...) after all merges, at the highest ids. Byte-fallback pieces come last, except those for
  ASCII characters no piece spells (a SentencePiece vocabulary often has no ``\n`` piece: every newline
  is the byte piece ``<0x0A>``), which come first; unused/padding tokens never;
* always kept: control tokens, the special ids in the GGUF (BOS/EOS/EOT/...), and every token of the
  chat template rendered for an empty conversation (``<|im_start|>``, ``assistant``, ...).

Measured on the demo pair and the scale pairs: see BENCHMARKS.md ("Reduced draft vocabulary").
"""
from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from dflash_gguf import paths
from dflash_gguf.convert.errors import ConvertError, ManifestError, PairError

log = logging.getLogger("dflash_gguf.convert")

# token types (llama.h: LLAMA_TOKEN_TYPE_*)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
# "auto" keeps the full head below this vocabulary size and uses AUTO_SIZE rows above it (BENCHMARKS.md)
AUTO_MIN_VOCAB = 65536
AUTO_SIZE = 32768
SPECIAL_KEYS = ("bos_token_id", "eos_token_id", "eot_token_id", "eom_token_id", "sep_token_id", "cls_token_id",
                "padding_token_id", "fim_pre_token_id", "fim_suf_token_id", "fim_mid_token_id")


@dataclass
class Vocab:
    """The tokenizer as stored in a GGUF (``tokenizer.ggml.*``)."""
    model: str
    tokens: list[str]
    types: np.ndarray
    scores: np.ndarray | None
    merges: list[str] | None
    special: dict[str, int]
    chat_template: str | None
    path: Path | None = None

    @property
    def n_vocab(self) -> int:
        return len(self.tokens)


@dataclass
class Choice:
    """The chosen draft vocabulary and how it was chosen (recorded in ``pair.json``)."""
    ids: np.ndarray                       # sorted absolute target ids, int64
    n_vocab: int
    method: str                           # "tokenizer-rank" | "corpus"
    n_required: int
    corpus: list[dict] = field(default_factory=list)
    corpus_tokens: int = 0
    corpus_coverage: float | None = None  # share of corpus tokens that are in the chosen set

    def manifest(self, head_type: str | None = None, head_source: str | None = None) -> dict:
        d = {"size": int(len(self.ids)), "of": self.n_vocab, "method": self.method,
             "required_tokens": self.n_required,
             "ids_sha256": hashlib.sha256(self.ids.astype("<i8").tobytes()).hexdigest()}
        if self.corpus:
            d.update(corpus=self.corpus, corpus_tokens=self.corpus_tokens,
                     corpus_coverage=None if self.corpus_coverage is None else round(self.corpus_coverage, 4))
        if head_type:
            d["head_type"] = head_type
        if head_source:
            d["head_rows_from"] = head_source
        return d


def _gguf():
    try:
        return paths.import_gguf()
    except ImportError as e:
        raise ConvertError(str(e)) from e


def read_vocab(path: str | os.PathLike) -> Vocab:
    """Read the tokenizer of a GGUF file (memory-mapped; no tensor data is read)."""
    gguf = _gguf()
    r = gguf.GGUFReader(str(path))

    def get(key, default=None):
        f = r.fields.get(key)
        return default if f is None else f.contents()

    tokens = get("tokenizer.ggml.tokens")
    if not tokens:
        raise PairError(f"{path} has no tokenizer (tokenizer.ggml.tokens): cannot choose a draft vocabulary")
    types = np.asarray(get("tokenizer.ggml.token_type", [NORMAL] * len(tokens)), dtype=np.int64)
    scores = get("tokenizer.ggml.scores")
    special = {k: int(get(f"tokenizer.ggml.{k}")) for k in SPECIAL_KEYS if get(f"tokenizer.ggml.{k}") is not None}
    return Vocab(model=str(get("tokenizer.ggml.model", "?")), tokens=list(tokens), types=types,
                 scores=None if scores is None else np.asarray(scores, dtype=np.float64),
                 merges=get("tokenizer.ggml.merges"), special=special,
                 chat_template=get("tokenizer.chat_template"), path=Path(path))


# ------------------------------------------------------------------ ranking
def tokenizer_rank(v: Vocab) -> np.ndarray:
    """Rank key per token (lower = more frequent by the tokenizer's own evidence; inf = never chosen)."""
    n = v.n_vocab
    rank = np.full(n, np.inf)
    normal = v.types == NORMAL
    if v.merges:                                   # GPT-2 style BPE: merge i makes token left+right
        index = {t: i for i, t in enumerate(v.tokens)}
        for i, m in enumerate(v.merges):
            j = index.get(m.replace(" ", "", 1))
            if j is not None and rank[j] == np.inf:
                rank[j] = i
    elif v.scores is not None:                     # SentencePiece: higher score = earlier merge / likelier
        rank[normal] = -v.scores[normal]
    else:                                          # no evidence at all: the id order
        rank[normal] = np.arange(n)[normal]
    # a base symbol is at least as frequent as the most frequent merged token containing it
    single = {t: i for i, t in enumerate(v.tokens) if normal[i] and len(t) == 1}
    if single:
        order = np.argsort(rank, kind="stable")
        seen: set[str] = set()
        for j in order:
            if not np.isfinite(rank[j]) or len(v.tokens[j]) < 2:
                continue
            for ch in v.tokens[j]:
                if ch not in seen and ch in single:
                    seen.add(ch)
                    rank[single[ch]] = min(rank[single[ch]], rank[j] - 0.5)
            if len(seen) == len(single):
                break
    finite = rank[np.isfinite(rank)]
    top = (finite.max() + 1) if len(finite) else 0.0
    low = (finite.min() - 1) if len(finite) else 0.0
    byte = v.types == BYTE                        # fallback pieces: after every normal token, in id order,
    rank[byte] = top + np.arange(n)[byte]
    for j in np.nonzero(byte)[0]:                 # except common ASCII the pieces cannot spell ('\n' in a
        m = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", v.tokens[j])   # SentencePiece vocabulary): first
        if m:
            ch = chr(int(m.group(1), 16))
            if (ch in "\t\n\r" or " " <= ch <= "~") and ch not in single and ("▁" if ch == " " else ch) not in single:
                rank[j] = low
    return rank


def required_ids(v: Vocab, extra: list[int] | None = None) -> np.ndarray:
    """Ids the draft head always keeps: control tokens, special ids, the chat template's tokens."""
    req = set(np.nonzero(v.types == CONTROL)[0].tolist())
    req |= {i for i in v.special.values() if 0 <= i < v.n_vocab}
    req |= set(template_ids(v))
    req |= {i for i in (extra or []) if 0 <= i < v.n_vocab}
    return np.array(sorted(req), dtype=np.int64)


def template_ids(v: Vocab) -> list[int]:
    """Tokens of the chat template rendered for an empty system/user/assistant exchange."""
    if not v.chat_template or v.path is None:
        return []
    try:
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        return []
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, undefined=jinja2.Undefined)

    def raise_exception(msg):
        raise jinja2.TemplateError(msg)

    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: "")
    texts = []
    msgs = [{"role": "system", "content": ""}, {"role": "user", "content": ""},
            {"role": "assistant", "content": ""}, {"role": "user", "content": ""}]
    for kw in ({}, {"enable_thinking": False}):
        try:
            texts.append(env.from_string(v.chat_template).render(messages=msgs, add_generation_prompt=True,
                                                                  bos_token="", eos_token="", **kw))
        except Exception as e:  # noqa: BLE001 - an unusual template only loses this refinement
            log.debug("chat template not rendered (%s)", e)
    if not texts:
        log.warning("the chat template could not be rendered: only control and special tokens are forced "
                    "into the draft vocabulary")
        return []
    ids: list[int] = []
    with VocabTokenizer(v.path) as tok:
        for t in texts:
            ids += tok.tokenize(t.encode("utf-8"), special=True)
    return ids


class VocabTokenizer:
    """The target's own tokenizer (llama.cpp, vocabulary only; no weights are loaded)."""

    def __init__(self, path: Path):
        from dflash_gguf.native.llama import llama_low as C

        self.C = C
        p = C.llama_model_default_params()
        p.vocab_only = True
        self.model = C.llama_model_load_from_file(str(path).encode(), p)
        if not self.model:
            raise PairError(f"llama.cpp could not read the tokenizer of {path}")
        self.vocab = C.llama_model_get_vocab(self.model)

    def tokenize(self, text: bytes, special: bool = False) -> list[int]:
        import ctypes

        n_max = len(text) + 16
        buf = (ctypes.c_int32 * n_max)()
        n = self.C.llama_tokenize(self.vocab, text, len(text), buf, n_max, False, special)
        if n < 0:
            buf = (ctypes.c_int32 * -n)()
            n = self.C.llama_tokenize(self.vocab, text, len(text), buf, -n, False, special)
        return list(buf[:n])

    def close(self) -> None:
        if self.model:
            self.C.llama_model_free(self.model)
            self.model = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def corpus_counts(v: Vocab, files: list[str | os.PathLike], chunk: int = 1 << 20) -> tuple[np.ndarray, list[dict]]:
    """Token counts over the corpus files (tokenized by the target's tokenizer, no special parsing)."""
    counts = np.zeros(v.n_vocab, dtype=np.int64)
    info = []
    paths = [Path(f).expanduser() for f in files]
    for p in paths:
        if not p.is_file():
            raise PairError(f"--vocab-corpus {p}: no such file")
        if p.stat().st_size == 0:
            raise PairError(f"--vocab-corpus {p} is empty")
    with VocabTokenizer(v.path) as tok:
        for p in paths:
            data = p.read_bytes()
            h = hashlib.sha256(data).hexdigest()
            n = 0
            start = 0
            while start < len(data):      # cut at a newline so pieces do not straddle chunks much
                end = len(data) if start + chunk >= len(data) else (data.rfind(b"\n", start, start + chunk) + 1 or start + chunk)
                ids = tok.tokenize(data[start:end])
                if ids:
                    counts += np.bincount(np.asarray(ids), minlength=v.n_vocab)[:v.n_vocab]
                n += len(ids)
                start = end
            if n == 0:
                raise PairError(f"--vocab-corpus {p} holds no text the tokenizer turns into tokens")
            info.append({"file": p.name, "sha256": h, "bytes": len(data), "tokens": n})
    return counts, info


# A calibration text present wherever the converter runs: Python's standard library - the English of
# Python's documentation (pydoc_data/topics.py) and a spread of modules (code, comments, docstrings).
# Measured as a default on the demo pair and not chosen (BENCHMARKS.md): the tokenizer's merge order,
# learnt on the model's own training text, kept as much acceptance from N = 1024 up.
BUILTIN_CORPUS = ("pydoc_data/topics.py", "argparse.py", "textwrap.py", "dataclasses.py", "functools.py",
                  "json/encoder.py", "pathlib.py", "shutil.py", "subprocess.py", "logging/__init__.py",
                  "collections/__init__.py", "inspect.py", "typing.py", "tempfile.py", "csv.py", "email/message.py",
                  "http/client.py", "unittest/case.py", "asyncio/base_events.py", "enum.py", "statistics.py",
                  "datetime.py", "difflib.py")


def builtin_corpus() -> list[Path]:
    """The default calibration files that exist on this machine (may be empty)."""
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    return [root / n for n in BUILTIN_CORPUS if (root / n).is_file()]


def parse_size(value: str | int | None) -> str | int | None:
    """``--draft-vocab`` value: an integer N, ``auto`` or ``off`` (clear error otherwise)."""
    if value is None or isinstance(value, int):
        return value
    s = str(value).strip().lower()
    if s in ("auto", "off"):
        return s
    if not re.fullmatch(r"\d+", s):
        raise PairError(f"--draft-vocab takes a number of tokens, 'auto' or 'off', got {value!r}")
    return int(s)


def precheck(size: str | int | None, corpus: list[str | os.PathLike] | None, n_vocab: int,
             min_size: int = 1) -> int | None:
    """Validate ``--draft-vocab`` / ``--vocab-corpus`` before any heavy work; returns the head size."""
    size = parse_size(size)
    n = resolve_size(size, n_vocab)
    if corpus and n is None:
        raise PairError("--vocab-corpus chooses the tokens of a reduced head: pass --draft-vocab N with it"
                        + (f" (auto keeps the full head for a vocabulary of {n_vocab} tokens)" if size == "auto" else ""))
    if n is not None and n < min_size:
        raise PairError(f"--draft-vocab {n} is below the minimum of {min_size} for this drafter "
                        "(a DFlash2 selector needs at least selector_top_k candidates)")
    for f in corpus or []:
        p = Path(f).expanduser()
        if not p.is_file():
            raise PairError(f"--vocab-corpus {p}: no such file")
        if p.stat().st_size == 0:
            raise PairError(f"--vocab-corpus {p} is empty")
    return n


def resolve_size(size: str | int | None, n_vocab: int) -> int | None:
    """The head size for ``size`` on a vocabulary of ``n_vocab`` tokens (None = full head)."""
    if size in (None, "off"):
        return None
    if size == "auto":
        return AUTO_SIZE if n_vocab >= AUTO_MIN_VOCAB else None
    n = int(size)
    if n < 1:
        raise PairError(f"--draft-vocab must be at least 1, got {n} (use 'off' for the full head)")
    if n >= n_vocab:
        raise PairError(f"--draft-vocab {n} is not smaller than the target vocabulary ({n_vocab} tokens): "
                        "leave it out (or 'off') to keep the full head")
    return n


def choose(v: Vocab, n: int, corpus: list[str | os.PathLike] | None = None, *, min_size: int = 1,
           extra_required: list[int] | None = None, builtin: bool = False) -> Choice:
    """Choose ``n`` token ids for the draft head (see the module docstring).

    ``corpus`` files count first; without them, ``builtin=True`` counts over :func:`builtin_corpus`,
    and otherwise only the tokenizer's own rank decides."""
    label = "corpus"
    if not corpus and builtin:
        corpus, label = builtin_corpus(), "builtin-corpus"
    if n >= v.n_vocab:
        raise PairError(f"--draft-vocab {n} is not smaller than the target vocabulary ({v.n_vocab} tokens)")
    if n < min_size:
        raise PairError(f"--draft-vocab {n} is below the minimum of {min_size} for this drafter "
                        "(a DFlash2 selector needs at least selector_top_k candidates)")
    req = required_ids(v, extra_required)
    if len(req) > n:
        raise PairError(f"--draft-vocab {n} is smaller than the {len(req)} tokens the head must keep (control and "
                        f"special tokens, the chat template's tokens): use at least {len(req)}")
    rank = tokenizer_rank(v)
    method, info, total, counts = "tokenizer-rank", [], 0, None
    if corpus:
        counts, info = corpus_counts(v, corpus)
        total = int(counts.sum())
        order = np.lexsort((rank, -counts))       # by count, then by the tokenizer's rank
        method = label
        seen = int((counts > 0).sum())
        if seen < n - len(req):
            log.info("the corpus uses %d distinct tokens; the other %d rows follow the tokenizer's ranking",
                     seen, n - len(req) - seen)
    else:
        order = np.argsort(rank, kind="stable")
    chosen = set(req.tolist())
    for j in order:
        if len(chosen) >= n:
            break
        if np.isfinite(rank[j]) or (counts is not None and counts[j] > 0 and v.types[j] != UNUSED):
            chosen.add(int(j))
    if len(chosen) < n:
        raise PairError(f"--draft-vocab {n}: the vocabulary has only {len(chosen)} tokens a drafter can propose")
    ids = np.array(sorted(chosen), dtype=np.int64)
    cov = float(counts[ids].sum() / total) if counts is not None and total else None
    return Choice(ids=ids, n_vocab=v.n_vocab, method=method, n_required=len(req), corpus=info,
                  corpus_tokens=total, corpus_coverage=cov)


# ------------------------------------------------------------------ writing the head
HEAD_TENSORS = ("output.weight", "token_embd.weight")


def _kv_copy(reader, writer, skip: set[str]) -> None:
    gguf = _gguf()
    for f in reader.fields.values():
        if f.name == gguf.Keys.General.ARCHITECTURE or f.name.startswith("GGUF.") or f.name in skip:
            continue
        vt = f.types[0]
        sub = f.types[-1] if vt == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(f.name, f.contents(), vt, sub_type=sub)


def head_rows_source(drafter_reader, target_reader):
    """The LM head the drafter uses today: its own full head if it has one, else the target's."""
    for reader, who in ((drafter_reader, "drafter"), (target_reader, "target")):
        if reader is drafter_reader and any(t.name == "d2t" for t in reader.tensors):
            continue   # a reduced head is replaced from the target's full head
        for name in HEAD_TENSORS:
            for t in reader.tensors:
                if t.name == name:
                    return t, f"{who} {name}"
    raise PairError("neither the drafter nor the target has an LM head (output.weight / token_embd.weight)")


def write_reduced_drafter(drafter: str | os.PathLike, target: str | os.PathLike, ids: np.ndarray,
                          out: str | os.PathLike) -> tuple[str, str]:
    """Write a copy of ``drafter`` with its own head over ``ids`` and the ``d2t`` map; returns (type, source).

    An existing reduced head (``d2t`` and its ``output.weight``) is replaced. Rows are copied byte for
    byte from the head the drafter would otherwise use, so they keep that tensor's quantization.
    """
    gguf = _gguf()
    dr = gguf.GGUFReader(str(drafter))
    tr = gguf.GGUFReader(str(target))
    arch = dr.fields["general.architecture"].contents()
    if arch != "dflash":
        raise PairError(f"{drafter} is a {arch!r} model, not a DFlash drafter")
    head, source = head_rows_source(dr, tr)
    n_vocab = int(head.shape[-1])          # ne[1] = rows
    ids = np.asarray(ids, dtype=np.int64)
    if ids.ndim != 1 or len(ids) == 0 or ids.min() < 0 or ids.max() >= n_vocab or len(np.unique(ids)) != len(ids):
        raise PairError(f"draft vocabulary ids must be distinct and within 0..{n_vocab - 1}")
    rows = np.ascontiguousarray(head.data[ids])           # [N, row bytes or n_embd]
    had_d2t = any(t.name == "d2t" for t in dr.tensors)
    out = Path(out)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    w = gguf.GGUFWriter(str(tmp), arch)
    try:
        _kv_copy(dr, w, skip=set())
        keep = [t for t in dr.tensors if t.name != "d2t" and not (had_d2t and t.name == "output.weight")]
        for t in keep:
            w.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
        w.add_tensor_info("output.weight", rows.shape, rows.dtype, rows.nbytes, head.tensor_type)
        w.add_tensor_info("d2t", ids.shape, ids.dtype, ids.nbytes, gguf.GGMLQuantizationType.I64)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for t in keep:
            w.write_tensor_data(t.data, tensor_endianess=dr.endianess)
        w.write_tensor_data(rows)
        w.write_tensor_data(ids)
        w.close()
        os.replace(tmp, out)
    except BaseException:
        w.close()
        tmp.unlink(missing_ok=True)
        raise
    return head.tensor_type.name, source


def draft_vocab_size(drafter: str | os.PathLike) -> int | None:
    """Rows of the drafter's own reduced head (``d2t`` length), or None for the full shared head."""
    gguf = _gguf()
    r = gguf.GGUFReader(str(drafter))
    for t in r.tensors:
        if t.name == "d2t":
            return int(t.shape[0])
    return None


def _selector_top_k(drafter: Path) -> int:
    gguf = _gguf()
    f = gguf.GGUFReader(str(drafter)).fields.get("dflash.selector_top_k")
    return int(f.contents()) if f is not None else 1


def apply(drafter: Path, target: Path, size: str | int | None, corpus: list[str | os.PathLike] | None = None) -> dict:
    """Give ``drafter`` (rewritten in place) a reduced head; returns the ``pair.json`` record."""
    v = read_vocab(target)
    n = resolve_size(size, v.n_vocab)
    if n is None:
        if corpus:
            raise PairError("--vocab-corpus needs a reduced head: pass --draft-vocab N")
        why = "off" if size in (None, "off") else f"auto: vocabulary of {v.n_vocab} < {AUTO_MIN_VOCAB} tokens"
        return {"size": None, "of": v.n_vocab, "why": why}
    c = choose(v, n, corpus, min_size=_selector_top_k(drafter))
    qtype, source = write_reduced_drafter(drafter, target, c.ids, drafter)
    log.info("draft head: %d of %d tokens (%s%s), rows from the %s (%s)", n, v.n_vocab, c.method,
             f", corpus coverage {c.corpus_coverage:.1%}" if c.corpus_coverage is not None else "", source, qtype)
    return c.manifest(qtype, source)


def check_manifest(pair, drafter_path: Path) -> str | None:
    """A problem between ``pair.json``'s ``draft_vocab`` and the drafter GGUF, or None."""
    rec = pair.data.get("draft_vocab") or {}
    want = rec.get("size")
    got = draft_vocab_size(drafter_path)
    if want != got:
        return (f"drafter GGUF draft head has {got or 'the full'} rows, pair.json says {want or 'the full vocabulary'}: "
                "the files do not belong together")
    return None


# ------------------------------------------------------------------ existing pairs
def reduce_pair(pair_dir: str | os.PathLike, size: str | int, corpus: list[str | os.PathLike] | None = None,
                out_dir: str | os.PathLike | None = None) -> Path:
    """Add (or replace) a reduced draft head on a converted pair; writes ``out_dir`` (default: in place)."""
    from dflash_gguf.convert import manifest as mf

    m = mf.load_manifest(pair_dir)
    src = m.dir
    dst = Path(out_dir).expanduser().absolute() if out_dir else src
    if dst != src:
        if dst.exists() and any(dst.iterdir()):
            raise PairError(f"output directory {dst} exists and is not empty")
        dst.mkdir(parents=True, exist_ok=True)
        for f in (m.target.path, ):
            _link_or_copy(f, dst / f.name)
        shutil.copy2(m.drafter.path, dst / m.drafter.path.name)
    drafter = dst / m.drafter.path.name
    try:
        rec = apply(drafter, dst / m.target.path.name, size, corpus)
    except BaseException:
        if dst != src:
            shutil.rmtree(dst, ignore_errors=True)
        raise
    doc = dict(m.data)
    doc["drafter"] = mf.file_entry(drafter, m.drafter.type, **{k: v for k, v in m.data["drafter"].items()
                                                                 if k not in ("file", "size", "sha256", "type")})
    doc["draft_vocab"] = rec
    mf.write_manifest(dst, doc)
    return dst


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def main(argv: list[str] | None = None) -> int:
    """``python -m dflash_gguf.convert.draft_vocab PAIR_DIR --draft-vocab N [--vocab-corpus F...] [-o OUT]``."""
    import argparse
    import sys

    ap = argparse.ArgumentParser(prog="python -m dflash_gguf.convert.draft_vocab",
                                 description="Add a reduced draft head (own LM head over N tokens + d2t) to a "
                                             "converted pair.")
    ap.add_argument("pair", help="converted pair directory (pair.json)")
    ap.add_argument("--draft-vocab", required=True, help="head rows N, 'auto' or 'off'")
    ap.add_argument("--vocab-corpus", nargs="+", metavar="FILE", help="count token frequencies over these files")
    ap.add_argument("-o", "--out", help="write a new pair directory (target hard-linked) instead of in place")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
    try:
        size = parse_size(args.draft_vocab)
        if size == "off":
            raise PairError("--draft-vocab off: nothing to add (convert the pair again for a full head)")
        out = reduce_pair(args.pair, size, args.vocab_corpus, args.out)
    except (PairError, ManifestError, ConvertError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"draft head written: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
