"""Tool calling on the request path: a GenerateRequest's tools and tool_choice checked, the
call enforced by a grammar when the choice requires one, and the reply's calls parsed out of
its text as it streams (GenerateResponse.tool_calls), in the format the served model's chat
template teaches (services.router.tool_calls), which the router learns from a worker's Info
and keeps while that worker is live.

tool_choice NONE: the worker renders no tools and nothing is parsed. AUTO: the template
renders them and a call the model writes is parsed (anything else stays text). REQUIRED and
FUNCTION: the call is grammar-enforced too (SamplingParams.grammar, so not beside one the
request gives); single_call (OpenAI's parallel_tool_calls false) allows one call.
"""
from __future__ import annotations

import json
import re

from services.common.errors import InvalidArgument, Unavailable
from services.common.gen.lorafleet.v1 import common_pb2, worker_pb2 as wpb
from services.router.tool_calls import CallParser, call_grammar, new_id

MAX_TOOLS = 128
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
Mode = common_pb2.ToolChoice


class ToolFormats:
    """The served model's tool-call format, from a live worker's Info (cached per worker
    incarnation)."""

    def __init__(self, workers, wait_s: float):
        self.workers, self.wait_s = workers, wait_s
        self._known: tuple[str, str] | None = None      # (worker id, format)

    async def get(self) -> str:
        live = self.workers.live()
        if self._known and any(w.worker_id == self._known[0] for w in live.values()):
            return self._known[1]
        if not live and not await self.workers.wait_live(self.wait_s):
            raise Unavailable("no worker available")
        worker = next(iter(self.workers.live().values()))
        info = await worker.stub.Info(wpb.WorkerInfoRequest(), timeout=10)
        self._known = (worker.worker_id, info.tool_call_format)
        return info.tool_call_format


def check_tools(req) -> list[tuple[str, dict]]:
    """The request's tools as (name, parameters schema); INVALID_ARGUMENT naming the field."""
    if len(req.tools) > MAX_TOOLS:
        raise InvalidArgument(f"tools: at most {MAX_TOOLS}")
    out, seen = [], set()
    for i, t in enumerate(req.tools):
        if not NAME.fullmatch(t.name):
            raise InvalidArgument(f"tools[{i}].name: {t.name!r} is not 1-64 letters, digits, "
                                  "'_' or '-'")
        if t.name in seen:
            raise InvalidArgument(f"tools[{i}].name: {t.name!r} is given twice")
        seen.add(t.name)
        try:
            params = json.loads(t.parameters_json) if t.parameters_json else {"type": "object"}
        except (json.JSONDecodeError, RecursionError):
            raise InvalidArgument(f"tools[{i}].parameters_json: not JSON") from None
        if not isinstance(params, dict):
            raise InvalidArgument(f"tools[{i}].parameters_json: a JSON Schema object")
        out.append((t.name, params))
    return out


def _check_choice(req, tools: list[tuple[str, dict]]) -> None:
    choice = req.tool_choice
    if choice.mode in (Mode.REQUIRED, Mode.FUNCTION):
        if not tools:
            raise InvalidArgument("tool_choice: a required or named call needs tools")
        if req.sampling.HasField("grammar"):
            raise InvalidArgument("tool_choice: a required or named call is enforced by a "
                                  "grammar, not beside sampling.grammar")
    if choice.mode == Mode.FUNCTION and choice.function not in {n for n, _ in tools}:
        raise InvalidArgument(f"tool_choice.function: {choice.function!r} is not among tools")


async def prepare(req, formats: ToolFormats) -> str | None:
    """Check the request's tools and choice and add the grammar that enforces a required or
    named call; the format to parse the reply in (None: no parsing)."""
    if not req.tools:
        if req.tool_choice.mode in (Mode.REQUIRED, Mode.FUNCTION):
            raise InvalidArgument("tool_choice: a required or named call needs tools")
        return None
    tools = check_tools(req)
    _check_choice(req, tools)
    if req.tool_choice.mode == Mode.NONE:
        return None
    fmt = await formats.get()
    if not fmt:
        raise InvalidArgument("tools: the served model's chat template renders no tools "
                              "(ModelInfo.tool_call_format is empty; the worker's "
                              "--tool-call-format names one)")
    if req.tool_choice.mode != Mode.AUTO:
        if req.tool_choice.mode == Mode.FUNCTION:
            tools = [t for t in tools if t[0] == req.tool_choice.function]
        single = req.tool_choice.single_call or req.tool_choice.mode == Mode.FUNCTION
        req.sampling.grammar.lark = call_grammar(fmt, tools, single)
    return fmt


async def parsed(responses, fmt: str):
    """The responses with their text's calls taken out into tool_calls (each whole, in the
    message where its text ended). Closing this closes the responses (which settles the
    request at once)."""
    parser, index = CallParser(fmt), 0
    try:
        async for resp in responses:
            text, calls = parser.feed(resp.text)
            if resp.stop_reason:
                rest, more = parser.close()
                text, calls = text + rest, calls + more
            resp.text = text
            for call in calls:
                resp.tool_calls.add(index=index, id=new_id(), name=call["name"],
                                    arguments=call["arguments"])
                index += 1
            yield resp
    finally:
        await responses.aclose()
