"""The engine's served steps by class, timed: where a worker's step time goes (issue 42: which
steps make adapter workloads slower than the base model at saturation).

A step's class is four labels:

    kind           decode-graph | mixed-graph (prompt chunks, beside decode rows or not, from a
                   CUDA graph) | eager (every other step, and every step on a CPU)
    rows           the step's sequences (a decode row or a prompt chunk each):
                   1-32, 33-64, 65-128, 129-256, >256
    prompt_tokens  the tokens of its rows fed more than one token (prompt chunks; a one-token row
                   costs a decode row's, whether or not it ends a prompt): 0, 1-512, 513-2048,
                   >2048
    adapters       its distinct adapters (base rows are none): 0, 1-8, 9-32, 33-128, >128

The runner says what each step was (`StepShape`, from what its step-input builder already
worked out: the row count, the prompt rows' token counts, the LoRA segments) and the engine keeps
the shape of the step whose tokens it collected last, when (perf_counter) and how many times its
loop has waited idle (services.worker.engine.loop). A step's time is the interval between its
tokens reaching the host and the previous step's: with overlap (the next step launched before
this one is collected) that is the step as served, host work included where the device waited
for it. A step after an idle wait is not timed (the interval holds the wait).

`StepProfile.step` is an Engine.on_step hook (on the engine thread, after every loop turn): two
attribute compares when no step was collected, else three bisections and two list adds. The
counts live in fixed lists, one slot per class, so the scrape thread (`collect`:
lorafleet_worker_step_seconds{kind, rows, prompt_tokens, adapters}, a summary's count and sum)
and the gRPC Info call (`classes`) read them without a lock.
"""
from __future__ import annotations

from bisect import bisect_left
from typing import NamedTuple

from prometheus_client.core import SummaryMetricFamily

KINDS = ("decode-graph", "mixed-graph", "eager")
# each label's upper bounds (inclusive) and names, the last open-ended
ROWS = ((32, 64, 128, 256), ("1-32", "33-64", "65-128", "129-256", ">256"))
PROMPT = ((0, 512, 2048), ("0", "1-512", "513-2048", ">2048"))
ADAPTERS = ((0, 8, 32, 128), ("0", "1-8", "9-32", "33-128", ">128"))
_NP, _NA = len(PROMPT[1]), len(ADAPTERS[1])
CLASSES = len(KINDS) * len(ROWS[1]) * _NP * _NA
METRIC = "lorafleet_worker_step_seconds"


class StepShape(NamedTuple):
    """What one step was, as its runner built it."""
    kind: str                # one of KINDS
    rows: int                # sequences in the step
    prompt_tokens: int       # tokens of its multi-token rows
    adapters: int            # distinct adapters among its sequences


def class_index(shape: StepShape) -> int:
    """The shape's class: an index into CLASSES slots (kind, rows, prompt, adapters order)."""
    k = KINDS.index(shape.kind)
    r = bisect_left(ROWS[0], shape.rows)
    p = bisect_left(PROMPT[0], shape.prompt_tokens)
    a = bisect_left(ADAPTERS[0], shape.adapters)
    return ((k * len(ROWS[1]) + r) * _NP + p) * _NA + a


def class_labels(index: int) -> tuple[str, str, str, str]:
    """(kind, rows, prompt_tokens, adapters) of a class index."""
    index, a = divmod(index, _NA)
    index, p = divmod(index, _NP)
    k, r = divmod(index, len(ROWS[1]))
    return KINDS[k], ROWS[1][r], PROMPT[1][p], ADAPTERS[1][a]


class StepProfile:
    """Steps timed and their seconds, per class, since the worker started."""

    def __init__(self):
        self.count = [0] * CLASSES
        self.seconds = [0.0] * CLASSES
        self._steps = 0            # the engine's step count at the last hook call
        self._idle = 0             # its idle waits then
        self._at: float | None = None      # when the last collected step's tokens came

    def step(self, engine) -> None:
        """After each engine loop turn (Engine.on_step), on the engine thread: time the step
        collected in it, if one was and the loop did not wait idle since the one before."""
        steps = engine.steps
        if steps == self._steps:
            return                                   # nothing collected this turn
        prev, self._at = self._at, engine.last_step_at
        idle, one = engine.idle_waits, steps == self._steps + 1
        self._steps = steps
        if idle != self._idle:
            self._idle = idle
            return
        shape = engine.last_step
        if shape is None or prev is None or not one:
            return
        i = class_index(shape)
        self.count[i] += 1
        self.seconds[i] += self._at - prev

    def classes(self) -> list[tuple[str, str, str, str, int, float]]:
        """(kind, rows, prompt_tokens, adapters, steps, seconds) of every class with a step."""
        count, seconds = list(self.count), list(self.seconds)
        return [(*class_labels(i), n, seconds[i]) for i, n in enumerate(count) if n]

    def describe(self):
        return []

    def collect(self):
        family = SummaryMetricFamily(
            METRIC, "Engine steps timed, by class: kind (decode-graph, mixed-graph, eager), "
            "rows (sequences), prompt_tokens (tokens of prompt chunks), adapters (distinct); "
            "a step's time is from the previous step's tokens reaching the host to its own, "
            "steps after an idle wait left out",
            labels=["kind", "rows", "prompt_tokens", "adapters"])
        for kind, rows, prompt, adapters, n, seconds in self.classes():
            family.add_metric([kind, rows, prompt, adapters], n, seconds)
        yield family
