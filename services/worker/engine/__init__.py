"""The torch-free loop: the engine (loop: schedule, launch, post-process, on its own thread), the
scheduler (continuous batching, chunked prefill, preemption, the tenants' fair order), sequences,
the KV block manager (prefix sharing), the detokenizer, the engine's gauges and its steps timed
by class (step_profile). Runs the same on a machine without torch; the device work is behind the
Runner protocol (loop.Runner)."""
