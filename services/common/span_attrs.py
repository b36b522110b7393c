"""OpenTelemetry semantic-convention attributes on the services' server spans: RPC
(`rpc.system`, `rpc.service`, `rpc.method`, `rpc.grpc.status_code`) and GenAI
(`gen_ai.operation.name`, `gen_ai.request.model`, `gen_ai.response.finish_reasons`,
`gen_ai.usage.input_tokens`, `gen_ai.usage.output_tokens`).

The servicers' own spans (router.generate, worker.generate, store.fetch, ...) carry them, so a
trace keeps one span a service hop (no extra interceptor span between a caller's span and the
callee's). Plain Python, no torch."""
from __future__ import annotations

import asyncio
import contextlib

import grpc

from services.common.errors import LorafleetError

# lorafleet.v1.StopReason values -> the finish reason OpenAI and the GenAI conventions name
FINISH_REASONS = {1: "length", 2: "stop", 3: "stop", 4: "length", 5: "cancelled", 6: "error"}


def rpc(service: str, method: str) -> dict:
    """The RPC attributes of a server span for lorafleet.v1.<service>/<method>."""
    return {"rpc.system": "grpc", "rpc.service": f"lorafleet.v1.{service}",
            "rpc.method": method}


def genai_request(operation: str, model: str) -> dict:
    return {"gen_ai.operation.name": operation, "gen_ai.request.model": model}


def genai_response(span, stop_reason: int, input_tokens: int, output_tokens: int) -> None:
    span.set_attributes({
        "gen_ai.response.finish_reasons": [FINISH_REASONS.get(int(stop_reason), "stop")],
        "gen_ai.usage.input_tokens": int(input_tokens),
        "gen_ai.usage.output_tokens": int(output_tokens)})


def genai_last(span, resp) -> None:
    """genai_response from a generation stream's message when it is the last (stop_reason
    set): the router's GenerateResponse and the worker's WorkerGenerateResponse alike."""
    if resp.stop_reason:
        genai_response(span, resp.stop_reason, resp.usage.prompt_tokens,
                       resp.usage.generated_tokens)


def status_code_of(exc: BaseException | None) -> int:
    """The gRPC status code (its number) a handler ending with exc answers with."""
    if exc is None:
        return grpc.StatusCode.OK.value[0]
    if isinstance(exc, LorafleetError):
        return exc.code.value[0]
    if isinstance(exc, GeneratorExit):
        return grpc.StatusCode.OK.value[0]       # the consumer stopped after the last message
    if isinstance(exc, asyncio.CancelledError):
        return grpc.StatusCode.CANCELLED.value[0]
    if isinstance(exc, grpc.aio.AbortError):
        return grpc.StatusCode.UNKNOWN.value[0]   # set by the aborting code (see `aborted`)
    return grpc.StatusCode.INTERNAL.value[0]


@contextlib.contextmanager
def grpc_status(span, context=None):
    """Sets rpc.grpc.status_code on span from how the block ends: OK, the LorafleetError's
    code, CANCELLED, or INTERNAL (as services.common.server's interceptor maps them); an abort
    (context.abort) takes the code the servicer context holds."""
    try:
        yield
    except BaseException as exc:
        code = status_code_of(exc)
        if isinstance(exc, grpc.aio.AbortError) and context is not None:
            got = context.code() if hasattr(context, "code") else None
            code = got.value[0] if isinstance(got, grpc.StatusCode) else code
        span.set_attribute("rpc.grpc.status_code", code)
        raise
    span.set_attribute("rpc.grpc.status_code", 0)
