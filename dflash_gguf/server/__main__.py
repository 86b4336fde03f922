from dflash_gguf.server.cli import main

raise SystemExit(main())
