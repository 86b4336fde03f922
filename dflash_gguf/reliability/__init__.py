"""Reliability tools, each a ``python -m dflash_gguf.reliability.<tool>`` with a bounded default size.

* ``fuzz``   - hostile model files: mutated GGUFs and pair manifests against every loader
* ``soak``   - divergence soak: DFlash vs plain decoding, token for token, over many configurations
* ``leaks``  - RSS, file descriptors and Python objects over many generations and open/close cycles
* ``server_soak`` - mixed concurrent traffic against a loopback server

RELIABILITY.md (repository root) lists each figure with the command that produced it.
"""
