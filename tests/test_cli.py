"""The ``dflash-gguf`` command line, run as a subprocess (``python -m dflash_gguf``)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from support import KW, pair, plain  # noqa: F401 (fixtures)

PY = [sys.executable, "-m", "dflash_gguf"]
SMALL = ["--n-ctx", "512", "--threads", "1"]


def run(args, stdin: str | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONIOENCODING="utf-8")
    return subprocess.run(PY + args, input=stdin, capture_output=True, text=True, timeout=timeout, env=env)




def model_args(pair) -> list[str]:
    return ["--model", str(pair.target), "--draft", str(pair.drafter)] + SMALL


def test_top_level_help():
    r = run(["--help"])
    assert r.returncode == 0
    for name in ("generate", "chat", "serve", "convert", "bench", "demo", "--pair", "--draft", "lossless"):
        assert name in r.stdout, name
    r = run([])
    assert r.returncode == 2 and "generate" in r.stdout


@pytest.mark.parametrize("cmd,expect", [("generate", "--max-tokens"), ("chat", "/reset"), ("serve", "--port"),
                                        ("convert", "convert"), ("bench", "bench"), ("demo", "demo")])
def test_subcommand_help(cmd, expect):
    r = run([cmd, "--help"])
    assert r.returncode == 0, r.stderr
    assert expect in r.stdout
    if cmd in ("generate", "chat", "serve"):
        assert "--pair" in r.stdout and "--draft" in r.stdout and "--n-ctx" in r.stdout


def test_generate_matches_plain(pair, plain):
    want = plain("def main(", max_tokens=30, temperature=0)["choices"][0]["text"]
    r = run(["generate", *model_args(pair), "-n", "30", "def main("])
    assert r.returncode == 0, r.stderr
    assert r.stdout == want + "\n"
    assert "acceptance length" in r.stderr and "30 tokens" in r.stderr


def test_generate_from_stdin_with_json_stats(pair, plain):
    want = plain("import os\n", max_tokens=12, temperature=0, stop=["e"])["choices"][0]["text"]
    r = run(["generate", *model_args(pair), "-n", "12", "--stop", "e", "--json", "-"], stdin="import os\n")
    assert r.returncode == 0, r.stderr
    assert r.stdout == want + "\n"
    stats = json.loads(r.stderr.strip().splitlines()[-1])
    assert stats["dflash"]["steps"] > 0 and stats["dflash"]["drafted"] >= stats["dflash"]["accepted"]


def test_generate_pair_dir_and_no_dflash(pair, plain, tmp_path):
    (tmp_path / "target.gguf").symlink_to(pair.target)
    (tmp_path / "drafter.gguf").symlink_to(pair.drafter)
    want = plain("class Foo:\n", max_tokens=10, temperature=0)["choices"][0]["text"]
    r = run(["generate", "--pair", str(tmp_path), *SMALL, "-n", "10", "class Foo:\n"])
    assert r.returncode == 0, r.stderr
    assert r.stdout == want + "\n"
    r = run(["generate", "--pair", str(tmp_path), *SMALL, "--no-dflash", "-n", "10", "class Foo:\n"])
    assert r.stdout == want + "\n" and "plain decoding" in r.stderr


def test_chat_with_piped_stdin(pair, plain):
    first, second = "def add(a, b):", "import os"
    msgs = [{"role": "user", "content": first}]
    r1 = plain.create_chat_completion(msgs, max_tokens=15, temperature=0)["choices"][0]["message"]["content"]
    msgs += [{"role": "assistant", "content": r1}, {"role": "user", "content": second}]
    r2 = plain.create_chat_completion(msgs, max_tokens=15, temperature=0)["choices"][0]["message"]["content"]
    r = run(["chat", *model_args(pair), "--chat-format", "chatml", "-n", "15"],
            stdin=f"{first}\n/stats\n\n{second}\n/quit\nnever read\n")
    assert r.returncode == 0, r.stderr
    assert r.stdout == f"{r1}\n{r2}\n"
    assert r.stderr.count("acceptance length") == 2
    assert '"steps"' in r.stderr                     # /stats printed the JSON statistics


def test_errors_are_one_line(pair, tmp_path):
    r = run(["generate", "hello"])
    assert r.returncode != 0 and "no model" in r.stderr and "Traceback" not in r.stderr
    r = run(["generate", "--model", str(tmp_path / "nope.gguf"), "hello"])
    assert r.returncode != 0 and "Traceback" not in r.stderr
    r = run(["generate", "--pair", str(tmp_path / "missing"), "hello"])
    assert r.returncode == 1 and "not found" in r.stderr


def test_console_script_installed():
    exe = Path(sys.executable).parent / "dflash-gguf"
    if not exe.exists():
        pytest.skip("dflash-gguf console script not installed in this environment")
    r = subprocess.run([str(exe), "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "generate" in r.stdout


def test_a_missing_server_extra_is_named():
    """Without the server's packages, the server says which extra brings them (not a bare traceback)."""
    code = ("import sys; sys.modules['fastapi'] = None\n"
            "from dflash_gguf.cli import main\n"
            "sys.exit(main(['serve', '--model', 'x.gguf']))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "pip install 'dflash-gguf[server]'" in r.stderr and "Traceback" not in r.stderr
    code = "import sys; sys.modules['fastapi'] = None\nimport dflash_gguf.server"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "pip install 'dflash-gguf[server]'" in r.stderr
