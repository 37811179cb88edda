"""
Every layout of 8 ranks over the dense axes (pp, dp_replicate, dp_shard, cp, tp: 35 of them),
measured: ms/step, the bytes each axis sends per rank, and the state (parameters, gradients,
Adam) each rank holds, on one model and batch.

    python bench/parallel_nd_layouts.py                      # 8 CPU ranks over gloo, several minutes on 2 cores
    python bench/parallel_nd_layouts.py --iters 4 --zero_stage 2 --layout contiguous
    python bench/parallel_nd_layouts.py --shard_overlap      # dp_shard's exposed communication, sync vs overlapped

--shard_overlap: dp_shard 2 x tp 2 and pp 2 x dp_shard 2 on 4 ranks, each with --overlap=False --prefetch=0
(every all-gather waited for where it is issued, every reduce-scatter after the last backward)
and --overlap=True --prefetch=1 (the next unit's all-gather issued while one computes, each unit's
reduce-scatter as its gradient completes), in one start of the ranks: the milliseconds a step
each rank waited on dp_shard's messages (the log's exposed_shard_ms, the most of any rank),
ms/step, and whether the two runs' losses are the same.

All layouts run in one start of 8 processes (tests/harness.spawn), one after the other,
on a synthetic 192-token vocabulary (the tests' data: with GPT-2's 50k vocabulary the
embedding would dwarf this small model). "= formula" says whether the bytes every axis
sent equal parallel_nd.axis_bytes, the traffic model bench/plan_cluster.py plans with, and
the state parallel_nd.state_per_rank. --n_micro defaults to parallel_nd's (2·pp with a
pipeline). On 8 processes sharing 2 cores the times measure Python's and gloo's
per-message cost more than bandwidth: tensor and context parallelism, with collectives
in every block of every micro-batch, pay most; the bytes and the state are exact.
"""
import argparse
import os
import statistics
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))
from harness import spawn  # noqa: E402
from conftest import make_dataset  # noqa: E402

SHAPE = dict(n_layer=8, n_head=8, n_embd=128, block_size=64)


def factorizations(n, k=5):
    """Every k-tuple of positive integers whose product is n, in lexicographic order."""
    if k == 1:
        return [(n,)]
    return [(d,) + rest for d in range(1, n + 1) if n % d == 0 for rest in factorizations(n // d, k - 1)]


def _child(rank, world, argv_by_layout):
    import contextlib
    import io
    import model as M
    import parallel_nd as P
    M.PRESETS["bench8"] = SHAPE
    out = {}
    for layout, argv in argv_by_layout:
        with contextlib.redirect_stdout(io.StringIO()):
            out[layout] = P.main(argv)
    return out if rank == 0 else None


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=4)
    ap.add_argument("--batch_size", type=int, default=32)
    ap.add_argument("--schedule", default="1f1b")
    ap.add_argument("--zero_stage", type=int, default=3)
    ap.add_argument("--layout", default="zigzag")
    ap.add_argument("--timeout", type=int, default=3600)
    ap.add_argument("--shard_overlap", action="store_true")
    args = ap.parse_args()
    if args.shard_overlap:
        return shard_overlap(args)
    import model as M
    import parallel_nd as P
    M.PRESETS["bench8"] = SHAPE
    with tempfile.TemporaryDirectory() as tmp:
        data = make_dataset(os.path.join(tmp, "data"))
        base = ["--model=bench8", f"--data_dir={data}", f"--batch_size={args.batch_size}", f"--max_iters={args.iters}",
                "--eval_interval=0", "--log_interval=0", "--dtype=float32", f"--schedule={args.schedule}",
                f"--zero_stage={args.zero_stage}", f"--layout={args.layout}"]
        runs = [(mesh, base + [f"--{a}={n}" for a, n in zip(P.AXES, mesh)]) for mesh in factorizations(8)]
        results = spawn(_child, 8, runs, timeout=args.timeout)[0]
    config = M.GPTConfig(**SHAPE, vocab_size=192)
    print(f"8 CPU ranks over gloo; {M.param_count(config) / 1e6:.2f}M parameters ({SHAPE}), batch "
          f"{args.batch_size} x {SHAPE['block_size']}, {args.schedule}, ZeRO-{args.zero_stage} on dp_shard, "
          f"{args.layout} ring; medians of iterations 1..{args.iters - 1}")
    short = dict(pp="pp", dp_replicate="rep", dp_shard="shard", cp="cp", tp="tp")
    print(" ".join(f"{short[a]:>5}" for a in P.AXES) + f" {'ms/step':>8} "
          + " ".join(f"{short[a] + ' MB':>8}" for a in P.AXES) + f" {'= formula':>9} {'state MB/rank':>13} {'loss':>7}")
    for mesh, argv in runs:
        records = results[mesh]
        cfg = M.parse_args(P.DEFAULTS, argv)
        cfg.n_micro = cfg.n_micro or (2 * cfg.pp if cfg.pp > 1 else 1)
        m = P.Mesh(*mesh)
        want = P.axis_bytes(config, cfg, m)
        state = [P.state_per_rank(config, cfg, m, P.coords(r, m).pp, P.coords(r, m).dp_shard) for r in range(8)]
        exact = all(sum(r[f"comm_bytes_{a}"]) == want[a] for r in records for a in P.AXES) and \
            records[-1]["state_bytes"] == state
        last = records[-1]
        mb = {a: sum(last[f"comm_bytes_{a}"]) / 8 / 1e6 for a in P.AXES}
        kept = f"{min(last['state_bytes']) / 1e6:.2f}-{max(last['state_bytes']) / 1e6:.2f}"
        print(" ".join(f"{n:>5}" for n in mesh) + f" {statistics.median(r['dt_ms'] for r in records[1:]):>8.1f} "
              + " ".join(f"{mb[a]:>8.3f}" for a in P.AXES) + f" {'yes' if exact else 'NO':>9} {kept:>13} "
              f"{last['loss']:>7.4f}")


def shard_overlap(args):
    import model as M
    M.PRESETS["bench8"] = SHAPE
    layouts = {"dp_shard 2 x tp 2": ["--dp_shard=2", "--tp=2"], "pp 2 x dp_shard 2": ["--pp=2", "--dp_shard=2"]}
    with tempfile.TemporaryDirectory() as tmp:
        data = make_dataset(os.path.join(tmp, "data"))
        base = ["--model=bench8", f"--data_dir={data}", f"--batch_size={args.batch_size}", f"--max_iters={args.iters}",
                "--eval_interval=0", "--log_interval=0", "--dtype=float32", f"--zero_stage={args.zero_stage}",
                "--dp_replicate=1"]
        runs = [((name, overlap), base + flags + [f"--overlap={overlap}", f"--prefetch={int(overlap)}"])
                for name, flags in layouts.items() for overlap in (False, True)]
        results = spawn(_child, 4, runs, timeout=args.timeout)[0]
    print(f"4 CPU ranks over gloo, {SHAPE}, batch {args.batch_size}, ZeRO-{args.zero_stage}; medians of iterations "
          f"1..{args.iters - 1}")
    print(f"{'layout':>18} {'overlap':>8} {'exposed dp_shard ms':>20} {'ms/step':>8} {'same losses':>12}")
    for (name, overlap), _ in runs:
        records, sync = results[name, overlap], results[name, False]
        same = [r["loss"] for r in records] == [r["loss"] for r in sync]
        print(f"{name:>18} {str(overlap):>8} {statistics.median(max(r['exposed_shard_ms']) for r in records[1:]):>20.1f} "
              f"{statistics.median(r['dt_ms'] for r in records[1:]):>8.1f} {'yes' if same else 'NO':>12}")


if __name__ == "__main__":
    main()
