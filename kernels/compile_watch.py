"""Counts Triton kernel specializations as they are first needed in this process.

Each time a @triton.jit kernel meets arguments whose specialization it has not run before, it
compiles (or loads from its on-disk cache) a new binary: a pause of milliseconds to seconds for
whatever waits on that launch. A server warms every specialization it can meet before it takes
traffic (services.worker.startup.warmup); this watch lets it prove that: `install(on_new)` calls
on_new(kernel repr) for every new specialization from then on.
"""
from __future__ import annotations

from typing import Callable

def describe(fn, compile: dict) -> str:
    """A kernel's name, its constexpr values and its arguments' specializations (which integer
    arguments are 1 or divide by 16): what tells one specialization from another."""
    try:
        names = getattr(getattr(fn, "jit_function", None), "arg_names", None) or []
        constants = {}
        for k, v in (compile.get("constants") or {}).items():     # keys: (index,) or names
            i = k[0] if isinstance(k, tuple) and len(k) == 1 else k
            constants[names[i] if isinstance(i, int) and i < len(names) else str(k)] = v
        attrs = {}
        for k, v in (compile.get("configs") or [{}])[0].items():
            i = k[0] if isinstance(k, tuple) and len(k) == 1 else k
            attrs[names[i] if isinstance(i, int) and i < len(names) else str(k)] = v
        return f"{getattr(fn, 'name', fn)} constexprs={constants} attrs={attrs}"
    except Exception:  # noqa: BLE001 - a description, never a failure of the launch
        return ""


def install(on_new: Callable[[str], None]) -> bool:
    """Call on_new(repr) for each new kernel specialization; False when this Triton has no hook
    for it (nothing is counted)."""
    try:
        from triton import knobs
        runtime = knobs.runtime
        if not hasattr(runtime, "jit_cache_hook"):
            return False
    except (ImportError, AttributeError):
        return False
    previous = runtime.jit_cache_hook

    def hook(*, key, repr, fn, compile, is_manual_warmup, already_compiled, **_):
        on_new(describe(fn, compile) or repr)
        if previous is not None:
            return previous(key=key, repr=repr, fn=fn, compile=compile,
                            is_manual_warmup=is_manual_warmup,
                            already_compiled=already_compiled)
        return None                                  # None: compile as usual
    runtime.jit_cache_hook = hook
    return True
