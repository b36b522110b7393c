"""The worker's step profile (services/worker/engine/step_profile.py): the engine's loop on its
own thread with the tiny model on CPU serves two waves of requests (base rows, rows of two
adapters, a prompt longer than the step budget taken in chunks beside decode rows), an idle wait
between them; every step the runner ran is recorded as it ran, and the profile must hold exactly
those steps' classes, less the first step after each idle wait, with no idle time in its
seconds. Also: the class boundaries, and the Prometheus summary's series."""
from __future__ import annotations

import collections
import threading
import time

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from services.worker.engine import step_profile as sp
from services.worker.engine.sequence import Sequence, Stopping
from tests.test_engine_parity import _engine


def test_class_boundaries_and_labels():
    def labels(rows, prompt, adapters, kind="eager"):
        return sp.class_labels(sp.class_index(sp.StepShape(kind, rows, prompt, adapters)))
    assert labels(1, 0, 0) == ("eager", "1-32", "0", "0")
    assert labels(32, 1, 1) == ("eager", "1-32", "1-512", "1-8")
    assert labels(33, 512, 8) == ("eager", "33-64", "1-512", "1-8")
    assert labels(64, 513, 9) == ("eager", "33-64", "513-2048", "9-32")
    assert labels(65, 2048, 32, "decode-graph") == ("decode-graph", "65-128", "513-2048", "9-32")
    assert labels(256, 2049, 33, "mixed-graph") == ("mixed-graph", "129-256", ">2048", "33-128")
    assert labels(257, 0, 128) == ("eager", ">256", "0", "33-128")
    assert labels(4096, 0, 129) == ("eager", ">256", "0", ">128")
    every = {sp.class_labels(i) for i in range(sp.CLASSES)}
    assert len(every) == sp.CLASSES == 3 * 5 * 4 * 5


def expected_labels(batch) -> tuple[str, str, str, str]:
    """A recorded CPU step's class, worked out here from its rows (all small: one bucket
    each above zero)."""
    prompt = sum(b.num_tokens for b in batch if b.num_tokens > 1)
    adapters = len({b.seq.slot for b in batch if b.seq.slot >= 0})
    assert len(batch) <= 32 and prompt <= 512 and adapters <= 8
    return ("eager", "1-32", "1-512" if prompt else "0", "1-8" if adapters else "0")


class Waves:
    """The engine loop on a thread, its steps recorded as the runner runs them, requests
    submitted in waves and waited for."""

    def __init__(self, built, profile):
        self.engine, self.profile = built.engine, profile
        self.steps: list[tuple[tuple, int]] = []          # (class, the loop's idle waits)
        runner = built.engine.runner

        def recording_run(batch, run=runner.run):
            self.steps.append((expected_labels(batch), self.engine.idle_waits))
            return run(batch)
        runner.run = recording_run
        self.engine.on_step = profile.step
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.engine.run, args=(self.stop,), daemon=True)
        self.thread.start()
        self.idle(1)

    def idle(self, waits: int) -> None:
        """Until the loop has waited idle `waits` times in all."""
        deadline = time.monotonic() + 60
        while self.engine.idle_waits < waits:
            assert time.monotonic() < deadline, "the engine never went idle"
            time.sleep(0.005)

    def wave(self, seqs: list[Sequence]) -> float:
        """Submit the sequences, wait until every one has finished; the seconds it took."""
        done = threading.Semaphore(0)
        start = time.perf_counter()
        for seq in seqs:
            self.engine.submit(seq, lambda ev: ev.stop and done.release())
        for _ in seqs:
            assert done.acquire(timeout=120)
        return time.perf_counter() - start

    def close(self) -> None:
        self.stop.set()
        self.engine.wake()
        self.thread.join(10)


def seq(rid: str, prompt_len: int, slot: int, n: int) -> Sequence:
    return Sequence(rid, list(range(3, 3 + prompt_len)), slot=slot,
                    stopping=Stopping(max_new_tokens=n, ignore_eos=True))


def test_the_profile_holds_the_served_steps_less_those_after_idle(hf_ckpt):
    root, _, _ = hf_ckpt
    built, slots = _engine(root)                      # max_batch_tokens 64, CPU: eager steps
    a, b = list(slots.values())[:2]
    profile = sp.StepProfile()
    waves = Waves(built, profile)
    try:
        first = waves.wave([seq("base", 5, -1, 14), seq("a", 7, a, 8), seq("b", 6, b, 6)])
        waves.idle(2)
        time.sleep(0.5)                               # an idle gap no step may be charged
        second = waves.wave([seq("a2", 4, a, 9), seq("base2", 9, -1, 9),
                             seq("long", 120, b, 4)])  # 120 prompt tokens: chunks of <= 64
    finally:
        waves.close()
    recorded = waves.steps
    assert len(recorded) > 20 and {w for _, w in recorded} == {1, 2}
    # the first step of each wave follows an idle wait: not timed; every other one is
    first_of_wave = {next(i for i, (_, w) in enumerate(recorded) if w == k) for k in (1, 2)}
    want = collections.Counter(c for i, (c, _) in enumerate(recorded) if i not in first_of_wave)
    got = {c[:4]: c[4] for c in profile.classes()}
    assert got == dict(want)
    # base-only decode, adapter decode, prompt chunks beside decode rows: all were seen
    assert {("eager", "1-32", "0", "0"), ("eager", "1-32", "0", "1-8"),
            ("eager", "1-32", "1-512", "1-8")} <= set(got)
    seconds = sum(c[5] for c in profile.classes())
    assert 0 < seconds <= first + second              # the 0.5 s gap is in neither wave
    assert all(c[5] > 0 for c in profile.classes())


def test_prometheus_has_the_summary_with_its_labels():
    profile = sp.StepProfile()
    i = sp.class_index(sp.StepShape("decode-graph", 200, 0, 40))
    profile.count[i], profile.seconds[i] = 3, 0.06
    j = sp.class_index(sp.StepShape("mixed-graph", 100, 700, 5))
    profile.count[j], profile.seconds[j] = 1, 0.03
    reg = CollectorRegistry()
    reg.register(profile)
    (family,) = text_string_to_metric_families(generate_latest(reg).decode())
    assert family.name == sp.METRIC and family.type == "summary"
    got = {(s.name, tuple(sorted(s.labels.items()))): s.value for s in family.samples}
    decode = (("adapters", "33-128"), ("kind", "decode-graph"), ("prompt_tokens", "0"),
              ("rows", "129-256"))
    mixed = (("adapters", "1-8"), ("kind", "mixed-graph"), ("prompt_tokens", "513-2048"),
             ("rows", "65-128"))
    assert got == {(sp.METRIC + "_count", decode): 3, (sp.METRIC + "_sum", decode):
                   pytest.approx(0.06), (sp.METRIC + "_count", mixed): 1,
                   (sp.METRIC + "_sum", mixed): pytest.approx(0.03)}
