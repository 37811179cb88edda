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
