"""Continuous batching: which sequences run this step, and how many of their tokens (no torch).

Each step: decode rows first (one token each, oldest first), then chunked prefill of running
sequences, then new admissions, all under a token budget. While any row of the step decodes,
its prompt tokens are also capped by `max_prefill_with_decode` (the token budget of
Sarathi-Serve, Agrawal et al., OSDI 2024): a burst of long prompts is taken in over several
steps rather than in a few that stall every stream in flight, and a step with nothing decoding
takes the whole budget. When KV blocks run out, the newest running sequence is preempted (its
blocks freed, recomputed later).

The scheduler also keeps a step's per-sequence bookkeeping (`advance`: the tokens a step
computed, a sequence's first step, the prompt blocks it can share) and, while a step is in
flight, picks the decode step that continues it (`continuation`) when nothing else needs it.

Admission is fair between tenants by the router's rule (services.router.fair_queue: the
Virtual Token Counter): each tenant's counter grows by W_IN a prompt token computed at
admission and W_OUT a token generated (settled when counters are read, not per token), and the next sequence admitted is the oldest waiting
one of the tenant with the smallest counter. A tenant that starts waiting is lifted to the
smallest counter of the tenants active here (waiting or running), so idle time banks no
credit. Without it (fair=False) admission is in arrival order. Either way a preempted sequence
keeps its arrival, so within its tenant it goes back ahead of younger ones and none starves.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from operator import attrgetter

from services.worker.engine.block_manager import BlockManager
from services.worker.engine.sequence import Sequence, Status


_ARRIVAL = attrgetter("arrival")
W_IN, W_OUT = 1.0, 2.0              # the router's VTC charges (services.router.fair_queue)


@dataclass(slots=True)
class Scheduled:
    seq: Sequence
    num_tokens: int          # tokens fed this step, starting at seq.num_computed

    @property
    def samples(self) -> bool:
        """Whether this step produces the sequence's next token."""
        seq = self.seq
        return seq.num_computed + self.num_tokens == len(seq.tokens)


class Scheduler:
    def __init__(self, blocks: BlockManager, max_batch_tokens: int, max_running: int,
                 fair: bool = True, max_prefill_with_decode: int = 0):
        if max_prefill_with_decode < 0:
            raise ValueError("max_prefill_with_decode must be >= 0 (0: no cap)")
        self.blocks = blocks
        self.max_batch_tokens = max_batch_tokens
        # prompt tokens a step takes beside decode rows (0: only the token budget)
        self.max_prefill_with_decode = max_prefill_with_decode or max_batch_tokens
        self.max_running = max_running
        self.fair = fair
        self.waiting: list[Sequence] = []      # sorted by arrival
        self.running: list[Sequence] = []      # sorted by arrival
        self.preemptions = 0
        self.counters: dict[str, float] = {}   # tenant -> virtual token counter
        self._by_tenant: dict[str, list[Sequence]] = {}   # waiting, per tenant, by arrival

    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        self._enqueue(seq)

    def _settle(self, seqs) -> None:
        """Charge these sequences' tokens generated since last charged. Output is charged
        here, when a counter is read or a sequence leaves, not per token on the step's path."""
        counters = self.counters
        for seq in seqs:
            new = seq.num_output - seq.charged_output
            if new:
                counters[seq.tenant] = counters.get(seq.tenant, 0.0) + W_OUT * new
                seq.charged_output += new

    def next_waiting(self) -> Sequence:
        """The sequence admission takes next: the oldest of the tenant with the smallest
        counter (fair), else the oldest of all."""
        if not self.fair or len(self._by_tenant) == 1:
            return self.waiting[0]
        self._settle(self.running)
        counters = self.counters
        tenant = min(self._by_tenant, key=lambda t: (counters.get(t, 0.0),
                                                     self._by_tenant[t][0].arrival))
        return self._by_tenant[tenant][0]

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def would_admit(self) -> bool:
        """Whether schedule() would now start the head of the queue: a free row, token budget
        beside one decode token per running sequence, and KV blocks for its first chunk."""
        if not self.waiting or len(self.running) >= self.max_running:
            return False
        budget = self.max_batch_tokens - len(self.running)
        if self.max_prefill_with_decode < budget and any(s.is_decoding for s in self.running):
            budget = self.max_prefill_with_decode
        if budget <= 0:
            return False
        seq = self.next_waiting()
        need = self.blocks.blocks_for(seq.num_computed + min(seq.remaining, budget))
        return need - len(seq.block_table) <= self.blocks.free_blocks

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out (finished or cancelled) and free its blocks."""
        self._settle((seq,))
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self._dequeue(seq)
        self.blocks.free(seq)
        seq.status = Status.FINISHED

    def schedule(self) -> list[Scheduled]:
        budget = self.max_batch_tokens
        prefill = budget             # prompt tokens left: capped once a row decodes
        batch: list[Scheduled] = []
        append, running_status = batch.append, Status.RUNNING
        block_size = self.blocks.block_size
        for seq in self._decode_first():
            if budget == 0:
                break
            if seq.status is not running_status:
                continue                       # preempted earlier in this loop
            num_computed = seq.num_computed
            n = len(seq.tokens) - num_computed                       # seq.remaining
            decoding = n == 1 and seq.num_output > 0                 # seq.is_decoding
            if decoding:
                if prefill > self.max_prefill_with_decode:
                    prefill = self.max_prefill_with_decode
            elif n > prefill:
                if prefill == 0:
                    continue                   # its chunk waits for a step with room
                n = prefill
            if n > budget:
                n = budget
            # blocks already cover the n tokens (the usual decode step): nothing to reserve
            if (len(seq.block_table) * block_size < num_computed + n
                    and not self._reserve(seq, n, batch)):
                continue
            append(Scheduled(seq, n))
            budget -= n
            if not decoding:
                prefill -= n
        budget = min(budget, prefill)
        while budget > 0 and self.waiting and len(self.running) < self.max_running:
            seq = self.next_waiting()
            if not seq.num_computed and not seq.block_table:
                self.blocks.share(seq)          # its prompt's start, if another computed it
            n = min(seq.remaining, budget)
            if not self.blocks.ensure(seq, seq.num_computed + n):
                break
            self._dequeue(seq)
            self.counters[seq.tenant] = self.counters.get(seq.tenant, 0.0) + W_IN * seq.remaining
            seq.status = Status.RUNNING
            self.running.append(seq)
            batch.append(Scheduled(seq, n))
            budget -= n
        return batch

    def advance(self, batch: list[Scheduled], now: float) -> None:
        """A step's rows were run or launched: their tokens count as computed, a sequence's
        first step is timed (now), and a prompt chunk's full blocks are published for sharing."""
        publish = self.blocks.publish
        for b in batch:
            seq = b.seq
            seq.num_computed += b.num_tokens
            if seq.first_scheduled is None:
                seq.first_scheduled = now
            if seq.prefix_key and seq.num_computed - b.num_tokens < len(seq.prompt):
                publish(seq)                          # a prompt chunk: its full blocks

    @staticmethod
    def advance_decode(rows: list[Scheduled]) -> None:
        """A continuation's rows were launched (see continuation): each one's token in flight
        counts as computed. (No first step to time, no prompt block to publish.)"""
        for b in rows:
            b.seq.num_computed += 1

    def continuation(self, batch: list[Scheduled]) -> list[Scheduled] | None:
        """The next decode step of a step in flight (batch, its sampling rows), or None when
        schedule() must decide: a waiting sequence could start now, a running sequence was not
        in the step, or KV blocks for the next token are short. (A queue that cannot start -
        rows or KV blocks all taken - does not stop the overlap.) Leaves out sequences finished
        since, and those whose in-flight token is their last (max_new_tokens)."""
        if self.would_admit():
            return None
        stepped = {id(b.seq) for b in batch}
        if any(id(s) not in stepped for s in self.running):
            return None
        rows = []
        for b in batch:
            seq = b.seq
            if seq.status is not Status.RUNNING:
                continue                              # finished or cancelled meanwhile
            if seq.num_output + 1 >= seq.stopping.max_new_tokens:
                continue                              # its token in flight is its last
            if not self.blocks.ensure(seq, seq.num_computed + 1):
                return None
            rows.append(Scheduled(seq, 1))
        return rows or None

    def _decode_first(self) -> list[Sequence]:
        """The running sequences, decoding ones (cheap, latency-bound) before prefill chunks,
        each group in arrival order. In the usual step every one is decoding: then a sort by
        arrival alone, with no per-sequence key tuple."""
        running = self.running
        if all(len(s.tokens) - s.num_computed == 1 and len(s.tokens) > len(s.prompt)
               for s in running):                                   # all s.is_decoding
            return sorted(running, key=_ARRIVAL)
        return sorted(running, key=lambda s: (not s.is_decoding, s.arrival))

    def _reserve(self, seq: Sequence, n: int, batch: list[Scheduled]) -> bool:
        """Blocks for seq's next n tokens, preempting the newest others if needed."""
        while not self.blocks.ensure(seq, seq.num_computed + n):
            scheduled = {id(b.seq) for b in batch}
            victims = [s for s in self.running if s is not seq and id(s) not in scheduled]
            victim = victims[-1] if victims else seq
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        self._settle((seq,))
        self.running.remove(seq)
        self.blocks.free(seq)
        seq.num_computed = 0
        if seq.prompt_lps:                      # recomputed: its prompt logprobs are again
            seq.prompt_lps = []
        seq.preemptions += 1
        self.preemptions += 1
        seq.status = Status.WAITING
        self._enqueue(seq)

    def _enqueue(self, seq: Sequence) -> None:
        keys = [s.arrival for s in self.waiting]
        self.waiting.insert(bisect.bisect_right(keys, seq.arrival), seq)
        mine = self._by_tenant.get(seq.tenant)
        if mine is None:                        # starts waiting: lifted (see module doc)
            self._lift(seq.tenant)
            mine = self._by_tenant[seq.tenant] = []
        mine.insert(bisect.bisect_right([s.arrival for s in mine], seq.arrival), seq)

    def _dequeue(self, seq: Sequence) -> None:
        self.waiting.remove(seq)
        mine = self._by_tenant[seq.tenant]
        mine.remove(seq)
        if not mine:
            del self._by_tenant[seq.tenant]

    def _lift(self, tenant: str) -> None:
        self._settle(self.running)
        active = {s.tenant for s in self.running} | set(self._by_tenant)
        active.discard(tenant)
        if active:
            floor = min(self.counters.get(t, 0.0) for t in active)
            self.counters[tenant] = max(self.counters.get(tenant, 0.0), floor)
