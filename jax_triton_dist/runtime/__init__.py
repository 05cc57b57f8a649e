"""The runtime: call sites, rank contexts, interpreter launches, FFI registration."""
