"""Stages 1-2: the standard-library corpus, the SentencePiece tokenizer, token streams."""
from __future__ import annotations

import hashlib
import platform
import random
import sysconfig
import time
from pathlib import Path

import numpy as np

from .common import EXCLUDE_DIRS, MASK_PIECE, log


# ----------------------------------------------------------------------------- 1-2 corpus/tokenizer
def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for f in sorted(root.rglob("*.py")):
        rel = f.relative_to(root).parts
        if any(p in EXCLUDE_DIRS for p in rel) or f.name.startswith("test_") or f.name.endswith("_test.py"):
            continue
        if f.name.startswith("bad"):
            continue
        out.append(f)
    return out


def read_capped(f: Path, cap: int) -> str | None:
    try:
        t = f.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None
    t = t.replace("\r\n", "\n").replace("\t", "    ")
    if len(t) > cap:
        cut = t.rfind("\n", 0, cap)
        t = t[:cut + 1 if cut > 0 else cap]
    return t if len(t) > 200 else None


def is_heldout(f: Path) -> bool:
    rel = f.relative_to(sysconfig.get_paths()["stdlib"]).as_posix()
    return int(hashlib.sha256(rel.encode()).hexdigest(), 16) % 32 == 0


def build_corpus(work: Path, cap: int) -> dict:
    train, val = [], []
    for f in stdlib_files():
        t = read_capped(f, cap)
        if t is not None:
            (val if is_heldout(f) else train).append(t)
    (work / "corpus-train.txt").write_text("\n\x00\n".join(train), encoding="utf-8")
    (work / "corpus-val.txt").write_text("\n\x00\n".join(val), encoding="utf-8")
    info = {"files_train": len(train), "files_val": len(val), "bytes_train": sum(map(len, train)),
            "bytes_val": sum(map(len, val)), "cap_bytes_per_file": cap,
            "stdlib": sysconfig.get_paths()["stdlib"], "python": platform.python_version()}
    log(f"corpus: {info['files_train']} train files ({info['bytes_train'] / 1e6:.2f} MB), "
        f"{info['files_val']} held-out files ({info['bytes_val'] / 1e6:.2f} MB), cap {cap} bytes per file")
    return info


def load_docs(work: Path, split: str) -> list[str]:
    return (work / f"corpus-{split}.txt").read_text(encoding="utf-8").split("\n\x00\n")


def train_tokenizer(work: Path, vocab: int, seed: int) -> Path:
    import sentencepiece as spm

    tok_dir = work / "tokenizer"
    tok_dir.mkdir(exist_ok=True)
    lines = (work / "corpus-train.txt").read_text(encoding="utf-8").split("\n")
    lines = [ln for ln in lines if ln.strip() and ln != "\x00"]
    random.Random(seed).shuffle(lines)
    src = tok_dir / "lines.txt"
    src.write_text("\n".join(lines), encoding="utf-8")
    t0 = time.time()
    spm.SentencePieceTrainer.train(
        input=str(src), model_prefix=str(tok_dir / "tokenizer"), vocab_size=vocab, model_type="bpe",
        byte_fallback=True, normalization_rule_name="identity", remove_extra_whitespaces=False,
        split_digits=True, allow_whitespace_only_pieces=True, control_symbols=[MASK_PIECE],
        bos_id=1, eos_id=2, unk_id=0, pad_id=-1, num_threads=2, minloglevel=2, character_coverage=1.0,
        input_sentence_size=0, max_sentence_length=8192, shuffle_input_sentence=False, seed_sentencepiece_size=200_000)
    src.unlink()
    (tok_dir / "tokenizer.vocab").unlink(missing_ok=True)
    log(f"tokenizer: SentencePiece BPE, vocab {vocab}, trained in {time.time() - t0:.0f} s")
    return tok_dir / "tokenizer.model"


def sp_model(work: Path):
    import sentencepiece as spm

    return spm.SentencePieceProcessor(model_file=str(work / "tokenizer" / "tokenizer.model"))


def encode_split(work: Path, split: str) -> np.ndarray:
    """One token stream: doc tokens separated by EOS (each doc encoded on its own)."""
    cache = work / f"tokens-{split}.npy"
    if cache.exists():
        return np.load(cache)
    sp = sp_model(work)
    out = []
    for d in load_docs(work, split):
        out.extend(sp.encode(d))
        out.append(sp.eos_id())
    arr = np.asarray(out, dtype=np.int32)
    np.save(cache, arr)
    return arr


def line_starts(sp, stream: np.ndarray) -> np.ndarray:
    """Indices of tokens that follow a newline byte token (or an EOS): window start points."""
    nl = sp.piece_to_id("<0x0A>")
    prev = np.concatenate([[sp.eos_id()], stream[:-1]])
    return np.nonzero((prev == nl) | (prev == sp.eos_id()))[0]

