"""Performance benchmarks (``kvshare bench ...``): figures and ratios measured side by side.

``engine`` (the engine against transformers), ``alora`` (the aLoRA pipeline against LoRA by
prompt length) and ``workflow`` (multi-agent ReAct on HotpotQA), with :mod:`.common` for
what they share. Speed goals live here, never in timed tests.
"""
