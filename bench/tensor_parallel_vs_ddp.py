"""
Tensor parallel against data parallel on the same model and global batch: time per
step, traffic and state per rank, at 2 and 4 ranks, each run launched with torchrun.

    python bench/tensor_parallel_vs_ddp.py                      # small preset, CPU ranks over gloo
    python bench/tensor_parallel_vs_ddp.py --ranks=2 --steps=5 --model=tiny

What to expect. DDP sends about twice the gradient bytes per step whatever N is, and
keeps the whole model, its gradients and Adam state on every rank (16 bytes per
parameter in float32). Tensor parallelism keeps about 1/N of that state per rank and
sends activations instead: (4L + 2) all-reduces of b·s·h per step, which depends on
the batch, not the model, and sits on the critical path of every layer. On one
2-core machine the ranks share the cores, so the times show the cost of many small
synchronous messages rather than a speed-up.
"""
import argparse
import os
import statistics
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
from harness import bench_data, run_logged  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="small")
    ap.add_argument("--batch_size", type=int, default=8)
    ap.add_argument("--block_size", type=int, default=64)
    ap.add_argument("--steps", type=int, default=8, help="steps per run; the first is not timed")
    ap.add_argument("--ranks", default="2,4")
    ap.add_argument("--sequence_parallel", default="True", help="also run tensor parallel with it")
    ap.add_argument("--timeout", type=int, default=900)
    args = ap.parse_args()

    runs = [("ddp", "ddp.py", [])]
    runs.append(("tensor parallel", "tensor_parallel.py", []))
    if args.sequence_parallel.lower() in ("true", "1", "yes"):
        runs.append(("tensor parallel + SP", "tensor_parallel.py", ["--sequence_parallel=True"]))
    with tempfile.TemporaryDirectory() as tmp:
        common = [f"--model={args.model}", f"--data_dir={bench_data(tmp)}", f"--batch_size={args.batch_size}",
                  f"--block_size={args.block_size}", f"--max_iters={args.steps}", "--eval_interval=0",
                  "--dtype=float32", "--log_interval=0"]
        print(f"{args.model} preset, global batch {args.batch_size} x {args.block_size} tokens, "
              f"{args.steps} steps (median of all but the first), float32, CPU ranks over gloo")
        header = f"{'strategy':<22}{'ranks':>6}{'ms/step':>10}{'tokens/s':>10}{'sent MB/rank':>14}{'state MB/rank':>15}"
        print(header)
        print("-" * len(header))
        for n in (int(r) for r in args.ranks.split(",")):
            for name, script, extra in runs:
                log = os.path.join(tmp, f"{script}.{n}.jsonl")
                records = run_logged(script, n, common + extra, log, args.timeout)[1:]
                ms = statistics.median(r["dt_ms"] for r in records)
                tok = statistics.median(r["tokens_per_s"] for r in records)
                sent = max(records[-1]["comm_bytes"]) / 1e6
                state = max(records[-1]["state_bytes"]) / 1e6
                print(f"{name:<22}{n:>6}{ms:>10.1f}{tok:>10.0f}{sent:>14.2f}{state:>15.2f}", flush=True)
        print("sent: bytes one rank sends per step; sent and state: the largest over the ranks")


if __name__ == "__main__":
    main()
