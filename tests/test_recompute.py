"""--recompute on every strategy: the same losses, and the bytes autograd keeps held to the formula.

One spawn of 2 ranks runs every strategy (fsdp at ZeRO-3 and ZeRO-1, tensor parallel with and
without sequence parallelism, the pipeline under GPipe and 1F1B) x {none, gelu, full} for 2
steps of the tiny preset: gelu and full give the losses of none within 1e-6 at every step,
and each rank's act_bytes (the bytes autograd keeps between forward and backward, counted by
saved-tensor hooks) is model.activation_bytes + the ends' exactly, split as the strategy
splits it (expert parallel: expert_parallel.activation_per_rank from the step's routing
counts, both dispatch modes, at a capacity that drops). The traffic formulas count full's
rerun messages: held to the log for tensor, context and expert parallel. One process: the
same for ddp.py, dense and with experts, and the bad flags, quick.
"""
import contextlib
import importlib
import io

import pytest
import torch

import model as M
from harness import spawn
from conftest import VOCAB

ARGS = ["--batch_size=4", "--max_iters=2", "--eval_interval=0"]  # after conftest's TRAIN_ARGS: 2 steps, the
# second on the weights the first step's recomputed gradients moved
B, S = 4, 32  # rows and positions of a step
RUNS = [("ddp", ()), ("fsdp", ("--zero_stage=3",)), ("fsdp", ("--zero_stage=1",)),  # ZeRO-2 runs ZeRO-1's forward
        ("tensor_parallel", ()), ("tensor_parallel", ("--sequence_parallel=True",)), ("context_parallel", ()),
        ("pipeline_parallel", ("--schedule=gpipe", "--n_micro=4")),
        ("pipeline_parallel", ("--schedule=1f1b", "--n_micro=4")),
        ("expert_parallel", ("--n_expert=4", "--capacity_factor=1.0")),  # drops: the capacity rule's rows
        ("expert_parallel", ("--n_expert=4", "--capacity_factor=1.0", "--dispatch=allgather"))]
CONFIG = M.make_config("tiny", VOCAB, block_size=S)
MOE = M.make_config("tiny", VOCAB, block_size=S, n_expert=4, capacity_factor=1.0)  # the expert parallel runs


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


def test_expert_parallel_bytes(results, train_args):
    """Expert parallel: each rank's act_bytes is activation_per_rank's from the step's routing counts
    (the rows its experts computed, the choices kept), exactly, in each mode and dispatch; the bytes
    each rank sends are exchange_bytes' from its sent and received rows, full's rerun exchanges
    included (and the step's all-reduces in sum over the ranks); the logged routing statistics are
    counted once, not again in the rerun."""
    import expert_parallel as EP
    L, n, k = MOE.n_layer, B * S // 2, MOE.top_k
    for script, extra in RUNS[-2:]:
        runs = {mode: results[script, extra, mode] for mode in M.RECOMPUTE}
        for mode, records in runs.items():
            cfg = M.parse_args(EP.DEFAULTS, train_args + ARGS + list(extra) + [f"--recompute={mode}"])
            for r, q in zip(records, runs["none"]):
                where = f"{' '.join(extra)} --recompute={mode}, iter {r['iter']}"
                assert r["expert_load"] == q["expert_load"] and r["dropped_tokens"] == q["dropped_tokens"], where
                assert sum(r["expert_load"]) == 2 * L * n * k - sum(r["dropped_tokens"]) and sum(r["dropped_tokens"])
                if cfg.dispatch == "allgather":  # its index of the whole batch's kept choices
                    kept = [sum(r["expert_load"])] * 2
                else:
                    kept = [L * n * k - r["dropped_tokens"][i] for i in range(2)]
                want = [EP.activation_per_rank(MOE, cfg, 2, r["expert_load"][i], kept[i]) for i in range(2)]
                assert r["act_bytes"] == want, (where, r["act_bytes"], want)
                rows = [(r["sent_tokens"][i], r["received_tokens"][i]) if cfg.dispatch == "alltoall" else (None, None)
                        for i in range(2)]
                assert r["dispatch_bytes"] == [EP.exchange_bytes(MOE, cfg, 2, *rows[i]) for i in range(2)], where
                total = sum(EP.traffic_per_rank(MOE, cfg, 2, *rows[i]) for i in range(2))
                assert sum(r["comm_bytes"]) == pytest.approx(total, rel=1e-9), where


@pytest.mark.quick
def test_one_process_ddp(train_args, capsys):
    """One process: the three modes' losses agree, and the bytes are the formula's, for the dense GPT
    and its mixture of experts (expert_parallel.activation_per_rank on one rank: without a capacity
    every choice is an expert row, so its expectation is exact); a bad mode, or gelu under --compile,
    ends the run with one line."""
    import ddp
    import expert_parallel as EP
    torch.set_num_threads(1)
    moe = M.make_config("tiny", VOCAB, block_size=S, n_expert=4)
    for experts in ((), ("--n_expert=4", "--max_iters=1")):  # one step of the experts: 2 cost seconds
        runs = {}
        for mode in M.RECOMPUTE:
            args = train_args + ARGS + list(experts) + [f"--recompute={mode}"]
            with contextlib.redirect_stdout(io.StringIO()):
                runs[mode] = ddp.main(args)
            want = EP.activation_per_rank(moe, M.parse_args(EP.DEFAULTS, args), 1) if experts else \
                M.activation_bytes(CONFIG, B * S, mode) + M.ends_bytes(CONFIG, B * S, S)
            assert [r["act_bytes"] for r in runs[mode]] == [[want]] * (1 if experts else 2), (experts, mode)
            assert [r["loss"] for r in runs[mode]] == pytest.approx([r["loss"] for r in runs["none"]], abs=1e-6)
    for bad, says in (("--recompute=some", "--recompute takes none, gelu, full"), ("--recompute=gelu", "eager")):
        with pytest.raises(SystemExit) as e:
            ddp.main(train_args + [bad] + (["--compile=True"] if bad.endswith("gelu") else []))
        assert e.value.code != 0 and says in capsys.readouterr().err
