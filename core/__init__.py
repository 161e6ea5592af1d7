"""kvshare: train and serve teams of LLM agents that share one base model and one KV cache.

The shared core (this package) holds what every subsystem needs: the CLI, the offline
model zoo, base fingerprints and the adapter manifest. Subsystems live beside it:
``kvshare.train``, ``kvshare.serve``, ``kvshare.kernels``, ``kvshare.eval``.
"""

__version__ = "0.1.0"
