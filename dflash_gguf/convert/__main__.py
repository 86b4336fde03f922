from dflash_gguf.convert.cli import main

raise SystemExit(main())
