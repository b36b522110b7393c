"""The router's tool-call formats (services.router.tool_calls), torch-free: calls parsed out of
replies however their text is split into deltas, text around them kept, what is not a call
(or a call cut by max_tokens) given back as text; and the enforcing grammar of each format
accepts exactly the calls the parser reads (checked with llguidance on the tiny tokenizer)."""
from __future__ import annotations

import json

import pytest

from services.router.tool_calls import CallParser, call_grammar
from tests.support import MODEL_DIR

pytestmark = pytest.mark.policy
ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [("add", ADD), ("noop", {"type": "object", "properties": {},
                                 "additionalProperties": False})]
H1 = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
H2 = '<tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call>'
CASES = [
    ("hermes", "Sure. " + H1 + "\n" + H2, "Sure. ", ["add", "noop"]),
    ("hermes", "no <tool call here, <b>bold</b>", "no <tool call here, <b>bold</b>", []),
    ("hermes", "cut " + H1[:30], "cut " + H1[:30], []),
    ("hermes", '<tool_call>\n{"nom": 1}\n</tool_call> after', '<tool_call>\n{"nom": 1}\n'
     '</tool_call> after', []),
    ("llama3_json", ' {"name": "add", "parameters": {"a": 1, "b": 2}}', "", ["add"]),
    ("llama3_json", '<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}; '
     '{"name": "noop", "parameters": {}}', "", ["add", "noop"]),
    ("llama3_json", 'It is {"name": "add"}', 'It is {"name": "add"}', []),
    ("llama3_json", '{"name": "add", "param', '{"name": "add", "param', []),
    ("mistral", 'ok[TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}}, '
     '{"name": "noop", "arguments": {}}]', "ok", ["add", "noop"]),
    ("mistral", "just [TOOLS] text [TOOL", "just [TOOLS] text [TOOL", []),
    ("mistral", ' [{"name": "noop", "arguments": {}}]', "", ["noop"]),   # the marker a special
    ("mistral", "[", "[", []),                                            # token, left out
    ("mistral", "[1, 2] [{", "[1, 2] [{", []),
]


@pytest.mark.parametrize("fmt, text, content, names", CASES)
@pytest.mark.parametrize("step", [1, 3, 1000])
def test_calls_are_parsed_however_the_text_streams(fmt, text, content, names, step):
    p, out, calls = CallParser(fmt), [], []
    for i in range(0, len(text), step):
        c, k = p.feed(text[i:i + step])
        out.append(c)
        calls += k
    c, k = p.close()
    assert "".join(out) + c == content
    assert [x["name"] for x in calls + k] == names
    for call in calls + k:
        json.loads(call["arguments"])


@pytest.mark.parametrize("fmt", ["hermes", "llama3_json", "mistral"])
@pytest.mark.parametrize("single", [True, False])
def test_the_enforcing_grammar_accepts_what_the_parser_reads(fmt, single):
    llguidance = pytest.importorskip("llguidance")
    tok = llguidance.LLTokenizer((MODEL_DIR / "tokenizer.json").read_text(), n_vocab=1024,
                                 eos_token=2)
    grammar = llguidance.grammar_from("lark", call_grammar(fmt, TOOLS, single))
    one = {"hermes": H1, "mistral": '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1, '
                                    '"b": 2}}]',
           "llama3_json": '{"name": "add", "parameters": {"a": 1, "b": 2}}'}[fmt]
    two = {"hermes": H1 + "\n" + H2,
           "mistral": '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}}, '
                      '{"name": "noop", "arguments": {}}]',
           "llama3_json": one + '; {"name": "noop", "parameters": {}}'}[fmt]
    for text, ok in ((one, True), (two, not single), (one.replace('"a": 1', '"a": "x"'), False),
                     ("Sure. " + one, False)):
        m = llguidance.LLMatcher(tok, grammar, log_level=0)
        assert not m.is_error(), m.get_error()
        accepted = m.consume_tokens(tok.tokenize_str(text)) and m.is_accepting()
        assert accepted == ok, (text, m.get_error())
        if ok:
            p = CallParser(fmt)
            c1, k1 = p.feed(text)
            c2, k2 = p.close()
            assert c1 + c2 == "" and len(k1 + k2) == (1 if text == one else 2)
