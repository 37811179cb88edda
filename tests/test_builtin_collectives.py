"""--collectives=torch: every strategy and the mesh, on torch.distributed's own collectives,
trains to the same losses and logs the same bytes as on the hand-written ones (the byte
counters count what the hand-written op would send). One launch of two ranks, 3 steps each."""
import importlib

from conftest import SHORT_STEPS, moe_preset
from harness import spawn

RUNS = [("ddp", []), ("fsdp", []), ("tensor_parallel", ["--sequence_parallel=True"]),
        ("pipeline_parallel", ["--n_micro=2"]), ("context_parallel", []),
        ("expert_parallel", ["--model=tiny_moe", "--n_expert=4"]), ("parallel_nd", ["--tp=2"])]


def both_ways(rank, world, train_args):
    import collectives as C
    moe_preset()
    out = {}
    for name, extra in RUNS:
        main = importlib.import_module(name).main
        args = train_args + [f"--max_iters={SHORT_STEPS}", "--eval_interval=0"] + extra
        out[name] = {kind: main(args + [f"--collectives={kind}"]) for kind in ("hand", "torch")}
        assert C.all_reduce is C._HAND["all_reduce"], "a finished run leaves the hand-written ones in place"
    return out


def test_builtin_collectives_match_hand(train_args):
    runs = spawn(both_ways, 2, train_args, timeout=300)[0]
    for name, by in runs.items():
        hand, torch_ = by["hand"], by["torch"]
        assert len(hand) == len(torch_) == SHORT_STEPS, name
        for h, t in zip(hand, torch_):
            assert abs(h["loss"] - t["loss"]) < 1e-5, (name, h["iter"], h["loss"], t["loss"])
            for key in h:
                if key.startswith("comm_bytes"):
                    assert h[key] == t[key], (name, key, h[key], t[key])
            assert sum(h["comm_bytes"]) > 0, name
