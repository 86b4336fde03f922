"""The native handles: which llama-cpp-python the package runs on (``llama``), the patched library's C boundary
(``_bindings``, declared in ``_cffi/dflash.cdef``), its models and contexts (``engine``), what is checked before
llama.cpp reads a file (``gguf_check``), its log, threads, memory presets, state files and RPC back ends. Built on
nothing of the package but ``errors`` and ``paths``."""
