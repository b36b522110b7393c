"""List pages (Google AIP-158): page sizes and opaque page tokens.

A page token is URL-safe base64 of `{"a": last id listed, "q": query key}`, the query key a
short digest of what was listed (tenant, all_tenants, owner, prefix). Pages are ordered by id
and the next page starts after the last id, so adapters registered or deleted between pages are
neither skipped nor repeated; a token of another listing, or one this store did not write, is
INVALID_ARGUMENT naming `page_token`. The token is not a secret: it carries an id its holder
has already been shown.
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import json

from services.common.errors import InvalidArgument
from services.common.names import NAME

DEFAULT_PAGE_SIZE = 1000
MAX_PAGE_SIZE = 1000
# a page stops short of this many bytes of AdapterInfo (a client's default receive limit is
# 4 MiB); _approx_bytes over-counts, so the encoded page is smaller
MAX_PAGE_BYTES = 2 << 20
MAX_TOKEN_CHARS = 512


def page_size(requested: int) -> int:
    """The page size to use: 0 = the default, above the maximum = the maximum."""
    if requested < 0:
        raise InvalidArgument(f"page_size: must be 0 (the default, {DEFAULT_PAGE_SIZE}) or "
                              f"positive, got {requested}")
    return min(requested or DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE)


def query_key(tenant: str, all_tenants: bool, owner: str, prefix: str) -> str:
    """What a token is bound to: a listing with other parameters does not take it."""
    text = json.dumps([tenant, all_tenants, owner, prefix])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def encode(last_id: str, key: str) -> str:
    raw = json.dumps({"a": last_id, "q": key}, separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode(token: str, key: str) -> str:
    """The id a page starts after ("" for an empty token); INVALID_ARGUMENT for a token that is
    not one of this listing's."""
    if not token:
        return ""
    try:
        if len(token) > MAX_TOKEN_CHARS:
            raise ValueError("too long")
        body = json.loads(base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)))
        after, their_key = body["a"], body["q"]
        if not isinstance(after, str) or not NAME.fullmatch(after):
            raise ValueError("no id")
    except (ValueError, TypeError, KeyError, binascii.Error, RecursionError):
        raise InvalidArgument("page_token: not a page token of this store (pass the "
                              "next_page_token of the previous page, or none)") from None
    if their_key != key:
        raise InvalidArgument("page_token: the token is from another listing (the tenant, "
                              "owner and prefix must stay as they were for the first page)")
    return after


def prefix_end(prefix: str) -> str:
    """The smallest string after every string that starts with prefix (ids are ASCII, compared
    bytewise): `id >= prefix AND id < prefix_end(prefix)` is the prefix as an index range."""
    return prefix[:-1] + chr(ord(prefix[-1]) + 1)


def approx_bytes(id_: str, owner: str, source: str, aliases: tuple[str, ...],
                 targets: tuple[str, ...], reason: str) -> int:
    """An upper bound of one AdapterInfo's encoded size (fields, tags, lengths, numbers)."""
    texts = (len(id_) + len(owner) + len(source) + len(reason) + sum(map(len, aliases))
             + sum(map(len, targets)))
    return texts + 4 * (len(aliases) + len(targets)) + 96
