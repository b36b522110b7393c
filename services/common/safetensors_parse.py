"""A safetensors file parsed by hand and checked before anything trusts it (numpy only, no torch).

Layout: 8-byte little-endian header length N, N bytes of JSON header
(`{"NAME": {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}`), then the
data section; offsets are relative to the data section. Every check here runs on the bytes in hand
before any tensor is interpreted: N capped (a length of 2**40 is refused without reading further),
JSON well-formed without duplicate keys, tensor count capped, dtypes F32/F16/BF16, offsets in range,
non-overlapping and covering the data section exactly, sizes matching shapes, no NaN/Inf.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass

import numpy as np

from services.common.errors import Refusal

MAX_HEADER_BYTES = 1 << 20
MAX_TENSORS = 4096
ITEMSIZE = {"F32": 4, "F16": 2, "BF16": 2}
# Raw-bit view and exponent mask per dtype: all exponent bits set means NaN or Inf.
_EXPONENT = {"F32": (np.dtype("<u4"), 0x7F800000), "F16": (np.dtype("<u2"), 0x7C00),
             "BF16": (np.dtype("<u2"), 0x7F80)}
_ENTRY_KEYS = {"dtype", "shape", "data_offsets"}


@dataclass(frozen=True)
class RawTensor:
    """One tensor of the file: `offset` is absolute in the file (the blob), not data-relative."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def parse(blob: bytes, what: str = "adapter_model.safetensors") -> list[RawTensor]:
    """Check the container and return its tensors sorted by offset; raises Refusal."""
    return parse_header(blob[:8 + header_length(blob, len(blob), what)], len(blob), what)


def parse_header(head: bytes, size: int, what: str = "adapter_model.safetensors"
                 ) -> list[RawTensor]:
    """`parse` from the file's first 8 + N bytes (`head`) and its size alone: the tensors'
    places, checked against each other and the size; the data section is not read."""
    header_len = header_length(head, size, what)
    header = _header_json(bytes(head[8:8 + header_len]), what)
    data_start = 8 + header_len
    tensors = [_entry(name, meta, data_start) for name, meta in header.items()
               if name != "__metadata__"]
    if not tensors:
        raise Refusal("header", f"{what}: holds no tensors")
    _check_layout(tensors, data_start, size, what)
    return tensors


def header_length(head: bytes, size: int, what: str = "adapter_model.safetensors") -> int:
    """N, the JSON header's length, from the first 8 bytes of a file of `size` bytes."""
    if size < 8 or len(head) < 8:
        raise Refusal("truncated", f"{what}: truncated: {size} bytes, no header length")
    header_len = int.from_bytes(bytes(head[:8]), "little")
    if header_len > MAX_HEADER_BYTES:
        raise Refusal("header", f"{what}: header length {header_len} exceeds the "
                                f"{MAX_HEADER_BYTES}-byte cap")
    if header_len < 2:
        raise Refusal("header", f"{what}: header length {header_len} is too small")
    if 8 + header_len > size:
        raise Refusal("truncated", f"{what}: truncated: header of {header_len} bytes but the "
                                   f"file has {size} bytes")
    return header_len


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict:
    out = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def _header_json(raw: bytes, what: str) -> dict:
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise Refusal("header", f"{what}: header is not valid JSON: {exc}") from None
    if not isinstance(header, dict):
        raise Refusal("header", f"{what}: header is not a JSON object")
    if len(header) > MAX_TENSORS + 1:
        raise Refusal("header", f"{what}: {len(header)} header entries exceed the cap of "
                                f"{MAX_TENSORS} tensors")
    meta = header.get("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise Refusal("header", f"{what}: __metadata__ must map strings to strings")
    return header


def _entry(name: str, meta: object, data_start: int) -> RawTensor:
    where = f"tensor {name!r}"
    if not isinstance(meta, dict) or set(meta) != _ENTRY_KEYS:
        raise Refusal("header", f"{where}: header entry must have exactly dtype, shape, "
                                "data_offsets")
    dtype, shape, offsets = meta["dtype"], meta["shape"], meta["data_offsets"]
    if dtype not in ITEMSIZE:
        raise Refusal("dtype", f"{where}: dtype {dtype!r} is not supported (F32, F16, BF16)")
    if (not isinstance(shape, list) or len(shape) > 8
            or not all(_is_uint(d) for d in shape)):
        raise Refusal("header", f"{where}: shape {shape!r} is not a list of sizes")
    if (not isinstance(offsets, list) or len(offsets) != 2
            or not all(_is_uint(o) for o in offsets) or offsets[0] > offsets[1]):
        raise Refusal("header", f"{where}: data_offsets {offsets!r} is not [begin, end]")
    nbytes = math.prod(shape) * ITEMSIZE[dtype]
    if offsets[1] - offsets[0] != nbytes:
        raise Refusal("header", f"{where}: data_offsets {offsets} span "
                                f"{offsets[1] - offsets[0]} bytes, shape {shape} {dtype} "
                                f"needs {nbytes}")
    return RawTensor(name, dtype, tuple(shape), data_start + offsets[0], nbytes)


def _is_uint(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < (1 << 48)


def _check_layout(tensors: list[RawTensor], data_start: int, size: int, what: str) -> None:
    """Offsets in range, no overlap, no gap, nothing after the last tensor; sorts in place."""
    tensors.sort(key=lambda t: (t.offset, t.nbytes))
    last = max(tensors, key=lambda t: t.offset + t.nbytes)
    if last.offset + last.nbytes > size:
        raise Refusal("truncated", f"{what}: truncated: tensor {last.name!r} ends at byte "
                                   f"{last.offset + last.nbytes}, the file has {size}")
    position, previous = data_start, None
    for t in tensors:
        if t.offset < position:
            raise Refusal("offsets", f"tensor {t.name!r}: data overlaps tensor "
                                     f"{previous.name!r}")
        if t.offset > position:
            raise Refusal("offsets", f"tensor {t.name!r}: gap of {t.offset - position} "
                                     "bytes before its data")
        position, previous = t.offset + t.nbytes, t
    if position != size:
        raise Refusal("offsets", f"{what}: {size - position} trailing bytes after the last "
                                 "tensor")


def check_finite(blob: bytes, tensor: RawTensor) -> None:
    """Refuse a tensor holding NaN or Inf, judged on raw bits (exponent all ones)."""
    view, mask = _EXPONENT[tensor.dtype]
    bits = np.frombuffer(blob, dtype=view, count=tensor.nbytes // view.itemsize,
                         offset=tensor.offset)
    bad = np.flatnonzero((bits & view.type(mask)) == mask)
    if bad.size:
        raise Refusal("nonfinite", f"tensor {tensor.name!r}: {bad.size} NaN/Inf values "
                                   f"(first at flat index {int(bad[0])})")
