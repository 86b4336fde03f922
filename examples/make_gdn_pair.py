"""A random hybrid pair whose recurrent state has a released model's size, for the rollback benchmark.

    python examples/make_gdn_pair.py OUT_DIR [--layers 24]

The target is a Qwen3.5 (``qwen35``) hybrid with the gated delta-net dimensions of Qwen3-Next's
published config (16 key heads and 32 value heads of 128 dims, conv kernel 4; a full-attention layer
every 4th), so one copy of its recurrent state is as large as a real one with that many layers; its
hidden size is small (the state does not depend on it), which keeps it quick to write and convert.
The drafter is a random DFlash drafter with block 16. Needs the test dependencies (``make test``
installs them) and the built llama.cpp tree (for its converter). Weights are random: acceptance is
not meaningful, memory and per-step costs are.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import tiny  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--layers", type=int, default=24)
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    tok = tiny.make_tokenizer(a.out / "tok").parent
    t_hf = tiny.make_hybrid_target(a.out / f"hf-target-{a.layers}", tok, "qwen35", hidden=64, layers=a.layers,
                                   linear_head_dim=128, linear_k_heads=16, linear_v_heads=32, conv_kernel=4,
                                   full_attention_interval=4)
    d_hf = tiny.make_drafter(a.out / f"hf-drafter-{a.layers}", t_hf, block_size=16,
                             target_layer_ids=[1, a.layers // 2, a.layers - 2])
    target = tiny.upstream_convert(t_hf, a.out / f"target-{a.layers}.gguf")
    drafter = tiny.upstream_convert(d_hf, a.out / f"drafter-{a.layers}.gguf", target_dir=t_hf)
    print(target)
    print(drafter)
    return 0


if __name__ == "__main__":
    sys.exit(main())
