"""OpenAI-compatible HTTP layer over the engine: ``kvshare serve``.

``/v1/models``, ``/v1/completions``, ``/v1/chat/completions`` (JSON or server-sent events),
``/health`` and ``/metrics`` (Prometheus text). The request's ``model`` names the base or a
loaded adapter. Errors use OpenAI's JSON shape: 400 invalid or oversize input, 401 bad key,
404 unknown model, 413 body too large, 503 overloaded; every request is bounded by
:class:`~kvshare.serve.config.ServerLimits`, and tokenisation runs off the event loop, so one
hostile request cannot stall or fail the others. With an aLoRA adapter, chat requests end
with the adapter's invocation after the conversation, as the adapter was trained; completion
prompts are taken as given (include the invocation to activate the adapter).

``/v1/completions`` takes OpenAI's four prompt shapes (text, token ids, or a batch of either:
one choice per prompt) and ``echo``: with ``logprobs`` the prompt tokens are scored under the
adapter's own sharing semantics (the engine's ``prompt_logprobs``), which is how lm-eval's
``local-completions`` model computes loglikelihoods through a server.

vLLM's surface, so that clients and scripts written for it work unchanged: its sampling
extensions (``top_k``, ``min_p``, ``repetition_penalty``), ``n`` choices per prompt (queued
together, so the later ones reuse the first's prompt blocks), ``stream_options.include_usage``,
chat content-part arrays, ``cache_salt`` (only requests with the same salt share prefix
blocks), model cards with ``root`` and ``parent``, and, behind a flag,
``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``. Fields we do not implement are a
400 that names them; vLLM's own request fields are implemented (``include_stop_str_in_output``,
``truncate_prompt_tokens``, ``request_id``, chat's ``add_generation_prompt``,
``continue_final_message`` and ``chat_template_kwargs``) or accepted at vLLM's defaults, so a
client that sends them as vLLM's does gets the same reply. A request that leaves out ``model``
runs on the first served base, as in vLLM 0.8 and later.

One app can serve several co-located base models (:class:`~kvshare.serve.driver.colocation.Colocation`):
the ``model`` field routes each request to its base's engine (its tokenizer, chat template and
context length), and ``/v1/models`` lists every base with its adapters.

One module per job: :mod:`.app` (wiring), :mod:`.state` (what the routes share),
:mod:`.protocol` (request bodies), :mod:`.limits`, :mod:`.params` (request -> sampling),
:mod:`.jobs` (queueing, collecting, cancelling), :mod:`.completions`, :mod:`.chat`,
:mod:`.streaming` (server-sent events), :mod:`.logprobs`, :mod:`.replies`, :mod:`.tokenize`,
:mod:`.models`, :mod:`.status`, :mod:`.admin` (runtime LoRA), :mod:`.lora_scope`,
:mod:`.metrics`, :mod:`.middleware` and :mod:`.errors`.
"""

from .app import create_app
from .errors import ApiError
from .state import ServerState

__all__ = ["ApiError", "ServerState", "create_app"]
