"""The adapter tiers and the cold path: the manager (acquire, pin, release, evict, the cold-load
job), the device pool (one flat buffer, a range allocator, per-slot tables) and its room queue,
the pinned host tier, the layout of an adapter's bytes, the store client and the fetch, the cold
loads' records, and the GIL switch interval while loads are in flight."""
