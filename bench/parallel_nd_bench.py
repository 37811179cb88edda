"""
Every (dp, tp, pp) of 8 ranks, measured: ms/step, the bytes each axis sends per rank,
and the state (parameters, gradients, Adam) each rank holds, on one model and batch.

    python bench/parallel_3d_bench.py                      # 8 CPU ranks over gloo, a few minutes on 2 cores
    python bench/parallel_3d_bench.py --iters 4 --sequence_parallel

All ten layouts run in one start of 8 processes (tests/harness.spawn), one after the
other, on a synthetic 192-token vocabulary (the tests' data: with GPT-2's 50k
vocabulary the embedding would dwarf this small model). "= formula" says whether the
bytes every axis sent equal parallel_3d.axis_bytes, the traffic model
bench/plan_3d.py plans with. On 8 processes sharing 2 cores the times measure
Python's and gloo's per-message cost more than bandwidth: tensor parallelism, with
4 collectives per block per micro-batch, pays most; the bytes and the state are exact.
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


def factorizations(n):
    return [(dp, tp, n // (dp * tp)) for dp in range(1, n + 1) if n % dp == 0
            for tp in range(1, n // dp + 1) if (n // dp) % tp == 0]


def _child(rank, world, argv_by_layout):
    import contextlib
    import io
    import model as M
    import parallel_3d as P3
    M.PRESETS["bench8"] = SHAPE
    out = {}
    for layout, argv in argv_by_layout:
        with contextlib.redirect_stdout(io.StringIO()):
            out[layout] = P3.main(argv)
    return out if rank == 0 else None


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=4)
    ap.add_argument("--batch_size", type=int, default=32)
    ap.add_argument("--n_micro", type=int, default=4)
    ap.add_argument("--schedule", default="1f1b")
    ap.add_argument("--sequence_parallel", action="store_true")
    ap.add_argument("--timeout", type=int, default=1800)
    args = ap.parse_args()
    import model as M
    import parallel_3d as P3
    M.PRESETS["bench8"] = SHAPE
    with tempfile.TemporaryDirectory() as tmp:
        data = make_dataset(os.path.join(tmp, "data"))
        base = ["--model=bench8", f"--data_dir={data}", f"--batch_size={args.batch_size}", f"--max_iters={args.iters}",
                "--eval_interval=0", "--log_interval=0", "--dtype=float32", f"--schedule={args.schedule}",
                f"--n_micro={args.n_micro}"]
        runs = []
        for dp, tp, pp in factorizations(8):
            sp = args.sequence_parallel and tp > 1
            runs.append(((dp, tp, pp), base + [f"--dp={dp}", f"--tp={tp}", f"--pp={pp}", f"--sequence_parallel={sp}"]))
        results = spawn(_child, 8, runs, timeout=args.timeout)[0]
    config = M.GPTConfig(**SHAPE, vocab_size=192)
    print(f"8 CPU ranks over gloo; {M.param_count(config) / 1e6:.2f}M parameters ({SHAPE}), batch "
          f"{args.batch_size} x {SHAPE['block_size']}, {args.schedule}, {args.n_micro} micro-batches"
          f"{', sequence parallel' if args.sequence_parallel else ''}; medians of iterations 1..{args.iters - 1}")
    print(f"{'dp':>3} {'tp':>3} {'pp':>3} {'ms/step':>8} {'tp MB/rank':>10} {'dp MB/rank':>10} {'pp MB/rank':>10} "
          f"{'= formula':>9} {'state MB/rank':>15} {'loss':>8}")
    for (dp, tp, pp), argv in runs:
        records = results[(dp, tp, pp)]
        cfg = M.parse_args(P3.DEFAULTS, argv)
        want = P3.axis_bytes(config, cfg, dp, tp, pp)
        exact = all(sum(r[f"comm_bytes_{a}"]) == want[a] for r in records for a in P3.AXES)
        last = records[-1]
        mb = {a: sum(last[f"comm_bytes_{a}"]) / 8 / 1e6 for a in P3.AXES}
        state = f"{min(last['state_bytes']) / 1e6:.2f}-{max(last['state_bytes']) / 1e6:.2f}"
        print(f"{dp:>3} {tp:>3} {pp:>3} {statistics.median(r['dt_ms'] for r in records[1:]):>8.1f} "
              f"{mb['tp']:>10.3f} {mb['dp']:>10.3f} {mb['pp']:>10.3f} {'yes' if exact else 'NO':>9} {state:>15} "
              f"{last['loss']:>8.4f}")


if __name__ == "__main__":
    main()
