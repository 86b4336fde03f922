from dflash_gguf.build.native import main

if __name__ == "__main__":
    main()
