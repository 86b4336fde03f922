import sys

from dflash_gguf.bench.cli import main

sys.exit(main())
