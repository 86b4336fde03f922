"""Scale benchmark: synthetic pairs at Qwen3-0.6B..8B shapes, replayed acceptance, plain vs ours vs upstream.

    python -m dflash_gguf.bench.scale                          # 0.6b, 1.7b, 4b x q4_0, q8_0
    python -m dflash_gguf.bench.scale --shapes 0.6b --types q4_0 --tokens 32 --trials 1

Modules: ``synth`` (random-weight GGUF pairs written with numpy + gguf-py, cached), ``replay``
(the acceptance-replay proposer and profiles), ``run`` (one case measured in its own process),
``__main__`` (the command line, upstream column, JSON + markdown table).
Everything it prints is labelled: synthetic weights, replayed acceptance.
"""
