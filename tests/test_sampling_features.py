"""The sampling features behind the OpenAI fields, through the running services and checked
against transformers + PEFT: per-token logprobs and top alternatives (transformers'
log-softmax, within 1e-4 on CPU), OpenAI's presence and frequency penalties, logit_bias and
min_tokens (transformers' generate with LogitsProcessors doing the same), over gRPC (TGIS-style
token details, min_new_tokens) and through the official openai SDK."""
from __future__ import annotations

import openai
import pytest
import torch

from services.client.client import LorafleetClient
from tests.conftest import Stack
from tests.support import DEMO_ADAPTERS, FreePort, MODEL_DIR
pytestmark = pytest.mark.slow
PROMPT = "Tell me about the weather."
EOS = 2                                   # the tiny model's </s>


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    port, metrics = FreePort("127.0.0.1:"), FreePort()
    s = Stack(MODEL_DIR, DEMO_ADAPTERS, tmp_path_factory.mktemp("sampling"),
              router_args=["--http-listen", port],
              worker_args=["--metrics-port", metrics])
    s.http = f"http://127.0.0.1:{port}"
    s.worker_metrics = f"http://127.0.0.1:{metrics}/metrics"
    yield s
    s.terminate()


@pytest.fixture(scope="module")
def hf(hf_tiny):
    return hf_tiny


class OpenAIPenalties:
    """OpenAI's presence and frequency penalties over the generated tokens, as a transformers
    LogitsProcessor: the reference the engine is checked against."""

    def __init__(self, prompt_len: int, presence: float, frequency: float):
        self.n, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids, scores):
        out = input_ids[:, self.n:]
        counts = torch.zeros_like(scores).scatter_add_(1, out, torch.ones_like(out, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0)


def reference(hf, adapter: str, ids: list[int], n: int, processors=(), eos=EOS):
    """transformers (+ PEFT) greedy generate with these logits processors; the new ids."""
    from peft import PeftModel
    from transformers import LogitsProcessorList
    _, base = hf
    model = PeftModel.from_pretrained(base, DEMO_ADAPTERS / adapter).eval() if adapter else base
    try:
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                                 logits_processor=LogitsProcessorList(processors),
                                 eos_token_id=eos, pad_token_id=0)
        return out[0, len(ids):].tolist()
    finally:
        if adapter:
            model.unload()


def step_logprobs(hf, adapter: str, ids: list[int], new: list[int]) -> torch.Tensor:
    """log_softmax of the model's logits at each generated position: [len(new), V]."""
    from peft import PeftModel
    _, base = hf
    model = PeftModel.from_pretrained(base, DEMO_ADAPTERS / adapter).eval() if adapter else base
    try:
        with torch.no_grad():
            logits = model(torch.tensor([ids + new])).logits[0]
        return logits[len(ids) - 1:len(ids) + len(new) - 1].float().log_softmax(-1)
    finally:
        if adapter:
            model.unload()


@pytest.mark.parametrize("adapter", ["pirate", ""])
def test_token_logprobs_and_top_alternatives_match_transformers(stack, hf, adapter):
    tok, _ = hf
    ids = tok(PROMPT)["input_ids"]
    with LorafleetClient(stack.router.addr) as c:
        resp = c.generate(prompt_ids=ids, adapter=adapter, max_new_tokens=8, ignore_eos=True,
                          logprobs=True, top_n_tokens=3)
    new = list(resp.token_ids)
    assert [t.id for t in resp.tokens] == new
    ref = step_logprobs(hf, adapter, ids, new)
    for i, t in enumerate(resp.tokens):
        assert abs(t.logprob - ref[i, t.id].item()) < 1e-4, (i, t.logprob, ref[i, t.id])
        top = ref[i].topk(3)
        assert [a.id for a in t.top_tokens] == top.indices.tolist()
        assert max(abs(a.logprob - v) for a, v in zip(t.top_tokens, top.values.tolist())) < 1e-4
        assert t.text == tok.decode([t.id])


@pytest.fixture(scope="module")
def random_stack(hf_ckpt, tmp_path_factory):
    """A random checkpoint and adapters (tests.hf_fixtures): flatter logits than the trained
    tiny model's, so that penalties and biases change greedy choices."""
    root, base, peft_models = hf_ckpt
    s = Stack(root / "base", root / "adapters", tmp_path_factory.mktemp("random"))
    yield s, base, peft_models
    s.terminate()


def greedy(model, ids, n, processors=()):
    from transformers import LogitsProcessorList
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                             logits_processor=LogitsProcessorList(processors),
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("adapter", ["r8-rslora", ""])
def test_penalties_and_logit_bias_match_transformers_processors(random_stack, adapter):
    from transformers.generation.logits_process import SequenceBiasLogitsProcessor
    stack, base, peft_models = random_stack
    model = peft_models[adapter] if adapter else base
    ids = [5, 17, 33, 2, 90, 41, 7]
    plain = greedy(model, ids, 16)
    bias = {plain[1]: -100.0, plain[3]: -5.0, 100: 4.0}
    cases = [
        (dict(presence_penalty=1.5), [OpenAIPenalties(len(ids), 1.5, 0.0)]),
        (dict(presence_penalty=0.3, frequency_penalty=1.7),
         [OpenAIPenalties(len(ids), 0.3, 1.7)]),
        (dict(frequency_penalty=-2.0), [OpenAIPenalties(len(ids), 0.0, -2.0)]),
        (dict(logit_bias=bias),
         [SequenceBiasLogitsProcessor({(t,): b for t, b in bias.items()})]),
        (dict(logit_bias=bias, presence_penalty=0.7, frequency_penalty=0.5),
         [SequenceBiasLogitsProcessor({(t,): b for t, b in bias.items()}),
          OpenAIPenalties(len(ids), 0.7, 0.5)]),
    ]
    with LorafleetClient(stack.router.addr) as c:
        for kw, processors in cases:
            expected = greedy(model, ids, 16, processors)
            got = c.generate(prompt_ids=ids, adapter=adapter, max_new_tokens=16,
                             ignore_eos=True, **kw)
            assert list(got.token_ids) == expected, kw
            assert expected != plain, kw       # the case does change the output


def test_min_new_tokens_holds_eos_back_as_transformers_does(stack, hf):
    from transformers.generation.logits_process import MinNewTokensLengthLogitsProcessor
    tok, _ = hf
    ids = tok.apply_chat_template([{"role": "user", "content": "Hello!"}],
                                  add_generation_prompt=True, tokenize=True, return_dict=False)
    ids = list(ids)
    free = reference(hf, "acme-support", ids, 40)
    assert free[-1] == EOS and len(free) < 30              # it ends by itself
    n = len(free) + 4
    expected = reference(hf, "acme-support", ids, 40,
                         [MinNewTokensLengthLogitsProcessor(len(ids), n, EOS)])
    with LorafleetClient(stack.router.addr) as c:
        got = c.generate(prompt_ids=ids, adapter="acme-support", max_new_tokens=40,
                         min_new_tokens=n)
        assert list(got.token_ids) == expected and len(got.token_ids) >= n
        sdk = openai.OpenAI(base_url=stack.http + "/v1", api_key="x", max_retries=0)
        chat = sdk.chat.completions.create(
            model="acme-support", messages=[{"role": "user", "content": "Hello!"}],
            max_tokens=40, temperature=0, extra_body={"min_tokens": n})
        assert chat.usage.completion_tokens == len(expected)


def test_logprobs_through_the_sdk_in_openai_shape(stack, hf):
    tok, _ = hf
    sdk = openai.OpenAI(base_url=stack.http + "/v1", api_key="x", max_retries=0)
    comp = sdk.completions.create(model="pirate", prompt=PROMPT, max_tokens=5, temperature=0,
                                  logprobs=2)
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == comp.choices[0].text
    assert all(len(d) == 2 and max(d.values()) >= v - 1e-6
               for d, v in zip(lp.top_logprobs, lp.token_logprobs))
    chat = sdk.chat.completions.create(model="pirate", max_tokens=4, temperature=0,
                                       messages=[{"role": "user", "content": "Hello!"}],
                                       logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(c.top_logprobs) == 3 and c.logprob <= 0 for c in content)
    chunks = list(sdk.chat.completions.create(
        model="pirate", max_tokens=4, temperature=0, stream=True, logprobs=True,
        messages=[{"role": "user", "content": "Hello!"}]))
    streamed = [c for ch in chunks if ch.choices and ch.choices[0].logprobs
                for c in ch.choices[0].logprobs.content]
    assert [c.logprob for c in streamed] == pytest.approx([c.logprob for c in content])
    with pytest.raises(openai.BadRequestError) as err:
        sdk.chat.completions.create(model="pirate", max_tokens=4, top_logprobs=2,
                                    messages=[{"role": "user", "content": "Hello!"}])
    assert err.value.body["param"] == "top_logprobs"


def test_seeded_sampling_with_processors_ignores_the_batch(stack):
    """A seeded request with penalties and a bias gets the same tokens alone and among
    other requests (the processors run batched, row by row)."""
    from concurrent.futures import ThreadPoolExecutor
    kw = dict(prompt=PROMPT, adapter="poet", max_new_tokens=12, temperature=0.9, seed=77,
              presence_penalty=0.8, frequency_penalty=0.4, logit_bias={100: 3.0})
    with LorafleetClient(stack.router.addr) as c:
        alone = list(c.generate(**kw).token_ids)
        with ThreadPoolExecutor(6) as pool:
            others = [pool.submit(c.generate, PROMPT, adapter=a, max_new_tokens=12,
                                  temperature=0.7, seed=i, logprobs=True, ignore_eos=True)
                      for i, a in enumerate(["pirate", "", "acme-support"] * 2)]
            mixed = pool.submit(c.generate, **kw)
            assert list(mixed.result().token_ids) == alone
            assert all(len(f.result().tokens) == 12 for f in others)


def shared_blocks(stack) -> float:
    import urllib.request
    text = urllib.request.urlopen(stack.worker_metrics, timeout=10).read().decode()
    return float(next(line.split()[-1] for line in text.splitlines()
                      if line.startswith("lorafleet_worker_prefix_blocks_shared_total")))


def test_n_choices_are_reproducible_with_a_seed_whatever_the_batch(stack):
    """n=3 with a seed: choice i samples with seed + i, so the three come back the same alone
    and among other requests; streamed, each chunk names its choice."""
    from concurrent.futures import ThreadPoolExecutor
    sdk = openai.OpenAI(base_url=stack.http + "/v1", api_key="x", max_retries=0)
    kw = dict(model="poet", prompt=PROMPT * 6, max_tokens=10, temperature=1.0, seed=11, n=3)
    shared = shared_blocks(stack)
    alone = sdk.completions.create(**kw)
    assert shared_blocks(stack) > shared      # the later choices took the first's prompt
    texts = [c.text for c in sorted(alone.choices, key=lambda c: c.index)]
    assert len(texts) == 3 and len(set(texts)) > 1
    single = sdk.completions.create(**{**kw, "n": 1})
    assert alone.usage.prompt_tokens == single.usage.prompt_tokens       # the prompt once
    assert alone.usage.completion_tokens > single.usage.completion_tokens
    with LorafleetClient(stack.router.addr) as c, ThreadPoolExecutor(6) as pool:
        noise = [pool.submit(c.generate, PROMPT, adapter=a, max_new_tokens=10,
                             temperature=0.8, seed=i) for i, a in enumerate(["", "pirate"] * 3)]
        again = pool.submit(sdk.completions.create, **kw)
        assert [x.text for x in sorted(again.result().choices, key=lambda x: x.index)] == texts
        assert all(f.result().token_ids for f in noise)
    chunks = list(sdk.completions.create(**kw, stream=True))
    streamed = ["".join(ch.choices[0].text for ch in chunks if ch.choices
                        and ch.choices[0].index == i) for i in range(3)]
    assert streamed == texts
    with LorafleetClient(stack.router.addr) as c:       # choice i is the request with seed+i
        one = c.generate(PROMPT * 6, adapter="poet", max_new_tokens=10, temperature=1.0,
                         seed=12)
    assert one.text == texts[1]


def test_generate_batch_answers_each_request_in_order(stack):
    import grpc
    with LorafleetClient(stack.router.addr) as c:
        reqs = [c.request(PROMPT, adapter=a, max_new_tokens=6, logprobs=i == 1)
                for i, a in enumerate(["pirate", "", "poet", "pirate"])]
        singles = [c._stub.Generate(r, timeout=60) for r in reqs]
        batched = c.generate_batch(reqs)
        assert [b.text for b in batched] == [s.text for s in singles]
        assert len(batched[1].tokens) == len(batched[1].token_ids) and not batched[0].tokens
        bad = [reqs[0], c.request(PROMPT, adapter="no-such-adapter", max_new_tokens=2)]
        with pytest.raises(grpc.RpcError) as err:
            c.generate_batch(bad)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        assert err.value.details().startswith("requests[1]: ")


def test_prompt_logprobs_and_echo_match_transformers(stack, hf):
    """echo with logprobs: the prompt's tokens with their logprobs given the ones before (the
    first none), then the completion's, as transformers' log-softmax gives them."""
    tok, _ = hf
    ids = tok(PROMPT)["input_ids"]
    with LorafleetClient(stack.router.addr) as c:
        resp = c.generate(prompt_ids=ids, adapter="pirate", max_new_tokens=3, ignore_eos=True,
                          logprobs=True, top_n_tokens=2, prompt_logprobs=True)
    assert [t.id for t in resp.prompt_tokens] == ids
    ref = step_logprobs(hf, "pirate", ids[:1], ids[1:])       # position i predicts ids[i + 1]
    assert resp.prompt_tokens[0].logprob != resp.prompt_tokens[0].logprob      # NaN: none
    for i, t in enumerate(resp.prompt_tokens[1:]):
        assert abs(t.logprob - ref[i, t.id].item()) < 1e-4, i
        assert [a.id for a in t.top_tokens] == ref[i].topk(2).indices.tolist()
    sdk = openai.OpenAI(base_url=stack.http + "/v1", api_key="x", max_retries=0)
    comp = sdk.completions.create(model="pirate", prompt=PROMPT, max_tokens=3, temperature=0,
                                  echo=True, logprobs=1)
    lp = comp.choices[0].logprobs
    assert comp.choices[0].text.startswith(PROMPT) and len(lp.tokens) == len(ids) + 3
    assert lp.token_logprobs[0] is None
    assert lp.token_logprobs[1:len(ids)] == pytest.approx(
        [t.logprob for t in resp.prompt_tokens[1:]], abs=1e-5)
    plain = sdk.completions.create(model="pirate", prompt=PROMPT, max_tokens=3, temperature=0)
    assert comp.choices[0].text == PROMPT + plain.choices[0].text
    echoed = sdk.completions.create(model="pirate", prompt=ids, max_tokens=3, temperature=0,
                                    echo=True)
    assert echoed.choices[0].text == tok.decode(ids) + plain.choices[0].text
    chunks = list(sdk.completions.create(model="pirate", prompt=PROMPT, max_tokens=3,
                                         temperature=0, echo=True, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == \
        comp.choices[0].text
