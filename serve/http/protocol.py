"""The request bodies the HTTP layer takes: OpenAI's fields, vLLM's extensions, and which
values of them kvshare refuses (``check_neutral``).

Unknown fields are refused, so that a client never believes an option took effect; OpenAI's
and vLLM's optional fields that kvshare does not implement are accepted at their neutral
values and refused, naming them, otherwise. Limits that depend on the server's
configuration (:class:`~kvshare.serve.config.ServerLimits`) are in :mod:`.limits`.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .errors import ApiError


class StreamOptions(BaseModel):
    """OpenAI's ``stream_options``: ``include_usage`` ends the stream with a usage chunk."""

    model_config = ConfigDict(extra="forbid")
    include_usage: bool | None = True  # vLLM's default: stream_options {} asks for the usage chunk
    continuous_usage_stats: bool | None = None  # vLLM's; refused when true (not implemented)


class OpenAIRequest(BaseModel):
    """Unknown fields are refused (as OpenAI does); OpenAI's own optional fields are accepted
    and ignored when they are at their neutral values."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None  # left out: the first served base (vLLM 0.8+)
    # left out: the model's generation_config.json (--generation-config auto), else off (1.0 / 1.0 / off)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)  # vLLM's extension: -1 or 0 = off; at most the vocabulary
    min_p: float | None = Field(None, ge=0, le=1)  # vLLM's extension
    repetition_penalty: float | None = Field(None, gt=0)  # vLLM's extension: over the prompt and the output
    n: int = Field(1, ge=1)  # choices per prompt, at most ServerLimits.max_n
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    cache_salt: str | None = Field(None, min_length=1, max_length=1024)  # vLLM's per-tenant prefix-cache salt
    ignore_eos: bool = False  # vLLM's extension: generate max_tokens even past the end-of-sequence token
    stop_token_ids: list[int] | None = None  # vLLM's extension: token ids that end a choice, as the EOS does
    kvshare_hints: dict | None = None  # agent hints (serve/hints.py), e.g. {"workflow_id": ..., "agent_id": ...}
    # OpenAI's own optional fields, accepted and ignored at their neutral values
    user: str | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict | None = None
    metadata: dict | None = None
    store: bool | None = None
    service_tier: str | None = None
    # vLLM's own fields: implemented ...
    include_stop_str_in_output: bool = False  # the matched stop string (or stop token's text) stays in the text
    truncate_prompt_tokens: int | None = Field(None, ge=-1)  # keep the prompt's last k tokens (-1: the context)
    request_id: str | None = Field(None, min_length=1, max_length=256)  # names the reply's id, as in vLLM
    min_tokens: int = Field(0, ge=0)  # no end-of-sequence, stop token or stop string ends a choice before these
    allowed_token_ids: list[int] | None = None  # sample only among these token ids
    # ... or accepted at vLLM's defaults (VLLM_DEFAULTS); another value is a 400 that names it
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    priority: int = 0
    use_beam_search: bool = False
    length_penalty: float = 1.0
    return_tokens_as_token_ids: bool = False
    bad_words: list[str] | None = None

    KEEP_NULL: ClassVar[tuple[str, ...]] = ()  # fields where null means something else than the default

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data):
        """OpenAI's optional fields are "X or null"; null asks for the default, as in vLLM."""
        if not isinstance(data, dict):
            return data
        return {k: v for k, v in data.items() if v is not None or k in cls.KEEP_NULL}

    VLLM_DEFAULTS: ClassVar[dict[str, Any]] = {
        "skip_special_tokens": True, "spaces_between_special_tokens": True, "priority": 0,
        "use_beam_search": False, "length_penalty": 1.0, "return_tokens_as_token_ids": False, "bad_words": None}

    def check_neutral(self) -> None:
        """A 400 naming the first field set to a value kvshare does not implement."""
        for name, default in self.VLLM_DEFAULTS.items():
            value = getattr(self, name)
            if value != default and not (default is None and value == []):
                raise ApiError(400, f"{name}={value!r} is not supported by kvshare (only vLLM's default, "
                               f"{default!r})", param=name)
        for name in ("frequency_penalty", "presence_penalty"):
            if getattr(self, name) not in (None, 0, 0.0):
                raise ApiError(400, f"{name} is not supported", param=name)
        if self.logit_bias:
            raise ApiError(400, "logit_bias is not supported", param="logit_bias")
        if self.stream_options is not None and not self.stream:
            raise ApiError(400, "stream_options is only allowed with stream: true", param="stream_options")
        if self.stream_options is not None and self.stream_options.continuous_usage_stats:
            raise ApiError(400, "stream_options.continuous_usage_stats is not supported",
                           param="stream_options.continuous_usage_stats")

    @property
    def include_usage(self) -> bool:
        """Whether a stream ends with a usage chunk."""
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class _Lenient(BaseModel):
    """Unknown fields ignored: chat messages carry fields (tool calls' ids, names) we pass on or drop."""

    model_config = ConfigDict(extra="ignore")


class CompletionRequest(OpenAIRequest):
    """``/v1/completions``: OpenAI's four prompt shapes, ``echo``, ``logprobs``."""

    prompt: str | list[str] | list[int] | list[list[int]]
    # 0 with echo: the prompt alone, scored (vLLM's echo without generation); null: the rest of the context (vLLM)
    max_tokens: int | None = Field(16, ge=0)
    KEEP_NULL: ClassVar[tuple[str, ...]] = ("max_tokens",)
    logprobs: int | None = Field(None, ge=0)  # at most ServerLimits.max_logprobs
    echo: bool = False  # the reply starts with the prompt; with logprobs, the prompt is scored
    best_of: int | None = Field(None, ge=1)  # OpenAI's; only 1 (or n) is accepted: no beam/best-of search
    # vLLM's field, with its default: text prompts get the tokenizer's special tokens (a BOS
    # where the model has one; SmolLM2 has none). Token-id prompts are taken as given
    add_special_tokens: bool = True

    def check_neutral(self) -> None:
        super().check_neutral()
        if self.best_of is not None and self.best_of != self.n:  # below n: vLLM's 400 too
            raise ApiError(400, "best_of other than n is not supported", param="best_of")
        if self.max_tokens == 0 and not self.echo:
            raise ApiError(400, "max_tokens 0 generates nothing: it takes echo: true (the prompt alone, scored)",
                           param="max_tokens")
        if self.stream and self.echo and self.logprobs is not None:  # the prompt's scores are not streamed
            raise ApiError(400, "echo with logprobs is not supported with stream: true", param="logprobs")
        if self.max_tokens == 0 and self.stream:
            raise ApiError(400, "max_tokens 0 (the prompt alone, scored) is not supported with stream",
                           param="max_tokens")

    @property
    def prompt_only(self) -> bool:
        """echo with max_tokens 0: the reply is the prompt and its scores, nothing generated."""
        return self.max_tokens == 0


class ChatMessage(_Lenient):
    """One message of a conversation, as OpenAI's clients send it."""

    # OpenAI's roles (system, developer, user, assistant, tool) or any the chat template knows, as vLLM
    role: str
    content: str | list[dict] | None = None  # text, OpenAI's content parts ("text" ones), or none (tool calls)
    # what OpenAI's tool-calling turns carry; the chat template receives them (as in vLLM)
    name: str | None = None
    tool_calls: list[dict] | None = None
    tool_call_id: str | None = None

    def text(self, where: str) -> str:
        """The message's text: content parts joined by newlines, as vLLM does ("" for none)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        texts = []
        for j, part in enumerate(self.content):
            kind = part.get("type")
            if kind != "text":
                raise ApiError(400, f"{where}.content.{j}: content part type {kind!r} is not supported "
                               "(only 'text' parts)", param=f"{where}.content")
            if not isinstance(part.get("text"), str):
                raise ApiError(400, f"{where}.content.{j}: a text part needs a string 'text'",
                               param=f"{where}.content")
            texts.append(part["text"])
        return "\n".join(texts)


# chat_template_kwargs that would replace what the server itself passes to the template
_TEMPLATE_ARGUMENTS = {"conversation", "messages", "tools", "documents", "chat_template", "tokenize", "padding",
                       "truncation", "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
                       "tokenizer_kwargs", "add_generation_prompt", "continue_final_message"}


class ChatRequest(OpenAIRequest):
    """``/v1/chat/completions``, with vLLM's chat-template fields."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)  # at most ServerLimits.max_logprobs; above 0 needs logprobs
    # vLLM's chat-template fields (an aLoRA's chat always ends with its invocation instead)
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the last (assistant) message is left open, to be continued
    chat_template_kwargs: dict[str, Any] | None = None  # extra template variables, e.g. enable_thinking
    # tool calling is not implemented: accepted where it asks for none, as vLLM without a tool parser
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict | None = None
    echo: bool = False  # vLLM's chat echo: not implemented
    add_special_tokens: bool = False  # vLLM's chat default: the template writes the special tokens

    def check_neutral(self) -> None:
        super().check_neutral()
        if self.add_generation_prompt and self.continue_final_message:
            raise ApiError(400, "continue_final_message needs add_generation_prompt: false (a generation prompt "
                           "after the message would end it)", param="continue_final_message")
        reserved = sorted(_TEMPLATE_ARGUMENTS & set(self.chat_template_kwargs or {}))
        if reserved:
            raise ApiError(400, f"chat_template_kwargs may not set {', '.join(reserved)} (the request's own "
                           "fields do)", param="chat_template_kwargs")
        if self.tools and self.tool_choice != "none":
            raise ApiError(400, "tool calling is not supported by kvshare (tools need tool_choice: \"none\")",
                           param="tools")
        if self.tool_choice not in (None, "none", "auto"):
            raise ApiError(400, "tool_choice other than \"none\" or \"auto\" is not supported", param="tool_choice")
        if self.response_format is not None and self.response_format.get("type") != "text":
            raise ApiError(400, "response_format other than {\"type\": \"text\"} is not supported",
                           param="response_format")
        for name, default in (("echo", False), ("add_special_tokens", False)):
            if getattr(self, name) != default:
                raise ApiError(400, f"{name}={getattr(self, name)!r} is not supported in chat by kvshare",
                               param=name)


class TokenizeRequest(BaseModel):
    """vLLM's ``/tokenize`` body: a ``prompt``, encoded as ``/v1/completions`` encodes it, or
    ``messages``, rendered as ``/v1/chat/completions`` renders them for ``model`` (an adapter's
    training system prompt and an aLoRA's invocation included), so the count is the prompt
    the server would run."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None  # default: the first served base
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool = False  # as /v1/completions (off by default, unlike vLLM)


class DetokenizeRequest(BaseModel):
    """vLLM's ``/detokenize`` body."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[int]


class LoadLoraRequest(BaseModel):
    """vLLM's ``/v1/load_lora_adapter`` body; ``base_model_name`` (as in vLLM's
    ``--lora-modules`` JSON) picks the co-located base to load onto (default: the first)."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)
    base_model_name: str | None = Field(None, min_length=1)


class UnloadLoraRequest(BaseModel):
    """vLLM's ``/v1/unload_lora_adapter`` body (adapters are named, so ``lora_int_id`` is not taken)."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1)
