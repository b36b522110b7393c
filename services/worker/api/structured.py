"""Structured output at a request's admission: its grammar's matcher (compiled or cached by
services.worker.api.grammar, before the request reaches the engine), and the tool-call format the
worker reports (ModelInfo.tool_call_format)."""
from __future__ import annotations

from services.common.errors import InvalidArgument
from services.worker.api.chat_template import ChatTemplate


async def matcher(grammars, sampling, stopping):
    """The request's fresh matcher, or None without a grammar; INVALID_ARGUMENT naming the
    field for a grammar that does not compile, and for min_new_tokens beside one (the grammar
    decides where the output ends)."""
    if not sampling.HasField("grammar"):
        return None
    if stopping.min_new_tokens:
        raise InvalidArgument("stopping.min_new_tokens: not with sampling.grammar (the grammar "
                              "decides where the output ends)")
    if grammars is None:
        raise InvalidArgument("sampling.grammar: structured output is off on this worker (its "
                              "tokenizer is not one llguidance reads)")
    return await grammars.matcher(sampling.grammar)


def tool_call_format(flag: str, template: ChatTemplate | None) -> str:
    """--tool-call-format: a format, "none", or "auto" (the template's, "" for none)."""
    if flag == "none":
        return ""
    if flag != "auto":
        return flag
    return template.tool_call_format if template is not None else ""
