"""OpenAI's Responses API: POST /v1/responses (stateless, or continuing a
stored response with ``previous_response_id``), GET and DELETE
/v1/responses/{id}, GET /v1/responses/{id}/input_items.

A converter (input items -> the chat layer's ChatRequest) and a serialiser
(the chat layer's output events -> output items and the stream's events);
everything between is the chat layer's.
"""

from __future__ import annotations

import copy
import json
import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from . import chat
from . import generation as gen
from .chat import ChatRequest
from .common import loads_field, new_id, off_loop, ready_body, state_of
from .errors import APIError, bad_request
from .events import ContentDelta, ReasoningDelta, ToolCallArgs, ToolCallEnd, ToolCallStart
from .openai import chat_logprobs
from .prompts import template_kwargs_for, tool_message_content
from .response_store import StoredResponse
from .schemas import ResponsesRequest
from .sse import named_event, sse_response

router = APIRouter()

# Web search, which Codex CLI offers by default: accepted and never offered
# to the model (there is no search here), as a model that chose not to
# search; forcing it with tool_choice is a 400. The other hosted tools act
# on the client's data (files, a computer, a container): a 400.
_WEB_SEARCH = ("web_search", "web_search_preview", "web_search_2025_08_26", "web_search_preview_2025_03_11")
# Tools OpenAI runs on its side, or whose calls only its models make;
# mlxfast runs none of them.
_HOSTED_TOOLS = _WEB_SEARCH + ("file_search", "computer", "computer_use_preview", "mcp", "code_interpreter",
                               "image_generation", "local_shell", "shell", "apply_patch")
# Input items that only hosted tools make.
_HOSTED_ITEMS = ("web_search_call", "file_search_call", "computer_call", "computer_call_output",
                 "code_interpreter_call", "image_generation_call", "local_shell_call", "local_shell_call_output",
                 "shell_call", "shell_call_output", "apply_patch_call", "apply_patch_call_output",
                 "mcp_call", "mcp_list_tools", "mcp_approval_request", "mcp_approval_response",
                 "custom_tool_call", "custom_tool_call_output")
_MEDIA_PARTS = ("input_image", "input_file", "input_audio", "image_url", "file")


# ------------------------------------------------------------ input


def _text_parts(content, where: str, role: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where}.content must be a string or a list of content parts", "input")
    texts = []
    for j, part in enumerate(content):
        pw = f"{where}.content[{j}]"
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise bad_request(f"{pw} must be a content part with a 'type'", "input")
        t = part["type"]
        if t in ("input_text", "output_text") or (t == "refusal" and role == "assistant"):
            text = part.get("refusal" if t == "refusal" else "text")
            if not isinstance(text, str):
                raise bad_request(f"{pw}: a '{t}' part needs a string '{'refusal' if t == 'refusal' else 'text'}'",
                                  "input")
            texts.append(text)
        elif t in _MEDIA_PARTS:
            raise bad_request(f"{pw} is an '{t}' part, but this model is text-only (it accepts input_text "
                              "and output_text parts only)", "input")
        else:
            raise bad_request(f"{pw} has unknown content part type '{t}'", "input")
    return "".join(texts)


def _namespace(item: dict, where: str) -> str | None:
    ns = item.get("namespace")
    if ns is not None and (not isinstance(ns, str) or not ns):
        raise bad_request(f"{where}: 'namespace' must be a non-empty string", "input")
    return ns


def _string(item: dict, key: str, where: str) -> str:
    v = item.get(key)
    if not isinstance(v, str) or not v:
        raise bad_request(f"{where}: '{key}' must be a non-empty string", "input")
    return v


def to_messages(items: list, names: ToolNames | None = None) -> list[dict]:
    """Responses input items -> chat messages (Hugging Face template form);
    calls name their functions as ``names`` shows them to the model."""
    names = names or ToolNames([])
    out: list[dict] = []
    reasoning: list[str] = []  # reasoning items wait for the assistant turn they belong to

    def assistant() -> dict:
        if out and out[-1]["role"] == "assistant" and "_closed" not in out[-1]:
            return out[-1]
        out.append({"role": "assistant", "content": ""})
        return out[-1]

    def take_reasoning(msg: dict) -> None:
        if reasoning:
            msg["reasoning_content"] = "\n".join(reasoning)
            reasoning.clear()

    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"{where} must be an object (an input item)", "input")
        if item.get("id") is not None and not isinstance(item["id"], str):
            raise bad_request(f"{where}: 'id' must be a string", "input")
        t = item.get("type", "message" if "role" in item else None)
        if not isinstance(t, str):
            raise bad_request(f"{where} needs a 'type' (or a 'role', for a message)", "input")
        if t == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise bad_request(f"{where}: unknown role {role!r} (expected user, assistant, system or developer)",
                                  "input")
            if "content" not in item:
                raise bad_request(f"{where}: a message needs 'content'", "input")
            text = _text_parts(item["content"], where, role)
            if role == "assistant":
                msg = assistant()
                if msg.get("tool_calls"):  # text after this turn's calls starts a new turn
                    msg["_closed"] = True
                    msg = assistant()
                msg["content"] += text
                take_reasoning(msg)
            else:
                out.append({"role": "system" if role == "developer" else role, "content": text})
        elif t == "function_call":
            name, call_id = _string(item, "name", where), _string(item, "call_id", where)
            name = names.shown(_namespace(item, where), name)
            args = item.get("arguments", "")
            if not isinstance(args, str):
                raise bad_request(f"{where}: 'arguments' must be a string of JSON", "input")
            parsed = loads_field(args, f"{where}: 'arguments'", "input", model_output=True) if args.strip() else {}
            msg = assistant()
            take_reasoning(msg)
            msg.setdefault("tool_calls", []).append(
                {"id": call_id, "type": "function", "function": {"name": name, "arguments": parsed}})
        elif t == "function_call_output":
            # call_id, or else the tool's name (and namespace): an output
            # the client made without a call (Codex CLI's goals).
            call_id = _string(item, "call_id", where) if item.get("call_id") is not None else None
            name = None
            if call_id is None:
                if item.get("name") is None:
                    raise bad_request(f"{where}: a function_call_output needs a 'call_id' (or the tool's 'name')",
                                      "input")
                name = names.shown(_namespace(item, where), _string(item, "name", where))
            output = item.get("output")
            if isinstance(output, list):
                output = _text_parts(output, where, "tool")
            elif not isinstance(output, str):
                raise bad_request(f"{where}: 'output' must be a string or a list of content parts", "input")
            if out and out[-1]["role"] == "assistant":
                out[-1]["_closed"] = True
            msg = {"role": "tool", "content": tool_message_content(output)}
            msg.update({"tool_call_id": call_id} if call_id is not None else {"name": name})
            out.append(msg)
        elif t == "reasoning":
            texts = []
            for key in ("content", "summary"):  # its full text where given, else its summary
                parts = item.get(key) or []
                if not isinstance(parts, list):
                    raise bad_request(f"{where}: '{key}' must be a list of parts", "input")
                texts = [p["text"] for p in parts if isinstance(p, dict) and isinstance(p.get("text"), str)]
                if texts:
                    break
            if texts:
                reasoning.append("\n".join(texts))
        elif t in _HOSTED_ITEMS:
            raise bad_request(f"{where} is a '{t}' item, which comes from a tool that OpenAI hosts; "
                              "mlxfast runs function tools only", "input")
        elif t == "item_reference":
            raise bad_request(f"{where}: item_reference is not supported; send the item itself, or continue "
                              "a stored response with previous_response_id", "input")
        else:
            raise bad_request(f"{where} has unknown item type '{t}'", "input")
    for m in out:
        m.pop("_closed", None)
    return out


class ToolNames:
    """Function tools as the model is shown them, and back. A namespace
    tool's functions are shown under their own names, or as
    ``namespace.name`` where another function has the same name; a call
    goes back to the client as (namespace, name), as OpenAI's
    ``function_call`` items carry it."""

    def __init__(self, pairs: list[tuple[str | None, str]]):
        counts: dict[str, int] = {}
        for _, name in pairs:
            counts[name] = counts.get(name, 0) + 1
        self._shown: dict[tuple[str | None, str], str] = {}
        self._origin: dict[str, tuple[str | None, str]] = {}
        for ns, name in pairs:
            shown = name if ns is None or counts[name] == 1 else f"{ns}.{name}"
            self._shown.setdefault((ns, name), shown)
            self._origin.setdefault(shown, (ns, name))

    def shown(self, namespace: str | None, name: str) -> str:
        return self._shown.get((namespace, name), name)

    def origin(self, shown: str) -> tuple[str | None, str]:
        return self._origin.get(shown, (None, shown))

    def chosen(self, name: str) -> str:
        """tool_choice's function by its own name (one in a namespace too)."""
        if name in self._origin:
            return name
        matches = [s for (_, n), s in self._shown.items() if n == name]
        return matches[0] if len(matches) == 1 else name


def _function(t: dict, where: str, param: str, context: str | None = None) -> dict:
    """A function tool in the chat layer's form (``context``: its namespace's description)."""
    name = t.get("name")
    if not isinstance(name, str) or not name:
        raise bad_request(f"{where}: a function tool needs a non-empty 'name'", f"{param}.name")
    params = t.get("parameters")
    if params is not None and not isinstance(params, dict):
        raise bad_request(f"{where}: 'parameters' must be a JSON schema object", f"{param}.parameters")
    desc = t.get("description")
    if desc is not None and not isinstance(desc, str):
        raise bad_request(f"{where}: 'description' must be a string", f"{param}.description")
    desc = " ".join(filter(None, (context, desc)))
    fn = {"name": name, "parameters": params or {"type": "object", "properties": {}}}
    if desc:
        fn["description"] = desc
    return fn


def _unsupported_tool(typ, where: str, param: str) -> APIError:
    if typ in _HOSTED_TOOLS:
        return bad_request(f"{where} is the hosted tool '{typ}', which mlxfast does not run; "
                           "define it as a function tool instead", f"{param}.type")
    if typ == "custom":
        return bad_request(f"{where} is a custom (free-form input) tool, which mlxfast does not support; "
                           "define it as a function tool with a JSON schema instead", f"{param}.type")
    return bad_request(f"{where} has unknown tool type {typ!r} (mlxfast runs function tools, "
                       "also in namespaces)", f"{param}.type")


def _tools(body: ResponsesRequest) -> tuple[list[dict] | None, ToolNames]:
    """The request's function tools, a namespace's flattened, in the chat
    layer's form (shown names), and the names' map."""
    found: list[tuple[str | None, dict]] = []
    for i, t in enumerate(body.tools or []):
        where = param = f"tools[{i}]"
        typ = t.get("type") if isinstance(t, dict) else None
        if typ == "function":
            found.append((None, _function(t, where, param)))
        elif typ == "namespace":
            ns, inner, desc = t.get("name"), t.get("tools"), t.get("description")
            if not isinstance(ns, str) or not ns:
                raise bad_request(f"{where}: a namespace needs a non-empty 'name'", f"{param}.name")
            if not isinstance(inner, list):
                raise bad_request(f"{where}: a namespace's 'tools' must be a list", f"{param}.tools")
            if desc is not None and not isinstance(desc, str):
                raise bad_request(f"{where}: 'description' must be a string", f"{param}.description")
            for j, u in enumerate(inner):
                w = p = f"{param}.tools[{j}]"
                kind = u.get("type") if isinstance(u, dict) else None
                if kind != "function":
                    raise _unsupported_tool(kind, w, p)
                found.append((ns, _function(u, w, p, desc)))
        elif typ not in _WEB_SEARCH:
            raise _unsupported_tool(typ, where, param)
    names = ToolNames([(ns, fn["name"]) for ns, fn in found])
    tools = [{"type": "function", "function": {**fn, "name": names.shown(ns, fn["name"])}} for ns, fn in found]
    return tools or None, names


def _tool_choice(choice) -> tuple[str, str | None]:
    if choice is None:
        return "auto", None
    if isinstance(choice, str):
        return choice, None
    typ = choice.get("type")
    if typ == "function":
        name = choice.get("name")
        if not isinstance(name, str) or not name:
            raise bad_request("tool_choice of type 'function' needs a 'name'", "tool_choice")
        return "function", name
    raise bad_request(f"tool_choice of type {typ!r} is not supported (use auto, none, required or "
                      "{\"type\": \"function\", \"name\": ...})", "tool_choice")


def _unsupported(body: ResponsesRequest) -> None:
    if body.background:
        raise bad_request("background responses are not supported: mlxfast answers in the request "
                          "(stream it to see it as it is written)", "background")
    if body.conversation is not None:
        raise bad_request("conversation objects are not supported; continue with previous_response_id",
                          "conversation")
    if body.prompt is not None:
        raise bad_request("stored prompt templates (prompt) are not supported; send instructions and input",
                          "prompt")
    if body.truncation == "auto":
        raise bad_request("truncation 'auto' is not supported: a conversation longer than the context is a 400 "
                          "(truncation 'disabled')", "truncation")


def chat_request(body: ResponsesRequest, history: list[dict]) -> ChatRequest:
    """A Responses body (and the conversation it continues) in the chat layer's form."""
    _unsupported(body)
    tools, names = _tools(body)
    if isinstance(body.input, str):
        messages = [{"role": "user", "content": body.input}]
    else:
        messages = to_messages(body.input, names)
    messages = history + messages
    if body.instructions:  # this request's only: instructions do not carry over a continuation
        messages = [{"role": "system", "content": body.instructions}] + messages
    if not messages:
        raise bad_request("input is empty", "input")
    choice, forced = _tool_choice(body.tool_choice)
    forced = names.chosen(forced) if forced is not None else None
    fmt = body.text.format if body.text is not None else None
    schema = None
    if fmt is not None and fmt.type == "json_schema":
        if fmt.schema_ is None:
            raise bad_request("text.format of type json_schema needs a 'schema'", "text.format.schema")
        schema = fmt.schema_
    effort = body.reasoning.effort if body.reasoning is not None else None
    limit = body.max_tool_calls
    if body.parallel_tool_calls is False:
        limit = 1
    return ChatRequest(
        messages=messages, sampling=body, max_tokens=body.max_output_tokens, tools=tools,
        tool_choice=choice, forced_tool=forced, max_tool_calls=limit,
        json_output=fmt is not None and fmt.type != "text", output_schema=schema, output_param="text.format",
        template_kwargs=template_kwargs_for(effort, None, effort_param="reasoning.effort"),
        logprobs=_wants_logprobs(body), top_logprobs=body.top_logprobs or 0, id_prefix="resp_",
        tool_params_param="tools[{i}].parameters", prompt_param="input")


def _wants_logprobs(body: ResponsesRequest) -> bool:
    return body.top_logprobs is not None or "message.output_text.logprobs" in (body.include or [])


_ITEM_ID_PREFIXES = {"message": "msg_", "function_call": "fc_", "function_call_output": "fco_", "reasoning": "rs_"}


def _input_items(body: ResponsesRequest) -> list[dict]:
    """The input as the items /input_items lists: each with its type, an id,
    a status where the item kind has one, and message content as parts."""
    raw = [{"role": "user", "content": body.input}] if isinstance(body.input, str) else body.input
    items = []
    for given in raw:
        item = copy.deepcopy(given)
        kind = item.setdefault("type", "message")
        if item.get("id") is None:  # absent or null (clients send null for items they made)
            item["id"] = new_id(_ITEM_ID_PREFIXES.get(kind, "item_"))
        if kind == "message":
            part_type = "output_text" if item.get("role") == "assistant" else "input_text"
            if isinstance(item.get("content"), str):
                item["content"] = [{"type": part_type, "text": item["content"]}]
            for part in item["content"]:
                if part.get("type") == "output_text":
                    part.setdefault("annotations", [])
            item.setdefault("status", "completed")
        elif kind in ("function_call", "function_call_output"):
            item.setdefault("status", "completed")
        items.append(item)
    return items


# ------------------------------------------------------------ output


class _Output:
    """The response's output items, built from the chat layer's events.
    ``feed`` and ``finish`` return the stream events that each step makes
    (without sequence numbers); a non-streamed response drops them, so both
    build the same items."""

    def __init__(self, tokenizer, logprobs: bool, top_n: int, names: ToolNames | None = None):
        self.items: list[dict] = []
        self._tool_names = names or ToolNames([])
        self._open: dict | None = None
        self._calls: dict[int, dict] = {}
        self._names, self._logprobs, self._top_n = gen.token_names(tokenizer), logprobs, top_n
        self._pending_lp: list[dict] = []
        self.reasoning_tokens = 0

    @property
    def _index(self) -> int:
        return len(self.items) - 1

    def _add(self, item: dict) -> list[dict]:
        self.items.append(item)
        self._open = item
        return [{"type": "response.output_item.added", "output_index": self._index, "item": copy.deepcopy(item)}]

    def _ensure(self, kind: str) -> list[dict]:
        if self._open is not None and self._open["type"] == kind:
            return []
        out = self.close()
        if kind == "message":
            out += self._add({"type": "message", "id": new_id("msg_"), "status": "in_progress",
                              "role": "assistant", "content": []})
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            self._open["content"].append(part)
            out.append({"type": "response.content_part.added", "item_id": self._open["id"],
                        "output_index": self._index, "content_index": 0, "part": copy.deepcopy(part)})
        else:
            out += self._add({"type": "reasoning", "id": new_id("rs_"), "summary": [], "encrypted_content": None})
            part = {"type": "summary_text", "text": ""}
            self._open["summary"].append(part)
            out.append({"type": "response.reasoning_summary_part.added", "item_id": self._open["id"],
                        "output_index": self._index, "summary_index": 0, "part": copy.deepcopy(part)})
        return out

    def feed(self, step) -> list[dict]:
        if step.token is not None:
            self.reasoning_tokens += step.reasoning
            if self._logprobs:
                self._pending_lp.append(chat_logprobs(self._names, step.token, self._top_n))
        out: list[dict] = []
        for p in step.pieces:
            if isinstance(p, ContentDelta):
                out += self._ensure("message")
                part, lp = self._open["content"][0], self._pending_lp
                self._pending_lp = []
                part["text"] += p.text
                part["logprobs"] += lp
                out.append({"type": "response.output_text.delta", "item_id": self._open["id"],
                            "output_index": self._index, "content_index": 0, "delta": p.text, "logprobs": lp})
            elif isinstance(p, ReasoningDelta):
                out += self._ensure("reasoning")
                self._open["summary"][0]["text"] += p.text
                out.append({"type": "response.reasoning_summary_text.delta", "item_id": self._open["id"],
                            "output_index": self._index, "summary_index": 0, "delta": p.text})
            elif isinstance(p, ToolCallStart):
                out += self.close()
                ns, name = self._tool_names.origin(p.name)
                item = {"type": "function_call", "id": new_id("fc_"), "call_id": new_id("call_"),
                        "name": name, "arguments": "", "status": "in_progress"}
                if ns is not None:
                    item["namespace"] = ns
                out += self._add(item)
                self._calls[p.index] = self._open
            elif isinstance(p, ToolCallArgs):
                item = self._calls[p.index]
                item["arguments"] += p.text
                out.append({"type": "response.function_call_arguments.delta", "item_id": item["id"],
                            "output_index": self.items.index(item), "delta": p.text})
            elif isinstance(p, ToolCallEnd):  # a call the output's end cut off is incomplete
                cut = step.finish is not None and step.finish.finish_reason == "length"
                out += self.close("incomplete" if cut else "completed")
        return out

    def close(self, status: str = "completed") -> list[dict]:
        """Close the item being written."""
        item, self._open = self._open, None
        if item is None:
            return []
        at, out = self.items.index(item), []
        if item["type"] == "message":
            part = item["content"][0]
            part["logprobs"] += self._pending_lp
            self._pending_lp = []
            out += [{"type": "response.output_text.done", "item_id": item["id"], "output_index": at,
                     "content_index": 0, "text": part["text"], "logprobs": part["logprobs"]},
                    {"type": "response.content_part.done", "item_id": item["id"], "output_index": at,
                     "content_index": 0, "part": part}]
            item["status"] = status
        elif item["type"] == "reasoning":
            part = item["summary"][0]
            out += [{"type": "response.reasoning_summary_text.done", "item_id": item["id"], "output_index": at,
                     "summary_index": 0, "text": part["text"]},
                    {"type": "response.reasoning_summary_part.done", "item_id": item["id"], "output_index": at,
                     "summary_index": 0, "part": part}]
        else:
            out.append({"type": "response.function_call_arguments.done", "item_id": item["id"],
                        "output_index": at, "name": item["name"], "arguments": item["arguments"]})
            item["status"] = status
        out.append({"type": "response.output_item.done", "output_index": at, "item": item})
        return out

    def messages(self) -> list[dict]:
        """The output as the chat message a continuation puts in its prompt."""
        msg: dict[str, Any] = {"role": "assistant", "content": ""}
        for item in self.items:
            if item["type"] == "message":
                msg["content"] += item["content"][0]["text"]
            elif item["type"] == "reasoning":
                msg["reasoning_content"] = item["summary"][0]["text"]
            else:
                try:
                    args = json.loads(item["arguments"])
                except (ValueError, RecursionError):  # the model's own text: kept as written
                    args = item["arguments"]
                msg.setdefault("tool_calls", []).append(
                    {"id": item["call_id"], "type": "function",
                     "function": {"name": self._tool_names.shown(item.get("namespace"), item["name"]),
                                  "arguments": args}})
        return [msg] if len(msg) > 2 or msg["content"] else []


class _Turn:
    """One request's response object, from in progress to its end."""

    def __init__(self, state, body: ResponsesRequest, prepared, model: str):
        self.state, self.body, self.model = state, body, model
        self.id = prepared.request.request_id
        self.created_at = int(time.time())
        self.n_prompt = len(prepared.request.prompt_ids)
        self.params = prepared.request.params
        self.output = _Output(state.tokenizer, _wants_logprobs(body), body.top_logprobs or 0, _tools(body)[1])

    def response(self, status: str, finish=None, error: dict | None = None) -> dict:
        b = self.body
        fmt = b.text.format.model_dump(by_alias=True, exclude_none=True) if b.text and b.text.format else \
            {"type": "text"}
        usage = None
        if finish is not None:
            usage = {"input_tokens": finish.prompt_tokens,
                     "input_tokens_details": {"cached_tokens": finish.cached_tokens, "cache_write_tokens": 0},
                     "output_tokens": finish.completion_tokens,
                     "output_tokens_details": {"reasoning_tokens": self.output.reasoning_tokens},
                     "total_tokens": finish.prompt_tokens + finish.completion_tokens}
            if finish.speculation is not None:
                usage["speculation"] = dict(finish.speculation)
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "background": False, "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": b.instructions, "max_output_tokens": b.max_output_tokens,
            "max_tool_calls": b.max_tool_calls, "model": self.model,
            "output": self.output.items if status != "in_progress" else [],
            "parallel_tool_calls": b.parallel_tool_calls is not False,
            "previous_response_id": b.previous_response_id,
            "reasoning": {"effort": b.reasoning.effort if b.reasoning else None,
                          "summary": b.reasoning.summary if b.reasoning else None},
            "service_tier": "default", "store": b.store is not False,
            "temperature": self.params.temperature, "text": {"format": fmt},
            "tool_choice": b.tool_choice if b.tool_choice is not None else "auto",
            "tools": b.tools or [], "top_logprobs": b.top_logprobs, "top_p": self.params.top_p,
            "truncation": b.truncation or "disabled", "usage": usage, "user": b.user,
            "metadata": b.metadata or {}, "prompt_cache_key": b.prompt_cache_key,
            "safety_identifier": b.safety_identifier,
        }

    def end(self, finish, own_messages: list[dict], input_items: list[dict]) -> dict:
        """The final response object (stored, unless the request said not to)."""
        if finish.finish_reason == "error":
            resp = self.response("failed", finish, error={
                "code": "server_error", "message": f"generation failed: {finish.error or 'engine error'}"})
        else:
            resp = self.response("incomplete" if finish.finish_reason == "length" else "completed", finish)
        if self.body.store is not False:
            self.state.responses.put(StoredResponse(
                response=resp, messages=own_messages + self.output.messages(), input_items=input_items,
                previous_id=self.body.previous_response_id))
        return resp


def _prepare(state, body: ResponsesRequest, history: list[dict]):
    """The engine request, and this turn's own input as chat messages (what the store keeps)."""
    request = chat_request(body, history)
    own = request.messages[len(history) + (1 if body.instructions else 0):]
    return chat.prepare(state, request), own


# ------------------------------------------------------------ routes


def _not_found(response_id: str, param: str | None = None) -> APIError:
    return APIError(404, f"Response with id '{response_id}' not found.", "invalid_request_error",
                    param=param, code="response_not_found")


@router.post("/v1/responses")
async def create_response(request: Request):
    state, body = await ready_body(request, ResponsesRequest)
    model = state.resolve_model(body.model)
    history: list[dict] = []
    if body.previous_response_id is not None:
        history = state.responses.history(body.previous_response_id)
        if history is None:
            found = state.responses.get(body.previous_response_id) is not None
            raise APIError(404, f"Previous response with id '{body.previous_response_id}' not found."
                           if not found else
                           f"An earlier response of the conversation that '{body.previous_response_id}' continues "
                           "is no longer stored, so it cannot be continued.",
                           "invalid_request_error", param="previous_response_id",
                           code="previous_response_not_found")
    prepared, own = await off_loop(_prepare, state, body, history)
    items = _input_items(body)
    turn = _Turn(state, body, prepared, model)
    parser = prepared.parser()
    if body.stream:
        steps = await gen.run(state, prepared.request, parser, heartbeat_s=state.settings.heartbeat_s)
        return sse_response(_stream(turn, steps, own, items))
    steps = await gen.run(state, prepared.request, parser, http_request=request,
                          heartbeat_s=state.settings.disconnect_poll_s)
    finish = None
    async for step in steps:
        turn.output.feed(step)
        if step.finish is not None:
            finish = step.finish
    if finish is None:  # the client went away
        return JSONResponse({}, status_code=499)
    if finish.finish_reason == "error":
        raise APIError(500, f"generation failed: {finish.error or 'engine error'}", "server_error")
    turn.output.close("incomplete" if finish.finish_reason == "length" else "completed")
    return turn.end(finish, own, items)


async def _stream(turn: _Turn, steps, own: list[dict], items: list[dict]):
    seq = 0

    def emit(ev: dict) -> bytes:
        nonlocal seq
        ev["sequence_number"] = seq
        seq += 1
        return named_event(ev["type"], ev)

    try:
        start = turn.response("in_progress")
        yield emit({"type": "response.created", "response": start})
        yield emit({"type": "response.in_progress", "response": start})
        async for step in steps:
            if step.heartbeat:
                yield b": keep-alive\n\n"
                continue
            for ev in turn.output.feed(step):
                yield emit(ev)
            finish = step.finish
            if finish is None:
                continue
            if finish.finish_reason != "error":
                for ev in turn.output.close("incomplete" if finish.finish_reason == "length" else "completed"):
                    yield emit(ev)
            resp = turn.end(finish, own, items)
            kind = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(
                resp["status"], "response.failed")
            yield emit({"type": kind, "response": resp})
            return
    finally:
        await steps.aclose()


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, request: Request):
    entry = state_of(request).responses.get(response_id)
    if entry is None:
        raise _not_found(response_id)
    if request.query_params.get("stream", "false").lower() not in ("false", "0", ""):
        # OpenAI replays a background response's events; mlxfast keeps the response, not its events.
        raise bad_request("stream: a stored response is read whole here (its events are not kept)", "stream")
    return entry.response


@router.post("/v1/responses/{response_id}/cancel")
async def cancel_response(response_id: str, request: Request):
    if state_of(request).responses.get(response_id) is None:
        raise _not_found(response_id)
    raise bad_request("only a background response can be cancelled, and mlxfast runs none "
                      "(a streamed response is cancelled by closing its connection)", "response_id")


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request):
    if not state_of(request).responses.delete(response_id):
        raise _not_found(response_id)
    return {"id": response_id, "object": "response", "deleted": True}


@router.get("/v1/responses/{response_id}/input_items")
async def input_items(response_id: str, request: Request, order: str = "desc", limit: int = 20,
                      after: str | None = None):
    entry = state_of(request).responses.get(response_id)
    if entry is None:
        raise _not_found(response_id)
    if order not in ("asc", "desc"):
        raise bad_request("order must be 'asc' or 'desc'", "order")
    if not 1 <= limit <= 100:
        raise bad_request("limit must be between 1 and 100", "limit")
    data = list(entry.input_items) if order == "asc" else list(reversed(entry.input_items))
    if after is not None:
        ids = [d["id"] for d in data]
        if after not in ids:
            raise bad_request(f"no input item with id '{after}' in this response", "after")
        data = data[ids.index(after) + 1:]
    page = data[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(data) > limit}
