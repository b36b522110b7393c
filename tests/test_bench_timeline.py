"""bench.engine.timeline's accounting: each kernel is charged from its predecessor's end to its
own, so kernels that overlap (programmatic dependent launch) are not counted twice, a gap before a
kernel is its cost, and the charges add up to the replay's span."""
from __future__ import annotations

from bench.engine.timeline import split_replays, summarize


def test_increments_add_up_to_the_span_and_overlap_counts_once():
    # one replay: shrink 0-10; expand launched early at 5, ends 12; a gap, then shrink 15-20
    replay = [("_shrink_kernel", 0.0, 10.0), ("_expand_kernel", 5.0, 12.0),
              ("_shrink_kernel", 15.0, 20.0)]
    rows, span = summarize([replay, [(n, s + 100, e + 100) for n, s, e in replay]])
    by = {r["kernel"]: r for r in rows}
    assert span == 20.0
    assert by["_shrink_kernel"]["incr_us"] == 10.0 + 8.0          # its own 10, then gap + 5
    assert by["_expand_kernel"]["incr_us"] == 2.0                 # 10 -> 12, not its 7
    assert by["_expand_kernel"]["dur_us"] == 7.0
    assert by["_shrink_kernel"]["calls"] == 2.0
    assert sum(r["incr_us"] for r in rows) == span
    assert rows[0]["kernel"] == "_shrink_kernel"                  # most costly first


def test_per_divides_by_the_calls_in_a_chain_and_names_are_shortened():
    replay = [("void cublasLt::splitKreduce_kernel<float, 4>(int, float*)", 0.0, 4.0),
              ("_expand_kernel", 4.0, 8.0)]
    rows, span = summarize([replay], per=2)
    assert span == 4.0
    assert {r["kernel"] for r in rows} == {"void cublasLt::splitKreduce_kernel", "_expand_kernel"}
    assert all(r["incr_us"] == 2.0 and r["calls"] == 0.5 for r in rows)


def test_a_kernel_ending_inside_its_predecessor_costs_nothing_and_the_span_is_the_last_end():
    rows, span = summarize([[("_rms_kernel", 0.0, 10.0), ("_rope_kv_kernel", 5.0, 8.0)]])
    assert span == 10.0
    assert {r["kernel"]: r["incr_us"] for r in rows} == {"_rms_kernel": 10.0,
                                                         "_rope_kv_kernel": 0.0}


def test_replays_are_split_at_the_marker_and_only_the_flush_is_dropped():
    fill = "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<uchar>>"
    trace = [(0, 5, fill), (6, 7, "spin_kernel"), (8, 9, "_shrink_kernel"),
             (9, 10, fill),                           # a fill of the step itself
             (11, 12, "_expand_kernel"), (13, 18, fill), (19, 20, "spin_kernel"),
             (21, 22, "_shrink_kernel"), (23, 24, fill)]
    groups = split_replays(trace)
    assert [[k[0] for k in g] for g in groups] == [
        ["_shrink_kernel", fill, "_expand_kernel"], ["_shrink_kernel", fill]]
