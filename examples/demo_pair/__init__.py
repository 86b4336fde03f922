"""The pieces of ``examples/train_demo_pair.py``, which trains the shipped demo pair: shared helpers
(``common``), the stdlib corpus and SentencePiece tokenizer (``corpus``), the Qwen3 target
(``target``), the greedy samples and the DFlash drafter (``drafter``), and conversion to GGUF,
verification and installation (``publish``)."""
