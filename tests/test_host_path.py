"""The host side of a CUDA-graph decode step, checked on CPU.

StaticInputs.fill keeps the block tables of its static buffers from one step to the next and
rewrites only the rows that changed: after any sequence of growth, preemption (a freed table
regrown to the same length with other blocks), reordering and padding, the buffers must hold
exactly the sequences' tables. And the whole graph path (its buffers replayed by stand-in graphs
that run the model eagerly) must give every request what the eager path gives.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from bench.engine.host_overhead import StandIns      # every key captured, made on first use
from services.worker.engine.scheduler import Scheduled
from services.worker.engine.sequence import Sampling, Sequence, Stop, Stopping
from services.worker.executor.graph_runner import GraphRunner
from services.worker.executor.step_inputs import StepPlan
from tests.test_engine_parity import _engine


class _StandIn:
    """A captured graph's stand-in: replay() runs the model on the runner's static buffers into
    its static output. key: the runner's graph key (batch size, LoRA mask, rank tile,
    column LoRA)."""

    def __init__(self, runner: GraphRunner, key):
        self.runner, self.key = runner, key

    def replay(self) -> None:
        r = self.runner
        args = self.key if isinstance(self.key, tuple) else (self.key,)
        r.outputs[self.key].copy_(r.model.forward(r.ids[:args[0]], r._ctx(*args),
                                                  r.runner.kv_cache))


def _graph_runner(built, sizes=(1, 2, 4, 8)) -> GraphRunner:
    """The engine's runner wrapped in a GraphRunner whose graphs are CPU stand-ins."""
    g = GraphRunner(built.engine.runner, sizes=sizes)
    g.rank = 64
    g.start_tiles = (16, 64)
    g.captured = set(g.sizes)
    vocab = built.spec.vocab_size
    g.outputs = StandIns(lambda key: torch.zeros(key[0] if isinstance(key, tuple) else key,
                                                  vocab))
    g.graphs = StandIns(lambda key: _StandIn(g, key))
    return g


def _check_buffers(g: GraphRunner, seqs: list[Sequence], b: int) -> None:
    """The device buffers hold exactly these decode rows, then inert padding up to b."""
    n, bs = len(seqs), g.block_size
    tables = g.tables.cpu()
    for i, q in enumerate(seqs):
        k, p = len(q.block_table), q.num_computed
        assert tables[i, :k].tolist() == q.block_table, i
        assert not tables[i, k:].any(), i
        assert g.ids[i] == q.tokens[p] and g.pos[i] == p and g.q_pos[i] == p
        assert g.slots[i] == q.block_table[p // bs] * bs + p % bs
        assert g.q_seq[i] == i
    assert not tables[n:b].any()
    assert (g.slots[n:b] == -1).all() and (g.q_seq[n:b] == -1).all()


def test_fill_keeps_block_tables_exact_across_steps(hf_ckpt):
    root, _, _ = hf_ckpt
    built, _ = _engine(root)
    blocks = built.engine.scheduler.blocks
    g = GraphRunner(built.engine.runner, sizes=(8,))
    seqs = [Sequence(f"s{i}", list(range(3, 9 + 3 * i)), slot=i % 3 - 1) for i in range(6)]

    def decode_step(rows):
        for q in rows:                                  # one more token, blocks for it
            assert blocks.ensure(q, len(q.tokens))
            q.num_computed = len(q.tokens) - 1
        slots = np.array([q.slot for q in rows], dtype=np.int64)      # rows as given
        g.inputs.fill(StepPlan([Scheduled(q, 1) for q in rows], rows, slots, 0, 0, False), 8)
        _check_buffers(g, rows, 8)

    decode_step(seqs)
    for step in range(9):                               # tables grow across block boundaries
        for q in seqs:
            q.tokens.append(4 + step)
        decode_step(seqs)
    victim = seqs[2]                                    # preempted, its blocks taken by
    held = list(victim.block_table)                     # another, then regrown in its row
    blocks.free(victim)
    other = Sequence("other", list(range(3, 3 + 4 * blocks.block_size)))
    assert blocks.ensure(other, len(other.tokens))
    decode_step(seqs)
    assert len(victim.block_table) == len(held) and victim.block_table != held
    decode_step(seqs[:2] + seqs[3:])                    # fewer rows: padding
    decode_step(seqs[::-1])                             # rows in another order
    decode_step(seqs[4:])


def _workload():
    greedy, sampled = Sampling(), Sampling(temperature=0.8, top_k=20, top_p=0.9, seed=5)
    g = torch.Generator().manual_seed(3)
    out = []
    for i in range(10):
        prompt = torch.randint(2, 256, (4 + 3 * i,), generator=g).tolist()
        stops = {0: ("t2",), 2: ("zzz", "t9 t")}.get(i % 4, ())      # word-level token text
        out.append((f"r{i}", prompt, i % 4, sampled if i % 2 else greedy,
                    Stopping(max_new_tokens=10 + 2 * i, stop_sequences=stops,
                             ignore_eos=i % 3 != 0)))
    return out


def _serve(built, slots, runner=None, overlap=True):
    """Run the workload (three requests join late); each request's tokens, text, end."""
    names = [None, *slots]
    results = {}
    def sink_for(rid):
        def sink(ev):
            r = results.setdefault(rid, {"tokens": [], "text": "", "stop": None})
            r["tokens"] += ev.token_ids
            r["text"] += ev.text
            if ev.stop is not Stop.NONE:
                r["stop"] = ev.stop
        return sink
    engine = built.engine
    if runner is not None:
        engine.runner = runner
    engine.overlap = overlap
    work = _workload()
    for k, (rid, prompt, adapter, sampling, stopping) in enumerate(work):
        name = names[adapter % len(names)]
        engine.submit(Sequence(rid, prompt, slot=slots[name] if name else -1, sampling=sampling,
                               stopping=stopping), sink_for(rid))
        if k >= 6:
            engine.step()
    for _ in range(500):
        if len([r for r in results.values() if r["stop"]]) == len(work):
            break
        engine.step()
    return results


@pytest.mark.parametrize("overlap", [False, True])
def test_graph_decode_path_matches_eager(hf_ckpt, overlap):
    """Small KV cache (preemptions), adapters, stop sequences, greedy and sampled rows. With
    overlap, decode steps are launched from the step in flight (tokens gathered on the device,
    sampling counters one ahead) across late arrivals, EOS, stop sequences and max_new_tokens."""
    root, _, _ = hf_ckpt
    per_block = 2 * 2 * 4 * 2 * 16 * 4                  # K+V, 2 layers, 4 tokens, 2 x 16, fp32
    eager_built, eager_slots = _engine(root, kv=32 * per_block)
    eager = _serve(eager_built, eager_slots)
    built, slots = _engine(root, kv=32 * per_block)
    graphs = _graph_runner(built)
    launches = []
    launch = graphs.launch
    graphs.launch = lambda batch, prev=None: launches.append(prev is not None) or launch(
        batch, prev)
    got = _serve(built, slots, graphs, overlap=overlap)
    assert graphs.replays > 10
    assert any(launches) == overlap                     # steps launched from steps in flight
    assert built.engine.scheduler.preemptions > 0
    assert got == eager
    assert all(r["stop"] in (Stop.MAX_TOKENS, Stop.EOS_TOKEN, Stop.STOP_SEQUENCE)
               for r in got.values())


def test_event_handoff_delivers_every_call_in_order():
    """The servicer's engine-to-loop handoff (one loop wake-up per burst): bursts from another
    thread arrive complete and in order, and a failing call does not hold back the rest."""
    import asyncio
    import random
    import threading
    import time

    from services.worker.api.servicer import EventHandoff
    loop = asyncio.new_event_loop()
    loop.set_exception_handler(lambda loop, context: errors.append(context["exception"]))
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    got, errors, sent = [], [], []

    def fail(arg):
        raise ValueError(arg)
    try:
        handoff, rng = EventHandoff(loop), random.Random(0)
        for burst in range(300):
            for i in range(rng.randrange(1, 65)):
                sent.append((burst, i))
                handoff.put(got.append, (burst, i))
            if burst % 50 == 0:
                handoff.put(fail, burst)
            if burst % 7 == 0:
                time.sleep(0.0002)
        deadline = time.monotonic() + 10
        while len(got) < len(sent) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert got == sent
        assert [e.args[0] for e in errors] == list(range(0, 300, 50))
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()


def test_overlap_cancel_and_time_limit_mid_flight(hf_ckpt):
    """With steps launched from steps in flight, a request cancelled or timed out mid-decode
    ends once (CANCELLED / TIME_LIMIT) with no tokens after its end, and the others get exactly
    the tokens they get alone."""
    root, _, _ = hf_ckpt
    built, slots = _engine(root)
    names = [None, *slots]

    def requests():
        return [Sequence(f"q{i}", list(range(5 + i, 12 + 2 * i)),
                         slot=slots[names[i % 4]] if names[i % 4] else -1,
                         stopping=Stopping(max_new_tokens=12, ignore_eos=True,
                                           time_limit_s=3600.0 if i == 4 else 0.0))
                for i in range(6)]

    def serve(engine, seqs, interrupt):
        events = {s.request_id: [] for s in seqs}
        for s in seqs:
            engine.submit(s, events[s.request_id].append)
        for k in range(200):
            if all(e and e[-1].stop is not Stop.NONE for e in events.values()):
                break
            interrupt(k, seqs)
            engine.step()
        return events

    alone_built, alone_slots = _engine(root)
    assert alone_slots == slots
    alone_built.engine.overlap = False
    alone = serve(alone_built.engine, requests(), lambda k, seqs: None)

    graphs = _graph_runner(built)
    built.engine.runner = graphs
    launched_from = []
    launch = graphs.launch
    graphs.launch = lambda batch, prev=None: launched_from.append(prev is not None) or launch(
        batch, prev)

    def interrupt(k, seqs):
        if k == 6:
            built.engine.abort("q1")
        if k == 7:
            seqs[4].stopping = Stopping(max_new_tokens=12, ignore_eos=True, time_limit_s=1e-9)
    got = serve(built.engine, requests(), interrupt)
    assert any(launched_from)
    for rid, evs in got.items():
        ends = [e for e in evs if e.stop is not Stop.NONE]
        assert len(ends) == 1 and evs[-1] is ends[0], rid
        tokens = [t for e in evs for t in e.token_ids]
        want = [t for e in alone[rid] for t in e.token_ids]
        if rid in ("q1", "q4"):
            assert ends[0].stop is (Stop.CANCELLED if rid == "q1" else Stop.TIME_LIMIT)
            assert len(tokens) < len(want) and tokens == want[:len(tokens)], rid
        else:
            assert ends[0].stop is Stop.MAX_TOKENS and tokens == want, rid
    assert not built.engine.scheduler.running and built.engine._pending is None


def _start_graphs(g: GraphRunner, keys=None) -> dict:
    """Stand-ins for what capture() makes at start (every batch size, start_keys' triples)."""
    triples = keys if keys is not None else g.start_keys()
    return {(b, *k): _StandIn(g, (b, *k)) for b in g.sizes for k in triples}


def test_a_step_without_its_own_graph_replays_the_smallest_captured_superset(hf_ckpt):
    """Nothing is captured while serving: a (LoRA mask, rank tile) without a graph replays the
    captured graph of its batch size with the fewest groups covering its own and the smallest
    tile holding its rank; a column-LoRA graph only for a step whose q/k/v adapters all have
    blocks; none at all (a rank above the graphs') means eager; and every request still gets
    the eager path's output."""
    from services.worker.executor.graph_runner import ATTENTION
    from services.worker.model.spec import ALL_GROUPS, GROUP_BIT as bit
    root, _, _ = hf_ckpt
    built, slots = _engine(root)
    g = _graph_runner(built)
    g.graphs = _start_graphs(g, [(ALL_GROUPS, 64, False), (ALL_GROUPS, 16, False),
                                 (ATTENTION, 16, False), (ALL_GROUPS, 16, True),
                                 (ATTENTION, 16, True), (0, 0, False)])
    assert g._graph_key(4, bit["qkv"], 16) == (4, ATTENTION, 16, False)
    assert g._graph_key(4, bit["qkv"], 16, True) == (4, ATTENTION, 16, True)
    assert g._graph_key(4, bit["o"] | bit["down"], 16) == (4, ALL_GROUPS, 16, False)
    assert g._graph_key(4, bit["o"] | bit["down"], 16, True) == (4, ALL_GROUPS, 16, True)
    assert g._graph_key(4, bit["qkv"], 32) == (4, ALL_GROUPS, 64, False)  # no tile-32 graph
    assert g._graph_key(4, bit["qkv"], 32, True) == (4, ALL_GROUPS, 64, False)
    assert g._graph_key(8, 0, 0) == (8, 0, 0, False)
    assert g._graph_key(4, bit["qkv"], 128) is None                   # above the graphs: eager
    g.graphs, g._choice = _start_graphs(g, [(ALL_GROUPS, 16, True), (0, 0, False)]), {}
    assert g._graph_key(4, bit["qkv"], 16) is None                    # a columns graph never
    eager_built, eager_slots = _engine(root)                          # serves a plain step
    eager = _serve(eager_built, eager_slots)
    built, slots = _engine(root)
    g = _graph_runner(built)
    g.graphs = _start_graphs(g, [(ALL_GROUPS, 16, False), (ALL_GROUPS, 64, False),
                                 (0, 0, False)])
    assert _serve(built, slots, g) == eager
    assert g.replays > 10


def test_overlap_continues_while_a_queue_cannot_start(hf_ckpt):
    """With every row taken (max_running), waiting requests do not stop steps from being launched
    ahead; they start as rows free up, and every request gets the eager path's output."""
    root, _, _ = hf_ckpt
    eager_built, eager_slots = _engine(root, max_running=3)
    eager = _serve(eager_built, eager_slots)
    built, slots = _engine(root, max_running=3)
    graphs = _graph_runner(built)
    ahead_with_queue = []
    launch = graphs.launch

    def spy(batch, prev=None):
        if prev is not None:
            ahead_with_queue.append(len(built.engine.scheduler.waiting))
        return launch(batch, prev)
    graphs.launch = spy
    assert _serve(built, slots, graphs) == eager
    assert any(ahead_with_queue)                   # launched ahead while requests were queued


def test_graph_sizes_reach_the_row_limit(hf_ckpt):
    """A full batch (max_running rows) always has a graph, up to the largest size."""
    root, _, _ = hf_ckpt
    for max_running, sizes in ((3, [1, 2, 3]), (100, [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 100]),
                               (300, [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224,
                                      256, 300]),
                               (1000, [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224,
                                       256, 320, 384, 448, 512])):
        built, _ = _engine(root, max_running=max_running)
        assert GraphRunner(built.engine.runner).sizes == sizes, max_running


@pytest.mark.parametrize("adapter,tile", [("r1-attn", 16), ("r8-rslora", 16), ("r64-all", 64),
                                          (None, 0)])
def test_a_step_replays_the_graph_of_its_own_adapters_rank_tile(hf_ckpt, adapter, tile):
    """The rank tile of the replayed graph follows the largest rank among the step's adapters,
    not the pool's (a rank-64 adapter is resident in every case here); with graphs only up to
    rank 16, a step with the rank-64 adapter runs eagerly and gives the same tokens."""
    root, _, _ = hf_ckpt
    outputs = {}
    for max_tile in (64, 16):
        built, slots = _engine(root)
        g = _graph_runner(built)
        g.rank, g.start_tiles = max_tile, tuple(sorted({16, max_tile}))
        replayed = []
        graphs = g.graphs

        class Spy(dict):
            def __contains__(self, key):
                return True

            def __missing__(self, key):
                graph = graphs[key]
                replay = graph.replay
                self[key] = graph
                graph.replay = lambda: (replayed.append(key), replay())[1]
                return graph
        g.graphs = Spy()
        built.engine.runner = g
        out = {}
        for i in range(3):
            rid = f"q{i}"
            out[rid] = []
            built.engine.submit(
                Sequence(rid, list(range(3, 9 + i)), slot=slots[adapter] if adapter else -1,
                         stopping=Stopping(max_new_tokens=5, ignore_eos=True)),
                lambda ev, rid=rid: out[rid].extend(ev.token_ids))
        for _ in range(40):
            built.engine.step()
        assert all(len(t) == 5 for t in out.values()), out
        outputs[max_tile] = out
        if tile > max_tile:
            assert replayed == []                        # too big for these graphs: eager
        else:
            assert replayed and {key[2] for key in replayed} == {tile}, replayed
    assert outputs[16] == outputs[64]


def test_prefault_writes_every_page_of_a_new_mapping_from_several_threads():
    import mmap

    import numpy as np

    from services.worker.adapters.host_tier import prefault
    n = (3 << 20) + 4099                       # not a multiple of the threads or of a page
    mapping = mmap.mmap(-1, n)
    array = np.frombuffer(mapping, dtype=np.uint8, count=n)
    array[::997] = 7
    prefault(array, threads=5)
    assert not array.any()
    prefault(array[:3], threads=8)             # more threads than bytes
    del array
    mapping.close()
