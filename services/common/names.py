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
