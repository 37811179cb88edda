"""
Each strategy's ms/step on collectives.py's hand-written collectives and on
torch.distributed's own (--collectives=torch), in one run: for every strategy the two
alternate (hand, torch, hand, ...), --repeats times each, and the table gives the median
step of each side's best run (the first steps, warm-up, left out) and their ratio.

    torchrun --nproc_per_node=2 bench/strategies_collectives.py
    torchrun --nproc_per_node=2 bench/strategies_collectives.py --iters=20 --repeats=3 --only=ddp,tensor_parallel

The model is the tests' tiny preset on their synthetic data (a Markov chain over 192
tokens), float32; both sides must log the same losses and bytes (the check prints a
mismatch).
"""
import argparse
import importlib
import os
import statistics
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

RUNS = [("ddp", []), ("fsdp", []), ("tensor_parallel", ["--sequence_parallel=True"]),
        ("pipeline_parallel", []), ("context_parallel", []),
        ("expert_parallel", ["--n_expert=4", "--model=tiny_moe"]), ("parallel_nd", ["--tp=2"])]


def main(argv=None):
    p = argparse.ArgumentParser(prog="strategies_collectives.py", description=__doc__.strip().splitlines()[0])
    p.add_argument("--iters", type=int, default=12)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--only", default=",".join(name for name, _ in RUNS))
    args = p.parse_args(argv)
    from conftest import make_dataset, moe_preset
    import torch
    torch.set_num_threads(1)
    moe_preset()
    rank = int(os.environ.get("RANK", 0))
    data = os.path.join(tempfile.gettempdir(), f"collectives_steps_{os.environ.get('TORCHELASTIC_RUN_ID', 'x')}")
    if int(os.environ.get("LOCAL_RANK", 0)) == 0 and not os.path.exists(os.path.join(data, "val.bin")):
        make_dataset(data)
    while not os.path.exists(os.path.join(data, "val.bin")):  # the other ranks wait for local rank 0's files
        import time
        time.sleep(0.1)
    base = ["--model=tiny", "--batch_size=8", "--block_size=64", "--dtype=float32", f"--max_iters={args.iters}",
            "--eval_interval=0", "--log_interval=0", "--warmup_iters=2", f"--data_dir={data}"]
    if rank == 0:
        print(f"{'strategy':<20}{'hand ms':>9}{'torch ms':>10}{'hand/torch':>12}  same losses and bytes")
    for name in args.only.split(","):
        extra = dict(RUNS)[name]
        main_fn, steps, logs = importlib.import_module(name).main, {"hand": [], "torch": []}, {}
        for _ in range(args.repeats):
            for kind in ("hand", "torch"):
                records = main_fn(base + extra + [f"--collectives={kind}"])
                if rank == 0:
                    steps[kind].append(statistics.median(r["dt_ms"] for r in records[2:]))
                    logs[kind] = records
        if rank == 0:
            same = all(abs(h["loss"] - t["loss"]) < 1e-5 and h["comm_bytes"] == t["comm_bytes"]
                       for h, t in zip(logs["hand"], logs["torch"]))
            hand, torch_ = min(steps["hand"]), min(steps["torch"])
            print(f"{name:<20}{hand:>9.1f}{torch_:>10.1f}{hand / torch_:>12.2f}  {'yes' if same else 'NO'}", flush=True)


if __name__ == "__main__":
    main()
