"""Structured output in the worker, in process on the CPU: the grammar compiler (errors naming
the field, the cache, the time bound, tokens past the tokenizer's never allowed), the batched
mask against a per-token reference, and the engine stepping constrained rows beside free ones
(seeded, so a free row's tokens must be exactly what they are without constrained neighbours)
both eagerly and through the overlap path that GPU graph steps take (a step launched from the
one in flight samples only once the matchers have seen that step's tokens)."""
from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import pytest
import torch

from services.common.errors import InvalidArgument
from services.common.gen.lorafleet.v1 import common_pb2
from services.worker.api.grammar import GrammarCompiler, compiler_for
from services.worker.config import GrammarOptions
from services.worker.engine.sequence import Sampling, Sequence, Stop, Stopping
from services.worker.executor.graph_inputs import collect, start_sampling
from services.worker.executor.sampling import apply_bitmask
from services.worker.config import EngineOptions
from services.worker.startup.factory import build_engine
from tests.support import MODEL_DIR

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8}, "n": {"type": "integer"},
    "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
    "required": ["name", "n", "tags"], "additionalProperties": False}
REGEX = r"[a-z]{2,5}-[0-9]{2}"


@pytest.fixture(scope="module")
def built():
    return build_engine(MODEL_DIR, EngineOptions(device="cpu", dtype="float32"))


@pytest.fixture(scope="module")
def grammars(built):
    """The compiler for the served tokenizer, as the worker makes it (services.worker.app)."""
    c = compiler_for((MODEL_DIR / "tokenizer.json").read_text(), built.spec.vocab_size,
                     tuple(built.spec.eos_token_ids), GrammarOptions())
    yield c
    c.close()


def compiler(**kw) -> GrammarCompiler:
    return GrammarCompiler((MODEL_DIR / "tokenizer.json").read_text(), 1024, (2,),
                           GrammarOptions(**kw))


def matcher(c: GrammarCompiler, **grammar):
    return asyncio.run(c.matcher(common_pb2.Grammar(**grammar)))


@pytest.mark.parametrize("grammar, field", [
    ({"json_schema": '{"type": "objekt"}'}, "sampling.grammar.json_schema: "),
    ({"json_schema": "{nope"}, "sampling.grammar.json_schema: not JSON"),
    ({"regex": "(a"}, "sampling.grammar.regex: "),
    ({"lark": "start: nothing_defined"}, "sampling.grammar.lark: "),
    ({"ebnf": "root ::= ("}, "sampling.grammar.ebnf: "),
    ({"choice": common_pb2.Choice()}, "sampling.grammar.choice: "),
    ({}, "sampling.grammar: set one of"),
])
def test_a_bad_grammar_is_invalid_argument_naming_the_field(grammar, field):
    c = compiler()
    with pytest.raises(InvalidArgument) as err:
        matcher(c, **grammar)
    assert err.value.message.startswith(field), err.value.message


def test_compiled_grammars_are_cached_and_shared_by_concurrent_requests():
    c = compiler()
    g = common_pb2.Grammar(json_schema=json.dumps(SCHEMA))

    async def many():
        return await asyncio.gather(*(c.matcher(g) for _ in range(8)))
    ms = asyncio.run(many())
    assert c.compiles == 1 and len({id(m) for m in ms}) == 8     # one compile, fresh copies
    matcher(c, json_schema=json.dumps(SCHEMA))
    matcher(c, regex=REGEX)
    assert c.compiles == 2


def test_a_compile_past_the_time_bound_is_refused():
    """A compile still running at timeout_s is refused. The compile threads are held first,
    so the compile cannot finish within the bound however the machine schedules it (a loaded
    run once finished a real compile inside 1 us of waiting); it finishes once released."""
    import threading
    c = compiler(timeout_s=0.05, compile_threads=1)
    held = threading.Event()
    c._pool.submit(held.wait, 30)
    try:
        with pytest.raises(InvalidArgument,
                           match=r"sampling.grammar.regex: did not compile within"):
            matcher(c, regex="[a-z]{1,200}(x|y){3,90}")
    finally:
        held.set()


def test_tokens_past_the_tokenizer_and_eos_follow_the_grammar():
    from llguidance.torch import allocate_token_bitmask, fill_next_token_bitmask
    c = compiler()
    m = matcher(c, choice=common_pb2.Choice(options=["ab"]))
    mask = allocate_token_bitmask(1, 1024)
    fill_next_token_bitmask(m, mask)
    allowed = apply_bitmask(torch.zeros(1, 1024), mask)[0] == 0
    assert not allowed[915:].any() and not allowed[2]        # padding ids, EOS before "ab"
    for t in (c.tokenizer.tokenize_str("ab")):
        assert m.consume_token(t)
    assert m.is_stopped()


def test_the_batched_mask_matches_a_per_token_reference():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(7, 1000, generator=g)
    bits = torch.randint(0, 2, (7, 1024), generator=g, dtype=torch.int64)
    bits[3] = 1                                                # an unconstrained row
    words = (bits.view(7, 32, 32) << torch.arange(32)).sum(-1)
    mask = words.to(torch.int64).apply_(lambda w: w - (1 << 32) if w >= 1 << 31 else w)
    out = apply_bitmask(logits, mask.to(torch.int32))
    ref = torch.where(bits[:, :1000].bool(), logits, torch.tensor(float("-inf")))
    assert torch.equal(out, ref) and torch.equal(out[3], logits[3])


class LaunchingRunner:
    """The GPU graph runner's launch/collect contract on the CPU: a step launched from one in
    flight reads that step's tokens as its inputs (the graphs gather them on the device), and
    with grammar rows it samples only when that step is collected (graph_inputs.collect)."""

    def __init__(self, runner):
        self.runner, self.masks = runner, runner.masks
        self.hosts = [torch.zeros(256, dtype=torch.int64) for _ in range(2)]  # used in turn,
        # as the graph runner's host sets: a step's tokens outlive the next one's launch

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def launch(self, batch, prev=None):
        if any(not b.samples or b.num_tokens != 1 for b in batch) and prev is None:
            return None                          # prefill steps run (eagerly), as on the GPU
        ahead = []
        if prev is not None:                     # the in-flight tokens, as the inputs
            tokens = dict(zip((id(b.seq) for b in prev.batch), prev.host.tolist()))
            ahead = [b.seq for b in batch]
            for seq in ahead:
                seq.tokens.append(tokens[id(seq)])
        try:
            inputs = self.runner.steps.eager(batch, self.runner.buffers)
            logits = self.runner.model.forward(inputs.input_ids, inputs.ctx,
                                               self.runner.kv_cache)
        finally:
            for seq in ahead:
                seq.tokens.pop()
        self.hosts.reverse()
        return start_sampling(inputs.sampled, logits, prev, self.runner.steps.eos,
                              self.hosts[0], self.masks)

    collect = staticmethod(collect)


def run_requests(built, grammars, specs, overlap: bool):
    """specs: (grammar kwargs or None, seed) per request; their texts and final events."""
    eng = built.engine
    eng.overlap = overlap
    saved = eng.runner
    if overlap:
        eng.runner = LaunchingRunner(saved)
    out, prompt = {}, built.tokenizer.encode("Tell me about the weather.").ids
    try:
        for i, (grammar, seed) in enumerate(specs):
            m = asyncio.run(grammars.matcher(common_pb2.Grammar(**grammar))) \
                if grammar else None
            seq = Sequence(f"r{i}", prompt, sampling=Sampling(temperature=1.0, seed=seed,
                                                              constrained=m is not None),
                           stopping=Stopping(max_new_tokens=80), matcher=m)
            eng.submit(seq, lambda ev, i=i: out.setdefault(i, []).append(ev))
        for _ in range(500):
            if not eng.step() and len(out) == len(specs) and all(
                    e[-1].stop is not Stop.NONE for e in out.values()):
                break
    finally:
        eng.runner, eng.overlap = saved, True
    return {i: ("".join(e.text for e in evs), evs[-1]) for i, evs in out.items()}


@pytest.mark.parametrize("overlap", [False, True])
def test_constrained_rows_beside_free_ones(built, grammars, overlap):
    schema = {"json_schema": json.dumps(SCHEMA)}
    specs = [(schema, 11), (None, 12), ({"regex": REGEX}, 13), (None, 14), (schema, 15),
             ({"choice": common_pb2.Choice(options=["sunny", "rain"])}, 16)]
    got = run_requests(built, grammars, specs, overlap)
    alone = run_requests(built, grammars, [s for s in specs if s[0] is None], overlap)
    for i, (grammar, _) in enumerate(specs):
        text, last = got[i]
        if grammar is None:
            continue
        assert last.stop is Stop.EOS_TOKEN, (text, last.stop)     # the grammar completed
        if "json_schema" in grammar:
            jsonschema.validate(json.loads(text), SCHEMA)
        elif "regex" in grammar:
            assert re.fullmatch(REGEX, text)
        else:
            assert text in ("sunny", "rain")
    free = [got[i][0] for i, s in enumerate(specs) if s[0] is None]
    assert free == [t for t, _ in alone.values()]       # rows without a grammar: untouched
    if overlap:
        assert built.masks.masks > 0
    eager = run_requests(built, grammars, specs, overlap=False)
    assert {i: t for i, (t, _) in got.items()} == {i: t for i, (t, _) in eager.items()}


def test_max_tokens_mid_object_ends_max_tokens(built, grammars):
    got = run_requests(built, grammars, [({"json_schema": json.dumps(SCHEMA)}, 3)], overlap=True)
    text, last = got[0]
    assert last.stop is Stop.EOS_TOKEN and last.generated_tokens > 4
    eng = built.engine
    m = asyncio.run(grammars.matcher(common_pb2.Grammar(json_schema=json.dumps(SCHEMA))))
    seq = Sequence("cut", built.tokenizer.encode("Hi").ids, matcher=m,
                   sampling=Sampling(temperature=1.0, seed=3, constrained=True),
                   stopping=Stopping(max_new_tokens=4))
    events = []
    eng.submit(seq, events.append)
    while eng.step():
        pass
    assert events[-1].stop is Stop.MAX_TOKENS and events[-1].generated_tokens == 4
    assert text.startswith("".join(e.text for e in events))    # the same seed, cut short


def test_a_token_its_grammar_refuses_ends_the_request_error(built, grammars, monkeypatch):
    """A sampler fault (here: no mask applied) whose token the matcher refuses: the runner marks
    the sequence, the engine ends it ERROR and drops the token."""
    monkeypatch.setattr(built.masks, "build", lambda sampled: None)
    m = asyncio.run(grammars.matcher(common_pb2.Grammar(regex="q{8}")))
    seq = Sequence("refused", built.tokenizer.encode("Hi").ids, matcher=m,
                   sampling=Sampling(temperature=1.0, seed=5, constrained=True),
                   stopping=Stopping(max_new_tokens=8))
    events = []
    built.engine.submit(seq, events.append)
    while built.engine.step():
        pass
    last = events[-1]
    assert last.stop is Stop.ERROR and last.error.startswith("structured output: ")
    assert last.generated_tokens == 0 and seq.tokens == seq.prompt


def test_a_tokenizer_llguidance_cannot_read_turns_structured_output_off():
    from tokenizers import Tokenizer, decoders, models
    from services.worker.api.structured import matcher as request_matcher
    tok = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1, "##b": 2}, unk_token="[UNK]"))
    tok.decoder = decoders.WordPiece()
    assert compiler_for(tok.to_str(), 3, (0,), GrammarOptions()) is None
    sampling = common_pb2.SamplingParams(grammar=common_pb2.Grammar(regex="a"))
    with pytest.raises(InvalidArgument, match="sampling.grammar: structured output is off"):
        asyncio.run(request_matcher(None, sampling, common_pb2.StoppingCriteria()))


def test_an_llguidance_older_than_the_floor_is_refused_naming_both_versions():
    """llguidance 1.6 takes one EOS token where the worker passes its list: the worker refuses
    it at start with both versions named, not with 1.6's TypeError."""
    from services.worker.api.grammar import check_llguidance
    with pytest.raises(RuntimeError, match=r"llguidance >= 1\.7; 1\.6\.1 is installed"):
        check_llguidance("1.6.1")
    check_llguidance("1.7.0")
    check_llguidance("2.0.0.dev3")
    check_llguidance()                           # the one installed meets the floor
