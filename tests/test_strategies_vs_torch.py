"""bench/strategies_vs_torch.py: ddp.py against PyTorch's DistributedDataParallel at 2 CPU ranks, the
loss gap at every step within 1e-4; and the gap it reports is the one between the sides."""
import os
import re
import sys

import pytest

from harness import ROOT, python

sys.path.insert(0, os.path.join(ROOT, "bench"))


def test_gaps_and_table():
    import strategies_vs_torch as V
    assert V.gaps([5.0, 4.0], [5.0, 4.1]) == pytest.approx([0.0, 0.1])
    assert V.gaps([5.0, 4.0], [5.0]) == [float("inf")]  # a missing step is no match
    row = dict(pair="ddp", gaps=[0.0, 3e-4, 1e-5], ours_ms=10.0, theirs_ms=8.0)
    assert "| ddp | DistributedDataParallel | 3.0e-04 (1) | 10.0 | 8.0 | 1.25 |" in V.table([row], 2, 1e-4)


def test_ddp_against_torch_ddp_at_2_ranks():  # not in the quick tier: it checks the bench, not a strategy
    r = python("bench/strategies_vs_torch.py", ["--world=2", "--pairs=ddp", "--iters=4", "--repeats=1"], timeout=240)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    line = re.search(r"^ddp +gap at each step: (.*)$", r.stdout, re.M)
    assert line, r.stdout
    gaps = [float(g) for g in line.group(1).split()]
    assert len(gaps) == 4 and max(gaps) <= 1e-4, gaps
    assert "every pair within 0.0001 at every step" in r.stdout
