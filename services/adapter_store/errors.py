"""The store's validation refusal: INVALID_ARGUMENT with a short reason label for metrics."""
from __future__ import annotations

from services.common.errors import InvalidArgument


class Refusal(InvalidArgument):
    """An adapter or name refused; the message names the field or tensor, `reason` labels
    lorafleet_store_refusals_total (a small fixed set: "r", "shape", "nonfinite", ...)."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason
