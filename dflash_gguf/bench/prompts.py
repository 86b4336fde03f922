"""Benchmark prompt sets: ``bench/prompts/*.txt`` (``### name`` headers) or the user's own files."""
from __future__ import annotations

from pathlib import Path

PROMPT_SETS = ("code", "math", "prose")
_PKG = Path(__file__).resolve().parent.parent


# --------------------------------------------------------------------------- prompts
def prompts_dir() -> Path | None:
    for cand in (_PKG.parent / "bench" / "prompts", _PKG / "data" / "bench_prompts"):
        if cand.is_dir():
            return cand
    return None


def parse_prompt_file(path: Path) -> list[tuple[str, str]]:
    """``### name`` starts a prompt; its text runs to the next ``### `` line. Trailing blank lines are
    dropped and the text keeps one final newline. Lines before the first header are comments."""
    out, name, buf = [], None, []
    for line in path.read_text(encoding="utf-8").splitlines(keepends=True):
        if line.startswith("### "):
            if name is not None:
                out.append((name, "".join(buf).rstrip() + "\n"))
            name, buf = line[4:].strip(), []
        elif name is not None:
            buf.append(line)
    if name is not None:
        out.append((name, "".join(buf).rstrip() + "\n"))
    return [(n, t) for n, t in out if t.strip()]


def load_prompts(specs: list[str]) -> list[dict]:
    """Prompt sets by name (code, math, prose, all) or prompt files."""
    out = []
    for spec in specs:
        names = PROMPT_SETS if spec == "all" else (spec,)
        for name in names:
            if name in PROMPT_SETS:
                d = prompts_dir()
                if d is None:
                    raise SystemExit("error: the bench/prompts folder is not in this installation; pass prompt files")
                path = d / f"{name}.txt"
            else:
                path = Path(name)
                if not path.is_file():
                    raise SystemExit(f"error: prompt set {name!r} is neither one of {', '.join(PROMPT_SETS)}, all, "
                                     "nor a file")
            for pname, text in parse_prompt_file(path):
                out.append({"set": path.stem, "name": pname, "text": text})
    if not out:
        raise SystemExit("error: no prompts found")
    return out

