"""vLLM's LoRA kernel files (lora_shrink_op.py, lora_expand_op.py, kernel_utils.py, utils.py),
loaded standalone for the kernel benches: every `vllm.*` import they make is answered by a stub
module, except the kernel files themselves, which load from the folder given (--vllm-src)."""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import types
from pathlib import Path

import torch

ENV_DEFAULTS = {"VLLM_TUNED_CONFIG_FOLDER": None}   # vLLM's defaults; every other flag False


class _Envs(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("VLLM_"):
            return ENV_DEFAULTS.get(name, False)
        raise AttributeError(name)


class _Platform:
    def is_cuda(self):
        return torch.cuda.is_available()

    def has_device_capability(self, cap):
        if not torch.cuda.is_available():
            return False
        major, minor = torch.cuda.get_device_capability()
        return major * 10 + minor >= cap


class _Logger:
    def __getattr__(self, name):              # info, warning, warning_once, ...
        return lambda *a, **k: None


def _shim_attrs():
    import triton
    import triton.language as tl
    envs = _Envs("vllm.envs")

    def h2d(values, dtype, device, pin_memory=True):
        pin = pin_memory and torch.cuda.is_available()
        return torch.tensor(values, dtype=dtype, pin_memory=pin).to(device, non_blocking=True)

    return dict(
        tl=tl, triton=triton, HAS_TRITON=True, envs=envs, current_platform=_Platform(),
        init_logger=lambda name: _Logger(), next_power_of_2=triton.next_power_of_2,
        cdiv=triton.cdiv, round_up=lambda x, m: (x + m - 1) // m * m,
        direct_register_custom_op=lambda *a, **k: None,  # -> torch.ops lookup fails -> plain fn
        async_tensor_h2d=h2d)


class _VllmFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    KERNEL_FILES = ("kernel_utils", "utils", "lora_shrink_op", "lora_expand_op")

    def __init__(self, src: Path):
        self.src, self.attrs = src, _shim_attrs()

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "vllm" and not fullname.startswith("vllm."):
            return None
        head, _, stem = fullname.rpartition(".")
        if head.endswith("lora.ops.triton_ops") and stem in self.KERNEL_FILES:
            return importlib.util.spec_from_file_location(fullname, self.src / f"{stem}.py")
        return importlib.util.spec_from_loader(fullname, self, is_package=True)

    def create_module(self, spec):
        if spec.name.endswith(".envs"):
            return self.attrs["envs"]
        mod = types.ModuleType(spec.name)
        attrs = self.attrs

        def __getattr__(name):
            if name in attrs:
                return attrs[name]
            if name.startswith("VLLM_"):
                return getattr(attrs["envs"], name)
            raise AttributeError(f"{spec.name}.{name} is not shimmed")

        mod.__getattr__ = __getattr__
        return mod

    def exec_module(self, module):
        module.__path__ = []


def load_vllm(src: str | None):
    """(shrink_fn, expand_fn, utils_module) from vLLM's kernel files, or an error string."""
    if not src:
        return "not requested (--vllm-src not given)"
    path = Path(src).resolve()
    missing = [f for f in _VllmFinder.KERNEL_FILES if not (path / f"{f}.py").exists()]
    if missing:
        return f"missing in {path}: {missing}"
    for name in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
        del sys.modules[name]
    finder = _VllmFinder(path)
    sys.meta_path.insert(0, finder)
    try:
        text = (path / "lora_shrink_op.py").read_text()
        pkg = ("vllm.runtime.modeling.lora.ops.triton_ops"
               if "vllm.runtime.modeling.lora" in text else "vllm.lora.ops.triton_ops")
        shrink = importlib.import_module(f"{pkg}.lora_shrink_op")
        expand = importlib.import_module(f"{pkg}.lora_expand_op")
        utils = importlib.import_module(f"{pkg}.utils")
        return shrink._lora_shrink, expand._lora_expand, utils
    except Exception as exc:                  # any import failure: skip vLLM, say why
        return f"import failed: {type(exc).__name__}: {exc}"
