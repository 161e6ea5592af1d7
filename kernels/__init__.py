"""kvshare.kernels: the engine's compute operations, each with a plain-torch reference."""
