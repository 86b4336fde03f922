"""The docs match the code: every command README.md, BENCHMARKS.md, its log, bench/README.md and docs/ show
runs a module that exists, with flags that module's --help lists; the defaults docs/memory.md states are
the code's; every relative link and every cited BENCHMARKS section exists; and the README's set-up
commands are the Makefile's targets that CI runs."""
from __future__ import annotations

import inspect
import re
import shlex
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LOG = "BENCHMARKS-LOG.md"   # the dated sections "BENCHMARKS section N" cites
DOCS = ("README.md", "BENCHMARKS.md", LOG, "bench/README.md",
        *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md")))
# `python -m dflash_gguf.X ...` up to the end of a code span / line / comment; `python -m dflash_gguf SUB`
CMD = re.compile(r"python -m (dflash_gguf(?:\.[a-z_]+)*)((?:[^`#\n|]|\\\n)*)")
SUBCOMMANDS = ("demo", "generate", "chat", "serve", "bench", "convert", "complete")


def commands() -> list[tuple[str, int, str, list[str]]]:
    """(doc, line, module or 'dflash_gguf SUB', flags) of every documented command."""
    out = []
    for doc in DOCS:
        text = (ROOT / doc).read_text()
        for m in CMD.finditer(text):
            module, rest = m.group(1), m.group(2).replace("\\\n", " ")
            line = text.count("\n", 0, m.start()) + 1
            try:
                words = shlex.split(rest, comments=False)
            except ValueError:
                words = rest.split()
            if module == "dflash_gguf" and words and words[0] in SUBCOMMANDS:
                module, words = f"dflash_gguf {words[0]}", words[1:]
            flags = sorted({w.split("=")[0] for w in words if re.fullmatch(r"--?[A-Za-z][\w-]*(=.*)?", w)})
            out.append((doc, line, module, flags))
    return out


@lru_cache(maxsize=None)
def help_text(module: str) -> str:
    args = [sys.executable, "-m", *module.split(), "--help"]
    r = subprocess.run(args, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, f"{' '.join(args)} failed:\n{r.stderr[-1500:]}"
    return r.stdout


DOCUMENTED = commands()


def test_the_docs_show_commands():
    assert len(DOCUMENTED) > 40 and {m for _, _, m, _ in DOCUMENTED} >= {
        "dflash_gguf.bench", "dflash_gguf.bench.scale", "dflash_gguf.convert", "dflash_gguf demo"}


@pytest.mark.parametrize("module", sorted({m for _, _, m, _ in DOCUMENTED}))
def test_every_documented_flag_exists(module):
    text = help_text(module)
    listed = set(re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", text))
    wrong = [(doc, line, f) for doc, line, m, flags in DOCUMENTED if m == module for f in flags
             if f not in listed]
    assert not wrong, f"flags the docs give {module} that its --help does not list: {wrong}"


def test_documented_defaults_are_the_codes():
    from dflash_gguf import Llama
    from dflash_gguf.native import memory
    from dflash_gguf.decoding.gate import DraftLength  # (the gate docs/drafters.md describes)

    readme = (ROOT / "docs" / "memory.md").read_text()
    sig = inspect.signature(Llama.__init__).parameters
    # "else 1024 minus the block size": the window the engine derives when draft_window is None and the
    # drafter GGUF has no sliding window of its own (tests/test_drafter_attention.py: one that has)
    assert "else 1024 minus the block size" in " ".join(readme.split())
    from dflash_gguf.native.engine import DEFAULT_DRAFT_CACHE
    assert DEFAULT_DRAFT_CACHE == 1024 and sig["draft_window"].default is None
    # the low-memory preset's "512-cell drafter cache" (window 512 - block: tests/test_api.py checks it)
    assert "512-cell drafter cache" in readme and memory.LOW_MEMORY_DRAFT_CACHE == 512
    assert memory.LOW_MEMORY["n_batch"] == 256 and memory.LOW_MEMORY["n_ubatch"] == 64
    assert "`n_batch` 256 / `n_ubatch` 64" in readme
    gate = " ".join((ROOT / "docs" / "drafters.md").read_text().split())
    assert f"re-planned every {DraftLength.REPLAN_EVERY} steps" in gate
    assert f"while fewer than {DraftLength.FEW_DRAWS} blocks have been drawn" in gate
    assert f"Every {DraftLength.PROBE_EVERY} steps (up to {DraftLength.PROBE_MAX}" in gate


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.M | re.S)
    return {slug(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", text, re.M)}


def links(doc: str) -> list[tuple[int, str]]:
    """(line, target) of every inline link and link definition outside code blocks."""
    text = (ROOT / doc).read_text()
    out = []
    for m in re.finditer(r"^```.*?^```|\]\(([^)\s]+)\)|^\[[^\]]+\]:\s*(\S+)", text, re.M | re.S):
        target = m.group(1) or m.group(2)
        if target:
            out.append((text.count("\n", 0, m.start()) + 1, target))
    return out


@pytest.mark.parametrize("doc", [d for d in DOCS if d != LOG])
def test_every_relative_link_resolves(doc):
    wrong = []
    for line, target in links(doc):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (ROOT / doc).parent / path if path else ROOT / doc
        if not dest.exists():
            wrong.append((line, target, "no such file"))
        elif anchor and anchor not in anchors(dest):
            wrong.append((line, target, "no such heading"))
    assert not wrong, f"{doc}: links that lead nowhere: {wrong}"


def log_sections() -> set[str]:
    return set(re.findall(r"^#{2,3} (\d+[a-z]?)\. ", (ROOT / LOG).read_text(), re.M))


# "BENCHMARKS section 9", "BENCHMARKS.md sections 9, 15 and 16", "(BENCHMARKS 20", "BENCHMARKS sections 31, 32"
CITE = re.compile(r"BENCHMARKS(?:\.md)?`?,?\s+(?:sections?\s+)?(\d+[a-z]?(?:(?:,\s*|\s+and\s+|-)\d+[a-z]?)*)")


@pytest.mark.parametrize("doc", ["README.md", "BENCHMARKS.md", *[d for d in DOCS if d.startswith("docs/")]])
def test_every_cited_benchmarks_section_exists(doc):
    text = " ".join((ROOT / doc).read_text().split())
    cited = {n for m in CITE.finditer(text) for n in re.split(r",\s*|\s+and\s+|-", m.group(1))}
    if doc == "BENCHMARKS.md":   # its table's last column
        cited |= {n for row in re.findall(r"^\|.*\| ([\w, ]+) \|$", (ROOT / doc).read_text(), re.M)
                  for n in re.split(r",\s*", row) if re.fullmatch(r"\d+[a-z]?", n)}
    if doc == "BENCHMARKS.md":
        assert cited, f"{doc} cites no BENCHMARKS section"
    missing = sorted(cited - log_sections())
    assert not missing, f"{doc} cites BENCHMARKS sections that {LOG} does not have: {missing}"


def test_the_readme_sets_up_with_the_commands_ci_runs():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    makefile = (ROOT / "Makefile").read_text()
    # the install commands come first: within the first 200 words, in a shell block
    head = " ".join(readme.split()[:200])
    assert "make demo" in head and "make test" in head
    block = re.search(r"```sh\n(.*?)```", readme, re.S).group(1)
    assert re.search(r"^make demo\b", block, re.M) and re.search(r"^make test\b", block, re.M)
    assert re.search(r"^make test$", ci, re.M), ".ci/run no longer runs `make test`: the README's test command"
    for target in re.findall(r"`make ([a-z][\w-]*)", readme) + ["demo", "test"]:
        assert re.search(rf"^{target}:", makefile, re.M), f"README names `make {target}`, which the Makefile lacks"


def test_every_topic_page_is_linked_from_the_readme():
    linked = {t.partition("#")[0] for _, t in links("README.md")}
    pages = {str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md")}
    assert pages and pages <= linked, f"pages the README does not link: {sorted(pages - linked)}"
