"""Tool calls in the three formats chat templates teach (the worker reports which one:
ModelInfo.tool_call_format): the grammar that enforces a call (tool_choice required or a named
function), and the parser that takes calls out of a reply's text as it streams.

- "hermes" (Hermes 2 Pro, Qwen 2/2.5/3): each call `<tool_call>\\n{"name": ..., "arguments":
  {...}}\\n</tool_call>`, text possibly around them;
- "llama3_json" (Llama 3.1-3.3 with JSON tool calling): the reply is the call, `{"name": ...,
  "parameters": {...}}` (optionally after `<|python_tag|>`; several separated by "; ");
- "mistral": `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` after any text.

Plain Python (no torch): the grammar is Lark text with the calls' JSON Schema embedded
(llguidance's `%json`), compiled by the worker as any other grammar; it writes the markers as
text. The worker's text leaves special tokens out, so a model that writes `[TOOL_CALLS]` or
`<|python_tag|>` as its special token shows none: a reply that opens with the calls' JSON
(`[{` for mistral, `{` for llama3_json) is read as calls too.
"""
from __future__ import annotations

import json
import uuid

FORMATS = ("hermes", "llama3_json", "mistral")
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
MISTRAL = "[TOOL_CALLS]"
PYTHON_TAG = "<|python_tag|>"
LEADING = {"llama3_json": "{", "mistral": "[{"}     # a reply that opens with calls' JSON
# JSON written compactly, as the worker writes a JSON Schema's (services.worker.api.grammar)
COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _arg_key(fmt: str) -> str:
    return "parameters" if fmt == "llama3_json" else "arguments"


def call_schema(fmt: str, tools: list[tuple[str, dict]]) -> dict:
    """The JSON Schema of one call of any of these (name, parameters schema) tools."""
    key = _arg_key(fmt)
    options = [{"type": "object", "properties": {"name": {"const": name}, key: params},
                "required": ["name", key], "additionalProperties": False}
               for name, params in tools]
    return options[0] if len(options) == 1 else {"anyOf": options}


def call_grammar(fmt: str, tools: list[tuple[str, dict]], single: bool) -> str:
    """Lark text whose sentences are one call (single) or one or more calls of these tools, in
    the format, and nothing else."""
    one = json.dumps({**call_schema(fmt, tools), "x-guidance": COMPACT})
    if fmt == "mistral":
        array = {"type": "array", "items": call_schema(fmt, tools), "minItems": 1,
                 "x-guidance": COMPACT}
        if single:
            array["maxItems"] = 1
        return f"start: {json.dumps(MISTRAL)} args\nargs: %json {json.dumps(array)}\n"
    if fmt == "hermes":
        more = "" if single else ' ("\\n" call)*'
        return (f"start: call{more}\n"
                f"call: {json.dumps(HERMES_OPEN + chr(10))} args "
                f"{json.dumps(chr(10) + HERMES_CLOSE)}\n"
                f"args: %json {one}\n")
    more = "" if single else ' ("; " args)*'
    return f"start: args{more}\nargs: %json {one}\n"


def new_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _as_call(obj, fmt: str) -> dict | None:
    """A parsed JSON value as a call {"name", "arguments" (JSON text)}, or None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(_arg_key(fmt), obj.get("arguments", obj.get("parameters", {})))
    if not isinstance(args, str):
        args = json.dumps(args, ensure_ascii=False)
    return {"name": obj["name"], "arguments": args}


def _objects(text: str, fmt: str) -> list[dict] | None:
    """The calls in a call region's text (a JSON object, an array of them, or objects
    separated by ';'), or None when it is not that."""
    text = text.strip()
    if fmt == "llama3_json" and text.startswith(PYTHON_TAG):
        text = text[len(PYTHON_TAG):].strip()
    decoder, calls, at = json.JSONDecoder(), [], 0
    try:
        while at < len(text):
            value, at = decoder.raw_decode(text, at)
            values = value if isinstance(value, list) else [value]
            for v in values:
                call = _as_call(v, fmt)
                if call is None:
                    return None
                calls.append(call)
            while at < len(text) and text[at] in " \t\r\n;,":
                at += 1
    except (json.JSONDecodeError, RecursionError):
        return None
    return calls or None


def _held(text: str, marker: str) -> int:
    """How many characters at the end of text may start the marker (held back)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class CallParser:
    """Feeds on a reply's text deltas; gives back the text outside calls and the calls, each
    whole once its text has ended. A call region that does not parse (cut by max_tokens, not a
    call) is given back as text at the end."""

    def __init__(self, fmt: str):
        if fmt not in FORMATS:
            raise ValueError(f"unknown tool-call format {fmt!r}")
        self.fmt = fmt
        self.buf = ""             # text not yet given back
        self.in_call = False      # buf is (the start of) a call region
        self.started = False      # some non-blank text has been seen (LEADING)
        self.after_call = False   # newlines right after a call are its separator, not text

    @property
    def marker(self) -> str:
        return {"hermes": HERMES_OPEN, "mistral": MISTRAL, "llama3_json": PYTHON_TAG}[self.fmt]

    def feed(self, delta: str) -> tuple[str, list[dict]]:
        self.buf += delta
        out, calls = [], []
        while True:
            if self.in_call:
                if self.fmt != "hermes":
                    return "".join(out), calls          # the rest of the reply is calls
                end = self.buf.find(HERMES_CLOSE)
                if end < 0:
                    return "".join(out), calls
                region, self.buf = self.buf[:end], self.buf[end + len(HERMES_CLOSE):]
                self.in_call = False
                parsed = _objects(region, self.fmt)
                if parsed is None:
                    out.append(HERMES_OPEN + region + HERMES_CLOSE)
                else:
                    calls += parsed
                    self.after_call = True
                continue
            if not self._enter(out):
                return "".join(out), calls

    def _enter(self, out: list[str]) -> bool:
        """In text: give back the text before a call region and enter it (True), or the text
        that cannot start one (False)."""
        if self.after_call:
            self.buf = self.buf.lstrip("\n")
            self.after_call = not self.buf
        lead = LEADING.get(self.fmt)
        if lead and not self.started:
            stripped = self.buf.lstrip()
            if not stripped or (len(stripped) < len(lead) and lead.startswith(stripped)):
                return False                     # not yet known
            self.started = True
            if stripped.startswith(lead):
                self.in_call = True
                return True
        at = self.buf.find(self.marker)
        if at >= 0:
            out.append(self.buf[:at])
            self.buf = self.buf[at + (len(self.marker) if self.fmt == "hermes" else 0):]
            self.in_call = True
            return True
        keep = _held(self.buf, self.marker)
        out.append(self.buf[:len(self.buf) - keep])
        self.buf = self.buf[len(self.buf) - keep:]
        return False

    def close(self) -> tuple[str, list[dict]]:
        """The end of the reply: what is still held, as calls or text."""
        buf, self.buf = self.buf, ""
        if not self.in_call:
            return buf, []
        self.in_call = False
        region = buf[len(MISTRAL):] if self.fmt == "mistral" and buf.startswith(MISTRAL) else buf
        parsed = _objects(region, self.fmt)
        if parsed is None:
            return (HERMES_OPEN + buf if self.fmt == "hermes" else buf), []
        return "", parsed
