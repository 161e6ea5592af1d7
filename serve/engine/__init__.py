"""The engine layer: what a caller drives, one request at a time or step by step.

- :mod:`.llm_engine`: the facade (``LLMEngine``: add_request / abort / step, adapters,
  properties) and ``LLM``, the offline ``generate`` API over it;
- :mod:`.scheduler` and :mod:`.admission`: which sequences run each step, under the token
  budget, the KV pool and workflow admission;
- :mod:`.output`: sequences -> ``RequestOutput`` (incremental detokenising, stop strings);
- :mod:`.stats`: what the engine reports (``stats()``, ``kv_usage()``).

It runs steps through :mod:`kvshare.serve.exec` and keeps KV in :mod:`kvshare.serve.cache`;
nothing here imports the driver, HTTP, Ray or workflow layers above it.
"""
