"""The shipped demo pair, the offline demo and the side-by-side benchmark."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_gguf.bench import prompts as bench
from dflash_gguf.bench import upstream as bench_upstream
from dflash_gguf.demo import DEFAULT_PROMPT, demo_pair

REPO = Path(__file__).resolve().parents[1]
TARGET, DRAFTER = demo_pair()


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def test_demo_pair_is_shipped():
    assert TARGET.is_file() and DRAFTER.is_file(), "dflash_gguf/data/demo must hold target.gguf and drafter.gguf"
    total = TARGET.stat().st_size + DRAFTER.stat().st_size
    assert total < 30e6, f"the demo pair should stay small, it is {total / 1e6:.1f} MB"
    assert (TARGET.parent / "MODEL_CARD.md").is_file()


@pytest.fixture(scope="module")
def demo_contexts():
    from dflash_gguf.native.engine import Context, ContextOptions, Model

    tm, dm = Model(TARGET), Model(DRAFTER)
    opts = ContextOptions(n_ctx=1024, n_batch=64, n_ubatch=64, n_threads=2)
    tctx = Context(tm, opts)
    dctx = Context(dm, opts, other=tctx)
    yield tm, tctx, dctx
    dctx.close()
    tctx.close()


def test_shipped_pair_dflash_equals_plain(demo_contexts):
    from dflash_gguf.decoding import DFlashDecoder, GenerationStats

    tm, tctx, dctx = demo_contexts
    ids = tm.tokenize(DEFAULT_PROMPT.encode())
    plain = list(DFlashDecoder(tctx, None).generate(ids, 64))
    st = GenerationStats()
    spec = DFlashDecoder(tctx, dctx)
    assert spec.info.kind == "dflash" and spec.info.block_size >= 8
    got = list(spec.generate(ids, 64, stats=st))
    assert got == plain
    assert st.tau > 1.5, f"acceptance length {st.tau:.2f} on the demo prompt"
    text = tm.detokenize(got).decode("utf-8", "replace")
    assert text.strip(), "the demo target produced only whitespace"


def test_demo_cli_prints_stats():
    r = subprocess.run([sys.executable, "-m", "dflash_gguf.demo", "--max-tokens", "32", "--trials", "1", "-t", "2",
                        "--no-scale"],
                       capture_output=True, text=True, timeout=300, env=_env(), cwd=REPO)
    assert r.returncode == 0, r.stderr[-2000:]
    out = r.stdout
    assert DEFAULT_PROMPT.splitlines()[0] in out
    for needle in ("plain decoding", "DFlash decoding", "speed-up", "acceptance length",
                   "same output as plain decoding: yes"):
        assert needle in out, f"{needle!r} missing from the demo output:\n{out}"


def test_headline_measures_a_kept_gate_against_plain(models):
    """The demo's realistic-size line (bench.scale.headline), on a tiny pair: one gated decoder for every
    trial, the replayed profile, the same tokens as plain in every run, and a labelled line."""
    from dflash_gguf.bench.scale import headline

    p = models.pair("qwen3", "dflash", 8)
    r = headline.measure(p.target, p.drafter, tokens=24, trials=2, threads=2)
    assert r["exact"] is True and r["trials"] == 2 and r["profile"] == "demo"
    assert r["plain_tps"] > 0 and r["dflash_tps"] > 0 and r["x_plain"] > 0
    # tau: acceptance length of the timed calls' drafting passes; 0 where the kept gate decoded them all
    # plainly, which it may on a tiny pair (a block of right tokens need not beat a plain step there, and
    # such a drafter is probed only once per second of plain decoding); never between 0 and 1
    assert r["tau"] == 0.0 or r["tau"] >= 1.0
    line = headline.line(r, "0.6b", "q4_0")
    assert "Qwen3-0.6B-shaped Q4_0 pair, random weights" in line and "same tokens as plain: yes" in line
    assert f"{r['x_plain']:.2f}x" in line


def test_prompt_sets_parse():
    d = bench.prompts_dir()
    assert d is not None
    for name in bench.PROMPT_SETS:
        ps = bench.parse_prompt_file(d / f"{name}.txt")
        assert len(ps) >= 5, name
        assert len({n for n, _ in ps}) == len(ps), f"duplicate prompt names in {name}"
        assert all(t.endswith("\n") and t.strip() for _, t in ps)


def test_parse_upstream_log():
    err = """0.00.981.321 I decoded   40 tokens in    0.845 seconds, speed:   47.335 t/s
0.00.981.332 I n_draft   = 7
0.00.981.336 I n_predict = 40
0.00.981.341 I n_drafted = 35
0.00.981.346 I n_accept  = 30
0.00.981.407 I spec common_specu: statistics     draft-dflash: #calls(b,g,a) =    1      5      5, #gen drafts =      5, \
#acc drafts =     5, #gen tokens =     35, #acc tokens =    30, #mean acc len = 7.00, #acc rate/pos = (1.000, 1.000, \
0.800, 0.800, 0.800, 0.800, 0.800), dur(b,g,a) = 0.002, 463.051, 0.006 ms
"""
    got = bench_upstream.parse_upstream(err)
    assert got["n_decoded"] == 40 and got["tps"] == pytest.approx(47.335)
    assert got["n_drafted"] == 35 and got["n_accept"] == 30
    assert got["gen_drafts"] == 5 and got["acc_tokens"] == 30 and got["mean_acc_len"] == 7.0
    assert got["rate_pos"][2] == pytest.approx(0.8) and got["t_draft_ms"] == pytest.approx(463.051)
    assert bench_upstream.upstream_generated(b"\n\n<s> def f():\n    return 1\n\n\n", b"<s> def f():\n") == b"    return 1\n"


def test_bench_writes_json(tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text("### a\ndef read_lines(path):\n\n### b\nclass Stack:\n    def __init__(self):\n")
    out = tmp_path / "res"
    cmd = [sys.executable, "-m", "dflash_gguf.bench", "--prompts", str(prompts), "--trials", "1", "--warmup", "0",
           "--max-tokens", "12", "-t", "2", "--out", str(out), "--sweep-block", "--profile"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=_env(), cwd=REPO)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    res = json.loads((out / "results.json").read_text())
    assert set(res) >= {"meta", "prompts", "modes", "speedup", "outputs_equal", "sweep", "profile"}
    for k in ("command", "machine", "versions", "block_size", "n_draft", "threads", "loadavg_start"):
        assert k in res["meta"], k
    m = res["modes"]
    for mode in ("plain", "dflash"):
        tps = m[mode]["tokens_per_second"]
        assert tps["min"] <= tps["median"] <= tps["max"] and tps["median"] > 0
        assert m[mode]["peak_rss_mb"] > 0
    d = m["dflash"]
    # one rate per drafted position: the speed gate (on by default) may not reach the whole block in 12 tokens
    ppa = d["per_position_acceptance"]
    assert d["acceptance_length"] >= 1.0 and 1 <= len(ppa) <= res["meta"]["n_draft"]
    assert all(x is None or 0.0 <= x <= 1.0 for x in ppa), ppa
    assert set(d["time_s"]) >= {"prefill", "draft", "verify", "inject", "rollback", "python"}
    assert res["outputs_equal"]["dflash_vs_plain"] is True
    assert res["speedup"]["dflash_over_plain"] > 0
    exe, why = bench_upstream.upstream_binary()
    if exe is None:
        # the only accepted reason to lack the upstream column: the tools were not built here
        assert m["upstream"]["skipped"] and m["upstream"]["reason"] == why
    else:
        assert m["upstream"]["tokens_per_second"]["median"] > 0
        assert m["upstream"]["acceptance_length"] >= 1.0
        assert res["outputs_equal"]["upstream_vs_ours"] is True, m["upstream"]["per_prompt"]
        assert res["speedup"]["dflash_over_upstream"] > 0
    assert [row["n_draft"] for row in res["sweep"]] == list(range(1, res["meta"]["block_size"]))
    prof = res["profile"]
    assert len(prof["verify_ms_argmax"]) >= 8 and len(prof["draft_ms"]) == res["meta"]["block_size"] - 1
    assert (out / "results.png").exists() or "matplotlib is not installed" in (r.stdout + r.stderr)


def test_sampling_bench_compares_lattice_and_one_hot(tmp_path):
    """``python -m dflash_gguf.bench.sampling`` on the shipped DFlash2 drafter: both proposal kinds run
    on the same prompts and seeds, their counts add up, and a non-DFlash2 drafter is refused."""
    prompts = tmp_path / "p.txt"
    prompts.write_text("### a\ndef read_lines(path):\n\n### b\nclass Stack:\n    def __init__(self):\n")
    out = tmp_path / "res"
    cmd = [sys.executable, "-m", "dflash_gguf.bench.sampling", "--prompts", str(prompts), "--temperatures", "0,1",
           "--seeds", "2", "-n", "12", "-t", "2", "--api", "1", "--out", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=_env(), cwd=REPO)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    rows = json.loads((out / "sampling.json").read_text())["rows"]
    assert [row["temperature"] for row in rows] == [0.0, 1.0]
    for row in rows:
        for mode in ("plain", "one-hot", "lattice", "lattice+gate"):
            assert row[mode]["tokens"] == 2 * 2 * 12 and row[mode]["tps"] > 0
        for mode in ("one-hot", "lattice", "lattice+gate"):
            m = row[mode]
            assert 0 <= m["accepted"] <= m["drafted"]
            assert m["steps"] > 0 or mode == "lattice+gate"       # the gate may decode plainly throughout
            if m["steps"]:
                assert m["tau"] == pytest.approx((m["accepted"] + m["steps"]) / m["steps"])
    greedy = rows[0]          # T = 0: both modes are the same greedy walk
    assert greedy["one-hot"]["accepted"] == greedy["lattice"]["accepted"]
    assert "| 1 | lattice |" in (out / "sampling.md").read_text()
    api = json.loads((out / "sampling.json").read_text())["api"]
    assert [row["temperature"] for row in api] == [0.0, 1.0]
    assert all(row[k] > 0 for row in api for k in ("llama_cpp", "gate", "fixed"))
    r = subprocess.run([sys.executable, "-m", "dflash_gguf.bench.sampling", "--drafter", str(DRAFTER), "--seeds", "1",
                        "-n", "4"], capture_output=True, text=True, timeout=600, env=_env(), cwd=REPO)
    assert r.returncode != 0 and "neither a DFlash2 drafter with a selector nor a DSpark drafter" in r.stdout + r.stderr
