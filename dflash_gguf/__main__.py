"""``python -m dflash_gguf``: the ``dflash-gguf`` command line (see :mod:`dflash_gguf.cli`)."""
import sys

from dflash_gguf.cli import main

sys.exit(main())
