"""
The pipeline bubble, measured: runs pipeline_parallel.py under torchrun for every
schedule at p stages and m micro-batches, and prints each stage's measured idle
fraction next to the formula (simulate() at unit costs: (p-1)/(m+p-1) for GPipe and
1F1B, (p-1)/(v·m+p-1) interleaved, (p-1)/(3m+p-1) ZB-H1, (p-1)/(6m+p-1) ZB-V), how busy
the ranks kept the cores, and the peak activation memory each stage held (the bytes
autograd saved for backward, summed over the micro-batches alive at once: GPipe holds m of
them, 1F1B at most p-stage). Then the step time, in one launch on p ranks where the steps
alternate between the schedules (below). Then, in one process, what the zero-bubble split
costs: per micro-batch, B + W (the input's gradient, then the weights' from the W store)
against one full backward.

    python bench/pipeline_parallel_bubble.py                          # p = 2 (m = 4), p = 4 (m = 8), 5 schedules
    python bench/pipeline_parallel_bubble.py --at 2x4 2x16 --iters 8 --schedules 1f1b zb zbv --cycles 12
    python bench/pipeline_parallel_bubble.py --model wide --batch_size 16 --schedules 1f1b zb zbv

--model wide (h = 512, 8 blocks) is the width where a CPU's backward is its matmuls, so
where W's dW = dYᵀx is moved work rather than added work (at tiny's h = 96 it is not).

ms/step: a machine shared with other work (or a VM) changes speed by 10-20% from one
minute, even one step, to the next, more than a schedule saves. So the steps are timed in
one launch per p, each schedule with its own stages, optimizer and executor (the pieces
and the training step of pipeline_parallel.py), one step of each in turn (a cycle), so a
drift moves them all alike; "vs 1f1b" is the median over the cycles of the step's ratio to
1F1B's step in the same cycle, "middle half" the 25th to 75th percentile of those ratios.
Idle = 1 - (time in forward and backward) / (first forward to last backward of the
step), averaged over the steps after the first two. "cores busy" is the ranks' CPU time
(every thread of each process) over the step's wall time times the cores they can use,
min(p, cores): a pipeline saves time by filling its bubble only while cores sit idle. On a
2-core CPU at p = 4, 1F1B already keeps the cores 0.86 (tiny) to 0.94 (wide) busy: a stage
that waits lends its core to one that works, so the bubble costs little time there and no
schedule can save much; a machine with a core (or GPU) per stage is where p = 4 means what
it says.
Data: a synthetic set with a 192-token vocabulary (with GPT-2's 50k vocabulary the head
would dwarf the tiny model's blocks and the last stage would be the bottleneck: an
imbalance, not the bubble).
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
from harness import spawn, torchrun  # noqa: E402
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
    return dict(idle=idle, theory=last["bubble_theory"],
                busy=statistics.median(sum(r["cpu_ms"]) / (cores * r["dt_ms"]) for r in steady),
                held=[int(h) for h in last["peak_micro"]], act_mb=[b / 2**20 for b in last["act_bytes"]]), None


def synthetic(args, m):
    """-> (the model's config, the micro-batch's sequences, batch(k): micro-batch k's inputs and
    targets), from random tokens: the speed does not depend on them."""
    import torch
    import model as M
    config = M.make_config(args.model, VOCAB, block_size=args.block_size)
    b = args.batch_size // m
    rows = torch.randint(0, VOCAB, (args.batch_size, args.block_size + 1), generator=torch.Generator().manual_seed(0))
    return config, b, lambda k: (rows[k * b:(k + 1) * b, :-1], rows[k * b:(k + 1) * b, 1:])


def alternating(rank, world, args, m):
    """ms/step, measured so that a noisy machine cannot pick the winner: each schedule gets its
    own stages, optimizer and executor on these ranks (pipeline_parallel.py's pieces, its
    training step), and the steps alternate between the schedules, one step each in turn (a
    cycle), so a drift of the machine's speed over seconds moves them all alike. A step is
    timed from a barrier to the last rank's end. -> {schedule: [seconds of each step]}."""
    import time
    import torch
    import collectives as C
    import pipeline_parallel as PP
    config, b, batch = synthetic(args, m)
    runs = {}
    for name in args.schedules:
        v = PP.virtual_stages(argparse.Namespace(schedule=name, virtual_stages=args.virtual_stages))
        stage = PP.Stage(config, rank, world, seed=0, n_virtual=v, schedule=name)
        optimizer = torch.optim.AdamW(stage.parameters(), lr=1e-4)
        executor = PP.Executor(stage, (b, args.block_size, config.n_embd), m)
        runs[name] = stage, optimizer, executor, PP.plan(name, world, m, rank, v)
    times = {name: [] for name in runs}
    for cycle in range(args.cycles + 2):  # two cycles warm up
        for name, (stage, optimizer, executor, plan) in runs.items():
            C.barrier()
            t0 = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            executor.run(plan, batch)
            PP.sum_tied_grads(stage)
            PP.clip_global_norm(stage, 1.0)
            optimizer.step()
            if cycle >= 2:
                times[name].append(time.perf_counter() - t0)
    for name, t in times.items():  # the step ends when its last rank does
        t = torch.tensor(t, dtype=torch.float64)
        C.all_reduce(t, op="max")
        times[name] = t.tolist()
    return times


def paired(times, name, base="1f1b"):
    """times: {schedule: [a step's seconds, a cycle each]} -> name's median step in ms, and the
    median and middle half (25th to 75th percentile) of its ratios to base's step of the same
    cycle (None without base)."""
    ms = 1000 * statistics.median(times[name])
    if base not in times:
        return ms, None, None
    ratios = [a / b for a, b in zip(times[name], times[base])]
    q = statistics.quantiles(ratios, n=4, method="inclusive") if len(ratios) > 1 else ratios * 3
    return ms, statistics.median(ratios), (q[0], q[2])


def split_cost(args, m=4):
    """One process, the whole model one stage, m micro-batches of the bench's batch: the
    seconds of one full backward (1F1B's B) and of ZB's B and W, per micro-batch, each the
    best of --cycles steps (the median over the micro-batches of the step)."""
    import torch
    import pipeline_parallel as PP
    torch.set_num_threads(1)  # as each rank of the runs above
    config, b, batch = synthetic(args, m)
    # a stage each: zb's executor swaps its stage's linears for DeferredLinear, which 1f1b's must not run
    stages = {name: PP.Stage(config, 0, 1, seed=0) for name in ("1f1b", "zb")}
    executors = {name: PP.Executor(stage, (b, args.block_size, config.n_embd), m) for name, stage in stages.items()}
    steps = {}  # (schedule, "F" | "B" | "W") -> [a step's median over its micro-batches], a round each
    for round_ in range(args.cycles + 1):  # round 0 warms up
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
    ap.add_argument("--schedules", nargs="+", default=["gpipe", "1f1b", "interleaved", "zb", "zbv"])
    ap.add_argument("--virtual_stages", type=int, default=2, help="interleaved's chunks a stage")
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--batch_size", type=int, default=32)
    ap.add_argument("--block_size", type=int, default=64)
    ap.add_argument("--iters", type=int, default=6, help="steps of each pipeline_parallel.py run (idle, memory)")
    ap.add_argument("--cycles", type=int, default=8, help="ms/step: cycles of one step of each schedule")
    ap.add_argument("--data_dir", default="", help="default: a synthetic set in a temporary folder")
    ap.add_argument("--timeout", type=int, default=300)
    args = ap.parse_args()
    at = [tuple(int(x) for x in pm.split("x")) for pm in args.at]
    with tempfile.TemporaryDirectory() as tmp:
        args.data_dir = args.data_dir or make_dataset(os.path.join(tmp, "data"))
        print(f"pipeline_parallel.py --model={args.model} --batch_size={args.batch_size} "
              f"--block_size={args.block_size}: idle and memory over iterations 2..{args.iters - 1} of a run each, "
              f"ms/step over {args.cycles} cycles of one step each; {os.cpu_count()} cores, load average "
              f"{os.getloadavg()[0]:.1f} at the start")
        # the ranks find the timer by its module's name: not __main__, which is theirs
        from pipeline_parallel_bubble import alternating as timer
        rows = []
        for p, m in at:
            runs = {name: run(name, p, m, args, tmp) for name in args.schedules}
            ok = [name for name, (_, err) in runs.items() if not err]
            args_ok = argparse.Namespace(**{**vars(args), "schedules": ok})
            times = spawn(timer, p, args_ok, m, timeout=args.timeout)[0] if ok else {}
            rows.append((p, m, runs, times))
        print(f"{'schedule':>11} {'p':>2} {'m':>3} {'idle per stage (measured)':>28} {'mean':>6} {'formula':>7} "
              f"{'cores busy':>10} {'ms/step':>8} {'vs 1f1b':>7} {'middle half':>11} {'micro-batches held':>19} "
              f"{'peak activations MB per stage':>30}")
        for p, m, runs, times in rows:
            for name, (res, err) in runs.items():
                if err:
                    print(f"{name:>11} {p:>2} {m:>3}  failed: {err}", flush=True)
                    continue
                ms, ratio, middle = paired(times, name)
                idle = " ".join(f"{f:.2f}" for f in res["idle"])
                held = " ".join(str(h) for h in res["held"])
                act = " ".join(f"{b:.1f}" for b in res["act_mb"])
                ratio, middle = ("-", "-") if ratio is None else (f"{ratio:.2f}", f"{middle[0]:.2f}-{middle[1]:.2f}")
                print(f"{name:>11} {p:>2} {m:>3} {idle:>28} {statistics.mean(res['idle']):>6.2f} "
                      f"{res['theory']:>7.2f} {res['busy']:>10.2f} {ms:>8.0f} {ratio:>7} {middle:>11} {held:>19} "
                      f"{act:>30}", flush=True)
    full, b, w, f = split_cost(args)
    print(f"one process, per micro-batch of {args.batch_size // 4}: forward {1000 * f:.1f} ms, one full backward "
          f"{1000 * full:.1f} ms; B {1000 * b:.1f} + W {1000 * w:.1f} = {1000 * (b + w):.1f} ms, "
          f"{(b + w) / full:.2f}x the full backward")
    for p, m in at:  # a ratio: the same at any micro-batch, were the costs proportional to its tokens
        ratios = on_paper(p, m, f, full, b, w)
        print(f"on paper at these costs, p = {p}, m = {m} (a stage 1/p of them, a ZB-V chunk half that, no messages): "
              + ", ".join(f"{name} {x:.2f}x" for name, x in ratios.items()) + " 1F1B's step")


def on_paper(p, m, f, full, b, w):
    """simulate() at measured costs, the whole model's per micro-batch -> {schedule: its step / 1F1B's}."""
    import pipeline_parallel as PP
    costs = {"1f1b": dict(F=f / p, B=full / p), "zb": dict(F=f / p, B=b / p, W=w / p),
             "zbv": dict(F=f / (2 * p), B=b / (2 * p), W=w / (2 * p))}
    span = {}
    for name, cost in costs.items():
        timelines = PP.simulate(name, p, m, cost=cost)
        span[name] = max(t[-1][2] for t in timelines) - min(t[0][1] for t in timelines)
    return {name: span[name] / span["1f1b"] for name in ("zb", "zbv")}


if __name__ == "__main__":
    main()
