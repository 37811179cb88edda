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
