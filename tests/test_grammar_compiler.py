"""The grammar compiler's view of a tokenizer: a tokenizer that llguidance
cannot read makes a grammar a 400 naming why (it was an internal error)."""

import pytest
from tiny_models import make_tiny_model

import mlxfast
from mlxfast.server.errors import APIError
from mlxfast.server.grammar import GrammarCompiler

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
