"""Hugging Face Hub downloads, offline against a local cache laid out as huggingface_hub lays it out
(``models--org--name/{blobs,refs/main,snapshots/<rev>/...}``): no network in these tests."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_gguf import Llama
from dflash_gguf.paths import sha256_file
from support import KW, pair, plain  # noqa: F401 (fixtures)

hub = pytest.importorskip("huggingface_hub", reason="huggingface_hub (the [hub] extra) is not installed")
from dflash_gguf.hub import HubFileNotFound  # noqa: E402

REV = "0123456789abcdef0123456789abcdef01234567"


def put_repo(cache: Path, repo_id: str, files: dict[str, Path]) -> Path:
    """Store ``files`` as huggingface_hub does: content-addressed blobs, a snapshot of symlinks, refs/main."""
    root = cache / ("models--" + repo_id.replace("/", "--"))
    snap = root / "snapshots" / REV
    (root / "blobs").mkdir(parents=True, exist_ok=True)
    snap.mkdir(parents=True, exist_ok=True)
    (root / "refs").mkdir(exist_ok=True)
    (root / "refs" / "main").write_text(REV)
    for name, src in files.items():
        digest = hashlib.sha256(src.read_bytes()).hexdigest()
        blob = root / "blobs" / digest
        if not blob.exists():
            shutil.copyfile(src, blob)
        link = snap / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    return snap


def manifest(tmp: Path, target: Path, drafter: Path) -> Path:
    from dflash_gguf.native.engine import DrafterInfo, Model

    with Model(drafter) as dm:
        info = DrafterInfo.read(dm)   # pair.json must describe the drafter it names
    doc = {"format": "dflash-gguf-pair", "format_version": 1, "kind": info.kind, "block_size": info.block_size,
           "mask_token_id": info.mask_token,
           "target_layers": info.target_layers, "target": {"file": "target.gguf", "size": target.stat().st_size,
                                            "sha256": sha256_file(target), "type": "f32"},
           "drafter": {"file": "drafter.gguf", "size": drafter.stat().st_size, "sha256": sha256_file(drafter),
                       "type": "f32"}}
    p = tmp / "pair.json"
    p.write_text(json.dumps(doc))
    return p


@pytest.fixture(scope="module")
def cache(pair, tmp_path_factory):
    c = tmp_path_factory.mktemp("hub")
    put_repo(c, "org/tiny-target-GGUF", {"tiny-target-f32.gguf": pair.target, "README.md": _readme(c)})
    put_repo(c, "org/tiny-drafter-GGUF", {"drafter-f32.gguf": pair.drafter})
    put_repo(c, "org/tiny-pair", {"target.gguf": pair.target, "drafter.gguf": pair.drafter,
                                  "pair.json": manifest(c, pair.target, pair.drafter)})
    put_repo(c, "org/half-pair", {"pair.json": manifest(c, pair.target, pair.drafter), "target.gguf": pair.target})
    return c


def _readme(c: Path) -> Path:
    p = c / "README.md"
    p.write_text("# tiny\n")
    return p


@pytest.fixture
def offline(cache, monkeypatch):
    import huggingface_hub.constants as constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    return cache


def test_from_pretrained_offline_from_the_cache(offline, plain):
    want = plain("def main(", max_tokens=16, temperature=0)["choices"][0]["text"]
    llm = Llama.from_pretrained("org/tiny-target-GGUF", "*.gguf", draft_repo_id="org/tiny-drafter-GGUF",
                                draft_filename="drafter-*.gguf", **KW)
    try:
        assert Path(llm.model_path).name == "tiny-target-f32.gguf" and REV in llm.model_path
        out = llm("def main(", max_tokens=16, temperature=0)
        assert out["choices"][0]["text"] == want and out["dflash"]["enabled"] is True
    finally:
        llm.close()


def test_from_pair_pretrained_offline(offline, plain):
    want = plain("import os\n", max_tokens=12, temperature=0)["choices"][0]["text"]
    llm = Llama.from_pair_pretrained("org/tiny-pair", **KW)
    try:
        out = llm("import os\n", max_tokens=12, temperature=0)
        assert out["choices"][0]["text"] == want and out["dflash"]["enabled"] is True
    finally:
        llm.close()


def test_offline_missing_files_are_clear_errors(offline):
    with pytest.raises(HubFileNotFound, match="HF_HUB_OFFLINE=1"):
        Llama.from_pretrained("org/not-downloaded", "*.gguf", **KW)
    with pytest.raises(HubFileNotFound, match=r"no file matching '\*q4_0.gguf' in org/tiny-target-GGUF \(offline"):
        Llama.from_pretrained("org/tiny-target-GGUF", "*q4_0.gguf", **KW)
    with pytest.raises(HubFileNotFound, match="drafter.gguf named by pair.json not in the cache"):
        Llama.from_pair_pretrained("org/half-pair", **KW)
    with pytest.raises(ValueError, match="draft_filename=False"):
        Llama.from_pretrained("org/tiny-target-GGUF", "*.gguf", draft_repo_id="org/tiny-drafter-GGUF",
                              draft_filename=False, **KW)
    put_repo(offline, "org/tiny-no-gguf", {"README.md": offline / "README.md"})
    with pytest.raises(HubFileNotFound, match="no GGUF in org/tiny-no-gguf"):
        Llama.from_pretrained("org/tiny-target-GGUF", "*.gguf", draft_repo_id="org/tiny-no-gguf", **KW)


def test_convert_cli_offline_hub_ids_fail_clearly(cache, tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(cache))
    r = subprocess.run([sys.executable, "-m", "dflash_gguf.convert", "org/missing-target", "org/missing-drafter",
                        "-o", str(tmp_path / "out")], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 1, r.stderr
    assert "org/missing-target" in r.stderr and "HF_HUB_OFFLINE=1" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "out").exists()


def test_convert_fetches_checkpoints_from_the_cache(cache, pair, offline):
    """Hub ids resolve to snapshot folders holding what the converter reads (validated like local folders)."""
    from dflash_gguf.convert.validate import validate_pair
    from dflash_gguf.hub import checkpoint

    files = {p.name: p for p in pair.target_hf.iterdir() if p.is_file()}
    put_repo(offline, "org/tiny-target-hf", files)
    put_repo(offline, "org/tiny-drafter-hf", {p.name: p for p in pair.drafter_hf.iterdir() if p.is_file()})
    t, d = checkpoint("org/tiny-target-hf"), checkpoint("org/tiny-drafter-hf")
    assert REV in str(t) and (t / "config.json").is_file()
    spec = validate_pair(t, d)
    assert spec.kind == "dflash" and spec.block_size == 8
    assert checkpoint(str(pair.target_hf)) == pair.target_hf      # a local folder stays itself


# --------------------------------------------------------------------------- llama_cpp's from_pretrained
def test_from_pretrained_signature_is_llama_cpp_s():
    """The same positional parameters, names and defaults as llama_cpp.Llama.from_pretrained; the
    drafter's are keyword-only."""
    import inspect

    import llama_cpp

    ours = list(inspect.signature(Llama.from_pretrained).parameters.values())
    theirs = [p for p in inspect.signature(llama_cpp.Llama.from_pretrained).parameters.values()
              if p.kind is not inspect.Parameter.VAR_KEYWORD]
    assert [(p.name, p.kind, p.default) for p in ours[: len(theirs)]] == \
        [(p.name, p.kind, p.default) for p in theirs]
    rest = {p.name: p.kind for p in ours[len(theirs):]}
    assert {"draft_repo_id", "draft_filename"} <= set(rest)
    assert set(rest.values()) <= {inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.VAR_KEYWORD}


@pytest.fixture(scope="module")
def split_target(pair, models):
    import peer_models

    shards = peer_models.split_gguf(pair.target_hf, models.root / "split-target", max_tensors=16)
    assert len(shards) >= 3 and shards[0].name.endswith("-00001-of-%05d.gguf" % len(shards))
    return shards


def test_from_pretrained_split_gguf_offline(offline, split_target, plain):
    """A split GGUF as llama_cpp fetches it: the first shard by ``filename``, the others by
    ``additional_files`` (positional, as llama_cpp takes them); shards not listed are fetched too."""
    n = len(split_target)
    put_repo(offline, "org/tiny-split-GGUF", {f"F32/{s.name}": s for s in split_target})
    want = plain("def main(", max_tokens=16, temperature=0)["choices"][0]["text"]
    others = [f"F32/*-{i:05d}-of-{n:05d}.gguf" for i in range(2, n + 1)]
    for extra in (others, others[:1], None):
        llm = Llama.from_pretrained("org/tiny-split-GGUF", "*-00001-of-*.gguf", extra, **KW)
        try:
            assert Path(llm.model_path).name == split_target[0].name
            assert llm("def main(", max_tokens=16, temperature=0)["choices"][0]["text"] == want
        finally:
            llm.close()
    llm = Llama.from_pretrained("org/tiny-split-GGUF", "*-00001-of-*.gguf", draft_repo_id="org/tiny-drafter-GGUF",
                                draft_filename="drafter-*.gguf", **KW)
    try:
        out = llm("def main(", max_tokens=16, temperature=0)
        assert out["choices"][0]["text"] == want and out["dflash"]["enabled"] is True
    finally:
        llm.close()
    put_repo(offline, "org/tiny-split-incomplete", {s.name: s for s in split_target[:-1]})
    with pytest.raises(HubFileNotFound, match=f"shard .*-{n:05d}-of-{n:05d}.gguf"):
        Llama.from_pretrained("org/tiny-split-incomplete", "*-00001-of-*.gguf", **KW)
    with pytest.raises(ValueError, match="no file matching"):    # llama_cpp's exception type, too
        Llama.from_pretrained("org/tiny-split-GGUF", "*-00001-of-*.gguf", ["*-00009-of-*.gguf"], **KW)


def test_from_pretrained_local_dir_offline(offline, pair, plain, tmp_path):
    """``local_dir`` is where the files are (and go), not a keyword swallowed by the constructor."""
    local = tmp_path / "local"
    local.mkdir()
    shutil.copyfile(pair.target, local / "tiny-target-f32.gguf")
    shutil.copyfile(pair.drafter, local / "drafter-f32.gguf")
    llm = Llama.from_pretrained("org/only-in-local-dir", "tiny-*.gguf", None, local, "auto",
                                draft_filename="drafter-*.gguf", **KW)
    try:
        assert Path(llm.model_path).resolve() == (local / "tiny-target-f32.gguf").resolve()
        assert Path(llm.draft_model_path).resolve() == (local / "drafter-f32.gguf").resolve()
        out = llm("def main(", max_tokens=12, temperature=0)
        assert out["choices"][0]["text"] == plain("def main(", max_tokens=12, temperature=0)["choices"][0]["text"]
    finally:
        llm.close()


# --------------------------------------------------------------------------- drafters published beside the target
def test_choose_drafter_follows_the_tables():
    """DSpark before DFlash, Q8_0 before BF16/F16; only files named as upstream names sidecars, in the
    target's folder or one above it (the nearest first); the first shard of a split drafter."""
    from dflash_gguf.hub import choose_drafter

    ggml = ["README.md", "Tiny-Q8_0.gguf", "Tiny-F16.gguf", "dflash-Tiny-BF16.gguf", "dflash-Tiny-Q8_0.gguf",
            "dspark-Tiny-BF16.gguf", "dspark-Tiny-Q8_0.gguf", "mmproj-Tiny-F16.gguf"]
    pick = choose_drafter(ggml, "Tiny-Q8_0.gguf")
    assert (pick.file, pick.kind, pick.quant) == ("dspark-Tiny-Q8_0.gguf", "dspark", "Q8_0")
    assert "dflash-Tiny-BF16.gguf" in pick.reason and "dspark > dflash" in pick.reason
    assert choose_drafter([f for f in ggml if "dspark" not in f], "Tiny-F16.gguf").file == "dflash-Tiny-Q8_0.gguf"
    assert choose_drafter(["Tiny-F16.gguf", "dflash-Tiny-F16.gguf", "dflash-Tiny-BF16.gguf", "dflash-Tiny-Q4_0.gguf"],
                          "Tiny-F16.gguf").file == "dflash-Tiny-BF16.gguf"
    assert choose_drafter(["Tiny-Q8_0.gguf", "README.md", "mmproj-Tiny-F16.gguf"], "Tiny-Q8_0.gguf") is None
    nested = ["Q8_0/Tiny-Q8_0.gguf", "dflash-Tiny-Q8_0.gguf", "Q8_0/dflash-Tiny-BF16.gguf",
              "BF16/dspark-Tiny-Q8_0.gguf", "Q8_0/sub/dspark-Tiny-Q8_0.gguf"]
    assert choose_drafter(nested, "Q8_0/Tiny-Q8_0.gguf").file == "Q8_0/dflash-Tiny-BF16.gguf"   # nearest folder
    assert choose_drafter(nested[:2], "Q8_0/Tiny-Q8_0.gguf").file == "dflash-Tiny-Q8_0.gguf"   # a folder above
    split = ["Tiny-Q8_0.gguf", "dspark-Tiny-BF16-00002-of-00002.gguf", "dspark-Tiny-BF16-00001-of-00002.gguf"]
    pick = choose_drafter(split, "Tiny-Q8_0.gguf")
    assert (pick.file, pick.quant) == ("dspark-Tiny-BF16-00001-of-00002.gguf", "BF16")
    # a drafter's own repository (a DSpark GGUF published alone): any GGUF, by the same tables
    alone = ["README.md", "Qwen3-1.7B-DSpark-BF16.gguf", "Qwen3-1.7B-DSpark-Q8_0.gguf"]
    assert choose_drafter(alone).file == "Qwen3-1.7B-DSpark-Q8_0.gguf"
    assert choose_drafter(["README.md"]) is None


@pytest.fixture(scope="module")
def published(pair, models, cache):
    """Repositories laid out as ggml-org's: the target and its drafters side by side."""
    dspark = models.pair("qwen3", "dspark", 8)
    assert dspark.target == pair.target            # one target for both kinds
    put_repo(cache, "org/Tiny-GGUF", {"Tiny-F32.gguf": pair.target, "dflash-Tiny-BF16.gguf": pair.drafter,
                                      "dflash-Tiny-Q8_0.gguf": pair.drafter, "dspark-Tiny-Q8_0.gguf": dspark.drafter})
    put_repo(cache, "org/Tiny-dflash-GGUF", {"Tiny-F32.gguf": pair.target, "dflash-Tiny-BF16.gguf": pair.drafter,
                                             "dflash-Tiny-Q8_0.gguf": pair.drafter})
    return cache


def _drafter_name(llm) -> str | None:
    return Path(llm.draft_model_path).name if llm.draft_model_path else None


def test_from_pretrained_finds_the_drafter_beside_the_target(published, offline, plain, caplog):
    """No draft_filename: the sidecar of the target's repository (the glob "*.gguf" matches the
    sidecars too, yet names the target). The choice among DSpark and DFlash files is the hub's alone;
    the DFlash one is loaded and decodes losslessly (DSpark decoding: test_dspark.py)."""
    from dflash_gguf.hub import fetch_model, find_drafter

    with caplog.at_level("INFO", logger="dflash_gguf.hub"):
        root, rel = fetch_model("org/Tiny-GGUF", "*.gguf")
        drafter = find_drafter("org/Tiny-GGUF", rel, root=root)
    assert rel == "Tiny-F32.gguf" and drafter == root / "dspark-Tiny-Q8_0.gguf"
    assert "drafter dspark-Tiny-Q8_0.gguf: the dspark sidecar beside the target; preferred to " \
           "dflash-Tiny-BF16.gguf, dflash-Tiny-Q8_0.gguf" in caplog.text

    want = plain("def main(", max_tokens=16, temperature=0)["choices"][0]["text"]
    caplog.clear()
    with caplog.at_level("INFO", logger="dflash_gguf.hub"):
        llm = Llama.from_pretrained("org/Tiny-dflash-GGUF", "*.gguf", **KW)
    try:
        assert Path(llm.model_path).name == "Tiny-F32.gguf" and _drafter_name(llm) == "dflash-Tiny-Q8_0.gguf"
        assert REV in llm.draft_model_path
        assert "drafter dflash-Tiny-Q8_0.gguf" in caplog.text and "preferred to dflash-Tiny-BF16.gguf" in caplog.text
        out = llm("def main(", max_tokens=16, temperature=0)
        assert out["choices"][0]["text"] == want and out["dflash"]["enabled"] is True
    finally:
        llm.close()


def test_from_pretrained_drafter_choice_can_be_overridden(published, offline, caplog):
    """An explicit draft_filename wins; draft_filename=False turns the search off; a repository
    without a sidecar decodes plainly, as before."""
    cases = [(dict(draft_filename="dflash-Tiny-BF16.gguf"), "dflash-Tiny-BF16.gguf"),
             (dict(draft_filename=False), None)]
    for kw, chosen in cases:
        llm = Llama.from_pretrained("org/Tiny-GGUF", "Tiny-*.gguf", **kw, **KW)
        try:
            assert Path(llm.model_path).name == "Tiny-F32.gguf" and _drafter_name(llm) == chosen
        finally:
            llm.close()
    with caplog.at_level("INFO", logger="dflash_gguf.hub"):
        llm = Llama.from_pretrained("org/tiny-target-GGUF", "*.gguf", **KW)
    try:
        assert llm.draft_model_path is None and "plain decoding" in caplog.text
    finally:
        llm.close()
    llm = Llama.from_pretrained("org/tiny-target-GGUF", "*.gguf", draft_repo_id="org/tiny-drafter-GGUF", **KW)
    try:
        assert _drafter_name(llm) == "drafter-f32.gguf"     # a drafter's own repository: its GGUF
    finally:
        llm.close()
    with pytest.raises(TypeError, match="draft_filename"):
        Llama.from_pretrained("org/Tiny-GGUF", "Tiny-*.gguf", draft_filename=True, **KW)


def test_online_the_listing_names_the_files_to_download(published, monkeypatch):
    """Online the repository's list comes first: a glob that also matches the sidecars downloads the
    target alone, then the one drafter chosen; a listing that fails falls back to the cache's files."""
    from dflash_gguf.hub import fetch_model, find_drafter

    snap = published / "models--org--Tiny-GGUF" / "snapshots" / REV
    asked = []

    def download(repo_id, *, allow_patterns, **kw):
        asked.append(allow_patterns)
        return str(snap)

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(hub, "snapshot_download", download)
    monkeypatch.setattr(hub.HfApi, "list_repo_files", lambda self, repo_id, revision=None, **kw: [
        "README.md", *sorted(p.name for p in snap.iterdir())])
    root, rel = fetch_model("org/Tiny-GGUF", "*.gguf")
    assert rel == "Tiny-F32.gguf" and asked == [["Tiny-F32.gguf"]]
    assert find_drafter("org/Tiny-GGUF", rel, root=root).name == "dspark-Tiny-Q8_0.gguf"
    assert asked[1:] == [["dspark-Tiny-Q8_0.gguf"]]

    def unreachable(self, repo_id, **kw):
        raise ConnectionError("no network")

    monkeypatch.setattr(hub.HfApi, "list_repo_files", unreachable)
    root, rel = fetch_model("org/Tiny-GGUF", "Tiny-*.gguf")
    assert rel == "Tiny-F32.gguf" and find_drafter("org/Tiny-GGUF", rel, root=root).name == "dspark-Tiny-Q8_0.gguf"


def test_choose_model_reads_upstreams_quant_tags():
    """-hf USER/MODEL[:QUANT]: the tag picks the model GGUF, case-insensitively (default Q4_K_M, else the
    first model GGUF); drafters, projectors and later shards are never the model; a missing tag is an
    error that names the tags there are."""
    from dflash_gguf.hub import choose_model, split_hf_spec

    files = ["README.md", "Tiny-Q8_0.gguf", "Tiny-Q4_K_M.gguf", "dspark-Tiny-Q4_K_M.gguf", "mmproj-Tiny-F16.gguf",
             "big/Tiny-F16-00001-of-00002.gguf", "big/Tiny-F16-00002-of-00002.gguf"]
    assert choose_model(files, None) == "Tiny-Q4_K_M.gguf"
    assert choose_model(files, "q8_0") == "Tiny-Q8_0.gguf"
    assert choose_model(files, "F16") == "big/Tiny-F16-00001-of-00002.gguf"
    assert choose_model(["Tiny-Q8_0.gguf", "Tiny-BF16.gguf", "dflash-Tiny-Q4_K_M.gguf"], None) == "Tiny-BF16.gguf"
    with pytest.raises(HubFileNotFound, match="no IQ2_XS model GGUF; there are: F16, Q4_K_M, Q8_0"):
        choose_model(files, "IQ2_XS")
    assert split_hf_spec("ggml-org/Qwen3-8B-GGUF:Q8_0") == ("ggml-org/Qwen3-8B-GGUF", "Q8_0")
    assert split_hf_spec("ggml-org/Qwen3-8B-GGUF") == ("ggml-org/Qwen3-8B-GGUF", None)
    with pytest.raises(ValueError, match="USER/MODEL"):
        split_hf_spec("Qwen3-8B-GGUF:Q8_0")


def test_cli_hf_fetches_the_target_and_the_drafter_beside_it(published, offline, plain):
    """``generate -hf org/Model:QUANT`` (llama.cpp's flag) loads the tagged GGUF and the sidecar beside it,
    as ``Llama.from_pretrained`` does, and prints plain decoding's text; ``--no-draft`` decodes plainly;
    ``-hfd`` takes the drafter from its own repository; an unknown tag stops with the tags there are."""
    want = plain("def main(", max_tokens=16, temperature=0)["choices"][0]["text"]
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(offline))

    def generate(*flags):
        return subprocess.run([sys.executable, "-m", "dflash_gguf", "generate", *flags, "-c", "512", "-t", "1", "-n",
                               "16", "--json", "-v", "def main("], capture_output=True, text=True, timeout=180, env=env)
    for flags, drafter in [(["-hf", "org/Tiny-GGUF:f32"], "dspark-Tiny-Q8_0.gguf"),
                           (["-hf", "org/Tiny-GGUF:F32", "--no-draft"], None),
                           (["-hf", "org/tiny-target-GGUF", "-hfd", "org/tiny-drafter-GGUF"], "drafter-f32.gguf")]:
        r = generate(*flags)
        assert r.returncode == 0, r.stderr
        assert r.stdout == want + "\n"
        stats = json.loads([line for line in r.stderr.splitlines() if line.startswith("{")][-1])
        dfl = stats["dflash"]
        assert (dfl is not None and dfl["steps"] > 0) == (drafter is not None), (flags, stats)
        assert drafter is None or f"drafter {drafter}" in r.stderr
    r = generate("-hf", "org/Tiny-GGUF:Q2_K")
    assert r.returncode != 0 and "org/Tiny-GGUF: no Q2_K model GGUF; there are: F32" in r.stderr


def test_cli_hf_fetches_the_target_once(published, offline, monkeypatch):
    """``-hf`` without ``-c`` reads the target's training context from the header of the file it then opens:
    the target is fetched once (online, each fetch lists the repository), then the drafter found beside it."""
    import argparse

    from dflash_gguf import hub, options

    calls = []
    real = hub.fetch_model
    monkeypatch.setattr(hub, "fetch_model", lambda *a, **k: calls.append(a[:2]) or real(*a, **k))
    ap = argparse.ArgumentParser()
    options.add_model_args(ap)
    llm = options.load_llama(ap.parse_args(["-hf", "org/Tiny-GGUF:f32", "-t", "1"]))
    try:
        assert calls == [("org/Tiny-GGUF", "Tiny-F32.gguf"), ("org/Tiny-GGUF", "dspark-Tiny-Q8_0.gguf")], calls
        assert _drafter_name(llm) == "dspark-Tiny-Q8_0.gguf"
        assert llm.n_ctx() == options.resolve_n_ctx(None, llm.model_path)
    finally:
        llm.close()
