"""The flight recorder: when a wait times out, the ranks that can still talk compare their
last collectives and one line says who is behind where. Three ways to diverge, on groups
with a 2 s timeout, in one launch of two ranks of their own (each case breaks its group):
a rank that skips a collective, two ranks that issue two groups' collectives in opposite
orders, and a rank stopped by SIGSTOP."""
import datetime
import os
import re
import signal
import time

import pytest

from harness import spawn

TIMEOUT_S = 2


def _case(C, dist):
    """A fresh group with a short timeout, and a fresh record (the last case's broken group
    would still show its op as waiting)."""
    with C._lock:
        C._flight.clear()
        C._flight_seq.clear()
    return dist.new_group([0, 1], timeout=datetime.timedelta(seconds=TIMEOUT_S))


def _diverge(rank, world):
    import torch
    import torch.distributed as dist
    import collectives as C
    C._store = dist.distributed_c10d._get_default_store()  # what init_distributed keeps; the harness made the group
    pids = torch.zeros(2)
    pids[rank] = os.getpid()
    C.all_reduce(pids)
    t, out = torch.ones(16), {}
    try:
        # 1. rank 1 skips the second of three all-reduces, and goes on to wait for the end
        g = _case(C, dist)
        t0 = time.monotonic()
        try:
            for i in range(3):
                if rank == 1 and i == 1:
                    continue
                C.all_reduce(t, group=g)
            C.barrier(g, timeout_s=2 * TIMEOUT_S)  # through the store: no message that rank 0 could take
        except C.CommError:
            out["skip"] = C.diagnose(wait_s=3 * TIMEOUT_S)[0], time.monotonic() - t0, C.group_ranks(g)
        # 2. the two ranks issue the collectives of two groups in opposite orders
        a, b = _case(C, dist), _case(C, dist)
        names = [a.group_name, b.group_name]
        t0 = time.monotonic()
        try:
            for group in ((a, b) if rank == 0 else (b, a)):
                C.all_reduce(t, group=group)
        except C.CommError:
            out["order"] = C.diagnose(wait_s=3 * TIMEOUT_S)[0], time.monotonic() - t0, names
        # 3. rank 1 stops (SIGSTOP) before its all-reduce; rank 0 wakes it up once it has its diagnosis
        s = _case(C, dist)
        t0 = time.monotonic()
        if rank == 1:
            os.kill(os.getpid(), signal.SIGSTOP)
        try:
            C.all_reduce(t, group=s)
        except C.CommError:
            out["stopped"] = C.diagnose(wait_s=TIMEOUT_S)[0], time.monotonic() - t0
    finally:
        if rank == 0:
            os.kill(int(pids[1]), signal.SIGCONT)
        C._store = None
    return out


def test_three_divergences_diagnosed():
    r0, r1 = spawn(_diverge, 2, timeout=300, fresh=True)
    line, took, _ = r0["skip"]
    assert line == "rank 1 never posted all_reduce #2 on [0, 1]; rank 0 is waiting in it " \
                   "(rank 1 is in store barrier on [0, 1])", line
    assert r1["skip"][0] == line, "both ranks compare the same records"
    assert took < 2 * TIMEOUT_S + 3 * TIMEOUT_S, took  # rank 0's timeout, then at most rank 1's

    line, took, (a, b) = r0["order"]
    assert line == f"rank 1 never posted all_reduce #0 on [0, 1] (group {a}); rank 0 is waiting in it; " \
                   f"rank 0 never posted all_reduce #0 on [0, 1] (group {b}); rank 1 is waiting in it: each waits " \
                   f"for the other, so the ranks issue these groups' collectives in different orders", line
    assert took < 3 * TIMEOUT_S + 2, took

    line, took = r0["stopped"]
    assert line == f"rank 1 did not answer within {TIMEOUT_S} s (stopped, or gone); rank 0 is waiting for it " \
                   f"in all_reduce #0 on [0, 1]", line
    assert took < 2 * TIMEOUT_S + 2, took
    assert "\n" not in "".join(r[0] for r in (r0["skip"], r0["order"], r0["stopped"]))


@pytest.mark.quick
def test_diagnosis_from_records():
    """The comparison alone, on records as ranks would publish them (no processes): a
    pipeline's message to a peer that is elsewhere, and ops of different kinds at one number."""
    import collectives as C
    records = {0: {"0": [[0, 1], [[None, "sendrecv", 0, [1], "posted"]]]},
               1: {"0": [[0, 1], [[3, "all_reduce", 64, [0], "posted"]]]}}
    assert C._diagnosis(records, []) == "rank 0 is waiting in sendrecv with rank 1, which is in all_reduce #3 on " \
        "[0, 1]; rank 0 never posted all_reduce #3 on [0, 1]; rank 1 is waiting in it (rank 0 is in sendrecv on [0, 1])"
    records = {0: {"0": [[0, 1], [[5, "all_reduce", 64, [1], "posted"]]]},
               1: {"0": [[0, 1], [[5, "broadcast", 64, [0], "posted"]]]}}
    assert re.fullmatch(r"rank 0 and rank 1 issued different collectives as #5 on \[0, 1\]: all_reduce and "
                        r"broadcast; .*", C._diagnosis(records, [])), C._diagnosis(records, [])
    assert C._diagnosis({0: {"0": [[0, 1], [[5, "all_reduce", 64, [1], "done"]]]}}, []) == ""


@pytest.mark.quick
def test_record_read_after_a_cuda_error():
    """After a sticky CUDA error every event query raises; the record is read then, to diagnose:
    an op whose event cannot say is still waited for, and nothing raises."""
    import torch
    import collectives as C

    class Broken:
        def query(self):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
    with C._lock:
        C._flight["x"] = ([0, 1], [[0, "all_reduce", "x", 64, {1}, Broken(), torch.device("cuda")]])
    try:
        assert C.flight_record()["x"] == [[0, 1], [[0, "all_reduce", 64, [1], "posted"]]]
    finally:
        with C._lock:
            del C._flight["x"]
