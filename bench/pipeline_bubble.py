"""
The pipeline bubble, measured: runs pipeline_parallel.py under torchrun for every
schedule at p stages and m micro-batches, and prints each stage's measured idle
fraction next to the formula (simulate() at unit costs: (p-1)/(m+p-1) for GPipe and
1F1B, (p-1)/(v·m+p-1) interleaved, (p-1)/(3m+p-1) ZB-H1), the step time, and the peak
activation memory each stage held (the bytes autograd saved for backward, summed over
the micro-batches alive at once: GPipe holds m of them, 1F1B at most p-stage).

    python bench/pipeline_bubble.py                          # p in {2, 4}, m = 8, 4 schedules: a few minutes
    python bench/pipeline_bubble.py --stages 2 --micro 4 16 --iters 8 --schedules 1f1b zb

Idle = 1 - (time in forward and backward) / (first forward to last backward of the
step), averaged over the steps after the first two. On a 2-core CPU, 4 stages
share 2 cores: a stage that waits lends its core to one that works, so the
measured bubble at p=4 is not the bubble a machine with a core (or GPU) per stage
would show. Data: a synthetic set with a 192-token vocabulary (with GPT-2's 50k
vocabulary the head would dwarf the tiny model's blocks and the last stage would
be the bottleneck: an imbalance, not the bubble).
"""
import argparse
import json
import os
import statistics
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
from harness import torchrun  # noqa: E402
from conftest import make_dataset  # noqa: E402


def run(schedule, p, m, args, tmp):
    log = os.path.join(tmp, f"{schedule}_{p}_{m}.jsonl")
    flags = [f"--model={args.model}", f"--data_dir={args.data_dir}", f"--batch_size={args.batch_size}",
             f"--block_size={args.block_size}", f"--max_iters={args.iters}", f"--schedule={schedule}",
             f"--n_micro={m}", f"--virtual_stages={args.virtual_stages}", "--eval_interval=0", "--log_interval=0",
             "--dtype=float32", f"--log_file={log}"]
    r = torchrun("pipeline_parallel.py", p, flags, timeout=args.timeout)
    if r.returncode:
        errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
        return None, (errors or r.stderr.strip().splitlines()[-1:] or [f"exit {r.returncode}"])[0]
    records = [json.loads(line) for line in open(log)]
    steady = records[2:] or records
    idle = [statistics.mean(r["idle_frac"][s] for r in steady) for s in range(p)]
    last = records[-1]
    return dict(idle=idle, theory=last["bubble_theory"], ms=statistics.median(r["dt_ms"] for r in steady),
                held=[int(h) for h in last["peak_micro"]], act_mb=[b / 2**20 for b in last["act_bytes"]]), None


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--micro", type=int, nargs="+", default=[8])
    ap.add_argument("--schedules", nargs="+", default=["gpipe", "1f1b", "interleaved", "zb"])
    ap.add_argument("--virtual_stages", type=int, default=2, help="interleaved's chunks a stage")
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--batch_size", type=int, default=32)
    ap.add_argument("--block_size", type=int, default=64)
    ap.add_argument("--iters", type=int, default=6)
    ap.add_argument("--data_dir", default="", help="default: a synthetic set in a temporary folder")
    ap.add_argument("--timeout", type=int, default=300)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        args.data_dir = args.data_dir or make_dataset(os.path.join(tmp, "data"))
        print(f"pipeline_parallel.py --model={args.model} --batch_size={args.batch_size} "
              f"--block_size={args.block_size}, mean of iterations 2..{args.iters - 1}")
        print(f"{'schedule':>11} {'p':>2} {'m':>3} {'idle per stage (measured)':>28} {'mean':>6} {'formula':>7} "
              f"{'ms/step':>8} {'micro-batches held':>19} {'peak activations MB per stage':>30}")
        for p in args.stages:
            for m in args.micro:
                for schedule in args.schedules:
                    res, err = run(schedule, p, m, args, tmp)
                    if err:
                        print(f"{schedule:>11} {p:>2} {m:>3}  failed: {err}", flush=True)
                        continue
                    idle = " ".join(f"{f:.2f}" for f in res["idle"])
                    held = " ".join(str(h) for h in res["held"])
                    act = " ".join(f"{b:.1f}" for b in res["act_mb"])
                    print(f"{schedule:>11} {p:>2} {m:>3} {idle:>28} {statistics.mean(res['idle']):>6.2f} "
                          f"{res['theory']:>7.2f} {res['ms']:>8.0f} {held:>19} {act:>30}", flush=True)


if __name__ == "__main__":
    main()
