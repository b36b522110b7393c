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
    presence_penalty: float = 0.0     # OpenAI's, on the output so far (0 = off)
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()   # (token id, bias), sorted by id
    min_tokens: int = 0               # the EOS tokens are not sampled before this many
    logprobs: int = -1                # -1: none; 0: the sampled token's; k: and the top k
    prompt_logprobs: int = -1         # the same for the prompt's tokens (echo)
    constrained: bool = False         # a grammar masks the tokens (Sequence.matcher)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @cached_property
    def history(self) -> bool:
        """Whether sampling reads the tokens so far (a penalty is on)."""
        return self.repetition_penalty not in (0.0, 1.0) or bool(
            self.presence_penalty or self.frequency_penalty)

    @cached_property
    def plain(self) -> bool:
        """Greedy argmax of the raw logits, nothing else asked: the batch's fast path."""
        return (self.temperature <= 0.0 and not self.history and not self.logit_bias
                and self.min_tokens == 0 and self.logprobs < 0 and not self.constrained)


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
    # what a prompt block's KV depends on besides its tokens (tenant, adapter version; see
    # services.worker.engine.block_manager); b"" shares nothing. Set by the servicer.
    prefix_key: bytes = b""
    prefix_digests: list | None = None   # BlockManager's, worked out once
    # with sampling.prompt_logprobs >= 0: (token, logprob, top) of prompt tokens 1.., filled
    # as the prompt is computed, handed on with the first token (then None)
    prompt_lps: list | None = None
    charged_output: int = 0              # output tokens charged to the tenant's counter
    # structured output: the grammar's matcher (llguidance, services.worker.api.grammar),
    # advanced by the runner with each sampled token (services.worker.executor.token_mask);
    # grammar_done once the grammar is complete (the output ends) or, with grammar_error, once
    # the matcher refused a token
    matcher: object = None
    grammar_done: bool = False
    grammar_error: str = ""

    def __post_init__(self) -> None:
        self.tokens = list(self.prompt)
        if self.sampling.prompt_logprobs >= 0:
            self.prompt_lps = []

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
