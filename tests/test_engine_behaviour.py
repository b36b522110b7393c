"""The engine stepped by hand: requests joining mid-flight, KV exhaustion with preemption,
cancel, stopping (stop sequences, EOS, max tokens, time limit), chunked prefill, seeded sampling
across batch mixes, and requests refused at submit. Outputs are checked against transformers +
PEFT greedy generate of each request alone."""
from __future__ import annotations

import json
import shutil
import time

import pytest
import torch

from services.common.errors import InvalidArgument
from services.worker.adapters.layout import staged_from_peft_dir
from services.worker.config import EngineOptions
from services.worker.engine.sequence import Sampling, Sequence, Stop, Stopping
from services.worker.startup.factory import build_engine
from tests.hf_fixtures import make_adapter, make_base
from tests.test_engine_parity import hf_greedy

ADAPTERS = ("r1-attn", "r64-all", "r8-rslora")
SAMPLED = Sampling(temperature=0.9, top_k=40, top_p=0.9, seed=1234, repetition_penalty=1.3)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("behaviour")
    base = make_base(root / "base")
    peft = {n: make_adapter(base, root / "adapters", n, seed=i + 1) for i, n in enumerate(ADAPTERS)}
    return root, {None: base, **peft}


def engine_for(root, model="base", **kw):
    kw = {"kv_cache_bytes": 4 << 20, "block_size": 4, "max_batch_tokens": 64, **kw}
    built = build_engine(root / model, EngineOptions(device="cpu", dtype="float32", **kw))
    slots = {None: -1}
    for n in ADAPTERS:
        layout = staged_from_peft_dir(root / "adapters" / n, built.spec)
        slots[n] = built.pool.place(n, layout)
    return built, slots


class Collector:
    """Submits sequences and gathers their streams: token ids, text, final event."""

    def __init__(self, engine, slots):
        self.engine, self.slots = engine, slots
        self.tokens, self.text, self.final, self.events = {}, {}, {}, {}

    def submit(self, rid, prompt, adapter=None, n=8, sampling=Sampling(), **stopping):
        stop = Stopping(max_new_tokens=n, **{"ignore_eos": True, **stopping})
        seq = Sequence(rid, prompt, slot=self.slots[adapter], sampling=sampling, stopping=stop)
        self.engine.submit(seq, lambda ev: self._sink(rid, ev))
        self.tokens[rid], self.text[rid], self.events[rid] = [], "", 0
        return seq

    def _sink(self, rid, ev):
        assert rid not in self.final, "event after the final one"
        self.tokens[rid] += ev.token_ids
        self.text[rid] += ev.text
        self.events[rid] += 1
        if ev.stop is not Stop.NONE:
            self.final[rid] = ev

    def step(self, times=1):
        for _ in range(times):
            self.engine.step()

    def run(self, max_steps=2000):
        for _ in range(max_steps):
            if len(self.final) == len(self.tokens):
                return self
            self.engine.step()
        raise AssertionError(f"unfinished: {set(self.tokens) - set(self.final)}")


def prompt(seed, n):
    return torch.randint(2, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def assert_kv_consistent(built):
    """Every block is either free or in exactly one live sequence's table."""
    s = built.engine.scheduler
    held = [b for q in s.running + s.waiting for b in q.block_table]
    assert len(held) == len(set(held))
    assert s.blocks.free_blocks + len(held) == s.blocks.num_blocks


def test_requests_arriving_mid_flight(ckpt):
    root, models = ckpt
    built, slots = engine_for(root)
    c = Collector(built.engine, slots)
    waves = [[(None, 5), ("r1-attn", 17)], [("r64-all", 3), (None, 30), ("r8-rslora", 9)],
             [("r1-attn", 12), ("r8-rslora", 1)]]
    expected = {}
    for w, wave in enumerate(waves):
        for i, (name, length) in enumerate(wave):
            p = prompt(10 * w + i, length)
            c.submit(f"w{w}-{i}", p, name)
            expected[f"w{w}-{i}"] = hf_greedy(models[name], p, 8)
        c.step(3)
    c.run()
    assert c.tokens == expected
    assert all(ev.stop is Stop.MAX_TOKENS for ev in c.final.values())
    assert built.engine.scheduler.blocks.free_blocks == built.engine.scheduler.blocks.num_blocks


def test_kv_exhaustion_preempts_and_resumes(ckpt):
    """12 blocks of 4 tokens, 6 requests of up to 7 blocks each: the newest are preempted,
    recomputed later, and every request still gets its solo output."""
    root, models = ckpt
    per_block = 2 * 2 * 4 * 2 * 16 * 4           # K+V, layers, block, kv heads, head dim, fp32
    built, slots = engine_for(root, kv_cache_bytes=12 * per_block)
    assert built.engine.scheduler.blocks.num_blocks == 12
    c = Collector(built.engine, slots)
    names = [None, "r1-attn", "r64-all", "r8-rslora", None, "r64-all"]
    expected, seqs = {}, []
    for i, name in enumerate(names):
        p = prompt(100 + i, 6 + i)
        seqs.append(c.submit(f"r{i}", p, name, n=16))
        expected[f"r{i}"] = hf_greedy(models[name], p, 16)
    seqs.append(c.submit("sampled", prompt(99, 8), "r1-attn", n=16, sampling=SAMPLED))
    for _ in range(400):
        if len(c.final) == len(c.tokens):
            break
        c.step()
        assert_kv_consistent(built)
    assert built.engine.scheduler.preemptions > 0
    assert any(s.preemptions > 0 for s in seqs)
    assert {r: c.tokens[r] for r in expected} == expected
    assert all(ev.stop is Stop.MAX_TOKENS for ev in c.final.values())   # none starved
    solo, slots = engine_for(root)
    alone = Collector(solo.engine, slots)
    alone.submit("sampled", prompt(99, 8), "r1-attn", n=16, sampling=SAMPLED)
    assert alone.run().tokens["sampled"] == c.tokens["sampled"]


def test_chunked_prefill_matches(ckpt):
    """A 45-token prompt under an 8-token budget is prefilled in chunks, beside a decode row."""
    root, models = ckpt
    built, slots = engine_for(root, max_batch_tokens=8)
    runner, chunks = built.engine.runner, []
    def recording_run(batch, run=runner.run):
        assert sum(b.num_tokens for b in batch) <= 8
        chunks.extend(b.num_tokens for b in batch if b.seq.request_id == "long")
        return run(batch)
    runner.run = recording_run
    c = Collector(built.engine, slots)
    c.submit("short", prompt(6, 3), None)
    c.step()
    c.submit("long", long := prompt(5, 45), "r64-all")
    c.run()
    assert chunks[:6] == [7, 7, 7, 7, 7, 7] and sum(chunks[:7]) == 45
    assert c.tokens["long"] == hf_greedy(models["r64-all"], long, 8)
    assert c.tokens["short"] == hf_greedy(models[None], prompt(6, 3), 8)


def test_cancel_frees_kv_at_once(ckpt):
    root, models = ckpt
    built, slots = engine_for(root)
    c = Collector(built.engine, slots)
    for i, name in enumerate(ADAPTERS):
        c.submit(f"k{i}", prompt(200 + i, 10), name, n=12)
    victim = c.submit("victim", prompt(210, 20), "r64-all", n=12)
    c.step(4)
    assert c.tokens["victim"] and victim.block_table
    built.engine.abort("victim")
    built.engine.abort("no-such-request")            # ignored
    c.step()
    assert c.final["victim"].stop is Stop.CANCELLED
    assert not victim.block_table
    assert victim not in built.engine.scheduler.running
    assert_kv_consistent(built)
    queued = c.submit("queued", prompt(211, 4), None)
    built.engine.abort("queued")                      # cancelled before it ever ran
    c.run()
    assert c.final["queued"].stop is Stop.CANCELLED and c.tokens["queued"] == []
    for i, name in enumerate(ADAPTERS):
        assert c.tokens[f"k{i}"] == hf_greedy(models[name], prompt(200 + i, 10), 12)
    assert not queued.block_table
    assert built.engine.scheduler.blocks.free_blocks == built.engine.scheduler.blocks.num_blocks


def first_with(tokenizer, out, stop):
    """How many tokens of out until the decoded text first contains stop."""
    return next(k for k in range(1, len(out) + 1) if stop in tokenizer.decode(out[:k]))


def test_stop_sequences(ckpt):
    """Word-level tokens ("t12 t40"): a stop spanning two tokens ends the output before it."""
    root, models = ckpt
    built, slots = engine_for(root)
    tok = built.tokenizer
    p = prompt(300, 7)
    out = hf_greedy(models[None], p, 12)
    full = tok.decode(out)
    stop = tok.decode(out[4:6])                          # e.g. "t12 t40"
    c = Collector(built.engine, slots)
    c.submit("stop", p, n=12, stop_sequences=("zzz", stop))
    c.submit("nomatch", p, n=12, stop_sequences=("zzz-never",))
    c.run()
    k = first_with(tok, out, stop)
    assert c.final["stop"].stop is Stop.STOP_SEQUENCE
    assert c.tokens["stop"] == out[:k]
    assert c.text["stop"] == full[:full.find(stop)] and stop not in c.text["stop"]
    assert c.final["nomatch"].stop is Stop.MAX_TOKENS and c.text["nomatch"] == full


def test_eos_and_max_tokens(ckpt, tmp_path):
    """EOS is the model's (config) eos id: make it a token the base emits greedily."""
    root, models = ckpt
    p = prompt(400, 6)
    out = hf_greedy(models[None], p, 10)
    eos = out[3]
    shutil.copytree(root / "base", tmp_path / "base")
    for name in ("config.json", "generation_config.json"):
        cfg = json.loads((tmp_path / "base" / name).read_text())
        (tmp_path / "base" / name).write_text(json.dumps({**cfg, "eos_token_id": eos}))
    (tmp_path / "adapters").symlink_to(root / "adapters")
    built, slots = engine_for(tmp_path)
    c = Collector(built.engine, slots)
    c.submit("eos", p, n=10, ignore_eos=False)
    c.submit("ignore", p, n=10, ignore_eos=True)
    c.submit("max", p, n=2)
    c.run()
    assert c.final["eos"].stop is Stop.EOS_TOKEN
    assert c.tokens["eos"] == out[:out.index(eos) + 1]
    assert c.final["ignore"].stop is Stop.MAX_TOKENS and c.tokens["ignore"] == out
    assert c.tokens["max"] == out[:2] and c.final["max"].stop is Stop.MAX_TOKENS
    assert (c.final["max"].generated_tokens, c.final["max"].prompt_tokens) == (2, 6)


def test_time_limit(ckpt):
    root, _ = ckpt
    built, slots = engine_for(root)
    c = Collector(built.engine, slots)
    c.submit("slow", prompt(500, 5), n=200, time_limit_s=0.5, stop_sequences=("held",))
    c.submit("free", prompt(501, 5), n=20)
    c.step(3)
    assert not c.final
    time.sleep(0.55)
    c.step()
    assert c.final["slow"].stop is Stop.TIME_LIMIT
    assert 0 < len(c.tokens["slow"]) < 200
    # the text held back for the stop sequence is flushed with the final event
    assert c.text["slow"] == built.tokenizer.decode(c.tokens["slow"])
    c.run()
    assert c.final["free"].stop is Stop.MAX_TOKENS


def run_sampled(root, others, delay=0, sampling=SAMPLED):
    """The sampled request (adapter r8-rslora) in a batch with others; its tokens."""
    built, slots = engine_for(root)
    c = Collector(built.engine, slots)
    for rid, (name, p, params) in others.items():
        c.submit(rid, p, name, n=10, sampling=params)
    c.step(delay)
    c.submit("target", prompt(600, 9), "r8-rslora", n=10, sampling=sampling)
    return c.run()


def test_seeded_sampling_is_batch_invariant(ckpt):
    root, models = ckpt
    alone = run_sampled(root, {}).tokens["target"]
    mix1 = {f"m{i}": ([None, *ADAPTERS][i % 4], prompt(610 + i, 3 + 4 * i),
                      Sampling() if i % 2 else Sampling(0.7, 10, 0.8, 77 + i, 1.1))
            for i in range(7)}
    batch = run_sampled(root, mix1)
    assert batch.tokens["target"] == alone
    mix2 = {f"n{i}": ([*ADAPTERS, None][i % 4], prompt(700 + i, 20 - i),
                      Sampling(1.2, 0, 1.0, 5 + i) if i % 3 else Sampling())
            for i in range(5)}
    assert run_sampled(root, mix2, delay=2).tokens["target"] == alone   # joins mid-flight
    # greedy rows beside sampled ones still get their solo greedy output
    for rid, (name, p, params) in mix1.items():
        if params.greedy:
            assert batch.tokens[rid] == hf_greedy(models[name], p, 10), rid
    other_seed = run_sampled(root, {}, sampling=Sampling(0.9, 40, 0.9, 4321, 1.3))
    assert other_seed.tokens["target"] != alone
    assert alone != hf_greedy(models["r8-rslora"], prompt(600, 9), 10)


def test_refused_at_submit(ckpt):
    root, _ = ckpt
    per_block = 2 * 2 * 4 * 2 * 16 * 4
    built, slots = engine_for(root, kv_cache_bytes=12 * per_block, max_model_len=64)
    c = Collector(built.engine, slots)
    with pytest.raises(InvalidArgument, match="exceeds the model's 64 tokens"):
        c.submit("long", prompt(1, 60), n=8)
    with pytest.raises(InvalidArgument, match="KV blocks"):
        c.submit("kv", prompt(1, 44), n=8)               # 52 tokens: 13 blocks of 12
    with pytest.raises(InvalidArgument, match="prompt"):
        c.submit("empty", [], n=8)
    with pytest.raises(InvalidArgument, match="max_new_tokens"):
        c.submit("none", prompt(1, 4), n=0)
    c.submit("fits", prompt(1, 40), n=8)                 # 48 tokens: exactly 12 blocks
    assert c.run().final["fits"].stop is Stop.MAX_TOKENS


def test_incremental_detokenization_equals_full_decode():
    """The engine decodes a small window per step; the text must equal decoding everything,
    multi-byte characters split across tokens included (byte-level BPE of the demo model)."""
    import random
    from tokenizers import Tokenizer
    from services.worker.engine.detokenizer import Detokenizer
    from tests.support import MODEL_DIR
    tok = Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))
    detok = Detokenizer(tok)
    text = "Héllo wörld, naïve café — 東京 🌧️ rain! " * 3
    ids = tok.encode(text, add_special_tokens=False).ids
    rng = random.Random(0)
    ids += [rng.randrange(4, tok.get_vocab_size()) for _ in range(40)]
    seq = Sequence("r", [1, 2, 3])
    for i, t in enumerate(ids):
        seq.tokens.append(t)
        detok.decoded(seq, final=i == len(ids) - 1)
    assert seq.decoded == tok.decode(ids, skip_special_tokens=True)


def test_sequences_of_one_prefix_share_its_prompt_blocks(ckpt):
    """A sequence admitted while another of the same prefix key holds its prompt's computed
    blocks takes them instead of computing them, and still gets the tokens transformers + PEFT
    give it alone; one of another key (another tenant or adapter) takes none."""
    root, models = ckpt
    built, slots = engine_for(root)
    c = Collector(built.engine, slots)
    blocks = built.engine.scheduler.blocks
    p = prompt(7, 37)                                      # 9 full blocks of 4
    expected = hf_greedy(models["r1-attn"], p, 8)
    first = c.submit("first", p, "r1-attn")
    first.prefix_key = b"tenant-a/r1-attn"
    while not c.tokens["first"]:
        c.step()
    same = [c.submit(f"same{i}", p, "r1-attn") for i in range(2)]
    other = c.submit("other", p, "r1-attn")
    for q in same:
        q.prefix_key = first.prefix_key
    other.prefix_key = b"tenant-b/r1-attn"
    c.run()
    assert blocks.shared_blocks == 2 * 9
    assert c.tokens == {rid: expected for rid in ("first", "same0", "same1", "other")}
    assert blocks.free_blocks == blocks.num_blocks          # every hold given back
