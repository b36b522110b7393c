"""PEFT LoRA adapter validation against the served base model (numpy only, no torch).

`validate(config_bytes, blob, base, max_rank)` applies the field policy of peft_config.py to
adapter_config.json, checks the safetensors container (safetensors_parse), maps every tensor to a
(layer, module, A|B) of the base and checks its shape, and refuses NaN/Inf. `AdapterCheck` is the
same as a blob streams in (first_pass.py: header and shapes before the body, then digests and
the finite check chunk by chunk, in one pass). Every refusal is a
Refusal (INVALID_ARGUMENT) naming the field or tensor and the reason. The modules are the base
family's (services.common.families: Phi-3's fused qkv_proj and gate_up_proj, q/k/v and gate/up
apart for the others), so an adapter trained on another family is refused naming the module the
base lacks, and one of another size naming the shape and the base. A multimodal base (Gemma 3
4B/12B/27B) is served as its text model (services.common.text_model): its adapters' language
model tensors are checked as the text model's, and their vision tower's and projector's (PEFT
wraps the vision tower's q/k/v too when target_modules names them short) are ignored and
counted. Shapes, per projection:

    q: A [r, hidden]            B [n_heads * head_dim, r]
    k, v: A [r, hidden]         B [n_kv_heads * head_dim, r]
    qkv (Phi-3): A [r, hidden]  B [(n_heads + 2 * n_kv_heads) * head_dim, r]
    o: A [r, n_heads*head_dim]  B [hidden, r]
    gate, up: A [r, hidden]     B [intermediate, r]
    gate_up (Phi-3): A [r, hidden]  B [2 * intermediate, r]
    down: A [r, intermediate]   B [hidden, r]
"""
from __future__ import annotations

import hashlib
import json
import pathlib
import threading
import re
from concurrent.futures import Executor
from dataclasses import dataclass

from services.common import safetensors_parse as st
from services.adapter_store.first_pass import BlobPass, feed_bytes
from services.adapter_store.peft_config import LoraFields, check_config
from services.common.errors import Refusal
from services.common.families import (PARENT as _PARENT, SPLIT_TARGETS, Family, family_of,
                                      in_out)
from services.common.text_model import (HEADS, IMAGE, IMAGE_PREFIXES, LAYER_STEMS, OTHER,
                                        PEFT_PREFIX, VISION_MODULES, split_name, text_config)

MODULES = SPLIT_TARGETS
# base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_{A|B}[.{adapter name}].weight
_KEY = re.compile(r"base_model\.model\.model\.layers\.(\d{1,6})\.(self_attn|mlp)\."
                  r"(q_proj|k_proj|v_proj|qkv_proj|o_proj|gate_proj|up_proj|gate_up_proj|"
                  r"down_proj)\.lora_(A|B)(?:\.[A-Za-z0-9_-]{1,64})?\.weight")


@dataclass(frozen=True)
class BaseShapes:
    """The served base model's dimensions that LoRA shapes depend on."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    architecture: str = "LlamaForCausalLM"
    targets: tuple[str, ...] = SPLIT_TARGETS      # the family's linear layers (PEFT targets)
    multimodal: bool = False                      # served as its text model

    def in_out(self, module: str) -> tuple[int, int]:
        """(in_features, out_features) of a projection."""
        return in_out(module, self.hidden, self.intermediate, self.heads * self.head_dim,
                      self.kv_heads * self.head_dim)

    @property
    def described(self) -> str:
        return f"{self.architecture} ({', '.join(self.targets)})"


def load_base_shapes(path: pathlib.Path) -> BaseShapes:
    """Read a Hugging Face config.json of a family the worker serves (services.common.families;
    a multimodal one's text model, as the worker reads it); ValueError if it lacks a dimension
    or is of another architecture."""
    cfg = json.loads(path.read_text())
    found = family_of(cfg) if cfg.get("architectures") else ("LlamaForCausalLM", Family())
    if found is None:
        raise ValueError(f"{path}: architecture {cfg.get('architectures')!r} is not served")
    try:
        cfg = text_config(cfg)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
    try:
        hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        shapes = BaseShapes(hidden=hidden, intermediate=int(cfg["intermediate_size"]),
                            layers=int(cfg["num_hidden_layers"]), heads=heads,
                            kv_heads=int(cfg.get("num_key_value_heads") or heads),
                            head_dim=int(cfg.get("head_dim") or hidden // heads),
                            architecture=found[0], targets=found[1].targets,
                            multimodal=found[1].multimodal)
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{path}: not a Llama-family config ({exc})") from None
    if min(v for v in shapes.__dict__.values() if type(v) is int) <= 0:
        raise ValueError(f"{path}: dimensions must be positive: {shapes}")
    return shapes


@dataclass(frozen=True)
class AdapterSummary:
    """A validated adapter. `tensors` offsets are absolute in the blob; `config_json` canonical."""

    rank: int
    alpha: float
    rslora: bool
    targets: tuple[str, ...]
    layers: tuple[int, ...]
    tensors: tuple[st.RawTensor, ...]
    total_bytes: int
    config_json: str
    version: str
    sha256: str
    ignored: tuple[str, ...] = ()     # config fields unknown to the store, left "off"
    ignored_tensors: int = 0          # a multimodal base's vision-side LoRA tensors, not served


def canonical_json(config: dict) -> str:
    """The config as canonical JSON (sorted keys, no spaces, ASCII): what the version hashes."""
    return json.dumps(config, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def content_version(config_json: str, blob: bytes) -> str:
    """The adapter's version: the first 16 hex of SHA-256(config_json + '\\n' + blob)."""
    h = hashlib.sha256(config_json.encode("ascii"))
    h.update(b"\n")
    h.update(blob)
    return h.hexdigest()[:16]


# headers checked, by (header bytes, blob size, canonical config, base): the adapters of one
# fleet (one shape, one config) have byte-identical headers, so a burst of first uses parses
# and checks 256 tensor entries once, not once each (~2 ms of GIL-held Python an adapter)
_HEADERS: dict[tuple, tuple[tuple[st.RawTensor, ...], int]] = {}
_HEADERS_LOCK = threading.Lock()
HEADERS_KEPT = 256


class AdapterCheck:
    """An adapter's validation as its blob arrives (first_pass.BlobPass): the config is
    checked when this is made, the header's tensors (names, shapes, one A and one B per
    targeted module) before the body is read, then the finite check and the digests."""

    def __init__(self, config_bytes: bytes, base: BaseShapes, max_rank: int,
                 helper: Executor | None = None):
        """helper: a thread for one of the two digests (first_pass.BlobPass)."""
        self.fields, self._expected = check_targets(config_bytes, base, max_rank)
        self._base = base
        self.config_json = canonical_json(json.loads(config_bytes))     # parsed fine above
        self.blob = BlobPass(self.config_json, self._check_tensors, helper=helper,
                             parse=self._header)
        self.ignored_tensors = 0

    def _header(self, head, size: int) -> list[st.RawTensor]:
        """The header's tensors, parsed and checked (or as a header alike was: _HEADERS)."""
        key = (bytes(head), size, self.config_json, self._base)
        hit = _HEADERS.get(key)
        if hit is None:
            tensors = st.parse_header(head, size, self.blob.what)
            self._check_tensors(tensors)
            hit = (tuple(tensors), self.ignored_tensors)
            with _HEADERS_LOCK:
                if len(_HEADERS) >= HEADERS_KEPT:
                    _HEADERS.pop(next(iter(_HEADERS)))
                _HEADERS[key] = hit
        tensors, self.ignored_tensors = hit
        return list(tensors)

    def _check_tensors(self, tensors: list[st.RawTensor]) -> None:
        found = [_check_tensor(t, self.fields.r, self._base) for t in tensors]
        self.ignored_tensors = found.count(None)
        _check_complete([f for f in found if f is not None], self._expected)

    def summary(self) -> AdapterSummary:
        """The validated adapter, once the whole blob went through (Refusal if it did not)."""
        version, sha = self.blob.finish()
        targets, layers = targets_and_layers(self._expected)
        f = self.fields
        return AdapterSummary(
            rank=f.r, alpha=f.alpha, rslora=f.rslora, targets=targets, layers=layers,
            tensors=tuple(self.blob.tensors), total_bytes=self.blob.size,
            config_json=self.config_json, version=version, sha256=sha, ignored=f.ignored,
            ignored_tensors=self.ignored_tensors)


def validate(config_bytes: bytes, blob: bytes, base: BaseShapes, max_rank: int
             ) -> AdapterSummary:
    """Check an adapter (its blob in memory) against the base; its summary, or Refusal."""
    check = AdapterCheck(config_bytes, base, max_rank)
    feed_bytes(check.blob, blob)
    return check.summary()


def check_targets(config_bytes: bytes, base: BaseShapes, max_rank: int
                  ) -> tuple[LoraFields, set[tuple[int, str]]]:
    """The config's checks, without the weights: its fields (peft_config's policy) and the
    (layer, module) pairs it targets in the base; raises Refusal."""
    fields = check_config(config_bytes, base.layers, max_rank)
    return fields, expected_pairs(fields, base)


def targets_and_layers(pairs: set[tuple[int, str]]) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """(targeted modules in the families' order, targeted layers ascending) of (layer, module)
    pairs."""
    modules = {m for _, m in pairs}
    return (tuple(m for m in _PARENT if m in modules),
            tuple(sorted({layer for layer, _ in pairs})))


def base_module_names(base: BaseShapes) -> dict[str, tuple[int, str] | None]:
    """The base's module paths as PEFT matches target_modules against them, each with its
    (layer, module), and its output head (None). A multimodal base's language model under both
    its namings (services.common.text_model), whichever the adapter's transformers had."""
    stems, heads = (LAYER_STEMS, HEADS) if base.multimodal else (("model.",), ("lm_head",))
    names: dict[str, tuple[int, str] | None] = {
        f"{stem}layers.{i}.{_PARENT[m]}.{m}": (i, m)
        for stem in stems for i in range(base.layers) for m in base.targets}
    return {**names, **dict.fromkeys(heads)}


def _vision_only(entry: str) -> bool:
    """A target_modules entry that names a module of the vision tower or the projector alone."""
    return entry.startswith(IMAGE_PREFIXES) or entry.rsplit(".", 1)[-1] in VISION_MODULES


def expected_pairs(fields: LoraFields, base: BaseShapes) -> set[tuple[int, str]]:
    """The (layer, module) pairs the config targets, resolved PEFT-style against the base (a
    multimodal base's language model; entries naming only its vision side are let be)."""
    names = base_module_names(base)
    spec = fields.target_modules
    if spec == "all-linear":  # every linear layer but the output head
        matched = [n for n, pair in names.items() if pair is not None]
    elif isinstance(spec, str):
        matched = [n for n in names if fields.target_regex.fullmatch(n)]
        if not matched:
            raise Refusal("target_modules", f"target_modules: regex {spec!r} matches no module "
                                            "of the base model")
    else:
        matched = []
        for entry in spec:
            hits = [n for n in names if n == entry or n.endswith("." + entry)]
            if not hits and not (base.multimodal and _vision_only(entry)):
                raise Refusal("target_modules", f"target_modules: the base model has no "
                                                f"module {entry!r} (LoRA targets of "
                                                f"{base.described})")
            matched += hits
    if any(names[n] is None for n in matched):
        raise Refusal("target_modules", "target_modules: lm_head is not supported (LoRA "
                                        f"targets of {base.described})")
    pairs = {names[n] for n in matched}
    if fields.layers is not None:
        pairs = {p for p in pairs if p[0] in fields.layers}
    if not pairs:
        raise Refusal("target_modules", "target_modules: no module of the served text model "
                                        f"is targeted (LoRA targets of {base.described})")
    return pairs


def _check_tensor(t: st.RawTensor, r: int, base: BaseShapes) -> tuple[int, str, str] | None:
    """Map a tensor to (layer, module, A|B) and check its shape; None for a multimodal base's
    vision tower or projector tensor (ignored); raises Refusal."""
    part, name = split_name(t.name, PEFT_PREFIX) if base.multimodal else ("", t.name)
    if part == IMAGE:
        return None
    m = None if part == OTHER else _KEY.fullmatch(name)
    if m is None or _PARENT[m.group(3)] != m.group(2) or m.group(3) not in base.targets:
        raise Refusal("tensor_name", f"tensor {t.name!r}: not a LoRA A/B weight of a "
                                     f"{'/'.join(base.targets)} projection (the served base "
                                     f"is {base.architecture})")
    layer, module, part = int(m.group(1)), m.group(3), m.group(4)
    if layer >= base.layers:
        raise Refusal("tensor_name", f"tensor {t.name!r}: layer {layer} out of range (the base "
                                     f"has {base.layers} layers)")
    fan_in, fan_out = base.in_out(module)
    want = (r, fan_in) if part == "A" else (fan_out, r)
    if t.shape != want:
        raise Refusal("shape", f"tensor {t.name!r}: shape {list(t.shape)}, expected "
                               f"{list(want)} for r={r} and the served base "
                               f"({base.architecture}, hidden {base.hidden}, intermediate "
                               f"{base.intermediate}, {base.heads}/{base.kv_heads} heads of "
                               f"{base.head_dim})")
    return layer, module, part


def _check_complete(found: list[tuple[int, str, str]], expected: set[tuple[int, str]]) -> None:
    """Exactly one A and one B per targeted (layer, module), nothing else."""
    seen = set(found)
    if len(seen) != len(found):
        layer, module, part = next(k for k in seen if found.count(k) > 1)
        raise Refusal("tensor_name", f"tensor for layer {layer} {module} lora_{part}: "
                                     "present twice")
    want = {(layer, module, part) for layer, module in expected for part in "AB"}
    extra, missing = sorted(seen - want), sorted(want - seen)
    if extra:
        layer, module, part = extra[0]
        raise Refusal("tensor_name", f"tensor for layer {layer} {module} lora_{part}: module "
                                     "not targeted by target_modules/layers_to_transform")
    if missing:
        layer, module, part = missing[0]
        raise Refusal("tensor_missing", f"tensor for layer {layer} {module} lora_{part}: "
                                        f"missing ({len(missing)} targeted tensors missing)")
