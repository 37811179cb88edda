"""--recompute on every strategy: the same losses, and the bytes autograd keeps held to the formula.

One spawn of 2 ranks runs every strategy (fsdp at each ZeRO stage, tensor parallel with and
without sequence parallelism, the pipeline under GPipe and 1F1B) x {none, gelu, full} for 3
steps of the tiny preset: gelu and full give the losses of none within 1e-6 at every step,
and each rank's act_bytes (the bytes autograd keeps between forward and backward, counted by
saved-tensor hooks) is model.activation_bytes + the ends' exactly, split as the strategy
splits it. One process: the same for ddp.py, quick.
"""
import contextlib
import importlib
import io

import pytest

import model as M
from harness import spawn
from conftest import VOCAB

ARGS = ["--batch_size=8", "--max_iters=3", "--eval_interval=0"]  # after conftest's TRAIN_ARGS
B, S = 8, 32  # rows and positions of a step
RUNS = [("ddp", ()), ("fsdp", ("--zero_stage=3",)), ("fsdp", ("--zero_stage=2",)), ("fsdp", ("--zero_stage=1",)),
        ("tensor_parallel", ()), ("tensor_parallel", ("--sequence_parallel=True",)), ("context_parallel", ()),
        ("pipeline_parallel", ("--schedule=gpipe", "--n_micro=4")),
        ("pipeline_parallel", ("--schedule=1f1b", "--n_micro=4")), ("expert_parallel", ("--n_expert=4",))]
CONFIG = M.make_config("tiny", VOCAB, block_size=S)
MOE = M.make_config("tiny", VOCAB, block_size=S, n_expert=4)


def worker(rank, world, train_args, runs):
    """Every run of `runs` in each mode, on this pool's ranks. -> {(script, extra, mode): records}"""
    out = {}
    for script, extra in runs:
        main = importlib.import_module(script).main
        for mode in M.RECOMPUTE:
            with contextlib.redirect_stdout(io.StringIO()):
                records = main(train_args + ARGS + list(extra) + [f"--recompute={mode}"])
            out[script, extra, mode] = records
    return out


def expected(script, extra, mode, world, train_args):
    """Each rank's act_bytes, from the formulas."""
    strategy = importlib.import_module(script)
    cfg = M.parse_args(strategy.DEFAULTS, train_args + ARGS + list(extra) + [f"--recompute={mode}"])
    n = B * S // world  # a data parallel rank's tokens
    if script == "ddp":
        return [M.activation_bytes(CONFIG, n, mode) + M.ends_bytes(CONFIG, n, S)] * world
    if script == "fsdp":  # the embedding's backward is written by hand: autograd keeps nothing of it
        return [M.activation_bytes(CONFIG, n, mode) + M.ends_bytes(CONFIG, n, S, embed=False)] * world
    if script == "pipeline_parallel":
        return strategy.activation_per_rank(CONFIG, cfg, world)
    return [strategy.activation_per_rank(CONFIG, cfg, world)] * world


@pytest.fixture(scope="module")
def results(train_args):
    return spawn(worker, 2, train_args, RUNS, timeout=600)[0]


def test_losses_and_bytes(results, train_args):
    for script, extra in RUNS:
        none = results[script, extra, "none"]
        for mode in M.RECOMPUTE:
            records, where = results[script, extra, mode], f"{script} {' '.join(extra)} --recompute={mode}"
            for r, q in zip(records, none):
                assert abs(r["loss"] - q["loss"]) <= 1e-6, f"{where}, iter {r['iter']}: {r['loss']} vs {q['loss']}"
            if script == "expert_parallel":
                continue  # below
            want = expected(script, extra, mode, 2, train_args)
            for r in records:
                assert r["act_bytes"] == want, f"{where}, iter {r['iter']}: {r['act_bytes']} bytes, formula {want}"
