"""
The pipeline bubble, measured: runs pipeline_parallel.py under torchrun for every
schedule at p stages and m micro-batches, and prints each stage's measured idle
fraction next to the formula (simulate() at unit costs: (p-1)/(m+p-1) for GPipe and
1F1B, (p-1)/(v·m+p-1) interleaved, (p-1)/(3m+p-1) ZB-H1, (p-1)/(6m+p-1) ZB-V), the
step time, and the peak activation memory each stage held (the bytes autograd saved for
backward, summed over the micro-batches alive at once: GPipe holds m of them, 1F1B at
most p-stage). Then, in one process, what the zero-bubble split costs: per micro-batch,
B + W (the input's gradient, then the weights' from the W store) against one full backward.

    python bench/pipeline_parallel_bubble.py                          # p = 2 (m = 4), p = 4 (m = 8), 5 schedules
    python bench/pipeline_parallel_bubble.py --at 2x4 2x16 --iters 8 --schedules 1f1b zb zbv --rounds 3
    python bench/pipeline_parallel_bubble.py --model wide --batch_size 16 --schedules 1f1b zb zbv

--model wide (h = 512, 8 blocks) is the width where a CPU's backward is its matmuls, so
where W's dW = dYᵀx is moved work rather than added work (at tiny's h = 96 it is not).

Each schedule runs once a round, in turn; ms/step is the median step of a run (the steps
after the first two), its median over the rounds. "vs 1f1b" is the median over the rounds of
the ratio to the 1F1B run of the same round (a drift of the machine's speed over the minutes
moves both alike); "each round" gives them all, to show the spread.
Idle = 1 - (time in forward and backward) / (first forward to last backward of the
step), averaged over the steps after the first two. "cores busy" is the ranks' CPU time
(every thread of each process) over the step's wall time times the cores they can use,
min(p, cores): a pipeline saves time by filling its bubble only while cores sit idle. On a
2-core CPU at p = 4, 1F1B already keeps the cores about 0.95 busy: a stage that waits lends
its core to one that works, so the bubble costs little time there and no schedule can save
much; a machine with a core (or GPU) per stage is where p = 4 means what it says. Data: a synthetic set with a 192-token vocabulary (with GPT-2's 50k
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
sys.path.insert(0, ROOT)
from harness import torchrun  # noqa: E402
from conftest import make_dataset, VOCAB  # noqa: E402


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
    cores = min(p, os.cpu_count())  # the cores the p ranks can use at once
    last = records[-1]
    return dict(idle=idle, theory=last["bubble_theory"], ms=statistics.median(r["dt_ms"] for r in steady),
                busy=statistics.median(sum(r["cpu_ms"]) / (cores * r["dt_ms"]) for r in steady),
                held=[int(h) for h in last["peak_micro"]], act_mb=[b / 2**20 for b in last["act_bytes"]]), None


def summarize(runs, base="1f1b"):
    """runs: the results of one (p, m, schedule), a round each, and of the base schedule in the
    same rounds (None where a run failed). Each round's ratio is taken to the base run just
    before it, so a drift of the machine's speed over the minutes moves both alike; the
    ratio reported is the median of the rounds', ms/step the median of the rounds' steps."""
    mine, theirs = runs
    ok = [r for r in mine if r]
    each = [a["ms"] / b["ms"] for a, b in zip(mine, theirs) if a and b]
    return dict(ms=statistics.median(r["ms"] for r in ok), ratio=statistics.median(each) if each else None,
                each=each, idle=[statistics.mean(col) for col in zip(*(r["idle"] for r in ok))],
                busy=statistics.mean(r["busy"] for r in ok), theory=ok[-1]["theory"], held=ok[-1]["held"],
                act_mb=ok[-1]["act_mb"])


def split_cost(args, m=4):
    """One process, the whole model one stage, m micro-batches of the bench's batch: the
    seconds of one full backward (1F1B's B) and of ZB's B and W, per micro-batch, each the
    best of --rounds steps (the median over the micro-batches of the step)."""
    import torch
    import model as M
    import pipeline_parallel as PP
    torch.set_num_threads(1)  # as each rank of the runs above
    config = M.make_config(args.model, VOCAB, block_size=args.block_size)
    b = args.batch_size // m
    rows = torch.randint(0, VOCAB, (args.batch_size, args.block_size + 1), generator=torch.Generator().manual_seed(0))
    batch = lambda k: (rows[k * b:(k + 1) * b, :-1], rows[k * b:(k + 1) * b, 1:])  # noqa: E731
    # a stage each: zb's executor swaps its stage's linears for DeferredLinear, which 1f1b's must not run
    stages = {name: PP.Stage(config, 0, 1, seed=0) for name in ("1f1b", "zb")}
    executors = {name: PP.Executor(stage, (b, args.block_size, config.n_embd), m) for name, stage in stages.items()}
    steps = {}  # (schedule, "F" | "B" | "W") -> [a step's median over its micro-batches], a round each
    for round_ in range(args.rounds + 1):  # round 0 warms up
        for name, executor in executors.items():
            stamps = []
            stages[name].zero_grad(set_to_none=True)
            executor.run(PP.plan(name, 1, m, 0), batch, stamps=stamps)
            times = PP.action_times(stamps, torch.device("cpu"))
            for kind in "FBW":
                spans = [t1 - t0 for a, (t0, t1) in zip(PP.schedule(name, 1, m, 0), times) if a.kind == kind]
                if spans and round_:
                    steps.setdefault((name, kind), []).append(statistics.median(spans))
    best = {key: min(v) for key, v in steps.items()}
    return best[("1f1b", "B")], best[("zb", "B")], best[("zb", "W")], best[("1f1b", "F")]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--at", nargs="+", default=["2x4", "4x8"], help="stages x micro-batches")
    ap.add_argument("--rounds", type=int, default=3, help="each schedule runs once a round, in turn")
    ap.add_argument("--schedules", nargs="+", default=["gpipe", "1f1b", "interleaved", "zb", "zbv"])
    ap.add_argument("--virtual_stages", type=int, default=2, help="interleaved's chunks a stage")
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--batch_size", type=int, default=32)
    ap.add_argument("--block_size", type=int, default=64)
    ap.add_argument("--iters", type=int, default=6)
    ap.add_argument("--data_dir", default="", help="default: a synthetic set in a temporary folder")
    ap.add_argument("--timeout", type=int, default=300)
    args = ap.parse_args()
    at = [tuple(int(x) for x in pm.split("x")) for pm in args.at]
    with tempfile.TemporaryDirectory() as tmp:
        args.data_dir = args.data_dir or make_dataset(os.path.join(tmp, "data"))
        print(f"pipeline_parallel.py --model={args.model} --batch_size={args.batch_size} "
              f"--block_size={args.block_size}, iterations 2..{args.iters - 1} of each run, {args.rounds} rounds; "
              f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at the start")
        runs, errors = {}, {}  # (p, m, schedule) -> a result per round (None: failed), the last error
        for _ in range(args.rounds):
            for p, m in at:
                for schedule in args.schedules:
                    res, err = run(schedule, p, m, args, tmp)
                    runs.setdefault((p, m, schedule), []).append(res)
                    if err:
                        errors[(p, m, schedule)] = err
        print(f"{'schedule':>11} {'p':>2} {'m':>3} {'idle per stage (measured)':>28} {'mean':>6} {'formula':>7} "
              f"{'cores busy':>10} {'ms/step':>8} {'vs 1f1b':>7} {'each round':>{5 * args.rounds + 1}} "
              f"{'micro-batches held':>19} {'peak activations MB per stage':>30}")
        for p, m in at:
            base = runs.get((p, m, "1f1b"), [None] * args.rounds)
            for schedule in args.schedules:
                if not any(runs[(p, m, schedule)]):
                    print(f"{schedule:>11} {p:>2} {m:>3}  failed: {errors[(p, m, schedule)]}", flush=True)
                    continue
                res = summarize((runs[(p, m, schedule)], base))
                idle = " ".join(f"{f:.2f}" for f in res["idle"])
                held = " ".join(str(h) for h in res["held"])
                act = " ".join(f"{b:.1f}" for b in res["act_mb"])
                ratio = "-" if res["ratio"] is None else f"{res['ratio']:.2f}"
                each = " ".join(f"{r:.2f}" for r in res["each"]) or "-"
                print(f"{schedule:>11} {p:>2} {m:>3} {idle:>28} {statistics.mean(res['idle']):>6.2f} "
                      f"{res['theory']:>7.2f} {res['busy']:>10.2f} {res['ms']:>8.0f} {ratio:>7} "
                      f"{each:>{5 * args.rounds + 1}} {held:>19} {act:>30}", flush=True)
    full, b, w, f = split_cost(args)
    print(f"one process, per micro-batch of {args.batch_size // 4}: forward {1000 * f:.1f} ms, one full backward "
          f"{1000 * full:.1f} ms; B {1000 * b:.1f} + W {1000 * w:.1f} = {1000 * (b + w):.1f} ms, "
          f"{(b + w) / full:.2f}x the full backward")


if __name__ == "__main__":
    main()
