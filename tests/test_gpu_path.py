"""The GPU path on a CPU: what only a GPU would show, checked with a fake torch.cuda.

A CUDA event here is a number on a fake device's timeline: record() puts it at the end of
the queued work, and it has completed once the device has been synchronized past it (or
the event itself was). elapsed_time refuses an event that has not completed, as torch's
does (c10/cuda/CUDAEvent.h). No kernel runs: these check the host's side of the GPU path
(which events are waited for, which device a tensor is put on, which flags are set)."""
import dataclasses
import os
import sys
from types import SimpleNamespace

import pytest
import torch

import collectives as C
import model as M
from harness import ROOT


class FakeDevice:
    queued = 0  # events recorded so far: the device's timeline
    done = 0    # the device has finished everything up to here


class FakeEvent:
    def __init__(self, enable_timing=False, **_):
        self.at = None

    def record(self, stream=None):
        FakeDevice.queued += 1
        self.at = FakeDevice.queued

    def query(self):
        return self.at is not None and self.at <= FakeDevice.done

    def synchronize(self):
        FakeDevice.done = max(FakeDevice.done, self.at)

    def elapsed_time(self, end):
        if not (self.query() and end.query()):
            raise RuntimeError("Both events must be completed before calculating elapsed time.")
        return float(end.at - self.at)


@pytest.fixture
def fake_cuda(monkeypatch):
    FakeDevice.queued = FakeDevice.done = 0
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: setattr(FakeDevice, "done", FakeDevice.queued))
    return torch.device("cuda", 0)


def test_trace_end_reads_only_completed_events(fake_cuda):
    """The step's last stamp is taken before the device is synchronized: taken after, it
    would still be queued when elapsed_time reads it (what a GPU does whenever the launch
    runs ahead of the kernels, that is, almost always)."""
    run = SimpleNamespace(device=fake_cuda, rank=0, trace=[], cfg=SimpleNamespace(compile=False))
    M.trace_begin(run)
    try:
        run.t0 = M.now(fake_cuda)
        M.span_between("forward", run.t0, M.now(fake_cuda))
    finally:
        M.trace_end(run, 3)
    names = [e["name"] for e in run.trace]
    assert names == ["step 3", "forward"], names
    assert all(e["dur"] >= 0 for e in run.trace)


def test_flight_recorder_waits_for_the_gpu(fake_cuda):
    """On a GPU an op's function returns once its kernels are queued: the flight record says
    "posted" until the event recorded after them has completed, then "done". On the CPU
    returned is done, as before."""
    import torch.distributed as dist
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        C._launch("all_reduce", lambda: None, False, fake_cuda)
        states = [ops[-1][4] for _, ops in C.flight_record().values()]
        torch.cuda.synchronize()
        after = [ops[-1][4] for _, ops in C.flight_record().values()]
        C._launch("all_reduce", lambda: None, False, torch.device("cpu"))
        on_cpu = [ops[-1][4] for _, ops in C.flight_record().values()]
    finally:
        dist.destroy_process_group()
        with C._lock:
            C._flight.clear()
            C._flight_seq.clear()
    assert (states, after, on_cpu) == (["posted"], ["done"], ["done"])


def test_peer_losses_reduce_on_the_runs_device(monkeypatch):
    """bench/strategies_vs_torch.py: an NCCL group has no CPU backend, so the losses it reduces must be
    on the run's device ("meta" here: any device but the CPU tells)."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import strategies_vs_torch as V
    seen = []

    class Reduced(Exception):
        pass

    def collective(t, *args, **kwargs):
        seen.append(t.device)
        raise Reduced  # a meta tensor has no values to read back: stop here

    monkeypatch.setattr(V.dist, "all_reduce", collective)
    monkeypatch.setattr(V.dist, "broadcast", collective)
    run = SimpleNamespace(device=torch.device("meta"), world=2)
    for who in ("mean", "last"):
        with pytest.raises(Reduced):
            V.peer_losses(run, [5.0, 4.0], who)
    assert seen == [torch.device("meta")] * 2


@pytest.mark.parametrize("flag", [True, False])
def test_compile_blocks_before_torch_2_5(monkeypatch, flag):
    """torch < 2.5 guards on the module object and gives up after cache_size_limit (8)
    recompiles of Block.forward: blocks 9 and up would run eagerly. compile_blocks sets 2.4's
    inline_inbuilt_nn_modules where it exists, else raises the limit past the blocks; on
    2.5 and later it changes nothing."""
    import ddp
    compiled = []
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kw: compiled.append(self))
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fn)
    config = dataclasses.replace(M.make_config("tiny", 192, block_size=16), n_layer=10)
    model = M.GPT(config)
    flags = SimpleNamespace(cache_size_limit=8, **({"inline_inbuilt_nn_modules": False} if flag else {}))
    monkeypatch.setattr(torch._dynamo, "config", flags)
    monkeypatch.setattr(torch, "__version__", "2.6.0")
    ddp.compile_blocks(model)
    assert flags == SimpleNamespace(cache_size_limit=8, **({"inline_inbuilt_nn_modules": False} if flag else {}))
    monkeypatch.setattr(torch, "__version__", "2.4.1+cu121")
    ddp.compile_blocks(model)
    if flag:
        assert flags.inline_inbuilt_nn_modules is True and flags.cache_size_limit == 8
    else:
        assert flags.cache_size_limit >= config.n_layer + 1  # the blocks and the head
    assert len(compiled) == 2 * config.n_layer


def test_checkpoint_reruns_once_per_backward_pass():
    """Why zb's W is not a second backward pass: had B been autograd.grad for the input and W
    autograd.backward for the weights (two graph tasks), the non-reentrant checkpoint would
    rerun the forward in each: 1 forward + 2 reruns. pipeline_parallel.py's B is one backward
    that leaves each linear's dW to its W store (test_zb_with_full_recompute)."""
    calls = []
    block = torch.nn.Linear(4, 4)

    def forward(x):
        calls.append(1)
        return block(x)

    x = torch.randn(2, 4, requires_grad=True)
    out = M.recompute_block(forward, x, "full")
    grad = torch.ones_like(out)
    torch.autograd.grad(out, x, grad, retain_graph=True)                 # B
    torch.autograd.backward(out, grad, inputs=list(block.parameters()))  # W
    assert len(calls) == 3
