"""A request as the engine tracks it (plain Python, no torch)."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from functools import cached_property


class Status(enum.Enum):
    WAITING = 0
    RUNNING = 1
    FINISHED = 2


class Stop(enum.IntEnum):
    """Mirrors lorafleet.v1.StopReason values."""
    NONE = 0
    MAX_TOKENS = 1
    EOS_TOKEN = 2
    STOP_SEQUENCE = 3
    TIME_LIMIT = 4
    CANCELLED = 5
    ERROR = 6


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    repetition_penalty: float = 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


@dataclass(frozen=True)
class Stopping:
    max_new_tokens: int = 64
    stop_sequences: tuple[str, ...] = ()
    time_limit_s: float = 0.0
    ignore_eos: bool = False

    @cached_property
    def stops(self) -> tuple[str, ...]:
        """The non-empty stop sequences (worked out once: read for every generated token)."""
        return tuple(s for s in self.stop_sequences if s)

    @cached_property
    def held_back(self) -> int:
        """Characters of output held back until final: a stop sequence may start there."""
        return max(map(len, self.stops)) - 1 if self.stops else 0


@dataclass(eq=False)
class Sequence:
    """One request: its tokens, its KV blocks and where it is in its life."""
    request_id: str
    prompt: list[int]
    slot: int = -1                       # adapter pool slot, -1 = base model
    adapter: str = ""                    # adapter key (for logs / residency counts)
    tenant: str = ""
    sampling: Sampling = field(default_factory=Sampling)
    stopping: Stopping = field(default_factory=Stopping)
    arrival: float = field(default_factory=time.monotonic)
    tokens: list[int] = field(init=False)
    num_computed: int = 0                # tokens whose KV is in the cache
    block_table: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    stop: Stop = Stop.NONE
    first_scheduled: float | None = None
    first_token: float | None = None
    preemptions: int = 0
    text: str = ""                       # detokenized output so far (what was emitted)
    decoded: str = ""                    # all output decoded so far (emitted + held back)
    detok_prefix: int = 0                # incremental detokenization window over the output
    detok_read: int = 0

    def __post_init__(self) -> None:
        self.tokens = list(self.prompt)

    @property
    def output(self) -> list[int]:
        return self.tokens[len(self.prompt):]

    @property
    def num_output(self) -> int:
        return len(self.tokens) - len(self.prompt)

    @property
    def remaining(self) -> int:
        """Tokens still to feed through the model before the next sample."""
        return len(self.tokens) - self.num_computed

    @property
    def is_decoding(self) -> bool:
        return self.remaining == 1 and self.num_output > 0
