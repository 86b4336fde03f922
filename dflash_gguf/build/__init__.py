"""Building the patched llama-cpp-python: ``native`` (the pinned sdist, the patch series, the wheel, its cache and
install, the reference tools; ``python -m dflash_gguf.build``), ``bundle`` (that wheel made into this package's
own copy, ``dflash_gguf._llama_cpp``, when a wheel of the package is built) and ``cross`` (the arm64 side: cross
flags, KleidiAI, the aarch64 wheel, an emulated aarch64 CPython)."""
