"""ggml's CPU kernels, checked and switched from Python: what CPU this is (``cpu``), MUL_MAT through each of ggml's
CPU buffer types against the exact product (``mulmat``, ``python -m dflash_gguf.kernels.mulmat``), flash attention
(``fattn``) and the AMX path (``amx``). Each runs on its own; the engine only reads ``cpu``."""
