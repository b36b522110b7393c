"""The router's cap on prompt size (--max-prompt-bytes), checked before anything is forwarded.

A prompt is measured as the bytes a worker would be handed: UTF-8 text, or each chat message's
role and content, or 4 bytes a token id (the worker holds ids as int32). The default, 1 MiB,
is twice the largest context the served Llama-family models take as text (128k tokens at
about 4 bytes a token: 512 KiB) and, as ids, 262,144 tokens, twice that context again: every
prompt a model can run passes, and a client cannot make the router hold and forward tens of
MiB per request. The router's gRPC server takes messages up to the cap plus RECEIVE_HEADROOM
(the request's other fields: sampling, up to 16 stop sequences, ids), so gRPC itself refuses a
far larger message RESOURCE_EXHAUSTED as it arrives, before it is parsed or copied.
"""
from __future__ import annotations

from services.common.errors import InvalidArgument

DEFAULT_MAX_PROMPT_BYTES = 1 << 20
RECEIVE_HEADROOM = 256 << 10
TOKEN_ID_BYTES = 4


def receive_limit(max_prompt_bytes: int) -> int:
    """The router server's grpc.max_receive_message_length for a prompt cap."""
    return max_prompt_bytes + RECEIVE_HEADROOM


def check_prompt_size(cap: int, text: str = "", messages=(), token_ids=()) -> None:
    """INVALID_ARGUMENT naming the field when a prompt is larger than cap bytes (0: no cap)."""
    if cap <= 0:
        return
    checks = (("text", lambda: len(text.encode("utf-8", "surrogatepass")) if text else 0),
              ("messages", lambda: sum(len(m.role.encode("utf-8", "surrogatepass"))
                                       + len(m.content.encode("utf-8", "surrogatepass"))
                                       for m in messages)),
              ("prompt_token_ids", lambda: TOKEN_ID_BYTES * len(token_ids)))
    for field, size in checks:
        n = size()
        if n > cap:
            unit = f" ({len(token_ids)} ids of {TOKEN_ID_BYTES} bytes)" if field == \
                "prompt_token_ids" else ""
            raise InvalidArgument(f"{field}: {n} bytes{unit} exceeds the router's "
                                  f"{cap}-byte prompt cap (--max-prompt-bytes)")
