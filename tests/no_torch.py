"""A pytest plugin (`-p tests.no_torch`) under which importing torch, triton, transformers or
peft fails: `make test-policy` runs the torch-free tests (marker `policy`) with it, so they stay
runnable where only the services' control plane is installed."""
from __future__ import annotations

import sys

BLOCKED = ("torch", "triton", "transformers", "peft")


class _Blocker:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{name} is not importable in a torch-free test run")
        return None


sys.meta_path.insert(0, _Blocker())
