"""What runs before the worker says SERVING: assembling the engine from a checkpoint (factory:
the model, KV cache, runners, scheduler and adapter pool), the warm-up of every eager step shape
(warmup), and the child processes that fill a cold kernel cache in parallel (precompile)."""
