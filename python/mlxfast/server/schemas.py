"""Request bodies (pydantic). Types are strict (no "0.5" for a float, no 1
for a bool); ranges follow the OpenAI / Anthropic documentation. Unknown
fields are accepted and ignored, as the peers do."""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

_CFG = ConfigDict(extra="allow", strict=True)
# Counts and ids become C ints in the engine and its kernels.
_INT32_MAX = (1 << 31) - 1


class _Model(BaseModel):
    model_config = _CFG


class FieldError(ValueError):
    """A check across fields that one field fails: the error names it
    (``param``), as a field's own validator's does (errors.validation_message)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


# ---------------------------------------------------------------- OpenAI


class ContentPart(_Model):
    type: str
    text: Optional[str] = None
    refusal: Optional[str] = None  # an assistant's "refusal" part


class FunctionCallIn(_Model):
    name: str
    arguments: Union[str, dict] = "{}"


class ToolCallIn(_Model):
    id: Optional[str] = None
    type: str = "function"
    function: FunctionCallIn


class ChatMessage(_Model):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: Union[str, list[ContentPart], None] = None
    name: Optional[str] = None
    tool_calls: Optional[list[ToolCallIn]] = None
    tool_call_id: Optional[str] = None
    reasoning_content: Optional[str] = None
    reasoning: Optional[str] = None


class FunctionDef(_Model):
    name: str = Field(min_length=1)
    description: Optional[str] = None
    parameters: Optional[dict] = None
    strict: Optional[bool] = None


class ToolDef(_Model):
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedToolChoiceFunction(_Model):
    name: str


class NamedToolChoice(_Model):
    type: Literal["function"] = "function"
    function: NamedToolChoiceFunction


class JsonSchemaFormat(_Model):
    name: Optional[str] = None
    description: Optional[str] = None
    schema_: Optional[dict] = Field(default=None, alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(_Model):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None


class StreamOptions(_Model):
    include_usage: Optional[bool] = False
    continuous_usage_stats: Optional[bool] = False


class SamplingKnobs(_Model):
    """Sampling fields shared by every OpenAI-style API (vLLM's extras included)."""

    temperature: Optional[float] = Field(default=None, ge=0.0, le=2.0)
    top_p: Optional[float] = Field(default=None, gt=0.0, le=1.0)
    top_k: Optional[int] = Field(default=None, ge=-1, le=_INT32_MAX)
    min_p: Optional[float] = Field(default=None, ge=0.0, le=1.0)
    presence_penalty: Optional[float] = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: Optional[float] = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: Optional[float] = Field(default=None, gt=0.0, le=10.0)
    logit_bias: Optional[dict[str, float]] = None
    seed: Optional[int] = Field(default=None, ge=-(1 << 63), le=(1 << 63) - 1)  # int64, as vLLM

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v):
        if v is None:
            return v
        for k, b in v.items():
            if not (k.isascii() and k.isdigit() and len(k) <= 12):
                raise ValueError(f"logit_bias keys must be token ids (decimal digits), got {k[:40]!r}")
            if not -100 <= b <= 100:
                raise ValueError(f"logit_bias values must be within [-100, 100], got {b}")
        return v


class SamplingFields(SamplingKnobs):
    """Fields shared by chat and text completions."""

    model: Optional[str] = None
    max_tokens: Optional[int] = Field(default=None, ge=1)
    stop: Union[str, list[str], None] = None
    stop_token_ids: Optional[list[int]] = None
    n: Optional[int] = Field(default=1, ge=1, le=128)
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    ignore_eos: Optional[bool] = False
    min_tokens: Optional[int] = Field(default=None, ge=0, le=_INT32_MAX)  # vLLM's
    include_stop_str_in_output: Optional[bool] = False  # vLLM's
    skip_special_tokens: Optional[bool] = None  # vLLM's (default true)
    truncate_prompt_tokens: Optional[int] = Field(default=None, ge=-1, le=_INT32_MAX)  # vLLM's
    # vLLM's token-id outputs (RL trainers, agent tracing): the prompt's and
    # the output's ids; logprobs naming tokens "token_id:<id>"
    return_token_ids: Optional[bool] = None
    return_tokens_as_token_ids: Optional[bool] = None
    # vLLM's structured output (grammar.guided_spec reads them)
    guided_json: Union[str, dict, None] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None
    structured_outputs: Optional[dict] = None
    # llama.cpp's: a JSON schema or a GBNF grammar the output follows, and
    # n_predict (max_tokens when that is not given; -1: the default)
    json_schema: Optional[dict] = None
    grammar: Optional[str] = None
    n_predict: Optional[int] = Field(default=None, ge=-1, le=_INT32_MAX)
    user: Optional[str] = None
    cache_salt: Optional[str] = None

    @model_validator(mode="after")
    def _vllm_extras(self):
        if self.truncate_prompt_tokens == 0:
            raise FieldError("truncate_prompt_tokens", "must be -1 (as many as the context holds) or at least 1")
        return self

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise FieldError("stream_options", "allowed only when stream is true")
        return self

    @model_validator(mode="after")
    def _n_predict_is_max_tokens(self):
        if self.n_predict is None or self.n_predict < 0 or self.max_tokens is not None \
                or getattr(self, "max_completion_tokens", None) is not None:
            return self
        if self.n_predict == 0 and "messages" in type(self).model_fields:
            raise FieldError("n_predict", "must be -1 or at least 1 on chat completions")
        self.max_tokens = self.n_predict
        return self

    @model_validator(mode="after")
    def _min_tokens_within_max(self):
        most = getattr(self, "max_completion_tokens", None)
        most = most if most is not None else self.max_tokens
        if self.min_tokens and most is not None and self.min_tokens > most:
            raise FieldError("min_tokens", f"{self.min_tokens} is more than max_tokens ({most})")
        return self

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        if isinstance(v, list) and any(s == "" for s in v):
            raise ValueError("stop strings must not be empty")
        if v == "":
            return None
        return v


class _ChatTemplateFlags(_Model):
    """How the chat template ends the prompt (vLLM's fields)."""

    add_generation_prompt: Optional[bool] = True
    continue_final_message: Optional[bool] = False

    @model_validator(mode="after")
    def _one_ending(self):
        # vLLM's and llama.cpp's rule; the default add_generation_prompt
        # gives way to continue_final_message.
        if self.continue_final_message and self.add_generation_prompt \
                and "add_generation_prompt" in self.model_fields_set:
            raise FieldError("continue_final_message", "cannot be true together with add_generation_prompt "
                             "(continuing the final message adds no generation prompt)")
        return self


class ChatCompletionRequest(_ChatTemplateFlags, SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(default=None, ge=1)
    logprobs: Optional[bool] = False
    top_logprobs: Optional[int] = Field(default=None, ge=0, le=20)
    response_format: Optional[ResponseFormat] = None
    tools: Optional[list[ToolDef]] = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: Optional[bool] = None
    # Legacy function calling (OpenAI still accepts it): mapped onto tools.
    prompt_logprobs: Optional[int] = None  # vLLM's; supported on /v1/completions only (a 400 here)
    functions: Optional[list[FunctionDef]] = None
    function_call: Union[Literal["none", "auto"], NamedToolChoiceFunction, None] = None
    reasoning_effort: Optional[str] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    echo: Optional[bool] = False  # vLLM's: the answer starts with the last message when it is the assistant's


class CompletionRequest(SamplingFields):
    prompt: Union[str, list[int], list[str], list[list[int]]]
    max_tokens: Optional[int] = Field(default=None, ge=0)  # 0 only with echo (the route checks)
    echo: Optional[bool] = False
    logprobs: Optional[int] = Field(default=None, ge=0, le=20)
    prompt_logprobs: Optional[int] = Field(default=None, ge=0, le=20)  # vLLM's
    suffix: Optional[str] = None
    best_of: Optional[int] = Field(default=None, ge=1, le=128)
    response_format: Optional[ResponseFormat] = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_is_one_kind(cls, v):
        # The union's own error names only its first member ("a valid string").
        if isinstance(v, list) and len({str if isinstance(p, str) else list if isinstance(p, list) else int
                                         for p in v}) > 1:
            raise ValueError("prompt is a string, a list of strings, a list of token ids or a list of "
                             "token-id lists, not a mix of them")
        return v


class TokenizeRequest(_ChatTemplateFlags):
    """vLLM's /tokenize (a prompt, or messages rendered as chat completions
    renders them), and llama.cpp's (``content``, ``add_special``, ``with_pieces``)."""

    model: Optional[str] = None
    prompt: Optional[str] = None
    content: Optional[str] = None  # llama.cpp's name for prompt
    messages: Optional[list[ChatMessage]] = None
    add_special_tokens: Optional[bool] = None  # default: True for a prompt (the chat template has its own)
    add_special: Optional[bool] = None  # llama.cpp's name for add_special_tokens
    tools: Optional[list[ToolDef]] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    return_token_strs: Optional[bool] = None
    with_pieces: Optional[bool] = False  # llama.cpp's: tokens as {id, piece}


class DetokenizeRequest(_Model):
    model: Optional[str] = None
    tokens: list[int]


# ---------------------------------------------------------------- Anthropic


class AnthropicMessage(_Model):
    # "system": the mid-conversation system messages of the
    # mid-conversation-* betas (Claude Code sends its environment so).
    role: Literal["user", "assistant", "system"]
    content: Union[str, list[dict]]
    clear_at: Optional[Literal["next_user_message", "never"]] = None
    output_config: Optional[dict] = None

    @model_validator(mode="after")
    def _system_only_fields(self):
        for name in ("clear_at", "output_config"):
            if getattr(self, name) is not None and self.role != "system":
                raise FieldError(name, f"{name} is only permitted on role 'system' messages")
        return self


class AnthropicTool(_Model):
    name: str = Field(min_length=1)
    description: Optional[str] = None
    input_schema: Optional[dict] = None
    type: Optional[str] = None
    strict: Optional[bool] = None  # input_schema enforced when the tool is forced (always, here)


class AnthropicOutputFormat(_Model):
    type: Literal["json_schema"]
    schema_: dict = Field(alias="schema")


class AnthropicOutputConfig(_Model):
    format: Optional[AnthropicOutputFormat] = None
    effort: Optional[Literal["low", "medium", "high", "xhigh", "max"]] = None


class AnthropicToolChoice(_Model):
    type: Literal["auto", "any", "tool", "none"]
    name: Optional[str] = None
    disable_parallel_tool_use: Optional[bool] = None


class AnthropicThinking(_Model):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Optional[int] = Field(default=None, ge=1, le=_INT32_MAX)


class AnthropicRequest(_Model):
    model: str
    max_tokens: int = Field(ge=1)
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: Union[str, list[dict], None] = None
    tools: Optional[list[AnthropicTool]] = None
    tool_choice: Optional[AnthropicToolChoice] = None
    stop_sequences: Optional[list[str]] = None
    temperature: Optional[float] = Field(default=None, ge=0.0, le=1.0)
    top_p: Optional[float] = Field(default=None, gt=0.0, le=1.0)
    top_k: Optional[int] = Field(default=None, ge=0, le=_INT32_MAX)
    metadata: Optional[dict] = None
    stream: Optional[bool] = False
    thinking: Optional[AnthropicThinking] = None
    output_config: Optional[AnthropicOutputConfig] = None
    output_format: Optional[AnthropicOutputFormat] = None  # the structured-outputs beta's name for it

    @field_validator("stop_sequences")
    @classmethod
    def _stop_sequences(cls, v):
        if v and any(s == "" for s in v):  # as OpenAI's stop: an empty one would match everywhere
            raise ValueError("stop sequences must not be empty")
        return v


class AnthropicCountRequest(_Model):
    model: str
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: Union[str, list[dict], None] = None
    tools: Optional[list[AnthropicTool]] = None
    tool_choice: Optional[AnthropicToolChoice] = None
    thinking: Optional[AnthropicThinking] = None
    output_config: Optional[AnthropicOutputConfig] = None
    output_format: Optional[AnthropicOutputFormat] = None


# ---------------------------------------------------------------- OpenAI Responses


class ResponsesTextFormat(_Model):
    type: Literal["text", "json_schema", "json_object"]
    name: Optional[str] = None
    description: Optional[str] = None
    schema_: Optional[dict] = Field(default=None, alias="schema")
    strict: Optional[bool] = None


class ResponsesText(_Model):
    format: Optional[ResponsesTextFormat] = None
    verbosity: Optional[Literal["low", "medium", "high"]] = None


class ResponsesReasoning(_Model):
    effort: Optional[str] = None  # mapped like reasoning_effort (an unknown value is a 400 there)
    summary: Optional[Literal["auto", "concise", "detailed"]] = None
    generate_summary: Optional[Literal["auto", "concise", "detailed"]] = None


# ``include`` values a client may ask for; the ones about hosted tools have
# nothing to include here, reasoning.encrypted_content comes back as null.
RESPONSES_INCLUDES = frozenset({
    "message.output_text.logprobs", "reasoning.encrypted_content", "message.input_image.image_url",
    "computer_call_output.output.image_url", "file_search_call.results", "web_search_call.results",
    "web_search_call.action.sources", "code_interpreter_call.outputs",
})


class ResponsesRequest(SamplingKnobs):
    model: Optional[str] = None
    input: Union[str, list[dict]]
    instructions: Optional[str] = None
    tools: Optional[list[dict]] = None
    tool_choice: Union[Literal["none", "auto", "required"], dict, None] = None
    parallel_tool_calls: Optional[bool] = None
    max_tool_calls: Optional[int] = Field(default=None, ge=1, le=_INT32_MAX)
    text: Optional[ResponsesText] = None
    reasoning: Optional[ResponsesReasoning] = None
    max_output_tokens: Optional[int] = Field(default=None, ge=1, le=_INT32_MAX)
    top_logprobs: Optional[int] = Field(default=None, ge=0, le=20)
    stream: Optional[bool] = False
    stream_options: Optional[dict] = None
    store: Optional[bool] = True
    previous_response_id: Optional[str] = None
    include: Optional[list[str]] = None
    metadata: Optional[dict[str, str]] = None
    user: Optional[str] = None
    safety_identifier: Optional[str] = None
    prompt_cache_key: Optional[str] = None
    service_tier: Optional[str] = None
    truncation: Optional[Literal["auto", "disabled"]] = None
    background: Optional[bool] = None
    conversation: Optional[Union[str, dict]] = None
    prompt: Optional[dict] = None

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, v):
        if v is None:
            return v
        if len(v) > 16:
            raise ValueError("metadata holds at most 16 keys")
        for k, x in v.items():
            if len(k) > 64 or len(x) > 512:
                raise ValueError("metadata keys are at most 64 characters, values at most 512")
        return v

    @field_validator("include")
    @classmethod
    def _include(cls, v):
        for x in v or []:
            if x not in RESPONSES_INCLUDES:
                raise ValueError(f"unknown include value {x[:80]!r}; supported: "
                                 + ", ".join(sorted(RESPONSES_INCLUDES)))
        return v

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise FieldError("stream_options", "allowed only when stream is true")
        return self
