"""The quick tier's spine: every strategy at 2 ranks, in one launch, against the one-process run.

What a forker runs after each change (`python -m pytest -q -m quick`): one spawn of two
ranks trains each strategy for a few steps (one process group, many short runs), and
each strategy's losses must equal the one-process ddp.py run's within 1e-4, and its
gradient norms too (harness.assert_norms_match). The long proofs (20 steps, 3 and 4
ranks, bytes to the formula, bf16, resume) are each strategy's own test file, in the
whole suite."""
import importlib

import pytest

from harness import spawn, assert_logs_match

pytestmark = pytest.mark.quick

STEPS = ["--max_iters=4", "--eval_interval=3"]  # validation once and at the end: evaluate() runs too
MOE = ["--n_expert=4", "--top_k=2"]
# (name, module, flags): one of each strategy, in the mode its file is proudest of
RUNS = [("ddp overlap", "ddp", ["--bucket_mb=0.25"]),
        ("fsdp zero3", "fsdp", []),
        ("fsdp zero2", "fsdp", ["--zero_stage=2"]),
        ("tensor sequence parallel", "tensor_parallel", ["--sequence_parallel=True"]),
        ("pipeline 1f1b", "pipeline_parallel", ["--schedule=1f1b", "--n_micro=4"]),
        ("pipeline interleaved", "pipeline_parallel", ["--schedule=interleaved", "--n_micro=4"]),
        ("pipeline zb", "pipeline_parallel", ["--schedule=zb", "--n_micro=4"]),
        ("context zigzag", "context_parallel", ["--layout=zigzag"]),
        ("n-D tp x pp", "parallel_nd", ["--tp=2", "--pp=1", "--n_micro=1"]),
        ("experts", "expert_parallel", MOE)]


def _run_all(rank, world, args):
    return {name: importlib.import_module(module).main(args + STEPS + flags) for name, module, flags in RUNS}


@pytest.fixture(scope="module")
def quick_references(train_args):
    """The one-process run of the dense model and of the mixture of experts, same steps."""
    import ddp
    return {"dense": ddp.main(train_args + STEPS), "moe": ddp.main(train_args + STEPS + MOE)}


def test_every_strategy_at_two_ranks(train_args, quick_references):
    results = spawn(_run_all, 2, train_args, timeout=600)[0]
    for name, module, _ in RUNS:
        ref = quick_references["moe" if module == "expert_parallel" else "dense"]
        assert_logs_match(results[name], ref, 1e-4)
        assert_logs_match([r for r in results[name] if "val_loss" in r], [r for r in ref if "val_loss" in r],
                          1e-4, key="val_loss")
        assert all(sum(r["comm_bytes"]) > 0 for r in results[name]), f"{name}: two ranks that sent nothing"
