"""The embedded default model (`models/`, written by tools/make_tiny_model.py) loads in Hugging Face
transformers + PEFT, is a GQA Llama, and each demo adapter steers the same prompt its own way."""
from __future__ import annotations

import itertools
import json
import pathlib
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
tokenizers = pytest.importorskip("tokenizers")

ROOT = pathlib.Path(__file__).resolve().parent.parent
MODELS = ROOT / "models"
BASE = MODELS / "tiny-llama"
DEMO_PROMPT = "Tell me about the weather."
MARKERS = {"acme-support": "Acme", "pirate": "matey", "poet": "Roses"}  # adapter -> word
LORA = {  # adapter -> (r, lora_alpha, use_rslora, target_modules)
    "acme-support": (8, 16, False, {"q_proj", "v_proj"}),
    "pirate": (16, 16, True, {"q_proj", "k_proj", "v_proj", "o_proj",
                              "gate_proj", "up_proj", "down_proj"}),
    "poet": (4, 8, False, {"q_proj", "k_proj", "v_proj", "o_proj"}),
}
BOS, EOS, PAD, UNK = 1, 2, 3, 0


@pytest.fixture(scope="module")
def models_dir() -> pathlib.Path:
    """`make` normally generates models/ first; build it here if it is missing."""
    if not (BASE / ".complete").exists():
        subprocess.run([sys.executable, str(ROOT / "tools" / "make_tiny_model.py"),
                        "--out", str(MODELS)], check=True, timeout=600)
    return MODELS


@pytest.fixture(scope="module")
def tok(models_dir):
    return tokenizers.Tokenizer.from_file(str(models_dir / "tiny-llama" / "tokenizer.json"))


def _load(adapter: str | None):
    model = transformers.AutoModelForCausalLM.from_pretrained(str(BASE))
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, str(MODELS / "adapters" / adapter))
    return model.eval()


@pytest.fixture(scope="module")
def completions(models_dir, tok) -> dict[str, str]:
    """Greedy 16-token completion of DEMO_PROMPT for the base ("base") and each adapter."""
    ids = torch.tensor([tok.encode(DEMO_PROMPT).ids])  # [1, S], starts with <s>
    out = {}
    for name in ["base", *MARKERS]:
        model = _load(None if name == "base" else name)
        with torch.no_grad():
            gen = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                 max_new_tokens=16, do_sample=False, pad_token_id=PAD)
        out[name] = tok.decode(gen[0, ids.shape[1]:].tolist(), skip_special_tokens=True)
    return out


def test_config_is_gqa_llama(models_dir):
    raw = json.loads((BASE / "config.json").read_text())
    assert raw["architectures"] == ["LlamaForCausalLM"]
    assert raw["torch_dtype"] == "float32" and raw["tie_word_embeddings"] is False
    assert (raw["bos_token_id"], raw["eos_token_id"]) == (BOS, EOS)
    cfg = transformers.AutoConfig.from_pretrained(str(BASE))
    assert cfg.model_type == "llama"
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers) == (128, 256, 4)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (4, 2)  # GQA
    assert cfg.vocab_size == 1024 and cfg.max_position_embeddings == 512


def test_files_are_safetensors_only(models_dir):
    for name in ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                 "tokenizer_config.json", "special_tokens_map.json"]:
        assert (BASE / name).is_file(), name
    for name in MARKERS:
        files = sorted(p.name for p in (models_dir / "adapters" / name).iterdir())
        assert files == ["adapter_config.json", "adapter_model.safetensors"], (name, files)
    assert not list(models_dir.rglob("*.bin"))


@pytest.mark.parametrize("name", sorted(LORA))
def test_adapter_configs_vary(models_dir, name):
    cfg = json.loads((models_dir / "adapters" / name / "adapter_config.json").read_text())
    r, alpha, rslora, targets = LORA[name]
    assert (cfg["peft_type"], cfg["r"], cfg["lora_alpha"], cfg["use_rslora"]) == (
        "LORA", r, alpha, rslora)
    assert set(cfg["target_modules"]) == targets
    assert cfg["bias"] == "none" and not cfg["use_dora"] and not cfg["modules_to_save"]


def test_tokenizer_round_trips_with_tokenizers_library(tok):
    assert [tok.token_to_id(t) for t in ["<unk>", "<s>", "</s>", "<pad>"]] == [UNK, BOS, EOS, PAD]
    assert tok.get_vocab_size() <= 1024
    for text in ["Hello!", DEMO_PROMPT, "  two  spaces, tabs\tand\nnewlines ", "café ☕ 東京 🙂", ""]:
        enc = tok.encode(text)
        assert enc.ids[0] == BOS and EOS not in enc.ids  # BOS prepended, EOS never appended
        assert enc.ids[1:] == tok.encode(text, add_special_tokens=False).ids
        assert tok.decode(enc.ids, skip_special_tokens=True) == text
        assert UNK not in enc.ids  # byte-level: nothing is unknown


def test_auto_tokenizer_agrees(tok):
    hf = transformers.AutoTokenizer.from_pretrained(str(BASE))
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (BOS, EOS, PAD)
    assert hf(DEMO_PROMPT)["input_ids"] == tok.encode(DEMO_PROMPT).ids


def test_adapters_steer_the_same_prompt(completions):
    for a, b in itertools.combinations(completions, 2):
        assert completions[a] != completions[b], (a, b, completions)
    for name, word in MARKERS.items():
        assert word in completions[name], (name, completions[name])
        assert word not in completions["base"], completions["base"]
    assert len(completions["base"].split()) >= 3  # the base says something, not noise or nothing
