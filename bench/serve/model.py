"""The serving benchmark's model and adapters: a random Llama checkpoint (tiny, or Llama-2-7B
shaped) and N PEFT adapters per rank, written once into a work directory and reused while their
manifest matches.

Adapters are cheap to make distinct: per rank one random tensor set is drawn once; each adapter
takes it with a per-adapter random scale on its B matrices of one layer and its index written
exactly into three elements of the first A matrix (values 2^-7 * (1 + k/128), exact in bf16 and
fp32), so no two adapters share a safetensors blob.
"""
from __future__ import annotations

import concurrent.futures
import json
import pathlib
import random
import re
import shutil
import time

from bench.lib.synthetic import SHAPES, adapter_tensors, model_config, module_shapes

MANIFEST = ".bench-manifest.json"
FORMAT = 1                           # bump when what is written changes

ADAPTER_ID = re.compile(r"r(\d+)-(\d{4,})")


def _manifest_matches(path: pathlib.Path, want: dict) -> bool:
    try:
        return json.loads((path / MANIFEST).read_text()) == want
    except (OSError, ValueError):
        return False


# ------------------------------------------------------------------------------- base model
def ensure_model(root: pathlib.Path, shape: str, seed: int = 0) -> pathlib.Path:
    """root/model-SHAPE holding a random checkpoint of `shape`, written unless already there.
    On a machine with a GPU the weights are drawn there, in a subprocess (so this process
    never holds GPU memory the worker will need)."""
    path = root / f"model-{shape}"
    want = {"format": FORMAT, "shape": shape, "seed": seed, "config": model_config(shape)}
    if _manifest_matches(path, want):
        print(f"model: reusing {path}", flush=True)
        return path
    shutil.rmtree(path, ignore_errors=True)
    import torch
    if torch.cuda.is_available():
        import multiprocessing as mp
        proc = mp.get_context("spawn").Process(target=write_checkpoint,
                                               args=(path, shape, seed, "cuda"))
        proc.start()
        proc.join()
        if proc.exitcode != 0:
            raise SystemExit(f"writing the {shape} checkpoint failed (exit {proc.exitcode})")
    else:
        write_checkpoint(path, shape, seed, "cpu")
    (path / MANIFEST).write_text(json.dumps(want, indent=1))
    return path


def _tensor_shapes(cfg: dict) -> list[tuple[str, tuple[int, ...]]]:
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    q = cfg["num_attention_heads"] * cfg["head_dim"]
    kv = cfg["num_key_value_heads"] * cfg["head_dim"]
    out = [("model.embed_tokens.weight", (v, h))]
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}."
        out += [(p + "input_layernorm.weight", (h,)), (p + "self_attn.q_proj.weight", (q, h)),
                (p + "self_attn.k_proj.weight", (kv, h)), (p + "self_attn.v_proj.weight", (kv, h)),
                (p + "self_attn.o_proj.weight", (h, q)),
                (p + "post_attention_layernorm.weight", (h,)),
                (p + "mlp.gate_proj.weight", (i, h)), (p + "mlp.up_proj.weight", (i, h)),
                (p + "mlp.down_proj.weight", (h, i))]
    return out + [("model.norm.weight", (h,)), ("lm_head.weight", (v, h))]


def _shards(shapes, shard_bytes: int, elem: int) -> list[list]:
    shards, cur, size = [], [], 0
    for name, shape in shapes:
        n = elem
        for d in shape:
            n *= d
        if cur and size + n > shard_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append((name, shape))
        size += n
    return shards + [cur] if cur else shards


def write_checkpoint(path: pathlib.Path, shape: str, seed: int, device: str) -> None:
    """Random weights (std 0.02; norm weights 1 + 0.05 * N(0, 1), so a norm applied in the
    wrong place shows) as safetensors shards of <= 2 GB with an index, config.json and a
    word-level tokenizer.json; progress per shard."""
    import torch
    from safetensors.torch import save_file
    from tests.hf_fixtures import write_tokenizer
    cfg = model_config(shape)
    dtype = getattr(torch, cfg["torch_dtype"])
    g = torch.Generator(device=device).manual_seed(seed)
    shards = _shards(_tensor_shapes(cfg), 2 << 30, torch.finfo(dtype).bits // 8)
    path.mkdir(parents=True, exist_ok=True)
    weight_map, start = {}, time.monotonic()
    for k, shard in enumerate(shards, 1):
        fname = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for name, dims in shard:
            t = torch.randn(dims, generator=g, device=device, dtype=torch.float32)
            t = 1 + 0.05 * t if name.endswith("norm.weight") else 0.02 * t
            tensors[name] = t.to(dtype).cpu()
            weight_map[name] = fname
        save_file(tensors, str(path / fname), metadata={"format": "pt"})
        print(f"model: shard {k}/{len(shards)} written ({time.monotonic() - start:.0f}s)",
              flush=True)
    (path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": weight_map}, indent=1))
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    write_tokenizer(path, cfg["vocab_size"])


# ----------------------------------------------------------------------------------- adapters
def parse_groups(text: str) -> list[tuple[int, int]]:
    """'32x16,2000x8' -> [(32, 16), (2000, 8)]: (count, rank) groups."""
    groups = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        m = re.fullmatch(r"(\d+)x(\d+)", part)
        if m is None or int(m.group(1)) < 1 or int(m.group(2)) < 1:
            raise ValueError(f"--adapters: {part!r} is not COUNTxRANK (e.g. 32x16)")
        groups.append((int(m.group(1)), int(m.group(2))))
    return groups


def adapter_id(rank: int, index: int) -> str:
    return f"r{rank}-{index:04d}"


def adapter_elements(cfg: dict, rank: int, targets) -> int:
    """Elements of one adapter's A and B matrices over every layer."""
    shapes = module_shapes(cfg)
    return cfg["num_hidden_layers"] * sum(rank * (shapes[m][0] + shapes[m][1]) for m in targets)


def _distinct(base: dict, index: int, layers: int) -> dict:
    """The base set made this adapter's: B of layer (index % layers) scaled by a seeded factor
    in [0.5, 1.5), and the index written exactly into A[0, 0:3] of the first tensor."""
    rng = random.Random(index)
    out = dict(base)
    tag = f"layers.{index % layers}."
    scale = 0.5 + rng.random()
    for name, t in base.items():
        if tag in name and name.endswith("lora_B.weight"):
            out[name] = (t.float() * scale).to(t.dtype)
    first = next(iter(base))
    a = base[first].clone()
    for j in range(3):                     # 7 bits each: 2^21 distinct adapters
        a[0, j] = 2.0 ** -7 * (1 + ((index >> (7 * j)) & 127) / 128)
    out[first] = a
    return out


def _write_one(path: pathlib.Path, base: dict, index: int, layers: int, config: dict) -> None:
    from safetensors.torch import save_file
    tensors = _distinct(base, index, layers)
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(tensors, str(tmp / "adapter_model.safetensors"))
    (tmp / "adapter_config.json").write_text(json.dumps(config))
    shutil.rmtree(path, ignore_errors=True)
    tmp.rename(path)                       # a dir that exists is whole


def ensure_adapters(root: pathlib.Path, model_cfg: dict, groups, targets, dtype_name: str,
                    seed: int = 0) -> dict:
    """root/adapters/r{rank}-{i:04d} for every (count, rank) group; adapters already there from
    a run with the same model, targets, dtype and seed are kept, others removed. Returns
    {"dir", "ids": {rank: [ids]}, "bytes": {rank: bytes}, ...} for the results header."""
    import torch
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype_name]
    out = root / "adapters"
    want = {"format": FORMAT, "model": {k: model_cfg.get(k) for k in SHAPES["7b"]},
            "targets": list(targets), "dtype": dtype_name, "seed": seed}
    if not _manifest_matches(out, want):
        shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / MANIFEST).write_text(json.dumps(want, indent=1))
    ids = {rank: [adapter_id(rank, i) for i in range(count)] for count, rank in groups}
    _remove_stale(out, {i for v in ids.values() for i in v})
    for rank, names in ids.items():
        _write_rank(out, model_cfg, rank, names, targets, dtype, seed)
    elem = 2 if dtype_name == "bf16" else 4
    return {"dir": str(out), "ids": ids, "targets": list(targets), "dtype": dtype_name,
            "elements": {r: adapter_elements(model_cfg, r, targets) for r in ids},
            "bytes": {r: elem * adapter_elements(model_cfg, r, targets) for r in ids},
            "groups": [{"count": c, "rank": r} for c, r in groups]}


def _remove_stale(out: pathlib.Path, keep: set[str]) -> None:
    for d in out.iterdir():
        if d.is_dir() and d.name not in keep:
            shutil.rmtree(d)


def _write_rank(out, model_cfg, rank, names, targets, dtype, seed) -> None:
    missing = [(int(ADAPTER_ID.fullmatch(n).group(2)), n) for n in names
               if not (out / n / "adapter_model.safetensors").exists()]
    if not missing:
        print(f"adapters: reusing {len(names)} of rank {rank}", flush=True)
        return
    # one random A/B set (std 0.01) per rank, each adapter's made distinct from it
    base = adapter_tensors(model_cfg, rank, seed * 1000 + rank, targets=targets,
                           dtype=dtype)
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
              "target_modules": list(targets), "bias": "none", "lora_dropout": 0.0,
              "task_type": "CAUSAL_LM", "base_model_name_or_path": "lorafleet-bench"}
    layers, start = model_cfg["num_hidden_layers"], time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(4) as pool:      # file writes overlap
        jobs = [pool.submit(_write_one, out / n, base, i, layers, config)
                for i, n in missing]
        for k, job in enumerate(jobs, 1):
            job.result()
            if k % 100 == 0 or k == len(jobs):
                print(f"adapters: rank {rank}: {k}/{len(jobs)} written "
                      f"({time.monotonic() - start:.0f}s)", flush=True)
