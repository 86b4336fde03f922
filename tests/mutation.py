"""Mutation testing of the core's pure logic (``make mutate``, ``make mutate-ci``) with mutmut.

mutmut changes one operator, constant or argument of the code at a time (a "mutant") and runs the
tests that cover it; a mutant no test notices "survives". Every survivor must be either killed by a
test or listed in ``tests/mutation-survivors.txt`` with the reason it cannot change behaviour (an
equivalent mutant). This script runs mutmut for a profile, then fails on any survivor not listed
there, printing its diff; listed survivors that now die are reported so the list stays short.

Profiles (one home for the lists): ``ci`` - the gate, the fallback rule, acceptance, stopping and the
confidence's verify lengths,
against their unit tests (about 3 minutes on 2 cores; ``make test``, so CI, runs it); ``full`` - also
the statistics, the sampler and rollback (``make mutate``, by hand; figures in the README's
development section). Both run unit tests only (no model is loaded), so each mutant takes well
under a second; the model-backed tests check the same code end to end outside mutation testing.

    python tests/mutation.py [ci|full]

mutmut (chosen over cosmic-ray: one command, no session database or worker set-up to manage, runs
only the tests that cover each mutant, and is maintained) works in a scratch folder per profile,
``build/mutate-<profile>/``, so that its copy of the tree and its results never touch the checkout.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SURVIVORS = Path(__file__).with_name("mutation-survivors.txt")
MUTMUT_VERSION = "3.8.1"

CI_MODULES = ["dflash_gguf/decoding/gate.py", "dflash_gguf/decoding/batch_costs.py", "dflash_gguf/requests/served.py",
              "dflash_gguf/decoding/acceptance.py", "dflash_gguf/requests/stopping.py", "dflash_gguf/decoding/confidence.py"]
CI_TESTS = ["tests/test_gate_rules.py", "tests/test_gate.py", "tests/test_gate_decoder.py", "tests/test_fallback.py",
            "tests/test_acceptance.py", "tests/test_stopping.py", "tests/test_confidence.py", "tests/test_requests.py"]
PROFILES = {
    "ci": (CI_MODULES, CI_TESTS),
    "full": (CI_MODULES + ["dflash_gguf/decoding/stats.py", "dflash_gguf/decoding/sampling.py",
                          "dflash_gguf/decoding/rollback.py"],
             CI_TESTS + ["tests/test_stats.py", "tests/test_sampling_rules.py", "tests/test_rollback_rules.py"]),
}


def config(modules: list[str], tests: list[str]) -> str:
    def lst(xs):
        return "[" + ", ".join(f'"{x}"' for x in xs) + "]"
    return (f"[tool.mutmut]\nsource_paths = [\"dflash_gguf/\"]\nonly_mutate = {lst(modules)}\n"
            f"pytest_add_cli_args_test_selection = {lst(tests)}\n"
            f"pytest_add_cli_args = [\"-q\", \"-p\", \"no:cacheprovider\"]\nalso_copy = [\"patches/\"]\n")


def workdir(profile: str) -> Path:
    """A scratch folder holding links to the tree's code, tests and patches and the profile's config."""
    d = ROOT / "build" / f"mutate-{profile}"
    d.mkdir(parents=True, exist_ok=True)
    for name in ("dflash_gguf", "tests", "patches"):
        link = d / name
        if not link.is_symlink():
            if link.exists():
                shutil.rmtree(link)
            link.symlink_to(ROOT / name)
    (d / "pyproject.toml").write_text(config(*PROFILES[profile]))
    return d


def readable(name: str) -> str:
    """``dflash_gguf.decoding.gate.xǁDraftLengthǁchoose__mutmut_12`` -> ``dflash_gguf.decoding.gate.DraftLength.choose``."""
    base = re.sub(r"__mutmut_\d+$", "", name)
    mod, _, fn = base.rpartition(".")
    if fn.startswith("xǁ"):
        fn = ".".join(p for p in fn[2:].split("ǁ") if p)
    elif fn.startswith("x_"):
        fn = fn[2:]
    return f"{mod}.{fn}"


def mutmut(d: Path, *args: str, log=None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(d)}
    exe = Path(sys.executable).with_name("mutmut")
    return subprocess.run([str(exe), *args], cwd=d, env=env, text=True,
                          stdout=log or subprocess.PIPE, stderr=subprocess.STDOUT)


def survivors(d: Path) -> dict[str, str]:
    """{key: diff} of every mutant that survived or that no test covers; the key is the function and
    the mutated line, stable across edits elsewhere in the file."""
    out = mutmut(d, "results").stdout
    found = {}
    for line in out.splitlines():
        m = re.match(r"\s*(\S+): (survived|no tests)$", line)
        if not m:
            continue
        diff = mutmut(d, "show", m.group(1)).stdout
        plus = [ln[1:].strip() for ln in diff.splitlines() if ln.startswith("+") and not ln.startswith("+++")]
        line = plus[0].split("  #")[0].strip() if plus else "?"       # without its comment
        key = f"{readable(m.group(1))}: {line}"
        found[key] = f"{m.group(1)} ({m.group(2)})\n{diff.strip()}"
    return found


def known() -> dict[str, str]:
    """The listed equivalent survivors: ``key  # reason`` lines (blank lines and ``#`` lines ignored)."""
    out = {}
    for line in SURVIVORS.read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        key, sep, why = line.partition("  # ")
        if not sep or not why.strip():
            raise SystemExit(f"{SURVIVORS.name}: every entry needs '  # why it is equivalent': {line!r}")
        out[key.strip()] = why.strip()
    return out


def main(argv: list[str]) -> int:
    profile = argv[0] if argv else "ci"
    if profile not in PROFILES:
        print(f"usage: python tests/mutation.py [{'|'.join(PROFILES)}]", file=sys.stderr)
        return 2
    if shutil.which("mutmut", path=str(Path(sys.executable).parent)) is None:
        print(f"mutmut is not installed: {sys.executable} -m pip install mutmut=={MUTMUT_VERSION}", file=sys.stderr)
        return 2
    d = workdir(profile)
    shutil.rmtree(d / "mutants", ignore_errors=True)
    log_path = d / "mutmut.log"
    t0 = time.time()
    print(f"mutation testing ({profile}): {', '.join(PROFILES[profile][0])}; log {log_path}", flush=True)
    with open(log_path, "w") as log:
        r = mutmut(d, "run", log=log)
    tail = log_path.read_text(errors="replace")[-400:].split("\r")[-1].split("⠋")[-1]
    if r.returncode != 0:
        print(log_path.read_text(errors="replace")[-3000:])
        print(f"mutmut failed (exit {r.returncode})")
        return 1
    found, listed = survivors(d), known()
    new = {k: v for k, v in found.items() if k not in listed}
    fixed = [k for k in listed if k not in found and any(k.startswith(m.replace("/", ".").removesuffix(".py") + ".")
                                                          for m in PROFILES[profile][0])]
    total = re.findall(r"(\d+)/(\d+)\s", tail)
    print(f"{total[-1][1] if total else '?'} mutants in {time.time() - t0:.0f} s; {len(found)} survived, "
          f"{len(found) - len(new)} of them listed as equivalent in {SURVIVORS.name}")
    for k in fixed:
        print(f"listed as equivalent, killed this run (a test timing real steps can kill one by chance; "
              f"drop the entry if it never survives): {k}")
    for k, v in new.items():
        print(f"\nNEW SURVIVOR {k}\n{v}")
    if new:
        print(f"\n{len(new)} mutant(s) survived that no test notices: add a test that fails on each, or list it in "
              f"{SURVIVORS.name} with why it cannot change behaviour")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
