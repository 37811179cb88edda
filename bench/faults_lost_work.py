"""
What does a failure cost: checkpoint-restart against per-step recovery (fault_tolerance.py)
against DiLoCo, as the share of a day's work lost (fault_tolerance.lost_work), at LLaMA-3
405B's failure rate (Meta: 419 unexpected interruptions in 54 days on 16,384 GPUs, "The Llama 3
Herd of Models", 2024, section 3.3.4) and at the rate you give; beside it, the recovery times
measured here: a launch of fault_tolerance.py (tiny preset, 3 replicas) with one replica killed
inside the all-reduce and once between steps, its log's fault_to_step_ms and death_to_rejoin_ms.

    python bench/faults_lost_work.py
    python bench/faults_lost_work.py --failures_per_day 20 --replicas 64 --ckpt_interval_s 900 --restart_s 300

The inputs other than the failure rate are assumptions, printed with the table: change them
to your cluster's. The replica is a model copy (LLaMA-3 405B: tensor 8 x pipeline 16 = 128
GPUs, 128 copies of it in 16,384 GPUs); a failed GPU takes its copy.
"""
import argparse
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

import fault_tolerance as F  # noqa: E402
from harness import bench_data, read_log  # noqa: E402

LLAMA3 = dict(failures_per_day=419 / 54, replicas=16384 // 128)


def measure(tmp):
    """-> (fault_to_step_ms of each kill, death_to_rejoin_ms of each return) from one launch."""
    log = os.path.join(tmp, "log.jsonl")
    cmd = [sys.executable, os.path.join(ROOT, "fault_tolerance.py"), "--model=tiny", "--batch_size=24",
           "--block_size=32", "--max_iters=8", "--eval_interval=0", "--log_interval=0", "--replicas=3",
           f"--data_dir={bench_data(tmp)}", "--faults=1@2:reduce>4,1@5:start>7", f"--log_file={log}"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    if p.returncode:
        sys.exit(f"{' '.join(cmd)} failed:\n{p.stderr[-3000:]}")
    records = read_log(log)
    return ([r["fault_to_step_ms"] for r in records if "fault_to_step_ms" in r],
            [r["death_to_rejoin_ms"] for r in records if "death_to_rejoin_ms" in r])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--failures_per_day", type=float, default=LLAMA3["failures_per_day"])
    ap.add_argument("--replicas", type=int, default=LLAMA3["replicas"])
    ap.add_argument("--ckpt_interval_s", type=float, default=1800, help="assumed: a checkpoint every 30 min")
    ap.add_argument("--restart_s", type=float, default=600, help="assumed: 10 min to reschedule, start, load")
    ap.add_argument("--recovery_s", type=float, default=10, help="assumed at scale: notice, re-form, redo a step")
    ap.add_argument("--rejoin_s", type=float, default=300, help="assumed: a replica restarts and takes a peer's state")
    ap.add_argument("--round_s", type=float, default=500 * 5, help="DiLoCo: H = 500 steps of an assumed 5 s")
    ap.add_argument("--skip_measure", action="store_true", help="no launch: the table alone")
    a = ap.parse_args()
    print(f"{a.failures_per_day:.2f} failures a day, {a.replicas} replicas; assumed: a checkpoint every "
          f"{a.ckpt_interval_s:.0f} s, restart {a.restart_s:.0f} s, recovery {a.recovery_s:.0f} s, rejoin "
          f"{a.rejoin_s:.0f} s, a DiLoCo round {a.round_s:.0f} s")
    lost = F.lost_work(a.failures_per_day, a.replicas, a.ckpt_interval_s, a.restart_s, a.recovery_s, a.rejoin_s,
                       a.round_s)
    print("| way | share of the day lost | GPU-hours lost a day per 1,000 GPUs |\n| --- | --- | --- |")
    for way, share in lost.items():
        print(f"| {way} | {100 * share:.2f}% | {24 * 1000 * share:.1f} |")
    if not a.skip_measure:
        with tempfile.TemporaryDirectory() as tmp:
            faults, rejoins = measure(tmp)
        print(f"measured here (fault_tolerance.py, tiny, 3 replicas): kill to the survivors' committed step "
              f"{', '.join(f'{t / 1000:.2f}' for t in faults)} s; death to the rejoined step "
              f"{', '.join(f'{t / 1000:.2f}' for t in rejoins)} s")


if __name__ == "__main__":
    main()
