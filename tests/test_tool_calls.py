"""Tool-call and reasoning parsers on fixed model outputs, whole and streamed."""

from __future__ import annotations

import json
import random

import pytest

from mlxfast.text import tool_calls as tc
from mlxfast.text.reasoning import ReasoningParser, prompt_opens_reasoning


def stream(parser, text: str, sizes=None, seed=0):
    """Feed ``text`` in random-sized pieces; return merged events."""
    rng = random.Random(seed)
    events = []
    i = 0
    while i < len(text):
        n = rng.randint(1, 4) if sizes is None else sizes
        events += parser.feed(text[i:i + n])
        i += n
    events += parser.finish()
    return tc._merge(events)


def calls(events):
    return [(e.name, json.loads(e.arguments)) for e in events if isinstance(e, tc.ToolCall)]


def text(events):
    return "".join(e.text for e in events if isinstance(e, tc.Text))


HERMES = (
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>{"name": "get_time", "arguments": {"tz": "CET"}}</tool_call>'
)
LLAMA = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
LLAMA_TAG = '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}'
MISTRAL = 'Sure.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "f", "arguments": {}}]'
MISTRAL_V11 = '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]f[ARGS]{}'


@pytest.mark.parametrize("chunk", [None, 1, 1000])
def test_hermes(chunk):
    ev = stream(tc.HermesParser(), HERMES, chunk)
    assert calls(ev) == [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]
    assert text(ev).strip() == "Let me check."
    assert "<tool_call" not in text(ev) and "</tool" not in text(ev)


def test_hermes_text_streams_before_call_and_holds_partial_marker():
    p = tc.HermesParser()
    assert p.feed("Hello <tool") == [tc.Text("Hello ")]  # "<tool" held back
    assert p.feed("box> done") == [tc.Text("<toolbox> done")]  # not a marker after all
    assert p.feed(" <tool_call>{\"name\": \"f\", ") == [tc.Text(" ")]
    assert p.feed('"arguments": {}}</tool_call>') == [tc.ToolCall("f", "{}")]
    assert p.finish() == []


def test_hermes_unterminated_call_at_eos_is_parsed():
    ev = tc.HermesParser().parse('<tool_call>\n{"name": "f", "arguments": {"a": [1, 2]}}\n')
    assert calls(ev) == [("f", {"a": [1, 2]})] and text(ev) == ""


def test_hermes_invalid_body_is_returned_as_text():
    raw = "<tool_call>not json</tool_call> ok"
    assert text(tc.HermesParser().parse(raw)) == raw


def test_hermes_arguments_as_string_and_parameters_key():
    ev = tc.HermesParser().parse('<tool_call>{"name": "f", "arguments": "{\\"q\\": 2}"}</tool_call>')
    assert calls(ev) == [("f", {"q": 2})]
    ev = tc.HermesParser().parse('<tool_call>{"name": "f", "parameters": {"q": 3}}</tool_call>')
    assert calls(ev) == [("f", {"q": 3})]


@pytest.mark.parametrize("chunk", [None, 1, 1000])
def test_llama3(chunk):
    ev = stream(tc.Llama3JsonParser(), LLAMA, chunk)
    assert calls(ev) == [("get_weather", {"city": "Paris"})] and text(ev) == ""
    ev = stream(tc.Llama3JsonParser(), LLAMA_TAG, chunk)
    assert calls(ev) == [("a", {"x": 1}), ("b", {})] and text(ev) == ""


def test_llama3_plain_text_streams_immediately():
    p = tc.Llama3JsonParser()
    assert p.feed("The answer") == [tc.Text("The answer")]
    assert p.feed(" is {4}.") == [tc.Text(" is {4}.")]
    assert p.finish() == []


def test_llama3_json_that_is_not_a_call_is_text():
    out = '{"result": 4}'
    ev = stream(tc.Llama3JsonParser(), out, 1)
    assert text(ev) == out and calls(ev) == []


@pytest.mark.parametrize("raw", [MISTRAL, MISTRAL_V11])
@pytest.mark.parametrize("chunk", [None, 1])
def test_mistral(raw, chunk):
    ev = stream(tc.MistralParser(), raw, chunk)
    assert calls(ev) == [("get_weather", {"city": "Paris"}), ("f", {})]
    assert "[TOOL_CALLS]" not in text(ev) and "[ARGS]" not in text(ev)
    assert text(ev) == ("Sure." if raw == MISTRAL else "")


def test_mistral_partial_marker_held():
    p = tc.MistralParser()
    assert p.feed("ok [TOOL") == [tc.Text("ok ")]
    assert p.feed("S] x") == [tc.Text("[TOOLS] x")]


def test_detect_family():
    assert tc.detect_family("{{ '<tool_call>' }}") == "hermes"
    assert tc.detect_family("[TOOL_CALLS] {{ tools }}") == "mistral"
    assert tc.detect_family("<|start_header_id|>{{ tools }} parameters <|python_tag|>") == "llama3"
    assert tc.detect_family(None) == "hermes"
    with pytest.raises(ValueError):
        tc.make_parser("nope")


def test_render_tool_call_round_trips_through_parsers():
    for fam in ("hermes", "llama3", "mistral"):
        raw = tc.render_tool_call(fam, "f", '{"a": 1}')
        assert calls(tc.make_parser(fam).parse(raw)) == [("f", {"a": 1})], fam


# ---------------------------------------------------------------- reasoning


def rstream(parser, text, seed=0):
    rng = random.Random(seed)
    out, i = [], 0
    while i < len(text):
        n = rng.randint(1, 3)
        out += parser.feed(text[i:i + n])
        i += n
    out += parser.finish()
    return ("".join(t for k, t in out if k == "reasoning"), "".join(t for k, t in out if k == "content"))


@pytest.mark.parametrize("seed", range(4))
def test_reasoning_split_streaming(seed):
    r, c = rstream(ReasoningParser(), "<think>\nLet me think.</think>\n\nThe answer is 4.", seed)
    assert r == "Let me think." and c == "The answer is 4."


def test_reasoning_started_by_prompt():
    r, c = rstream(ReasoningParser(in_reasoning=True), "step 1, step 2</think>Done.")
    assert (r, c) == ("step 1, step 2", "Done.")
    assert prompt_opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n")


def test_no_think_is_all_content_and_late_tags_stay():
    assert ReasoningParser().parse("Hello <think>x</think>") == ("", "Hello <think>x</think>")
    assert ReasoningParser().parse("<think>unfinished") == ("unfinished", "")
    p = ReasoningParser()
    assert p.feed("<thi") == []  # undecided
    assert p.feed("nk>a</th") == [("reasoning", "a")]
    assert p.feed("ink>b") == [("content", "b")]
