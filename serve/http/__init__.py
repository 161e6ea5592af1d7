"""OpenAI-compatible HTTP layer over the engine (``kvshare serve``)."""
