"""Paged KV cache bookkeeping: fixed-size blocks, per-sequence block tables (no torch), and
prompt blocks shared between sequences of the same prefix.

Sharing. A full block of a prompt whose KV a sequence has computed is published under a
digest of everything its KV depends on: the sequence's prefix key (tenant and adapter version:
a LoRA on k/v changes the KV, and sharing stays within a tenant so that timing reveals nothing
across tenants) and every prompt token up to the block's end, chained block by block. A
sequence admitted later with the same key and prompt start takes those blocks into its table
(reference counted) instead of computing them, and computes its own from there. At least
its last prompt token is always its own, so it samples its first token from its own logits.
Blocks are only shared while some sequence holds them (no cache beyond the running set).
"""
from __future__ import annotations

import hashlib

import numpy as np

from services.worker.engine.sequence import Sequence


class BlockManager:
    """Hands out KV blocks. A sequence's token p lives in block_table[p // block_size]."""

    def __init__(self, num_blocks: int, block_size: int, share_prefixes: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("need at least one KV block of at least one token")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.share_prefixes = share_prefixes
        self._free = list(range(num_blocks - 1, -1, -1))   # stack: low ids handed out first
        self._refs = [0] * num_blocks
        self._published: dict[bytes, int] = {}            # digest -> block
        self._digest_of: dict[int, bytes] = {}
        self.shared_blocks = 0          # blocks taken from another sequence instead of computed

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
            block = self._free.pop()
            self._refs[block] = 1
            seq.block_table.append(block)
        return True

    def free(self, seq: Sequence) -> None:
        """Drop seq's hold on its blocks (on finish, cancel or preemption); a block nobody
        holds any more is free again (and no longer shared).

        The table is replaced by a new empty list rather than cleared: a list that has been a
        block table only ever grows, so a reader holding it (GraphRunner's copy of the tables)
        knows that the same list at the same length still holds the same blocks."""
        refs = self._refs
        for block in reversed(seq.block_table):
            refs[block] -= 1
            if refs[block] == 0:
                self._free.append(block)
                digest = self._digest_of.pop(block, None)
                if digest is not None:
                    del self._published[digest]
        seq.block_table = []
        seq.prefix_digests = None

    def share(self, seq: Sequence) -> int:
        """For a sequence with no KV yet: take the published blocks of its prompt's start
        into its table (at most up to its last prompt token's block, exclusive) and mark them
        computed. Returns the number of blocks taken."""
        if not (self.share_prefixes and seq.prefix_key and self._published) or \
                seq.block_table or seq.num_computed or seq.prompt_lps is not None:
            return 0                    # (a sequence asking for prompt logprobs computes all)
        digests = self._digests(seq)
        limit = (len(seq.prompt) - 1) // self.block_size
        taken = 0
        for digest in digests[:limit]:
            block = self._published.get(digest)
            if block is None:
                break
            self._refs[block] += 1
            seq.block_table.append(block)
            taken += 1
        seq.num_computed = taken * self.block_size
        self.shared_blocks += taken
        return taken

    def publish(self, seq: Sequence) -> None:
        """Publish seq's full prompt blocks whose KV is computed (called after a step)."""
        if not (self.share_prefixes and seq.prefix_key):
            return
        done = min(seq.num_computed, len(seq.prompt)) // self.block_size
        digests = self._digests(seq)
        for i in range(min(done, len(digests))):
            block = seq.block_table[i]
            if block in self._digest_of or digests[i] in self._published:
                continue
            self._published[digests[i]] = block
            self._digest_of[block] = digests[i]

    def _digests(self, seq: Sequence) -> list[bytes]:
        """The chained digests of seq's full prompt blocks (worked out once a sequence)."""
        if seq.prefix_digests is None:
            bs = self.block_size
            tokens = np.asarray(seq.prompt[:len(seq.prompt) // bs * bs], dtype=np.int64)
            chain, out = seq.prefix_key, []
            for i in range(len(tokens) // bs):
                chain = hashlib.blake2b(chain + tokens[i * bs:(i + 1) * bs].tobytes(),
                                        digest_size=16).digest()
                out.append(chain)
            seq.prefix_digests = out
        return seq.prefix_digests
