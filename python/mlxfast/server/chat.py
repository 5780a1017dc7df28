"""The chat layer under every chat API (OpenAI chat completions, Anthropic
messages, OpenAI responses).

Each API adapter converts its body into a neutral ``ChatRequest``;
``prepare`` is the one path from there to an engine request (template,
tools, grammar, thinking, token budget); ``OutputParser`` turns the engine's
text into typed output events that each API serialises in its own wire
format:

``events.py``'s ContentDelta, ReasoningDelta and the tool-call start /
arguments piece / end.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..engine.api import Request as EngineRequest
from ..text import tool_calls as tc
from ..text.reasoning import ReasoningParser
from . import generation as gen
from .common import new_id
from .errors import bad_request
from .events import ContentDelta, ReasoningDelta
from .prompts import ChatPrompt, build_chat_prompt, require_template

TOOL_CHOICES = ("auto", "none", "required", "function")


@dataclass
class ChatRequest:
    """What a chat API asks of the engine, whatever its wire format."""

    messages: list[dict]  # Hugging Face template form (see prompts.py)
    sampling: Any  # an object with OpenAI-named sampling fields (temperature, top_p, seed, ...)
    max_tokens: int | None = None  # None: the server's default
    stop: list[str] | str | None = None
    tools: list[dict] | None = None  # [{"type": "function", "function": {name, description, parameters}}]
    tool_choice: str = "auto"  # one of TOOL_CHOICES
    forced_tool: str | None = None  # the tool named by tool_choice "function"
    max_tool_calls: int | None = None  # calls given out at most (1: parallel calls off)
    json_output: bool = False  # the answer is JSON: any object, or ``output_schema``
    output_schema: dict | None = None
    output_param: str = "response_format"  # the field named in its errors
    tool_params_param: str = "tools[{i}].function.parameters"  # a tool's schema, as its errors name it
    prompt_param: str = "messages"  # the field a context overflow names
    guided: tuple | None = None  # vLLM's structured output (grammar.guided_spec): (kind, value, param, extra_keys)
    thinking: bool | None = None  # asked for explicitly (None: the template's default)
    template_kwargs: dict = field(default_factory=dict)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    cache_salt: str = ""
    id_prefix: str = "chatcmpl-"


@dataclass
class Prepared:
    request: EngineRequest
    prompt: ChatPrompt
    tool_family: str | None  # the tool-call markup to parse (None: tools off)
    reasoning: bool  # split <think> blocks from the answer
    max_tool_calls: int | None

    def parser(self) -> "OutputParser":
        return OutputParser(reasoning=self.reasoning,
                            in_reasoning=self.reasoning and self.prompt.in_reasoning,
                            tool_family=self.tool_family,
                            max_calls=self.max_tool_calls)


def _check_tools(chat: ChatRequest) -> bool:
    """Whether tools are on; a 400 for a choice the tools cannot meet."""
    if chat.tool_choice not in TOOL_CHOICES:
        raise bad_request(f"unknown tool_choice {chat.tool_choice!r}", "tool_choice")
    names = [t["function"]["name"] for t in chat.tools or []]
    for i, t in enumerate(chat.tools or []):
        # A call's arguments are an object (OpenAI and Anthropic reject any
        # other schema): a forced call under another one would be markup the
        # parser cannot read back as a call.
        params = t["function"].get("parameters")
        if params is not None and (not isinstance(params, dict) or params.get("type", "object") != "object"):
            got = params.get("type") if isinstance(params, dict) else type(params).__name__
            param = chat.tool_params_param.format(i=i)
            raise bad_request(f"{param}: the schema of tool '{names[i]}' must have type 'object' "
                              f"(a call's arguments are an object), got {got!r}", param)
    if chat.tool_choice in ("required", "function") and not names:
        raise bad_request("tool_choice requires tools", "tool_choice")
    if chat.tool_choice == "function" and chat.forced_tool not in names:
        raise bad_request(f"tool_choice names '{chat.forced_tool}', which is not in tools", "tool_choice")
    return bool(names) and chat.tool_choice != "none"


def _forces_call(chat: ChatRequest, use_tools: bool) -> bool:
    return use_tools and chat.tool_choice in ("required", "function")


def render(state, chat: ChatRequest) -> tuple[ChatPrompt, bool]:
    """The prompt (rendered and tokenized) and whether tools are on."""
    require_template(state.tokenizer)  # before anything else: no chat request can work without one
    use_tools = _check_tools(chat)
    if chat.guided is not None and (chat.json_output or _forces_call(chat, use_tools)):
        other = chat.output_param if chat.json_output else "a forced tool call"
        raise bad_request(f"{chat.guided[2]} cannot be combined with {other}", chat.guided[2])
    constrained = chat.json_output or _forces_call(chat, use_tools) or chat.guided is not None
    kwargs = dict(chat.template_kwargs)
    if chat.thinking is not None:
        if chat.thinking and constrained:
            raise bad_request("thinking cannot be enabled together with a structured output format or a "
                              "forced tool call: the grammar leaves no room for a thinking block",
                              chat.output_param if chat.json_output else
                              chat.guided[2] if chat.guided is not None else "tool_choice")
        kwargs["enable_thinking"] = chat.thinking
    elif constrained:
        kwargs["enable_thinking"] = False  # the grammar leaves no room for <think>
    prompt = build_chat_prompt(
        state.tokenizer, chat.messages, tools=chat.tools, use_tools=use_tools, template_kwargs=kwargs,
        add_generation_prompt=chat.add_generation_prompt, continue_final_message=chat.continue_final_message,
        keep_billing_header=state.settings.keep_billing_header)
    return prompt, use_tools


def _grammar(state, chat: ChatRequest, prompt: ChatPrompt, use_tools: bool):
    """The grammar the answer must follow, or None. A forced call is one call
    in the model's tool markup; tools left to the model's choice together
    with a JSON format allow either a call or the JSON answer."""
    if chat.guided is not None:
        return state.grammar.guided(*chat.guided)
    answer = (chat.output_schema if chat.output_schema is not None else {"type": "object"}) \
        if chat.json_output else None
    if use_tools and (_forces_call(chat, use_tools) or answer is not None):
        name = chat.forced_tool if chat.tool_choice == "function" else None
        return state.grammar.tool_calls(prompt.tool_family or "hermes", [t["function"] for t in chat.tools],
                                        name, answer=None if _forces_call(chat, use_tools) else answer,
                                        answer_param=chat.output_param)
    if answer is not None:
        return state.grammar.json_schema(chat.output_schema, param=chat.output_param)
    return None


def count(state, chat: ChatRequest) -> int:
    """The prompt's tokens, for a request that would be accepted: its
    grammar compiled too, so a body the generation route refuses is refused
    here as well (Anthropic's count_tokens)."""
    prompt, use_tools = render(state, chat)
    _grammar(state, chat, prompt, use_tools)
    return len(prompt.ids)


def prepare(state, chat: ChatRequest) -> Prepared:
    """The engine request for ``chat`` (runs off the event loop: template
    rendering, tokenizing and grammar compiling take time)."""
    prompt, use_tools = render(state, chat)
    prompt.ids = gen.truncate_prompt(state, prompt.ids, chat.sampling)
    grammar = _grammar(state, chat, prompt, use_tools)
    max_tokens = gen.cap_max_tokens(state, len(prompt.ids), chat.max_tokens, chat.prompt_param)
    # A forced call is the whole answer (the grammar allows nothing else):
    # stop strings cut only text, as OpenAI's and Anthropic's do, not a call's
    # markup ("the" in "get_weather" left an empty answer).
    stop = None if _forces_call(chat, use_tools) else chat.stop
    params = gen.sampling_params(state, chat.sampling, max_tokens, stop=stop, logprobs=chat.logprobs,
                                 top_logprobs=chat.top_logprobs, grammar=grammar)
    request = EngineRequest(prompt_ids=prompt.ids, params=params, request_id=new_id(chat.id_prefix),
                            cache_salt=chat.cache_salt or "")
    # Under a grammar the answer has no think block to split off.
    return Prepared(request, prompt, tool_family=prompt.tool_family if use_tools else None,
                    reasoning=prompt.reasoning and grammar is None,
                    max_tool_calls=chat.max_tool_calls)


class OutputParser:
    """Engine text -> ContentDelta / ReasoningDelta / tool-call events."""

    def __init__(self, *, reasoning: bool, in_reasoning: bool, tool_family: str | None,
                 max_calls: int | None = None):
        self.reasoning = ReasoningParser(in_reasoning) if reasoning else None
        self.tools = tc.make_parser(tool_family) if tool_family else None
        self.max_calls = max_calls

    @property
    def in_reasoning(self) -> bool:
        """Whether the model is writing its reasoning now (for token counts)."""
        return self.reasoning is not None and self.reasoning.in_reasoning

    def feed(self, text: str) -> list:
        return self._route(self.reasoning.feed(text) if self.reasoning else [("content", text)])

    def finish(self, text: str = "") -> list:
        parts = self.reasoning.feed(text) + self.reasoning.finish() if self.reasoning else [("content", text)]
        out = self._route(parts)
        if self.tools:
            out += self._typed(self.tools.finish())
        return _merge(out)

    def _route(self, parts) -> list:
        out: list = []
        for kind, text in parts:
            if not text:
                continue
            if kind == "content" and self.tools:
                out += self._typed(self.tools.feed(text))
            else:
                out.append(ReasoningDelta(text) if kind == "reasoning" else ContentDelta(text))
        return _merge(out)

    def _typed(self, events) -> list:
        out = []
        for e in events:
            if isinstance(e, tc.Text):
                out.append(ContentDelta(e.text))
            elif self.max_calls is None or e.index < self.max_calls:
                out.append(e)
        return out


def _merge(events: list) -> list:
    out: list = []
    for e in events:
        if isinstance(e, (ContentDelta, ReasoningDelta)):
            if not e.text:
                continue
            if out and type(out[-1]) is type(e):
                out[-1] = type(e)(out[-1].text + e.text)
                continue
        out.append(e)
    return out
