"""bench/strategies_roofline.py: the threshold's arithmetic on fixed inputs, and the sweep's crossing-finder
on synthetic data. No launch: the measured side is the bench's to print, never asserted."""
import math
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "bench")]
import plan_cluster  # noqa: E402
import strategies_roofline as R  # noqa: E402


def test_gpu_rows_reproduce_the_scaling_books_dp_thresholds():
    rows = {(r["gpu"], r["where"]): r for r in R.gpu_dp_rows(plan_cluster.CLUSTERS)}
    for key, published in R.PUBLISHED.items():
        assert rows[key]["book"] == pytest.approx(published, rel=0.10), key
    h100 = rows[("H100", "node")]
    assert h100["book"] == pytest.approx(989e12 / 450e9)  # C/W exactly, under the book's assumptions
    # ddp.py sends float32 gradients, twice the book's bf16 bytes: twice the tokens, less the ring's 1/N
    assert h100["code"] == pytest.approx(2 * h100["book"] * 7 / 8)
    for gpu in ("H200", "B200"):
        assert (gpu, "node") in rows and (gpu, "across") in rows


def test_threshold_balances_backward_against_the_all_reduce():
    fpt, comm, rate = 6e6, 0.05, 2e9
    x = R.ddp_threshold(fpt, comm, rate)
    assert (4 / 6) * fpt * x / rate == pytest.approx(comm)


def test_link_fit_recovers_alpha_and_beta():
    traffic = [2**18, 2**20, 2**22, 2**24]
    alpha, beta = R.fit_link(traffic, [3e-4 + s / 2e9 for s in traffic])
    assert alpha == pytest.approx(3e-4) and beta == pytest.approx(2e9)


def test_crossing_finder():
    xs = [16, 32, 64, 128, 256, 512]
    # backward: 20 ms of overhead plus 0.5 ms a token, the all-reduce 95 ms: they cross at 150
    backward = [20 + 0.5 * x for x in xs]
    found, how = R.crossing(xs, [95.0] * 6, backward)
    assert how == "found" and found == pytest.approx(150)
    # the all-reduce's noise: its median decides, not one slow call
    found, how = R.crossing(xs, [95, 95, 400, 95, 90, 100], backward)
    assert how == "found" and found == pytest.approx(150)
    assert R.crossing(xs, [10.0] * 6, backward) == (16, "below")     # compute-bound at every x
    assert R.crossing(xs, [5000.0] * 6, backward) == (512, "above")  # communication-bound at every x
    # one noisy backward (a descheduled rank) moves the crossing, but not far
    noisy = list(backward)
    noisy[0] *= 3
    found, how = R.crossing(xs, [95.0] * 6, noisy)
    assert how == "found" and 100 < found < 200


def test_tp_bound_on_h100_is_the_books_order_of_magnitude():
    rows = {(r["gpu"], r["where"]): r for r in R.gpu_other_rows(plan_cluster.CLUSTERS)}
    h100 = rows[("H100", "node")]
    # the book: about 8-way inside an H100 node; this code counts every matmul, the book the MLP's
    assert h100["tp_published"] == 8 and 4 <= h100["tp_max"] <= 32
    assert rows[("H100", "across")]["tp_max"] < h100["tp_max"]  # the network: far less width to spare
    assert rows[("B200", "node")]["tp_width"] > h100["tp_width"]  # compute grew 2.3x, NVLink 2x


def test_tp_threshold_is_the_layers_matmuls_against_its_four_all_reduces():
    # deep and wide enough that the head and attention fade: 72·b·s·h²/N FLOPs a layer against
    # 4 all-reduces of b·s·h·d, 2(N-1)/N each -> h/N = (N-1)/N · d·F/(9β)
    config = R.M.GPTConfig(n_layer=400, n_embd=64, block_size=8, vocab_size=64)
    for n, d, dtype in ((2, 4, "float32"), (8, 2, "bfloat16")):
        F, beta = 1e12, 1e10
        w = R.tp_threshold(config, n, F, 0.0, beta, 8, dtype)
        assert w == pytest.approx((n - 1) / n * d * F / (9 * beta), rel=0.05)
        # latency only raises it
        assert R.tp_threshold(config, n, F, 1e-4, beta, 8, dtype) > w


def test_pp_threshold_is_the_bubble_without_messages_and_more_with_them():
    config = R.M.GPTConfig(n_layer=8, n_embd=64, block_size=32, vocab_size=64)
    for p in (2, 4, 8):  # 1f1b idles (p-1)/(m+p-1): as long as compute until m > p-1
        assert R.pp_threshold(config, p, 1e9, 0.0, math.inf, 1) == p
    assert R.pp_threshold(config, 4, 1e9, 5e-3, 1e8, 1) > 4  # 2 sends a 20 ms micro-batch
    assert R.pp_threshold(config, 4, 1e9, 1.0, 1e8, 1) == math.inf  # a send outlasts a micro-batch


def test_cp_threshold_is_a_hops_bytes_against_its_blocks_attention():
    # bf16 K and V forward and again backward, dK and dV in float32: 2·c·h·(2a+4) bytes a hop
    # against 6·c²·h FLOPs (causal half of 4·c²·h forward, 3x with backward) -> c = (2a+4)·F/(3β)
    config = R.M.GPTConfig(n_layer=4, n_embd=64, block_size=32, vocab_size=64)
    F, beta = 1e12, 1e11
    assert R.cp_threshold(config, 4, F, 0.0, beta, 1) == pytest.approx(8 * F / (3 * beta), abs=1)
    assert R.cp_threshold(config, 4, F, 0.0, beta, 1, "float32") == pytest.approx(12 * F / (3 * beta), abs=1)
    assert R.cp_threshold(config, 4, F, 1e-5, beta, 1) > R.cp_threshold(config, 4, F, 0.0, beta, 1)


def test_solve_finds_the_first_compute_bound_x():
    assert R.solve(lambda x: 100 - x, 1, 1000) == 101
    assert R.solve(lambda x: -1, 1, 1000) == 1
    assert R.solve(lambda x: 1, 1, 1000) == math.inf


def test_loglog_crossing_reads_a_measured_curve_between_its_two_points():
    xs = [1, 2, 4, 8, 16]
    # communication flat at 10, compute 2.5·x: equal at x = 4, a swept point
    found, how = R.crossing_loglog(xs, [10.0] * 5, [2.5 * x for x in xs])
    assert how == "found" and found == pytest.approx(4)
    # between two points: comm/compute = 8/x falls as a power law, so log-log is exact (8)
    found, how = R.crossing_loglog([2, 4, 16, 32], [8.0] * 4, [1.0 * x for x in [2, 4, 16, 32]])
    assert how == "found" and found == pytest.approx(8)
    assert R.crossing_loglog(xs, [1.0] * 5, [2.0] * 5) == (1, "below")    # compute-bound throughout
    assert R.crossing_loglog(xs, [3.0] * 5, [2.0] * 5) == (16, "above")   # communication-bound throughout
    assert R.crossing_loglog(xs, [10, 10, 10, 10, 50], [2.5 * x for x in xs]) == (16, "above")  # bound at the end
    # noise: a point that flips back to communication-bound moves the crossing past it
    found, how = R.crossing_loglog(xs, [10, 10, 3, 30, 10], [2.5 * x for x in xs])
    assert how == "found" and 8 < found < 16
    # the pipeline's reading: idle and busy shares of the step cross at an idle fraction of 1/2
    idle = [0.6, 0.4, 0.3]
    found, how = R.crossing_loglog([1, 2, 4], idle, [1 - f for f in idle])
    assert how == "found" and 1 < found < 2


def test_costs_and_thresholds_are_one_definition():
    # each threshold is the first integer at which its costs turn compute-bound
    config = R.M.GPTConfig(n_layer=4, n_head=4, n_embd=64, block_size=16, vocab_size=64)
    tp = (config, 2, 1e10, 1e-3, 1e9, 8, "float32")
    pp = (config, 2, 1e9, 1e-3, 1e9, 1)
    cp = (config, 2, 1e10, 1e-3, 1e9, 1, "float32")
    for costs, threshold in ((R.tp_costs(*tp), R.tp_threshold(*tp)), (R.pp_costs(*pp), R.pp_threshold(*pp)),
                             (R.cp_costs(*cp), R.cp_threshold(*cp))):
        assert math.isfinite(threshold) and threshold > 1
        comm, compute = costs(threshold)
        assert comm < compute
        comm, compute = costs(threshold - 1)
        assert comm >= compute


def test_tp_costs_scale_with_the_batch_only_through_latency():
    config = R.M.GPTConfig(n_layer=4, n_head=4, n_embd=64, block_size=16, vocab_size=64)
    one, eight = (R.tp_costs(config, 2, 1e10, 0.0, 1e9, rows, "float32") for rows in (1, 8))
    for w in (16, 128):
        (c1, k1), (c8, k8) = one(w), eight(w)
        assert k8 == pytest.approx(8 * k1) and c8 == pytest.approx(8 * c1, rel=1e-3)  # the norm's 4 bytes aside


def test_pp_costs_idle_share_is_the_bubble_without_messages():
    config = R.M.GPTConfig(n_layer=8, n_embd=64, block_size=32, vocab_size=64)
    costs = R.pp_costs(config, 2, 1e9, 0.0, math.inf, 1)
    for m in (1, 2, 4, 8):
        idle, busy = costs(m)
        assert idle / (idle + busy) == pytest.approx(1 / (m + 1))  # 1f1b at p = 2: (p-1)/(m+p-1)


def test_tp_trace_reader_counts_the_wire_not_the_wait_for_a_rank_still_computing(tmp_path):
    # one step, 2 ranks (times in µs): rank 1 computes 5 ms longer before the first all-reduce, so
    # rank 0 waits in it; rank 1, last, sends and leaves at once (0.2 ms), rank 0 gets the reply
    # 1 ms after rank 1 arrived. Then a call they enter together, 2 ms each, in the optimizer
    def ev(name, cat, ts, dur, rank):
        return dict(name=name, cat=cat, ph="X", ts=ts, dur=dur, pid=rank, tid=0, args=dict(step=1))
    events = []
    for rank, arrive, leave in ((0, 10_000, 16_000), (1, 15_000, 15_200)):
        events += [ev("step 1", "step", 0, 30_000, rank), ev("forward", "compute", 0, 16_000, rank),
                   ev("all_reduce", "comm", arrive, leave - arrive, rank),
                   ev("backward", "compute", 16_000, 4_000, rank), ev("optimizer", "compute", 20_000, 5_000, rank),
                   ev("all_reduce", "comm", 21_000, 2_000, rank)]
    path = tmp_path / "trace.json"
    path.write_text(R.json.dumps(dict(traceEvents=events)))
    comm, compute = R.trace_blocking(str(path))
    # 1 ms from the last arrival to the last exit, then 2: not rank 0's 6 ms wait, nor rank 1's 0.2 ms
    assert comm == pytest.approx(0.001 + 0.002)
    assert compute == pytest.approx(0.0198)  # the slower rank 1: 16 + 4 ms of forward and backward, less its call
    ring = [ev("ring step 0 k/v (0.1 MB)", "comm", 0, 3_000, 0), ev("ring step 0 k/v (0.1 MB)", "comm", 0, 2_000, 1),
            ev("all_reduce", "comm", 5_000, 9_000, 0), ev("all_reduce", "comm", 5_000, 9_000, 1)]
    path.write_text(R.json.dumps(dict(traceEvents=ring)))
    assert R.trace_named(str(path), "ring step") == pytest.approx(0.002)  # the hops alone, the rank with least
