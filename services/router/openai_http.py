"""The HTTP gateway's edges (services.router.openai_gateway): every error as an OpenAI error
object, whatever refused the request.

- `json_errors`: unknown routes and methods, refusals, and anything unforeseen (logged, a 500).
- `GatewayRunner`: a request that HTTP parsing itself refuses (a header line over aiohttp's
  8 KiB limit, too many headers, a malformed request line) gets the same JSON body (431 for
  an over-long line or too many headers, 400 otherwise) and one INFO line in the log, which
  never quotes the line (it may be a token); aiohttp answered plain text and logged an ERROR
  with a traceback.
- `check_strings`: the one place where a body's strings are checked. JSON may carry a lone
  UTF-16 surrogate (`"\\ud800"`), which no UTF-8 text holds; every string of the body, keys
  included, is checked once after parsing, and a lone surrogate is a 400 naming its field
  (`messages[0].content`), before any field reaches protobuf (which raised UnicodeEncodeError:
  a 500).
"""
from __future__ import annotations

import json
import logging
import re

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError, LineTooLong

from services.common.errors import LorafleetError
from services.router.openai_errors import error_response, json_error
from services.router.openai_fields import BodyError

log = logging.getLogger(__name__)
SURROGATE = re.compile("[\ud800-\udfff]")     # after json.loads every one left is unpaired


def check_strings(body) -> None:
    """BodyError (invalid_value, the field's path as param) for the first string of the parsed
    body, key or value, that holds a lone surrogate. Iterative: a body nested as deeply as
    json.loads allows does not recurse here."""
    todo = [("", body)]
    while todo:
        path, value = todo.pop()
        if isinstance(value, str):
            if SURROGATE.search(value):
                _refuse(path or "body")
        elif isinstance(value, dict):
            for key, item in value.items():
                where = f"{path}.{key}" if path else key
                if SURROGATE.search(key):
                    _refuse(f"{path}.{json.dumps(key)}" if path else json.dumps(key))
                todo.append((where, item))
        elif isinstance(value, list):
            todo.extend((f"{path}[{i}]", item) for i, item in enumerate(value))


def _refuse(path: str) -> None:
    raise BodyError(f"{path}: holds a lone UTF-16 surrogate escape (\\ud800-\\udfff), which is "
                    "not text; send a valid surrogate pair or the character itself", path,
                    "invalid_value")


@web.middleware
async def json_errors(request: web.Request, handler):
    """Every error as an OpenAI-style JSON body: unknown routes and methods too, and anything
    unforeseen (logged) as a 500 rather than aiohttp's plain text."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return json_error(f"{request.method} {request.path}: {exc.reason}",
                          "not_found_error" if exc.status == 404 else "invalid_request_error",
                          exc.reason.lower().replace(" ", "_"), status=exc.status)
    except LorafleetError as err:
        return error_response(err)
    except Exception:  # noqa: BLE001 - a bug must not reach the client as a bare 500 page
        log.exception("HTTP gateway: %s %s failed", request.method, request.path)
        return json_error("internal error", "server_error", "internal_error", status=500,
                          grpc_code="INTERNAL")


def parse_refusal(exc: HttpProcessingError) -> tuple[int, str, str]:
    """(HTTP status, OpenAI code, message) for a request that HTTP parsing refused. The
    parser's own text is not repeated: it quotes the offending line, which may be a token."""
    reason = (getattr(exc, "message", "") or str(exc)).lower()
    if isinstance(exc, LineTooLong):            # a header's value or name (or the URL)
        limit = exc.args[1] if len(exc.args) > 1 else "?"
        return (431, "request_header_fields_too_large",
                f"request headers: a header (or the request line) is longer than {limit} "
                "bytes")
    if "too many headers" in reason:
        return 431, "request_header_fields_too_large", "request headers: too many headers"
    return 400, "bad_request", "request: not valid HTTP"


class _Handler(web.RequestHandler):
    """aiohttp's connection handler, with parse refusals answered as OpenAI errors."""

    def handle_error(self, request, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if not isinstance(exc, HttpProcessingError) or request.writer.output_size > 0:
            return super().handle_error(request, status, exc, message)
        status, code, text = parse_refusal(exc)
        log.info("HTTP gateway: refused a request from %s (%d): %s", request.remote, status,
                 text)
        resp = json_error(text, "invalid_request_error", code, status=status)
        resp.force_close()           # the rest of the connection's bytes cannot be trusted
        return resp


class _Server(web.Server):
    def __call__(self) -> web.RequestHandler:
        return _Handler(self, loop=self._loop, **self._kwargs)


class GatewayRunner(web.AppRunner):
    """web.AppRunner whose connections answer parse refusals as OpenAI errors (_Handler)."""

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()     # the app's start-up, freeze and handler
        server.__class__ = _Server                # same state, our connection handler
        return server
