"""The grammar compiler's view of a tokenizer: a tokenizer that llguidance
cannot read makes a grammar a 400 naming why (it was an internal error)."""

import pytest
from tiny_models import make_tiny_model

import mlxfast
from mlxfast.server.errors import APIError
from mlxfast.server.grammar import GrammarCompiler, closed_objects

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def test_a_tokenizer_the_grammar_engine_cannot_read_is_a_400(tmp_path):
    model, tok = mlxfast.load(str(make_tiny_model(tmp_path / "m", "llama")))  # a tokenizer.json without a decoder
    compiler = GrammarCompiler(tok, model.args.vocab_size)
    for param in ("response_format", "response_format"):  # the failure is kept, and said again
        with pytest.raises(APIError) as e:
            compiler.json_schema(SCHEMA, param)
        assert e.value.status == 400 and e.value.param == param
        assert "cannot read this model's tokenizer" in e.value.message and "decoder" in e.value.message
    with pytest.raises(APIError) as e:
        compiler.tool_calls("hermes", [{"name": "f", "parameters": {"type": "object"}}], None)
    assert e.value.status == 400 and e.value.param == "tools"


def test_the_default_tokenizer_compiles_a_schema():
    model, tok = mlxfast.load()
    matcher = GrammarCompiler(tok, model.args.vocab_size).json_schema(SCHEMA)()
    assert not matcher.is_error()


def test_a_schema_error_keeps_its_detail():
    """The compiler's multi-line messages (a regex error quotes the pattern,
    points at it with carets, then says what is wrong) reach the 400 whole,
    on one line: it said only "regex parse error:"."""
    model, tok = mlxfast.load()
    with pytest.raises(APIError) as e:
        GrammarCompiler(tok, model.args.vocab_size).json_schema({"type": "string", "maxLength": 10 ** 12})
    msg = e.value.message
    assert e.value.status == 400 and "\n" not in msg and "^" not in msg
    head, _, detail = msg.partition("regex parse error:")
    assert "1000000000000" in detail and detail.strip().split()[-1] != "error:", msg


def _accepts(matcher, tok, text: str) -> bool:
    """Whether ``matcher`` takes all of ``text`` and may end there."""
    ids = tok.encode(text, add_special_tokens=False)
    if matcher.validate_tokens(ids) != len(ids):
        return False
    matcher.consume_tokens(ids)
    return matcher.is_accepting()


CITY = {"type": "object", "properties": {"city": {"type": "string"},
                                         "where": {"type": "object", "properties": {"lat": {"type": "number"}}},
                                         "tags": {"type": "array", "items": {"$ref": "#/$defs/Tag"}}},
        "required": ["city"], "$defs": {"Tag": {"type": "object", "properties": {"t": {"type": "string"}}}}}


@pytest.mark.parametrize("text, closed, open_", [
    ('{"city": "Paris"}', True, True),
    ('{"city": "Paris", "where": {"lat": 48.8}, "tags": [{"t": "x"}]}', True, True),
    ('{"city": "Paris", "population": 2}', False, True),  # a key the schema does not name
    ('{"city": "Paris", "where": {"lat": 48.8, "lon": 2.3}}', False, True),  # ... in a nested object
    ('{"city": "Paris", "tags": [{"t": "x", "u": "y"}]}', False, True),  # ... in a $defs object
])
def test_objects_take_only_the_keys_their_schema_names(text, closed, open_):
    """A schema's objects that list their properties take no others unless it
    says so (llama.cpp's grammars and vLLM's xgrammar read schemas so, and
    OpenAI's strict mode requires it; JSON Schema's own default lets a small
    model add keys until max_tokens). vLLM's
    structured_outputs.disable_additional_properties: false opens them."""
    model, tok = mlxfast.load()
    compiler = GrammarCompiler(tok, model.args.vocab_size)
    assert _accepts(compiler.json_schema(CITY)(), tok, text) is closed
    assert _accepts(compiler.json_schema(CITY, extra_keys=True)(), tok, text) is open_
    explicit = dict(CITY, additionalProperties=True)  # a schema that says so keeps its word
    assert _accepts(compiler.json_schema(explicit)(), tok, '{"city": "Paris", "population": 2}')
    anything = compiler.json_schema(None)()  # json_object: any object
    assert _accepts(anything, tok, '{"x": 1, "y": [true]}')


def test_closing_objects_leaves_keys_shared_across_schemas_open():
    """Where an object's keys come from several schemas (allOf, or anyOf
    members beside the object's own properties) none of them is closed:
    closing one would refuse the keys the others name."""
    shared = {"type": "object", "properties": {"kind": {"type": "string"}},
              "allOf": [{"properties": {"a": {"type": "integer"}}}]}
    out = closed_objects(shared)
    assert "additionalProperties" not in out and "additionalProperties" not in out["allOf"][0]
    union = {"anyOf": [{"type": "object", "properties": {"a": {}}}, {"type": "string"}]}
    assert closed_objects(union)["anyOf"][0]["additionalProperties"] is False
    beside = {"properties": {"k": {}}, "oneOf": [{"properties": {"a": {}}}]}
    assert closed_objects(beside) == beside
    assert closed_objects({"type": "object"}) == {"type": "object"}
    assert closed_objects({"type": "object"}, every=True) == {"type": "object", "additionalProperties": False}
    pattern = {"type": "object", "properties": {"a": {}}, "patternProperties": {"^x": {}}}
    assert "additionalProperties" not in closed_objects(pattern)
    assert closed_objects(CITY) is not CITY and "additionalProperties" not in CITY  # the request's own is untouched


def test_a_compiler_panic_reaches_the_client_without_its_backtrace():
    from mlxfast.server.grammar import _one_line

    panic = ("panic: assertion failed: grammar.symbols.len() < u16::MAX\n<backtrace>\n"
             "   0: <unknown>\n   1: <unknown>\n" + "   2: frame\n" * 200)
    assert _one_line(panic) == "panic: assertion failed: grammar.symbols.len() < u16::MAX"
