"""kvshare.serve: the serving engine with one paged KV pool shared across adapters (see the engine issue)."""
