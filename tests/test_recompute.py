"""--recompute on every strategy: the same losses, and the bytes autograd keeps held to the formula.

One spawn of 2 ranks runs every strategy (fsdp at ZeRO-3 and ZeRO-1, tensor parallel with and
without sequence parallelism, the pipeline under GPipe and 1F1B) x {none, gelu, full} for 3
steps of the tiny preset: gelu and full give the losses of none within 1e-6 at every step,
and each rank's act_bytes (the bytes autograd keeps between forward and backward, counted by
saved-tensor hooks) is model.activation_bytes + the ends' exactly, split as the strategy
splits it (expert parallel: the part its routing decides, checked apart). One process: the
same for ddp.py, and the bad flags, quick.
"""
import contextlib
import importlib
import io

import pytest
import torch

import model as M
from harness import spawn
from conftest import VOCAB

ARGS = ["--batch_size=4", "--max_iters=3", "--eval_interval=0"]  # after conftest's TRAIN_ARGS
B, S = 4, 32  # rows and positions of a step
RUNS = [("ddp", ()), ("fsdp", ("--zero_stage=3",)), ("fsdp", ("--zero_stage=1",)),  # ZeRO-2 runs ZeRO-1's forward
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
                continue  # below: its experts' rows depend on the routing
            want = expected(script, extra, mode, 2, train_args)
            for r in records:
                assert r["act_bytes"] == want, f"{where}, iter {r['iter']}: {r['act_bytes']} bytes, formula {want}"
            if script in ("tensor_parallel", "context_parallel"):  # full's rerun sends again: counted by the formula
                strategy = importlib.import_module(script)
                cfg = M.parse_args(strategy.DEFAULTS, train_args + ARGS + list(extra) + [f"--recompute={mode}"])
                sent = strategy.traffic_per_rank(CONFIG, cfg, 2)
                assert all(sum(r["comm_bytes"]) / 2 == pytest.approx(sent, rel=1e-9) for r in records), where


def test_expert_parallel_bytes(results):
    """Expert parallel: full keeps each block's input as every strategy does (the dense formula, the
    routing rerun in backward); gelu drops exactly the GELU outputs of the rows this rank's experts
    computed (expert_load: every layer's, this step), 4h float32 numbers a row; and the logged
    routing statistics are counted once, not again in the rerun."""
    extra, n, d, h = ("--n_expert=4",), B * S // 2, 4, MOE.n_embd
    for none, gelu, full in zip(*(results["expert_parallel", extra, mode] for mode in M.RECOMPUTE)):
        assert full["act_bytes"] == [M.activation_bytes(MOE, n, "full") + M.ends_bytes(MOE, n, S)] * 2
        assert none["expert_load"] == gelu["expert_load"] == full["expert_load"]
        assert sum(full["expert_load"]) == MOE.n_layer * B * S * MOE.top_k  # no capacity: every choice, once
        for r in range(2):
            assert none["act_bytes"][r] - gelu["act_bytes"][r] == d * 4 * h * none["expert_load"][r]


@pytest.mark.quick
def test_one_process_ddp(train_args, capsys):
    """One process: the three modes' losses agree, and the bytes are the formula's; a bad mode, or gelu
    under --compile, ends the run with one line."""
    import ddp
    torch.set_num_threads(1)
    runs = {}
    for mode in M.RECOMPUTE:
        with contextlib.redirect_stdout(io.StringIO()):
            runs[mode] = ddp.main(train_args + ARGS + [f"--recompute={mode}"])
        want = M.activation_bytes(CONFIG, B * S, mode) + M.ends_bytes(CONFIG, B * S, S)
        assert [r["act_bytes"] for r in runs[mode]] == [[want]] * 3, mode
        assert [r["loss"] for r in runs[mode]] == pytest.approx([r["loss"] for r in runs["none"]], abs=1e-6), mode
    for bad, says in (("--recompute=some", "--recompute takes none, gelu, full"), ("--recompute=gelu", "eager")):
        with pytest.raises(SystemExit) as e:
            ddp.main(train_args + [bad] + (["--compile=True"] if bad.endswith("gelu") else []))
        assert e.value.code != 0 and says in capsys.readouterr().err
