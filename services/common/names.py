"""Names of adapters, aliases and tenants: plain names, never paths or URLs. The store checks
the names it keeps; the router checks those of the public API first, so that an error names the
public request's field (`adapter_id`, `tenant`), not the store's."""
from __future__ import annotations

import re

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def name_error(field: str, value: str, allow_empty: bool = False) -> str | None:
    """The INVALID_ARGUMENT message for `value` in `field` when it is not a valid name; None
    when it is (or when it is empty and allow_empty)."""
    if (allow_empty and value == "") or NAME.fullmatch(value):
        return None
    return f"{field}: {value[:100]!r} is not a valid name ({NAME.pattern})"


VERSION = re.compile(r"[0-9a-f]{16}")


def ref_error(field: str, value: str, allow_empty: bool = False) -> str | None:
    """As name_error, for a reference to an adapter that may pin a version: NAME or
    NAME@VERSION (VERSION: the 16 hex digits of an adapter version)."""
    name, at, version = value.partition("@")
    if at and not VERSION.fullmatch(version):
        return f"{field}: {value[:100]!r}: a version is 16 hex digits (NAME@VERSION)"
    return name_error(field, name, allow_empty and not at)

