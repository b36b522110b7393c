"""Paged KV cache bookkeeping: fixed-size blocks, per-sequence block tables (no torch)."""
from __future__ import annotations

from services.worker.sequence import Sequence


class BlockManager:
    """Hands out KV blocks. A sequence's token p lives in block_table[p // block_size]."""

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("need at least one KV block of at least one token")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free = list(range(num_blocks - 1, -1, -1))   # stack: low ids handed out first

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def used_fraction(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def ensure(self, seq: Sequence, num_tokens: int) -> bool:
        """Grow seq's block table to hold num_tokens; False (and no change) if blocks run out."""
        need = self.blocks_for(num_tokens) - len(seq.block_table)
        if need <= 0:
            return True
        if need > len(self._free):
            return False
        for _ in range(need):
            seq.block_table.append(self._free.pop())
        return True

    def free(self, seq: Sequence) -> None:
        """Return every block of seq (on finish, cancel or preemption).

        The table is replaced by a new empty list rather than cleared: a list that has been a
        block table only ever grows, so a reader holding it (GraphRunner's copy of the tables)
        knows that the same list at the same length still holds the same blocks."""
        self._free.extend(reversed(seq.block_table))
        seq.block_table = []
