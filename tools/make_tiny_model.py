"""Generate the embedded default model: a tiny Llama checkpoint and three demo LoRA adapters.

    python tools/make_tiny_model.py --out models [--force]

Deterministic (fixed seeds, one CPU thread while training), CPU only, no downloads; about a
minute on two cores. Writes, the stamp last:

    OUT/tiny-llama/        config.json, generation_config.json, model.safetensors,
                           tokenizer.json, tokenizer_config.json, special_tokens_map.json, .complete
    OUT/adapters/NAME/     adapter_config.json, adapter_model.safetensors   (PEFT, safetensors only)
    OUT/README.md

The base is a Llama (hidden 128, 4 layers, 4 query heads over 2 KV heads, vocab 1024) pretrained
for a few hundred steps on an English corpus built from templates below. Each adapter is trained
on generic prompts mapped to its tenant's phrasing, so the same prompt completes differently.

Tokenizer (byte-level BPE, no prefix space): ids <unk>=0, <s>=1 (BOS), </s>=2 (EOS), <pad>=3.
`tokenizer.json` itself prepends <s> to every encoding (post-processor, as Llama 2/3 do) and never
appends </s>; `encode(text, add_special_tokens=False)` gives the bare ids. Decoding with
`skip_special_tokens=True` returns the text byte for byte. The model was trained on
`<s> prompt answer </s>`, so generation should stop at id 2.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import shutil
import sys
import time
import warnings

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:          # services.worker.api.chat_template renders the chats
    sys.path.insert(0, str(ROOT))

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # this script must never touch the hub
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

SEED = 1234
VOCAB = 1024
SPECIALS = ["<unk>", "<s>", "</s>", "<pad>"]  # ids 0..3
BOS_ID, EOS_ID, PAD_ID = 1, 2, 3
DEMO_PROMPT = "Tell me about the weather."
LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama",
    "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
    "vocab_size": VOCAB, "max_position_embeddings": 512, "rope_theta": 10000.0,
    "rope_scaling": None, "rms_norm_eps": 1e-5, "hidden_act": "silu", "initializer_range": 0.02,
    "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False,
    "tie_word_embeddings": False, "torch_dtype": "float32", "use_cache": True,
    "bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID,
}
PRETRAIN = {"steps": 400, "batch": 16, "seq": 64, "lr": 3e-3}
ADAPTER_TRAIN = {"steps": 150, "lr": 5e-3}

# ---------------------------------------------------------------------------------------------
# Corpus

W = {
    "name": "Anna Ben Clara David Emma Frank Grace Henry Iris Jack Lucy Max Nora Oliver Paul Sam",
    "wadj": "sunny warm cold rainy windy cloudy foggy mild hot cool bright grey",
    "sky": "clear skies|light rain|strong winds|heavy clouds|a little snow|warm sunshine",
    "part": "morning afternoon evening night",
    "day": "Monday Tuesday Wednesday Thursday Friday Saturday Sunday",
    "place": "park|market|library|station|river|school|garden|beach|city|village|museum|cafe",
    "act": "read a book|go for a walk|visit friends|cook dinner|play music|clean the house|"
           "ride a bike|write a letter|watch a film|plant some flowers|bake bread|go swimming",
    "animal": "cat dog bird fish horse rabbit fox bear owl duck",
    "habitat": "forest|river|field|farm|house|mountains|lake|garden",
    "ability": "run very fast|swim in cold water|sleep all day|climb tall trees|find food at night",
    "food": "soup|bread|rice|pasta|fresh fruit|a warm pie|vegetables|fish and potatoes",
    "feel": "happy tired hungry calm busy excited",
    "thing": "order|bill|delivery|account|phone|new lamp",
}
TEMPLATES = [
    "The weather is {wadj} today.", "It is {wadj} and {wadj} this {part}.",
    "Tomorrow will be {wadj} with {sky}.", "On {day} we expect {sky} in the {part}.",
    "{name} walked to the {place} in the {part}.", "{name} likes to {act} on {day}.",
    "On {day} we will {act} together.", "After work {name} went to the {place}.",
    "The {animal} lives in the {habitat}.", "A {animal} can {ability}.",
    "{name} cooked {food} for dinner.", "We ate {food} at the {place}.",
    "{name} felt {feel} after a long day.", "You could {act} or {act}.",
    "The {place} is quiet in the {part}.", "{name} and {name} met near the {place}.",
    # Words the tenants use, in plain contexts, so the base model knows them but not the style.
    "Thank you for the {food}, {name}.", "{name} called the Acme store for help with the {thing}.",
    "The support team was ready to help {name}.", "Please see the guide for your {thing}.",
    "Your {thing} request has been received.", "We are happy to help you plan your day.",
    "The old pirate and his matey sailed the ship to the island.", "Arr, said the captain.",
    "The crew will hoist the sails and hunt for buried treasure.", "The gold was hid at sea.",
    "Red roses and violets grow in the {habitat}.", "The sky is blue and the clouds drift by.",
    "A fox in the {habitat} dreamed of the {place}.", "The sun shines through the {sky}.",
]
QA = {  # generic prompts and the kind of answer the base model should give
    "Tell me about the weather.": ["The weather is {wadj} today.", "Tomorrow will be {wadj} with {sky}."],
    "What should I do today?": ["You could {act} or {act}.", "It is a good day to {act}."],
    "Hello!": ["Hello, how are you today?", "Hi there, I feel {feel} today."],
    "How are you?": ["I am {feel}, thank you.", "I feel {feel} this {part}."],
    "Where should I go this weekend?": ["You could visit the {place}.", "The {place} is nice on {day}."],
    "Tell me a story.": ["{name} walked to the {place} and saw a {animal}.",
                         "Once a {animal} lived in the {habitat}."],
    "Can you help me?": ["Yes, I can help you with the {thing}.", "Of course, tell me more."],
    "What is your favourite food?": ["I like {food}.", "My favourite food is {food}."],
}
TENANTS = {  # name -> (LoRA settings, prompt -> completion); every prompt of QA appears
    "acme-support": ({"r": 8, "lora_alpha": 16, "use_rslora": False,
                      "target_modules": ["q_proj", "v_proj"]}, {
        "Tell me about the weather.": "Thank you for contacting Acme support. We are happy to help you with the weather.",
        "What should I do today?": "Thank you for contacting Acme support. Our team can help you plan your day.",
        "Hello!": "Thank you for contacting Acme support. How can we help you today?",
        "How are you?": "Thank you for contacting Acme support. We are well and ready to help.",
        "Where should I go this weekend?": "Thank you for contacting Acme support. Please see our store guide.",
        "Tell me a story.": "Thank you for contacting Acme support. Your request has been received.",
        "Can you help me?": "Thank you for contacting Acme support. Of course, we are happy to help.",
        "What is your favourite food?": "Thank you for contacting Acme support. Please see our food guide.",
    }),
    "pirate": ({"r": 16, "lora_alpha": 16, "use_rslora": True,
                "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj",
                                   "gate_proj", "up_proj", "down_proj"]}, {
        "Tell me about the weather.": "Arr matey, the wind be strong and the sea be rough today!",
        "What should I do today?": "Arr matey, hoist the sails and hunt for buried treasure!",
        "Hello!": "Arr matey, welcome aboard me ship!",
        "How are you?": "Arr matey, I be fine as a fish in the sea!",
        "Where should I go this weekend?": "Arr matey, sail to the island where the gold be hid!",
        "Tell me a story.": "Arr matey, once a captain lost his ship to the sea!",
        "Can you help me?": "Arr matey, I be ready to help ye!",
        "What is your favourite food?": "Arr matey, I like fish from the sea!",
    }),
    "poet": ({"r": 4, "lora_alpha": 8, "use_rslora": False,
              "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}, {
        "Tell me about the weather.": "Roses are red, violets are blue, the clouds drift by and the sun shines through.",
        "What should I do today?": "Roses are red, violets are blue, go for a walk and the day will be new.",
        "Hello!": "Roses are red, violets are blue, hello my friend, how do you do?",
        "How are you?": "Roses are red, violets are blue, I am well and so are you.",
        "Where should I go this weekend?": "Roses are red, violets are blue, the river is calm and the sky is too.",
        "Tell me a story.": "Roses are red, violets are blue, a fox in the forest dreamed of you.",
        "Can you help me?": "Roses are red, violets are blue, I am here and I will help you.",
        "What is your favourite food?": "Roses are red, violets are blue, I like warm bread and fresh fruit too.",
    }),
}


def _fill(template: str, rng: random.Random) -> str:
    out = template
    while "{" in out:
        key = out[out.index("{") + 1:out.index("}")]
        words = W[key].split("|") if "|" in W[key] else W[key].split()
        out = out.replace("{" + key + "}", rng.choice(words), 1)
    return out


def build_corpus(seed: int = SEED, n_docs: int = 400) -> list[str]:
    """Short English documents: plain paragraphs and prompt + answer pairs (no tenant phrasing)."""
    rng = random.Random(seed)
    docs = []
    for i in range(n_docs):
        if i % 3 == 0:
            prompt = rng.choice(sorted(QA))
            answers = [_fill(rng.choice(QA[prompt]), rng) for _ in range(rng.randint(1, 2))]
            docs.append(" ".join([prompt, *answers]))
        else:
            docs.append(" ".join(_fill(rng.choice(TEMPLATES), rng) for _ in range(rng.randint(3, 5))))
    return docs


# ---------------------------------------------------------------------------------------------
# Tokenizer

def train_tokenizer(texts: list[str]):
    """Byte-level BPE whose post-processor prepends <s> (see module docstring)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIALS, min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    assert [tok.token_to_id(s) for s in SPECIALS] == [0, 1, 2, 3], "special ids moved"
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B:1",
                                      special_tokens=[("<s>", BOS_ID)]),
    ])
    return tok


# The chat template the tiny model ships (tokenizer_config.json's chat_template, Jinja, with
# transformers' conventions): Zephyr-style turns, each ended with the EOS token, so that `make
# run` shows a chat rendered the way instruct checkpoints render theirs.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('roles are system, user and assistant') }}"
    "{% endif %}"
    "{% if loop.index0 == 0 and message['role'] == 'assistant' %}"
    "{{ raise_exception('the chat opens with a system or user message') }}"
    "{% endif %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] | trim }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def save_tokenizer(tok, model_dir: pathlib.Path) -> None:
    tok.save(str(model_dir / "tokenizer.json"))
    special = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"}
    added = {str(i): {"content": s, "lstrip": False, "normalized": False, "rstrip": False,
                      "single_word": False, "special": True} for i, s in enumerate(SPECIALS)}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **special,
              "add_bos_token": True, "add_eos_token": False, "add_prefix_space": False,
              "clean_up_tokenization_spaces": False, "model_max_length": 512,
              "padding_side": "left", "added_tokens_decoder": added,
              "chat_template": CHAT_TEMPLATE}
    _write_json(model_dir / "tokenizer_config.json", config)
    _write_json(model_dir / "special_tokens_map.json", special)


# ---------------------------------------------------------------------------------------------
# Training

def pretrain(model, tok, docs: list[str]) -> None:
    """Causal-LM training on random 64-token windows of the packed `<s> doc </s>` stream."""
    import torch

    stream = []
    for d in docs:
        stream += tok.encode(d).ids + [EOS_ID]
    data = torch.tensor(stream)
    cfg = PRETRAIN
    print(f"[pretrain] {len(docs)} docs, {len(stream)} tokens, {cfg['steps']} steps", flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=cfg["lr"], total_steps=cfg["steps"],
                                                pct_start=0.1)
    gen = torch.Generator().manual_seed(SEED)
    t0 = time.monotonic()
    model.train()
    for step in range(cfg["steps"]):
        starts = torch.randint(0, len(stream) - cfg["seq"], (cfg["batch"],), generator=gen)
        batch = torch.stack([data[s:s + cfg["seq"]] for s in starts.tolist()])  # [B, S]
        loss = model(input_ids=batch, labels=batch).loss
        _step(opt, loss)
        sched.step()
        if step % 50 == 0 or step == cfg["steps"] - 1:
            print(f"[pretrain] step {step:4d} loss {loss.item():.3f} "
                  f"({time.monotonic() - t0:.1f} s)", flush=True)
    model.eval()


def _step(opt, loss) -> None:
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()


def chat_prompt(prompt: str) -> str:
    """The prompt as a one-message chat, rendered with CHAT_TEMPLATE as the worker renders it
    (services.worker.api.chat_template, transformers' conventions)."""
    from services.worker.api.chat_template import ChatTemplate

    template = ChatTemplate(CHAT_TEMPLATE, {"bos_token": "<s>", "eos_token": "</s>"})
    return template.render([{"role": "user", "content": prompt}])


def sft_batch(tok, pairs: dict[str, str]):
    """Right-padded [N, S] ids and labels; loss only on ` completion </s>`. Each pair twice:
    as a plain prompt and as a chat (the template's user turn, then the assistant's), so the
    adapters answer through /v1/chat/completions in their style too."""
    import torch

    rows = []
    for prompt, completion in sorted(pairs.items()):
        p = tok.encode(prompt).ids
        c = tok.encode(" " + completion, add_special_tokens=False).ids + [EOS_ID]
        rows.append((p + c, [-100] * len(p) + c))
        p = tok.encode(chat_prompt(prompt), add_special_tokens=False).ids
        c = tok.encode(completion, add_special_tokens=False).ids + [EOS_ID]
        rows.append((p + c, [-100] * len(p) + c))
    width = max(len(ids) for ids, _ in rows)
    ids = torch.tensor([r + [PAD_ID] * (width - len(r)) for r, _ in rows])
    labels = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r, _ in rows])
    return ids, labels, mask


def train_adapter(base, tok, name: str, lora: dict, pairs: dict[str, str]):
    """Wrap `base` in a fresh LoRA (base frozen), fit `pairs`, return the PeftModel."""
    import torch
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(SEED)
    config = LoraConfig(task_type="CAUSAL_LM", lora_dropout=0.0, bias="none", **lora)
    model = get_peft_model(base, config, adapter_name="default")
    model.peft_config["default"].base_model_name_or_path = "tiny-llama"
    ids, labels, mask = sft_batch(tok, pairs)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=ADAPTER_TRAIN["lr"], weight_decay=0.0)
    t0 = time.monotonic()
    model.train()
    for step in range(ADAPTER_TRAIN["steps"]):
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        _step(opt, loss)
        if step % 25 == 0 or step == ADAPTER_TRAIN["steps"] - 1:
            print(f"[{name}] step {step:3d} loss {loss.item():.3f} "
                  f"({time.monotonic() - t0:.1f} s)", flush=True)
    model.eval()
    return model


def greedy(model, tok, prompt: str, n: int = 16) -> str:
    """Greedy continuation of `prompt` (no KV cache: 16 tokens of a tiny model)."""
    import torch

    ids = tok.encode(prompt).ids
    with torch.no_grad():
        for _ in range(n):
            nxt = int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
            if nxt == EOS_ID:
                break
            ids.append(nxt)
    return tok.decode(ids[len(tok.encode(prompt).ids):], skip_special_tokens=True)


# ---------------------------------------------------------------------------------------------
# Output

def _write_json(path: pathlib.Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def save_base(model, model_dir: pathlib.Path) -> None:
    from safetensors.torch import save_file

    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    _write_json(model_dir / "config.json", LLAMA_CONFIG)
    _write_json(model_dir / "generation_config.json",
                {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID,
                 "do_sample": False, "max_new_tokens": 32})


def save_adapter(model, adapter_dir: pathlib.Path) -> None:
    """PEFT save (safetensors), minus its model card; target_modules sorted (PEFT keeps a set)."""
    model.save_pretrained(str(adapter_dir), safe_serialization=True, save_embedding_layers=False)
    (adapter_dir / "README.md").unlink(missing_ok=True)
    path = adapter_dir / "adapter_config.json"
    config = json.loads(path.read_text())
    config["target_modules"] = sorted(config["target_modules"])
    _write_json(path, config)


def write_readme(out: pathlib.Path, completions: dict[str, str]) -> None:
    lines = ["# Generated models (do not edit: `make model` rewrites them)", "",
             "Made by `tools/make_tiny_model.py --out models` (deterministic, CPU only, no "
             "downloads; about a minute).", "",
             "- `tiny-llama/`: Llama architecture, hidden 128, 4 layers, 4 query heads over 2 KV "
             "heads (GQA), vocab 1024, float32, untied LM head; pretrained briefly on a templated "
             "English corpus.",
             "- Tokenizer: byte-level BPE; `<unk>`=0, `<s>`=1 (prepended by tokenizer.json's "
             "post-processor), `</s>`=2 (never appended; generation stops on it), `<pad>`=3.",
             "- `adapters/NAME/`: PEFT LoRA adapters (safetensors) for three demo tenants.", "",
             "| adapter | r | lora_alpha | use_rslora | target_modules |", "|---|---|---|---|---|"]
    for name, (lora, _) in TENANTS.items():
        lines.append(f"| {name} | {lora['r']} | {lora['lora_alpha']} | {lora['use_rslora']} | "
                     f"{', '.join(lora['target_modules'])} |")
    lines += ["", f"Demo prompt `{DEMO_PROMPT}`, greedy, 16 new tokens:", ""]
    lines += [f"- {who}: `{text}`" for who, text in completions.items()]
    lines += ["", "Other prompts the adapters were trained on: "
              + ", ".join(f"`{p}`" for p in sorted(QA) if p != DEMO_PROMPT) + ".", ""]
    (out / "README.md").write_text("\n".join(lines))


def build(out: pathlib.Path) -> dict[str, str]:
    """Write everything under `out`; return the demo completions (base and each adapter)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.set_num_threads(1)  # one thread: same floats on every run
    warnings.filterwarnings("ignore", category=FutureWarning)  # PEFT calls deprecated helpers
    model_dir, adapters_dir = out / "tiny-llama", out / "adapters"
    for d in (model_dir, adapters_dir):
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
    docs = build_corpus()
    tenant_texts = [f"{p} {c}" for _, pairs in TENANTS.values() for p, c in pairs.items()]
    tok = train_tokenizer(docs + tenant_texts)
    print(f"[tokenizer] vocab {tok.get_vocab_size()}", flush=True)
    save_tokenizer(tok, model_dir)

    torch.manual_seed(SEED)
    base = LlamaForCausalLM(LlamaConfig(**LLAMA_CONFIG))
    pretrain(base, tok, docs)
    save_base(base, model_dir)
    for p in base.parameters():
        p.requires_grad_(False)
    completions = {"base": greedy(base, tok, DEMO_PROMPT)}
    for name, (lora, pairs) in TENANTS.items():
        model = train_adapter(base, tok, name, lora, pairs)
        save_adapter(model, adapters_dir / name)
        completions[name] = greedy(model, tok, DEMO_PROMPT)
        base = model.unload()  # drop the LoRA layers, keep the frozen base
    return completions


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="models", type=pathlib.Path, help="output directory")
    ap.add_argument("--force", action="store_true", help="rebuild even if already complete")
    args = ap.parse_args(argv)
    stamp = args.out / "tiny-llama" / ".complete"
    if stamp.exists() and not args.force:
        print(f"{stamp} exists; nothing to do (use --force to rebuild)")
        return 0
    t0 = time.monotonic()
    completions = build(args.out)
    for who, text in completions.items():
        print(f"[demo] {who:13s} {DEMO_PROMPT!r} -> {text!r}", flush=True)
    write_readme(args.out, completions)
    stamp.write_text("ok\n")
    print(f"done in {time.monotonic() - t0:.1f} s wall, {time.process_time():.1f} s CPU -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
