"""Native handles: llama.cpp through the patched library's bindings."""
