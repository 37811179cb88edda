"""--compile=True at one process: tensor_parallel.py, pipeline_parallel.py, context_parallel.py
and parallel_nd.py compile and train the same steps as their eager runs. ddp.py's and fsdp.py's
compiled runs are checked in their own files, and test_expert_parallel.py checks that dynamo
skips expert_parallel.py's collectives (its compiled run, whose routing changes shapes every
step, costs 13 s here). The test compiles with aot_eager: dynamo traces the
strategy's code and AOTAutograd its backward, which is where a strategy can break (a graph
break where none is meant, a compiled module used as a plain one); inductor only generates
the kernels, and takes minutes on two CPU cores. A 2-block model: each block's graphs are
the same, and tracing 12 of them costs 5 times as long."""
import contextlib
import functools
import importlib
import io

import pytest
import torch

import model as M

RUNS = [("tensor_parallel", []), ("pipeline_parallel", ["--n_micro=2"]), ("context_parallel", []),
        ("parallel_nd", ["--dp_replicate=1", "--tp=1"])]


def test_each_strategy_compiles_and_trains_as_in_eager_mode(train_args, monkeypatch):
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    monkeypatch.setitem(M.PRESETS, "tiny_2", dict(M.PRESETS["tiny"], n_layer=2))
    torch.set_num_threads(1)
    steps = ["--model=tiny_2", "--max_iters=2", "--eval_interval=0"]
    for name, flags in RUNS:
        main = importlib.import_module(name).main
        with contextlib.redirect_stdout(io.StringIO()):
            eager = [r["loss"] for r in main(train_args + steps + flags)]
            compiled = [r["loss"] for r in main(train_args + steps + flags + ["--compile=True"])]
        assert len(compiled) == 2 and max(abs(a - b) for a, b in zip(eager, compiled)) < 1e-5, (name, eager, compiled)


def _dp_shard(rank, world, train_args, steps):
    """parallel_nd --dp_shard=2 eager and compiled (aot_eager, restored after: the ranks are pooled)."""
    import parallel_nd
    compile_ = torch.compile
    torch.compile = functools.partial(compile_, backend="aot_eager")
    M.PRESETS.setdefault("tiny_2", dict(M.PRESETS["tiny"], n_layer=2))
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            return {mode: [r["loss"] for r in parallel_nd.main(train_args + steps + ["--dp_shard=2", "--dp_replicate=1"]
                                                              + flags)]
                    for mode, flags in [("eager", []), ("compiled", ["--compile=True"])]}
    finally:
        torch.compile = compile_


def test_parallel_nd_compiles_with_dp_shard(train_args):
    """--compile with --dp_shard=2 (ZeRO-3: the units' weights come and go between the compiled
    graphs; their gathers run between them): the same losses as eager, at 2 ranks."""
    from harness import spawn
    steps = ["--model=tiny_2", "--max_iters=2", "--eval_interval=0"]
    losses = spawn(_dp_shard, 2, train_args, steps, timeout=600)[0]
    assert len(losses["compiled"]) == 2 and losses["compiled"] == pytest.approx(losses["eager"], abs=1e-5), losses


def test_zero_bubble_compiles_without_graph_breaks(train_args, monkeypatch):
    """--schedule=zb and zbv under --compile: B's store of each linear's input and output
    gradient (pipeline_parallel.input_grad) runs inside the compiled backward, with no graph
    break (what TORCH_LOGS=graph_breaks prints, dynamo's graph_break counter), and W's gradients
    train as in eager mode. A Python append in the traced backward broke the graph at every
    linear (4 a block, "Unsafe side effect"), each falling back to eager."""
    from torch._dynamo.utils import counters
    import pipeline_parallel
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    monkeypatch.setitem(M.PRESETS, "tiny_2", dict(M.PRESETS["tiny"], n_layer=2))
    torch.set_num_threads(1)
    steps = ["--model=tiny_2", "--max_iters=2", "--eval_interval=0", "--n_micro=2"]
    for schedule in ("zb", "zbv"):
        flags = train_args + steps + [f"--schedule={schedule}"]
        counters.clear()
        with contextlib.redirect_stdout(io.StringIO()):
            eager = [r["loss"] for r in pipeline_parallel.main(flags)]
            compiled = [r["loss"] for r in pipeline_parallel.main(flags + ["--compile=True"])]
        assert counters["stats"]["unique_graphs"] > 0, schedule  # it compiled
        assert not counters["graph_break"], (schedule, dict(counters["graph_break"]))
        assert len(compiled) == 2 and max(abs(a - b) for a, b in zip(eager, compiled)) < 1e-5, (schedule, eager, compiled)
