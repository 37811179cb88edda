"""bench/gpu_check.py can fail: each verdict on made-up figures (a loss off by 1e-2, a
slow speed, a timeout, a faked GPU) gives FAIL and a non-zero exit, and the CPU smoke
run passes."""
import os
import sys

import pytest

from harness import ROOT, python

sys.path.insert(0, os.path.join(ROOT, "bench"))
import gpu_check as G  # noqa: E402

LOSSES = [5.3, 5.2, 5.1, 5.0, 4.9, 4.8]


NORMS = [3.6, 3.1, 2.5, 2.2, 2.0, 1.9]


def fake_runs(part, shift=0.0, drop=None, scale=1.0):
    """A child's result for `part` on a CPU in which every strategy matches the plain loop,
    except for `shift` added to fsdp's losses, `scale` times its gradient norms, and the run
    `drop` left out."""
    runs = {}
    for dtype, _ in G.checked_dtypes(part, "cpu"):
        runs[f"plain {dtype}"] = runs[f"plain moe {dtype}"] = dict(loss=LOSSES, grad_norm=NORMS)
        for name, _, _ in G.STRATEGIES:
            key = f"{name} {dtype}" + (" compiled" if part == "compile" else "")
            runs[key] = dict(loss=[x + (shift if name == "fsdp" else 0.0) for x in LOSSES], max_gathered_units=2,
                             grad_norm=[x * (scale if name == "fsdp" else 1.0) for x in NORMS])
    runs.pop(drop, None)
    return dict(part=part, iters=len(LOSSES), runs=runs, seconds=1.0)


@pytest.mark.quick
def test_loss_verdicts():
    assert G.loss_verdict("ddp", LOSSES, LOSSES, 1e-4, 6)[0]
    assert not G.loss_verdict("ddp", [x + 1e-2 for x in LOSSES], LOSSES, G.BF16_TOL, 6)[0]  # off by 1e-2: even bf16's
    assert not G.loss_verdict("ddp", [x + 2e-4 for x in LOSSES], LOSSES, G.FP32_TOL, 6)[0]
    assert not G.loss_verdict("ddp", LOSSES[:5], LOSSES[:5], 1e-4, 6)[0]  # a step missing
    assert not G.loss_verdict("ddp", [5.0] * 6, [5.0] * 6, 1e-4, 6)[0]  # learns nothing
    assert not G.loss_verdict("ddp", None, LOSSES, 1e-4, 6)[0]
    assert G.units_verdict(2)[0] and not G.units_verdict(13)[0]


@pytest.mark.quick
def test_speed_verdict():
    ok, detail = G.speed_verdict(480e3, 500e3, 989e12, 8.5e8, 0.95)
    assert ok and "MFU 41.3%" in detail and "0.960" in detail
    assert not G.speed_verdict(470e3, 500e3, 989e12, 8.5e8, 0.95)[0]  # 0.94 of the plain loop
    assert not G.speed_verdict(0, 500e3, None, 8.5e8, 0.95)[0]
    assert "unknown" in G.speed_verdict(500e3, 500e3, None, 8.5e8, 0.95)[1]
    # the bound on a GPU: T/(T + H), T the plain loop's step (16 x 1024 tokens at 400k tok/s: 41 ms)
    bound = G.min_speed(16 * 1024, 400e3, "cuda")
    assert bound == pytest.approx(40.96 / (40.96 + G.HOST_STEP_MS))
    assert not G.speed_verdict(0.93 * 400e3, 400e3, 989e12, 8.5e8, bound)[0]
    assert G.min_speed(16 * 1024, 400e3, "cpu") == G.MIN_SPEED_CPU


@pytest.mark.quick
def test_host_cost_verdict():
    """Each op's host cost on a GPU at most the CPU's measured figure for it; a CPU is not judged."""
    good = dict(G.HOST_US_MAX)
    assert G.host_verdict(good, "cuda")[0]
    assert not G.host_verdict(dict(good, **{"all_reduce 4K": good["all_reduce 4K"] + 1}), "cuda")[0]
    assert G.host_verdict({k: 10 * v for k, v in good.items()}, "cpu")[0]
    assert set(G.HOST_US_MAX) == {f"{op} {size >> 10}K" for op, size in G.HOST_OPS}
    assert all(sum(G.PARTS[p][1] for p in c.split(",")) <= 300 for c in G.COMMANDS)  # each command ~5 min
    assert sorted(p for c in G.COMMANDS for p in c.split(",")) == sorted(G.PARTS)


def test_device_verdict_and_fake_cuda(monkeypatch):
    """CUDA that says it is there but cannot make a tensor gives FAIL, not a traceback."""
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    facts = G.device_check()
    assert "error" in facts
    assert not G.device_verdict(facts, "cuda")[0]
    assert not G.device_verdict(dict(kind="cpu", name="cpu"), "cuda")[0]  # the child found no GPU
    assert not G.device_verdict(dict(kind="cuda", name="x", matmul_err=0.5, bf16=True), "cuda")[0]  # wrong sums
    assert G.device_verdict(dict(kind="cuda", name="NVIDIA H200", matmul_err=1e-6, bf16=True, peak=989e12), "cuda")[0]


@pytest.mark.parametrize("case", ["good", "loss_off", "norm_off", "missing", "slow", "timeout", "crash"])
def test_main_exit_code(case, monkeypatch, capsys):
    """main() on made-up child results: every bad one gives a FAIL line and exit code 1."""
    def launch(part, device, data, iters, timeout, tmp):
        if part == "speed":
            plain = dict(loss=LOSSES, tokens_per_s=100.0)
            ours = dict(loss=LOSSES, tokens_per_s=40.0 if case == "slow" else 99.0)
            return dict(part=part, iters=6, runs=dict(plain=plain, ddp=ours), peak=None, flops_per_token=1.0,
                        seconds=1.0)
        if part == "device":
            return dict(part=part, facts=dict(kind="cpu", name="cpu"), seconds=1.0)
        result = fake_runs(part, shift=1e-2 if case == "loss_off" else 0.0,
                           drop="tensor float32" if case == "missing" else None,
                           scale=2.0 if case == "norm_off" else 1.0)  # a gradient summed over 2 ranks
        if case == "timeout":
            result = dict(fake_runs(part, drop="expert float32"), error=f"timed out after {timeout}s")
        if case == "crash":
            result = dict(error="error: something broke", seconds=1.0)
        return result
    monkeypatch.setattr(G, "launch", launch)
    code = G.main(["--device=cpu"])
    out = capsys.readouterr().out
    assert code == (0 if case == "good" else 1), out
    assert ("FAIL" in out) == (case != "good"), out
    if case == "timeout":
        assert "FAIL  parity expert float32: timed out after" in out
    if case == "loss_off":
        assert "FAIL  parity fsdp float32: max |loss - reference| 1.0e-02" in out
    if case == "norm_off":
        assert "FAIL  parity fsdp float32: max |loss - reference| 0.0e+00" in out and "norm at step 0 1.0e+00" in out
    if case == "slow":
        assert "FAIL  speed: ddp.py 40 tok/s" in out


def test_list_and_bad_part(capsys):
    assert G.main(["--list"]) == 0
    listed = capsys.readouterr().out
    assert all(p in listed for p in G.PARTS), listed
    assert G.main(["--device=cpu", "--only=nope"]) == 2
    assert capsys.readouterr().err.startswith("error: --only: unknown part 'nope'")


def test_faked_gpu_fails_end_to_end(monkeypatch, capsys):
    """The parent (here) believes in a GPU (torch.cuda.is_available faked), the child (a
    real process, as every part is) finds none: the device item fails and the exit code
    says so."""
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert G.main(["--only=device"]) == 1
    assert "FAIL  device:" in capsys.readouterr().out


def test_cpu_smoke_run_passes():
    """The real thing on CPU: every part but compile, 3 steps a run (the default is 6)."""
    r = python("bench/gpu_check.py", ["--device=cpu", "--iters=3"], timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    assert "failed" in r.stdout and " 0 failed" in r.stdout
    for name, _, _ in G.STRATEGIES:
        assert f"PASS  parity {name} float32" in r.stdout
    assert "PASS  speed:" in r.stdout


def test_a_real_timeout_kills_the_part(capsys):
    """A part that outlives --timeout_s is killed there and then (not left running until it
    ends), and gives a FAIL line, not a traceback."""
    import time
    t0 = time.time()
    code = G.main(["--device=cpu", "--only=parity", "--timeout_s=3"])
    out = capsys.readouterr().out
    assert code == 1 and "timed out after 3s" in out and "Traceback" not in out, out
    assert time.time() - t0 < 30
