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
    return tc.assemble(events)


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


START_F = tc.ToolCallStart(0, "f")


def test_hermes_text_streams_before_call_and_holds_partial_marker():
    p = tc.HermesParser()
    assert p.feed("Hello <tool") == [tc.Text("Hello ")]  # "<tool" held back
    assert p.feed("box> done") == [tc.Text("<toolbox> done")]  # not a marker after all
    assert p.feed(" <tool_call>{\"name\": \"f\", ") == [tc.Text(" ")]
    assert p.feed('"arguments": {}}</tool_call>') == [START_F, tc.ToolCallArgs(0, "{}"), tc.ToolCallEnd(0)]
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


# ------------------------------------------------- JSON-aware call parsing

# Argument strings that hold every family's markup, braces and brackets, an
# escaped quote, and a string ending in a backslash ("C:\\dir\\" in JSON).
TRICKY = {
    "code": 'print("</tool_call>")\nd = {"a": [1, "}]"]}\n# [TOOL_CALLS] [ARGS] <tool_call> <|python_tag|>',
    "path": "C:\\dir\\",
    "quote": 'say \\"hi\\" {"name": "x"}',
}
PY = tc.ToolCall("python", json.dumps(TRICKY, ensure_ascii=False))
TIME = tc.ToolCall("get_time", '{"tz": "CET"}')


def hermes_call(name, args, sep="\n"):
    return f"<tool_call>{sep}{json.dumps({'name': name, 'arguments': args})}{sep}</tool_call>"


def llama_call(name, args):
    return json.dumps({"name": name, "parameters": args})


CASES = {  # (family, raw output, the events it must give)
    "hermes": ("hermes", "Let me run it.\n" + hermes_call("python", TRICKY) + "\n"
               + hermes_call("get_time", {"tz": "CET"}, sep="") + " Done.",
               [tc.Text("Let me run it.\n"), PY, tc.Text("\n"), TIME, tc.Text(" Done.")]),
    "hermes_array": ("hermes", "<tool_call>" + json.dumps([{"name": "python", "arguments": TRICKY},
                                                          {"name": "get_time", "parameters": {"tz": "CET"}}])
                     + "</tool_call>", [PY, TIME]),
    "mistral": ("mistral", "Sure. [TOOL_CALLS]" + json.dumps([{"name": "python", "arguments": TRICKY},
                                                             {"name": "get_time", "arguments": {"tz": "CET"}}]),
                [tc.Text("Sure. "), PY, TIME]),
    "mistral_v11": ("mistral", "[TOOL_CALLS]python[ARGS]" + json.dumps(TRICKY)
                    + '[TOOL_CALLS]get_time[ARGS]{"tz": "CET"} Done.', [PY, TIME, tc.Text(" Done.")]),
    "llama3": ("llama3", llama_call("python", TRICKY) + "; " + llama_call("get_time", {"tz": "CET"}) + "\nDone.",
               [PY, TIME, tc.Text("Done.")]),
    "llama3_tag": ("llama3", "<|python_tag|>" + llama_call("python", TRICKY), [PY]),
    "llama3_text_first": ("llama3", "Here: " + llama_call("python", TRICKY),
                          [tc.Text("Here: " + llama_call("python", TRICKY))]),
}
MARKERS = ["<tool_call>", "</tool_call>", "[TOOL_CALLS]", "[ARGS]", "<|python_tag|>", '{"name":', '\\"', "\\\\"]


def near_markers(raw):
    """Each occurrence of a marker (or escape) as the positions from its start to its end."""
    for m in MARKERS:
        k = raw.find(m)
        while k >= 0:
            yield range(k, k + len(m) + 1)
            k = raw.find(m, k + 1)


def splits(raw):
    """``raw`` whole, character by character, cut once anywhere, and cut
    twice within each marker."""
    yield [raw]
    yield list(raw)
    for i in range(1, len(raw)):
        yield [raw[:i], raw[i:]]
    for span in near_markers(raw):
        for i in span:
            for j in span:
                if 0 < i < j < len(raw):
                    yield [raw[:i], raw[i:j], raw[j:]]


def feed_pieces(parser, pieces):
    events = []
    for p in pieces:
        events += parser.feed(p)
    return tc.assemble(events + parser.finish())


def test_tricky_arguments_hold_escapes_and_markup():
    raw = json.dumps(TRICKY)
    assert '\\"' in raw and '\\\\"' in raw and "</tool_call>" in raw and "[TOOL_CALLS]" in raw


@pytest.mark.parametrize("case", CASES)
def test_calls_parse_in_every_split(case):
    family, raw, expected = CASES[case]
    n = 0
    for pieces in splits(raw):
        p = tc.make_parser(family)
        assert feed_pieces(p, pieces) == expected, pieces
        assert not p.unfinished_call
        n += 1
    assert n > len(raw)


def cut_points(raw, opened_at, args_at, args_end):
    """Each cut of ``raw`` and how it must come back: before ``opened_at`` no
    call has begun (text); up to the opening of the arguments at ``args_at``
    the call is not recognisable yet (dropped, flagged: markup is never
    content); inside the arguments
    the call has started and is ended there (a call with the arguments cut
    short, flagged); from ``args_end`` on it is the whole call."""
    for k in range(len(raw) + 1):
        yield k, ("text" if k < opened_at else "unrecognised" if k <= args_at
                  else "cut" if k < args_end else "call")


UNTERMINATED = {  # family, output, where the call region opens
    "hermes": ("hermes", "Hi.\n" + hermes_call("python", TRICKY), len("Hi.\n<tool_call>")),
    "mistral": ("mistral", "Sure. [TOOL_CALLS]" + json.dumps([{"name": "python", "arguments": TRICKY}]),
                len("Sure. [TOOL_CALLS]")),
    "mistral_v11": ("mistral", "[TOOL_CALLS]python[ARGS]" + json.dumps(TRICKY), len("[TOOL_CALLS]")),
    "llama3": ("llama3", llama_call("python", TRICKY), len('{"name":')),
}


@pytest.mark.parametrize("case", UNTERMINATED)
def test_output_ending_inside_a_call(case):
    family, raw, opened_at = UNTERMINATED[case]
    args = json.dumps(TRICKY)
    args_at = raw.index(args)
    args_end = args_at + len(args)
    before = raw[:raw.index(tc.make_parser(family).START)] if family != "llama3" else ""
    for k, kind in cut_points(raw, opened_at, args_at, args_end):
        for pieces in ([raw[:k]], list(raw[:k])):
            p = tc.make_parser(family)
            ev = feed_pieces(p, pieces)
            if kind == "call":
                assert ev == _merge_text(before, PY), k
            elif kind == "cut":
                assert ev == _merge_text(before, tc.ToolCall("python", raw[args_at:k])), k
            elif kind == "unrecognised":
                assert ev == ([tc.Text(before)] if before else []), k
            else:
                assert ev == ([tc.Text(raw[:k])] if k else []), k
            assert p.unfinished_call == (kind in ("unrecognised", "cut")), (k, kind)


def _merge_text(before, call):
    return [tc.Text(before), call] if before else [call]


@pytest.mark.parametrize("family,first,sep,cut", [
    ("hermes", hermes_call("get_time", {"tz": "CET"}), "",
     '<tool_call>{"name": "python", "arguments": {"code": "x = {'),
    ("mistral", '[TOOL_CALLS]get_time[ARGS]{"tz": "CET"}', "", '[TOOL_CALLS]python[ARGS]{"code": "a\\"}'),
    ("llama3", llama_call("get_time", {"tz": "CET"}), "; ", '{"name": "python", "parameters": {"code": "]'),
])
def test_finished_call_then_cut_off_call(family, first, sep, cut):
    raw = first + sep + cut
    for pieces in ([raw], list(raw)):
        p = tc.make_parser(family)
        assert feed_pieces(p, pieces) == [TIME, tc.ToolCall("python", cut[cut.index('{"code"'):])]
        assert p.unfinished_call


@pytest.mark.parametrize("family,raw", [
    ("hermes", '<tool_call>{"arguments": {"a": "</tool_call>"}}</tool_call> ok'),
    ("hermes", "<tool_call>not json</tool_call> ok"),
    ("mistral", "[TOOL_CALLS][1, 2] ok"),
    ("llama3", '{"name": 3, "parameters": {"a": "}"}} ok'),
])
def test_closed_but_invalid_call_is_text_and_not_flagged(family, raw):
    for pieces in ([raw], list(raw)):
        p = tc.make_parser(family)
        assert feed_pieces(p, pieces) == [tc.Text(raw)]
        assert not p.unfinished_call


@pytest.mark.parametrize("family,raw", [
    ("hermes", "Use the <tool_call> tag to call tools."),
    ("hermes", "Hello <tool_call>\nnot json"),
    ("hermes", 'Hello <tool_call>\n{"foo": 1}'),
    ("mistral", "Write [TOOL_CALLS] then the calls."),
    ("mistral", "[TOOL_CALLS] [1, 2"),
])
def test_unclosed_region_that_is_no_call_is_text(family, raw):
    """Output that ends inside a call region the parser already knows is no
    call (not JSON, or JSON that is not a call) comes back whole: the marker
    was the model's text, not markup (it was dropped, with finish "stop")."""
    for pieces in ([raw], list(raw)):
        p = tc.make_parser(family)
        assert feed_pieces(p, pieces) == [tc.Text(raw)]
        assert not p.unfinished_call
    # It streams: the marker goes out once the text after it shows no call,
    # not at the end of the output.
    p = tc.make_parser(family)
    early = text(tc.assemble(p.feed(raw)))
    assert early.startswith(raw[:raw.index(p.START) + len(p.START)]), early


def test_text_after_a_marker_that_was_text_can_hold_a_call():
    raw = 'Use <tool_call> tags: <tool_call>{"name": "get_time", "arguments": {"tz": "CET"}}</tool_call>'
    for pieces in ([raw], list(raw)):
        assert feed_pieces(tc.make_parser("hermes"), pieces) == [tc.Text("Use <tool_call> tags: "), TIME]


@pytest.mark.parametrize("family,raw", [
    ("hermes", 'Hi <tool_call>\n{"nam'),
    ("hermes", "Hi <tool_call>\n"),
    ("mistral", "Hi [TOOL_CALLS]get_wea"),
    ("mistral", "Hi [TOOL_CALLS]get[AR"),
])
def test_region_cut_before_a_call_could_show_is_dropped_and_flagged(family, raw):
    for pieces in ([raw], list(raw)):
        p = tc.make_parser(family)
        assert feed_pieces(p, pieces) == [tc.Text("Hi ")]
        assert p.unfinished_call


@pytest.mark.parametrize("family,raw,args", [
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": }}</tool_call>', '{"a": }'),
    ("mistral", '[TOOL_CALLS]f[ARGS]{"a": 1,}', '{"a": 1,}'),
])
def test_a_started_call_keeps_the_arguments_as_written(family, raw, args):
    """Arguments stream as the model writes them, so a call that started is
    a call even when its JSON turns out invalid (a client validates them)."""
    for pieces in ([raw + " ok"], list(raw + " ok")):
        p = tc.make_parser(family)
        assert feed_pieces(p, pieces) == [tc.ToolCall("f", args), tc.Text(" ok")]


def test_hermes_brace_left_off_before_the_end_marker():
    raw = '<tool_call>{"name": "f", "arguments": {"a": "}"}</tool_call> ok'
    for pieces in ([raw], list(raw)):
        assert feed_pieces(tc.HermesParser(), pieces) == [tc.ToolCall("f", '{"a": "}"}'), tc.Text(" ok")]


@pytest.mark.parametrize("family,raw", [
    ("hermes", hermes_call("python", TRICKY)),
    ("mistral", "[TOOL_CALLS]" + json.dumps([{"name": "python", "arguments": TRICKY}])),
    ("mistral", "[TOOL_CALLS]python[ARGS]" + json.dumps(TRICKY)),
    ("llama3", llama_call("python", TRICKY)),
])
def test_arguments_stream_in_pieces_that_join_to_the_call(family, raw):
    """Fed a character at a time, the call starts once, its arguments come
    as many pieces (one per character once the head is read), and the
    pieces join to exactly the arguments' JSON."""
    p = tc.make_parser(family)
    events = [e for c in raw for e in p.feed(c)] + p.finish()
    starts = [e for e in events if isinstance(e, tc.ToolCallStart)]
    pieces = [e.text for e in events if isinstance(e, tc.ToolCallArgs)]
    assert starts == [tc.ToolCallStart(0, "python")]
    assert len(pieces) == len(json.dumps(TRICKY))
    assert json.loads("".join(pieces)) == TRICKY
    assert [type(e) for e in events].count(tc.ToolCallEnd) == 1
    assert events.index(starts[0]) < events.index(next(e for e in events if isinstance(e, tc.ToolCallEnd)))


def test_calls_in_one_output_get_their_own_indices():
    p = tc.HermesParser()
    events = p.feed(HERMES) + p.finish()
    assert [e.index for e in events if isinstance(e, tc.ToolCallStart)] == [0, 1]
    assert {e.index for e in events if isinstance(e, tc.ToolCallArgs)} == {0, 1}


def test_hermes_complete_json_with_end_marker_cut_short_is_a_call():
    p = tc.HermesParser()
    assert p.parse(hermes_call("python", TRICKY)[:-4]) == [PY] and not p.unfinished_call


def test_hermes_end_marker_in_a_string_does_not_end_the_call():
    p = tc.HermesParser()
    assert p.feed('Run:<tool_call>{"name": "python", "arguments": {"code": "</tool_call>') == [
        tc.Text("Run:"), tc.ToolCallStart(0, "python"), tc.ToolCallArgs(0, '{"code": "</tool_call>')]
    assert p.feed(' \\"}</tool_call>') == [tc.ToolCallArgs(0, ' \\"}</tool_call>')]
    assert p.feed('"}}</tool_call> after') == [tc.ToolCallArgs(0, '"}'), tc.ToolCallEnd(0), tc.Text(" after")]
    assert p.finish() == []


def test_mistral_text_streams_around_calls():
    p = tc.MistralParser()
    assert p.feed("Sure. [TOOL_") == [tc.Text("Sure. ")]
    assert p.feed("CALLS]get_time[AR") == []
    assert p.feed('GS]{"tz": "[TOOL_CALLS]"}') == [
        tc.ToolCallStart(0, "get_time"), tc.ToolCallArgs(0, '{"tz": "[TOOL_CALLS]"}'), tc.ToolCallEnd(0)]
    assert p.feed(" Done") == [tc.Text(" Done")]
    assert p.finish() == []


def test_llama3_holds_only_what_could_start_a_call():
    p = tc.Llama3JsonParser()
    assert p.feed(' {"na') == []
    assert p.feed('mX') == [tc.Text(' {"namX')]
    p = tc.Llama3JsonParser()
    assert p.feed("<|python") == []
    assert p.feed("_tag|>print(1)") == [tc.Text("<|python_tag|>print(1)")]
    p = tc.Llama3JsonParser()
    assert tc.assemble(p.feed(llama_call("get_time", {"tz": "CET"}))) == [TIME]
    assert p.feed("\nIt is noon") == [tc.Text("It is noon")]
    assert p.finish() == [] and not p.unfinished_call


@pytest.mark.parametrize("family", ["hermes", "llama3", "mistral"])
def test_render_tool_call_round_trips_tricky_arguments(family):
    raw = tc.render_tool_call(family, "python", TRICKY)
    assert stream(tc.make_parser(family), raw, 1) == [PY]


def test_output_parser_exposes_unfinished_call():
    from mlxfast.server.chat import OutputParser
    from mlxfast.server.events import ContentDelta

    parser = OutputParser(reasoning=False, in_reasoning=False, tool_family="hermes")
    raw = '<tool_call>\n{"name": "python", "arguments": {"code": "</tool_call>'
    assert parser.feed("Hi " + raw) == [ContentDelta("Hi "), tc.ToolCallStart(0, "python"),
                                        tc.ToolCallArgs(0, '{"code": "</tool_call>')]
    assert parser.finish() == [tc.ToolCallEnd(0)]
    assert parser.tools.unfinished_call


def test_output_parser_keeps_only_the_first_call_when_parallel_calls_are_off():
    from mlxfast.server.chat import OutputParser

    parser = OutputParser(reasoning=False, in_reasoning=False, tool_family="hermes", max_calls=1)
    events = parser.feed(HERMES) + parser.finish()
    assert [e.name for e in events if isinstance(e, tc.ToolCallStart)] == ["get_weather"]
    assert all(e.index == 0 for e in events if isinstance(e, (tc.ToolCallArgs, tc.ToolCallEnd)))


def test_long_arguments_parse_in_linear_time():
    code = 'print("}</tool_call>\\n")\n' * 20000  # ~500k characters of JSON string
    raw = hermes_call("python", {"code": code})
    p = tc.HermesParser()
    events = []
    for i in range(0, len(raw), 4):
        events += p.feed(raw[i:i + 4])
    assert tc.assemble(events + p.finish()) == [tc.ToolCall("python", json.dumps({"code": code}))]


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
