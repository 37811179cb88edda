"""
How much of DDP's communication does backward hide? Runs ddp.py in its three modes
at 2 and 4 CPU ranks and prints time per step next to the time the step spent
waiting for all-reduces that backward did not hide.

    python bench/ddp_overlap.py                      # the small preset, a few minutes on 2 cores
    python bench/ddp_overlap.py --worlds 2 --iters 6 --model tiny

hidden = 1 - exposed(overlap) / exposed(bucketed): in bucketed mode all of the
communication is exposed, so its exposed time is the communication time.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(world, mode, args, tmp):
    log = os.path.join(tmp, f"{world}_{mode}.jsonl")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={world}", "ddp.py",
           f"--model={args.model}", f"--batch_size={args.batch_size}", f"--max_iters={args.iters}",
           f"--overlap={mode == 'overlap'}", f"--bucket_mb={0 if mode == 'naive' else args.bucket_mb}", "--eval_interval=0", "--log_interval=0",
           f"--log_file={log}"] + ([f"--data_dir={args.data_dir}"] if args.data_dir else [])
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=args.timeout,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    if r.returncode:
        return None, r.stderr.strip().splitlines()[-1] if r.stderr.strip() else f"exit {r.returncode}"
    records = [json.loads(line) for line in open(log)][2:]  # skip warm-up iterations
    dt = statistics.median(r["dt_ms"] for r in records)
    exposed = statistics.median(max(r["exposed_comm_ms"]) for r in records)
    return dict(dt=dt, exposed=exposed, mb=max(records[-1]["comm_bytes"]) / 1e6, loss=records[-1]["loss"]), None


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    p.add_argument("--model", default="small")
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--iters", type=int, default=8)
    p.add_argument("--bucket_mb", type=float, default=4.0)
    p.add_argument("--data_dir", default="")
    p.add_argument("--timeout", type=int, default=600)
    args = p.parse_args()
    print(f"ddp.py, --model={args.model} --batch_size={args.batch_size} --bucket_mb={args.bucket_mb}, "
          f"median of iterations 2..{args.iters - 1}")
    print(f"{'ranks':>5} {'mode':>9} {'ms/step':>9} {'exposed comm ms':>16} {'hidden':>7} {'MB sent/rank':>13} {'vs naive':>9}")
    with tempfile.TemporaryDirectory() as tmp:
        for world in args.worlds:
            res = {}
            for mode in ("naive", "bucketed", "overlap"):
                res[mode], err = run(world, mode, args, tmp)
                if err:
                    print(f"{world:>5} {mode:>9}  failed: {err}")
                    continue
                r = res[mode]
                hidden = ""
                if mode == "overlap" and res.get("bucketed"):
                    hidden = f"{100 * (1 - r['exposed'] / res['bucketed']['exposed']):.0f}%"
                speedup = f"{res['naive']['dt'] / r['dt']:.2f}x" if res.get("naive") else ""
                print(f"{world:>5} {mode:>9} {r['dt']:>9.1f} {r['exposed']:>16.1f} {hidden:>7} {r['mb']:>13.2f} {speedup:>9}",
                      flush=True)


if __name__ == "__main__":
    main()
