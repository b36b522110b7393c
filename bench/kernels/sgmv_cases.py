"""The SGMV benchmark's problems: a pool of 128 adapters in our layout and vLLM's, T tokens
spread evenly over n of them, the fp32 reference, and each implementation as a closure that adds
the LoRA delta into y in place (ours as the engine's eager steps call it, ours without PDL, the
fused and split kernels alone, vLLM's kernels with and without their PDL path, a cuBLAS loop per
adapter, per-token gather + bmm)."""
from __future__ import annotations

import inspect

import torch

from bench.kernels.vllm_ops import ENV_DEFAULTS

POOL_SLOTS = 128
SCALE = 0.5
TOL = 2e-2                                   # max |out - ref| / (1 + |ref|) at bf16


def make_weights(hidden, rank, dtype, device, gen):
    """A pool of 128 adapters in both layouts: ours (flat, rank-exact) and vLLM's (stacked)."""
    a_all = (torch.randn(POOL_SLOTS, rank, hidden, generator=gen, device=device)
             / hidden ** 0.5).to(dtype)
    bt_all = (torch.randn(POOL_SLOTS, rank, hidden, generator=gen, device=device)
              / rank ** 0.5).to(dtype)
    idx = torch.arange(POOL_SLOTS, dtype=torch.int64, device=device)
    return dict(
        a_all=a_all, bt_all=bt_all,
        pool=torch.cat([a_all.flatten(), bt_all.flatten()]),      # all A blobs, then all Bt
        a_off=(idx * rank * hidden).view(1, -1),
        b_off=(POOL_SLOTS * rank * hidden + idx * rank * hidden).view(1, -1),
        ranks=torch.full((POOL_SLOTS,), rank, dtype=torch.int32, device=device),
        # every offset is a multiple of rank x hidden: the alignment the engine's pool promises
        align=8 if rank * hidden % 8 == 0 else 1,
        scales=torch.full((POOL_SLOTS,), SCALE, dtype=torch.float32, device=device),
        a_stacked=a_all.view(POOL_SLOTS, 1, rank, hidden),          # [loras, 1, r, K]
        b_stacked=bt_all.transpose(1, 2).contiguous().view(POOL_SLOTS, 1, hidden, rank))


def make_problem(weights, hidden, rank, t, n, dtype, device, gen):
    """x, y0, W and the segment metadata for T tokens spread evenly over n adapters."""
    slots = sorted(torch.randperm(POOL_SLOTS, generator=gen, device=device)[:n].tolist())
    lens = [t // n + (i < t % n) for i in range(n)]
    starts = [0]
    for ln in lens:
        starts.append(starts[-1] + ln)
    pad = POOL_SLOTS + 1 - n

    def i32(values):
        return torch.tensor(values, dtype=torch.int32, device=device)

    token_slot = torch.repeat_interleave(torch.tensor(slots), torch.tensor(lens)).to(device)
    return dict(
        weights, hidden=hidden, rank=rank, t=t, n=n, slots=slots, starts=starts,
        x=torch.randn(t, hidden, generator=gen, device=device).to(dtype),
        y0=torch.randn(t, hidden, generator=gen, device=device).to(dtype),
        w=(torch.randn(hidden, hidden, generator=gen, device=device) / hidden ** 0.5).to(dtype),
        seg_start=i32(starts + [t]), seg_slot=i32(slots + [-1]),        # one padded segment
        token_slot=token_slot,
        # vLLM metadata, as LoRAKernelMeta.prepare_tensors builds it (tokens already sorted)
        token_lora_mapping=token_slot.to(torch.int32),
        token_indices_sorted_by_lora_ids=torch.arange(t, dtype=torch.int32, device=device),
        lora_ids=i32(slots + [-1] * pad), num_tokens_per_lora=i32(lens + [0] * pad),
        lora_token_start_loc=i32(starts + [0] * pad),
        no_lora_flag_cpu=torch.tensor([False]),
        num_active_loras=torch.tensor([n], dtype=torch.int32))


def reference(p):
    """fp32: y0 + s * (x @ A.T) @ Bt per adapter segment."""
    ref = p["y0"].float().clone()
    for i, s in enumerate(p["slots"]):
        lo, hi = p["starts"][i], p["starts"][i + 1]
        v = p["x"][lo:hi].float() @ p["a_all"][s].float().T
        ref[lo:hi] += SCALE * v @ p["bt_all"][s].float()
    return ref


def impl_fn(name, p, y, vllm):
    """A closure that adds the LoRA delta into y in place (ours/vllm/loop/gather)."""
    args = (y, p["x"], p["pool"], p["a_off"], p["b_off"], p["ranks"], p["scales"],
            [0, p["hidden"]], p["seg_start"], p["seg_slot"], p["rank"])
    if name == "ours":          # what the engine's eager steps call (with the host tables)
        from kernels.sgmv import sgmv
        from kernels.sgmv_choice import HostSegments, only_live_segment
        host = HostSegments(only_live_segment(p["starts"] + [p["t"]], p["slots"] + [-1]),
                            p["a_off"].cpu().numpy(), p["b_off"].cpu().numpy(),
                            p["ranks"].cpu().numpy(), p["scales"].cpu().numpy())
        return lambda: sgmv(*args, host=host, align=p["align"])
    if name == "ours_nopdl":
        from kernels import pdl
        ours = impl_fn("ours", p, y, vllm)

        def run():                             # the flag is read at each launch
            with pdl.disabled():
                ours()
        return run
    if name == "vllm_pdl":
        plain = impl_fn("vllm", p, y, vllm)

        def run():                             # vLLM reads the flag at each call
            ENV_DEFAULTS["VLLM_LORA_ENABLE_DUAL_STREAM"] = True
            try:
                plain()
            finally:
                ENV_DEFAULTS.pop("VLLM_LORA_ENABLE_DUAL_STREAM")
        return run
    if name in ("ours_fused", "ours_split"):
        from kernels.sgmv_split import sgmv_split
        from kernels.sgmv_triton import sgmv_triton
        if name == "ours_fused":
            return lambda: sgmv_triton(*args)
        return lambda: sgmv_split(*args, align=p["align"])
    if name == "vllm":
        shrink, expand, _ = vllm
        meta = {k: p[k] for k in ("token_lora_mapping", "token_indices_sorted_by_lora_ids",
                                  "num_tokens_per_lora", "lora_token_start_loc", "lora_ids",
                                  "no_lora_flag_cpu", "num_active_loras")}
        s_kw = _kwargs(shrink, dict(meta, inputs=p["x"], lora_a_weights=[p["a_stacked"]],
                                    scaling=SCALE))
        e_kw = _kwargs(expand, dict(meta, lora_b_weights=[p["b_stacked"]], output_tensor=y,
                                    offset_start=0, add_inputs=True))

        def run():                             # as PunicaWrapperGPU.add_lora_linear
            buf = torch.empty((1, p["t"], p["rank"]), dtype=torch.float32, device=y.device)
            shrink(output_tensor=buf, **s_kw)
            expand(inputs=buf, **e_kw)
        return run
    if name == "loop":
        segs = [(p["starts"][i], p["starts"][i + 1], s) for i, s in enumerate(p["slots"])]

        def run():
            for lo, hi, s in segs:
                y[lo:hi].addmm_(p["x"][lo:hi] @ p["a_all"][s].T, p["bt_all"][s], alpha=SCALE)
        return run
    if name == "gather":
        def run():
            v = torch.bmm(p["a_all"][p["token_slot"]], p["x"].unsqueeze(2))       # [T, r, 1]
            d = torch.bmm(v.transpose(1, 2), p["bt_all"][p["token_slot"]])      # [T, 1, N]
            y.add_(d.squeeze(1), alpha=SCALE)
        return run
    raise ValueError(name)


def _kwargs(fn, available):
    """The keyword arguments fn takes, from what we have; vLLM's signature varies by version."""
    params = inspect.signature(fn).parameters
    needed = [k for k, v in params.items() if v.default is inspect.Parameter.empty]
    missing = [k for k in needed if k not in available and k not in ("inputs", "output_tensor")]
    if missing:
        raise TypeError(f"{fn.__name__} needs arguments this bench does not know: {missing}")
    return {k: v for k, v in available.items() if k in params}
