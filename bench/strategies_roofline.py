"""
The roofline, measured: below how many tokens per rank does a DDP step wait for the wire (and
FSDP's; below what width, micro-batches, sequence tensor parallel, the pipeline, the ring)?
Predicted from this machine's measured compute rate and link, then found by running the scripts.

    python bench/strategies_roofline.py                 # ~100 s on an idle 2-core machine: measure, predict, sweep, print
    python bench/strategies_roofline.py --json out.json --svg out.svg
    python bench/strategies_roofline.py --gpus_only     # the H100/H200/B200 rows alone (a calculation, instant)

Overlapped DDP hides the gradient all-reduce behind backward, so a step is compute-bound
while the all-reduce takes less time than backward (the scaling book's condition):

    k·α + traffic/β  <  (4/6)·flops_per_token · x / F          x = tokens per rank

traffic = ddp.traffic_per_rank() (2(N-1)/N of the gradient bytes), k the buckets, 4/6 the
backward's share of the 6N FLOPs a token. Measured here, in one 2-rank launch:
  F      FLOP/s of one rank running the model's own forward and backward at each swept x,
         just before that x's runs, while the other rank does the same (both share the
         machine, as in training); the predicted x* is where the two sides cross, read as below
  α, β   collectives.py's all_reduce between the 2 ranks at a few sizes, t = α + traffic/β
  found  ddp.py --overlap=False at each x: its all-reduce time (the log's exposed_comm_ms:
         bucketed hides nothing) against its backward (the trace's "backward" span); the
         threshold is where the two cross (crossing(): backward fitted as a fixed cost plus a
         cost a token, since a CPU step pays per-op overhead at small x). --overlap=True at each
         x too, for the picture: step time split into compute and exposed communication.

fsdp.py (ZeRO-3) the same way, unless --no-fsdp: predicted from the same F, α, β and
fsdp.traffic_per_rank() against forward and backward, found with --prefetch=0 from its
trace (its collectives' time against the rest of the step).

Tensor parallel, the pipeline and context parallel the same way, in the same launch (--no-tp,
--no-pp, --no-cp skip them): each predicted from F, α, β and its file's traffic_per_rank (and
the pipeline's bubble) at every swept point (tp_costs, pp_costs, cp_costs), and found by
running the script there; both curves read by crossing_loglog:
  tp  tensor_parallel.py at each width per rank (presets of the bench's own, registered in the
      ranks: depth and heads fixed), its blocking all-reduces against forward and backward
      less them, from its trace; F the whole model's at that width and batch
  pp  pipeline_parallel.py --schedule=1f1b at m micro-batches of 1 sequence: the log's
      idle_frac (mean over the stages) against the busy share, communication-bound above 1/2
  cp  context_parallel.py --attention=ring at c positions a rank of 1 sequence: the ring's hops
      (their spans in the trace) against the attention they overlap ((N-1)/N of attn_ms)

The GPU rows apply the same threshold to data-sheet figures (plan_cluster.CLUSTERS) under the
scaling book's assumptions (bf16 gradients, α = 0, many ranks: x* = C/W) and under this
code's (float32 gradients, 2(N-1)/N).
"""
import argparse
import contextlib
import io
import json
import math
import multiprocessing as mp
import os
import socket
import statistics
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [ROOT, HERE]
import model as M  # noqa: E402

# The scaling book ("How to Scale Your Model", the GPU chapter), data parallelism on H100:
# compute-bound above C/W tokens per GPU, C = 990e12 bf16 FLOP/s, W = 450 GB/s of NVLink a GPU
# inside a node, 400 GB/s a node (8 x 400 Gb/s NICs) across nodes
PUBLISHED = {("H100", "node"): 2200, ("H100", "across"): 2475}


# ---------------------------------------------------------------------------------- the roofline
def fit_link(traffic, seconds):
    """Least squares t = α + traffic/β over the measured sizes -> (α seconds, β bytes/s)."""
    slope, alpha = np.polyfit(np.asarray(traffic, float), np.asarray(seconds, float), 1)
    return max(alpha, 0.0), 1.0 / max(slope, 1e-30)


def ddp_threshold(flops_per_token, comm_s, rate, bwd_share=4 / 6):
    """Tokens per rank at which backward takes as long as the all-reduce, at a constant rate F:
    x* = comm·F/(share·fpt)."""
    return comm_s * rate / (bwd_share * flops_per_token)


def gpu_dp_rows(clusters):
    """DP thresholds on data-sheet hardware: per GPU, inside a node (NVLink) and across (the
    node's NICs, which a hierarchical all-reduce shares among its GPUs: each GPU carries
    1/gpus_per_node of the cross-node bytes). A large model: α's share vanishes.
    book: bf16 gradients, ring traffic 2S, backward 4 FLOPs a parameter a token -> C/W
    code: ddp.py's float32 gradients and 2(N-1)/N (N = a node's GPUs; across, 2 nodes' worth)."""
    rows = []
    for gpu, cl in clusters.items():
        for where, bw, n in (("node", cl["nvlink_bw"], cl["gpus_per_node"]),
                             ("across", cl["ib_bw"] * cl["gpus_per_node"], 2 * cl["gpus_per_node"])):
            book = ddp_threshold(4, 2 * 2 / bw, cl["peak"], bwd_share=1)          # per parameter
            code = ddp_threshold(4, 2 * (n - 1) / n * 4 / bw, cl["peak"], bwd_share=1)
            rows.append(dict(gpu=gpu, where=where, peak=cl["peak"], bw=bw, book=book, code=code,
                             published=PUBLISHED.get((gpu, where))))
    return rows


def crossing(xs, comm, compute):
    """Where the step turns compute-bound as x grows, read from a sweep: compute(x) fitted as
    t0 + x/r (a fixed cost a step, per-op overhead, plus the per-token work; least squares on
    relative error, so the small x weigh as much as the large), the communication as its median
    (it does not depend on x), solved for t0 + x/r = comm -> (x*, how): how is "found" when
    x* lies within a factor of 2 of the swept range, "below" (compute-bound at every x swept)
    or "above" (communication-bound at every x swept)."""
    x, t = np.asarray(xs, float), np.asarray(compute, float)
    slope, t0 = np.polyfit(x, t, 1, w=1 / t)
    level = statistics.median(comm)
    if slope <= 0:
        return float(xs[-1]), "above" if level > t.max() else "below"
    found = (level - t0) / slope
    if found < xs[0] / 2:
        return float(xs[0]), "below"
    if found > 2 * xs[-1]:
        return float(xs[-1]), "above"
    return float(found), "found"


def crossing_loglog(xs, comm, compute):
    """Where a swept curve turns compute-bound as x grows, read off the points as measured
    (no model of either side): the first x beyond which every swept point has comm < compute,
    log(comm/compute) interpolated linearly in log x between the last communication-bound point
    and the next -> (x*, how): "found", "below" (compute-bound at every x swept) or "above"
    (communication-bound at the largest x swept). A noisy point that flips back to
    communication-bound moves the crossing past it: the threshold is where the step stays
    compute-bound, not where it first touches the line."""
    r = [math.log(max(a, 1e-12) / max(b, 1e-12)) for a, b in zip(comm, compute)]
    bound = [i for i, v in enumerate(r) if v >= 0]
    if not bound:
        return float(xs[0]), "below"
    i = bound[-1]
    if i == len(xs) - 1:
        return float(xs[-1]), "above"
    lo, hi = math.log(xs[i]), math.log(xs[i + 1])
    return float(math.exp(lo + (hi - lo) * r[i] / (r[i] - r[i + 1]))), "found"


# ------------------------------------------------------- tensor parallel, the pipeline, context parallel
# Each strategy's costs put its own traffic_per_rank (and the pipeline's bubble) against its
# compute at one rate F, with t = calls·α + bytes/β: costs(x) -> (communication s, compute s)
# at x, the quantity the strategy's threshold is in. The bench evaluates them at its swept
# points (with F measured there) and reads the crossing as it reads the measured one
# (crossing_loglog); the *_threshold functions solve the same costs for a constant F (the
# GPU rows).
def solve(gap, lo, hi):
    """The smallest integer x in [lo, hi] with gap(x) = communication - compute < 0, found by
    bisection (gap falls as x grows) -> x, or math.inf when communication wins even at hi."""
    if gap(hi) >= 0:
        return math.inf
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (mid + 1, hi) if gap(mid) >= 0 else (lo, mid)
    return lo


def gap(costs):
    """costs(x) -> (communication, compute)  ->  x -> communication - compute, for solve()."""
    def g(x):
        comm, compute = costs(x)
        return comm - compute
    return g


def tp_costs(config, n, rate, alpha, beta, rows, dtype="bfloat16"):
    """tensor_parallel.py's step at hidden width `width` per rank (n_embd = width·N; depth and
    block_size config's, `rows` sequences): its all-reduces, every one blocking (4 a layer of
    b·s·h, the head's, the embedding's, the loss's 3, the norm's: 4L + 6 calls), against the
    model's FLOPs split N ways. Both grow with b·s, so the batch matters only through α; the
    width decides: compute ~ h², the bytes ~ h."""
    import dataclasses
    import tensor_parallel
    cfg = argparse.Namespace(dtype=dtype, batch_size=rows, sequence_parallel=False, recompute="none")
    calls = 4 * config.n_layer + 6

    def costs(width):
        c = dataclasses.replace(config, n_embd=width * n, n_head=1)  # the FLOPs do not depend on the heads
        comm = calls * alpha + tensor_parallel.traffic_per_rank(c, cfg, n) / beta
        return comm, M.flops_per_token(c) * rows * c.block_size / (n * rate)
    return costs


def tp_threshold(config, n, rate, alpha, beta, rows, dtype="bfloat16"):
    """Hidden width per rank (n_embd/N) above which tensor_parallel.py's step is compute-bound."""
    return solve(gap(tp_costs(config, n, rate, alpha, beta, rows, dtype)), 1, 1 << 20)


def pp_costs(config, p, rate, alpha, beta, rows, schedule="1f1b"):
    """pipeline_parallel.py's step at m micro-batches of `rows` sequences -> (idle s, compute s)
    of a stage: step = (compute + messages)/(1 - bubble), with the messages its traffic_per_rank
    (the boundaries' activations and gradients, 2 sends a micro-batch, the tied matrix's
    gradient) on the critical path, idle = step - compute. Communication-bound while the idle
    share (bubble and messages) outlasts the compute, idle fraction > 1/2: the log's idle_frac,
    measured the same way (1 - a stage's busy time / the pipeline's span)."""
    import pipeline_parallel
    s = config.block_size

    def costs(m):
        cfg = argparse.Namespace(batch_size=m * rows, schedule=schedule, grad_clip=1.0, virtual_stages=1)
        compute = M.flops_per_token(config) * m * rows * s / (p * rate)
        comm = 2 * m * alpha + pipeline_parallel.traffic_per_rank(config, cfg, p) / beta
        return (compute + comm) / (1 - pipeline_parallel.bubble(schedule, p, m)) - compute, compute
    return costs


def pp_threshold(config, p, rate, alpha, beta, rows, schedule="1f1b"):
    """Micro-batches (of `rows` sequences each) from which pipeline_parallel.py's step is
    compute-bound. No message: m > p-1 for 1f1b."""
    return solve(gap(pp_costs(config, p, rate, alpha, beta, rows, schedule)), 1, 1 << 16)


def cp_costs(config, n, rate, alpha, beta, rows, dtype="bfloat16"):
    """context_parallel.py --method=ring at c positions per rank (block_size c·N, `rows`
    sequences) -> (the ring's hops s, the attention they overlap s): its K/V hops
    (traffic_per_rank less the gradients' all-reduce, 3 messages a layer a hop: K/V forward,
    again backward, dK/dV) against the blocks they overlap, N-1 of a rank's N a pass (one a
    hop), 4·b·c²·h FLOPs forward, 3x that with backward, half of it skipped by the causal mask
    (zigzag: the diagonal's half, half of every other block). Compute ~ c², a hop's bytes ~ c."""
    import dataclasses
    import context_parallel
    cfg = argparse.Namespace(batch_size=rows, dtype=dtype, method="ring", recompute="none")
    L, h = config.n_layer, config.n_embd

    def costs(c):
        cc = dataclasses.replace(config, block_size=c * n)
        ring = context_parallel.traffic_per_rank(cc, cfg, n) - 2 * (n - 1) / n * 4 * M.param_count(cc)
        return 3 * L * (n - 1) * alpha + ring / beta, L * (n - 1) * 6 * rows * c * c * h / rate
    return costs


def cp_threshold(config, n, rate, alpha, beta, rows, dtype="bfloat16"):
    """Sequence per rank (s/N) above which context_parallel.py's ring hides behind attention."""
    return solve(gap(cp_costs(config, n, rate, alpha, beta, rows, dtype)), 1, 1 << 24)


# A large model for the GPU rows: LLaMA-3-70B's width and depth, GPT-2's block (MLP 4h)
BIG = dict(n_layer=80, n_head=64, n_embd=8192, block_size=4096, vocab_size=128256)
# the scaling book: tensor parallelism inside an H100 node stays compute-bound to about 8-way
PUBLISHED_TP = {("H100", "node"): 8}


def gpu_other_rows(clusters, n=8):
    """tp, pp and cp thresholds on data-sheet hardware for BIG in bf16, N = n ranks inside a
    node (NVLink, NCCL's latencies) or one a node across n nodes (a GPU's NIC). tp also as the
    most ranks BIG's width allows (width/rank >= the threshold)."""
    import plan_cluster as P
    config = M.GPTConfig(**BIG)
    rows = []
    for gpu, cl in clusters.items():
        for where, bw, hop in (("node", cl["nvlink_bw"], P.LAT_NVLINK), ("across", cl["ib_bw"], P.LAT_IB)):
            ar, p2p = P.LAT_CALL + 2 * (n - 1) * hop, P.LAT_CALL + hop  # an all-reduce's α, a send's
            tp = tp_threshold(config, n, cl["peak"], ar, bw, 1)
            rows.append(dict(gpu=gpu, where=where, n=n, tp_width=tp,
                             tp_max=max(k for k in range(1, 1025) if config.n_embd / k >= tp_threshold(
                                 config, k, cl["peak"], ar, bw, 1)) if n > 1 else 1,
                             pp_micro=pp_threshold(config, n, cl["peak"], p2p, bw, 1),
                             cp_seq=cp_threshold(config, n, cl["peak"], p2p, bw, 1),
                             tp_published=PUBLISHED_TP.get((gpu, where))))
    return rows


# ---------------------------------------------------------------------------------- measuring
def _rank_main(rank, world, port, jobs, out):
    os.environ.update(CUDA_VISIBLE_DEVICES="", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    sys.path[:0] = [ROOT, HERE]
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)  # the ranks share the cores, as torchrun's OMP_NUM_THREADS=1 has them
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        out.put((rank, [globals()[fn](rank, world, *args) for fn, args in jobs]))
    except BaseException as e:  # noqa: BLE001 -- reported by the parent, with the rank
        out.put((rank, f"{type(e).__name__}: {e}"))
        raise


def launch(jobs, world=2, timeout=900):
    """Runs each (function name, args) on `world` fresh gloo ranks, in order -> rank 0's results."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, jobs, out)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        got = dict(out.get(timeout=timeout) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    for r, v in got.items():
        if isinstance(v, str):
            sys.exit(f"error: rank {r}: {v}")
    return got[0]


def job_compute(rank, world, preset, vocab, block, rows_list, reps):
    """Forward and backward of the whole model at each row count, both ranks at once -> per
    row count (tokens, forward s, backward s), the slower rank's median."""
    import torch
    import collectives as C
    config = M.make_config(preset, vocab, block)
    model = M.GPT(config, seed=0)
    res = []
    for rows in rows_list:
        idx = torch.randint(0, vocab, (rows, block))
        fw, bw = [], []
        for k in range(reps + 1):
            C.barrier()
            t0 = time.perf_counter()
            _, loss = model(idx, idx)
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            model.zero_grad(set_to_none=True)
            if k:  # the first is warm-up
                fw.append(t1 - t0)
                bw.append(t2 - t1)
        t = torch.tensor([statistics.median(fw), statistics.median(bw)], dtype=torch.float64)
        C.all_reduce(t, op="max")
        res.append((rows * block, *t.tolist()))
    return res


def job_link(rank, world, sizes, reps, burst=6):
    """collectives.py's all_reduce of each size (bytes, float32) -> median seconds a call, slower
    rank. Each round is `burst` calls back to back after a barrier, as a step's buckets follow
    one another (ddp.py's 6 on the tiny preset): a call timed alone after a barrier, both ranks
    idle, measured up to twice the time the same bytes take inside a step on this machine."""
    import torch
    import collectives as C
    res = []
    for size in sizes:
        buf = torch.ones(size // 4)
        ts = []
        for k in range(reps + 1):
            C.barrier()
            t0 = time.perf_counter()
            for _ in range(burst):
                C.all_reduce(buf, op="avg")
            if k:
                ts.append((time.perf_counter() - t0) / burst)
        t = torch.tensor([statistics.median(ts)], dtype=torch.float64)
        C.all_reduce(t, op="max")
        res.append((size, t.item()))
    return res


def job_main(rank, world, script, runs):
    """script.main(argv) for each argv, in these ranks -> rank 0's log records of each."""
    import importlib
    import collectives as C
    main = importlib.import_module(script).main
    out = []
    for argv in runs:
        C.barrier()
        with contextlib.redirect_stdout(io.StringIO()):  # the scripts' own lines: the bench prints its table
            out.append(main(argv))
    return out


def job_presets(rank, world, presets):
    """Registers the bench's own presets in this rank (tensor parallel's widths: model.py has no
    width flag, and a preset is what --model reads), for the jobs after it."""
    M.PRESETS.update(presets)


def trace_events(path):
    """A trace's complete events -> {(step, rank): [events]}."""
    per = {}
    for e in json.load(open(path))["traceEvents"]:
        if e.get("ph") == "X":
            per.setdefault((e["args"]["step"], e["pid"]), []).append(e)
    return per


def trace_blocking(path):
    """tensor_parallel.py's trace -> (communication s, compute s) a step: its all-reduces are
    blocking (each a "comm" span on the rank's main row, inside forward, backward or the
    optimizer), all of them exposed. The communication: call by call (every rank issues the
    same ones in the same order; the ranks share the machine's clock), from the moment the last
    rank arrived to the moment the last one left, summed: what the wire and the protocol cost,
    without the wait for a rank still computing (skew, not communication; the last to arrive
    alone would miss the reply the others were still waiting for). The compute: forward and
    backward less the all-reduces inside them, on the slower rank. Medians over the steps."""
    calls, compute = {}, {}
    for (step, rank), events in sorted(trace_events(path).items()):
        work = [(e["ts"], e["ts"] + e["dur"]) for e in events if e["name"] in ("forward", "backward")]
        mine = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e["cat"] == "comm")
        inside = sum(b - a for a, b in mine if any(lo <= a < hi for lo, hi in work))
        calls.setdefault(step, []).append(mine)
        compute.setdefault(step, []).append((sum(b - a for a, b in work) - inside) / 1e6)
    comm = [sum(max(0.0, max(b for _, b in call) - max(a for a, _ in call)) for call in zip(*ranks)) / 1e6
            for ranks in calls.values()]
    return statistics.median(comm), statistics.median(map(max, compute.values()))


def trace_named(path, prefix):
    """Median over the traced steps of the sum of the spans whose name starts with `prefix`, on
    the rank with the least (s): context_parallel.py's ring hops ("ring step"), each the
    transfer's time on the group's worker, whatever overlaps it."""
    per = {}
    for (step, rank), events in trace_events(path).items():
        per.setdefault(step, []).append(sum(e["dur"] for e in events if e["name"].startswith(prefix)) / 1e6)
    return statistics.median(map(min, per.values()))


def trace_comm_compute(path):
    """fsdp.py --prefetch=0's trace -> (communication s, compute s) a step: the communication the
    sum of its collectives' spans on the rank that waited least (min: the others' extra wait is
    skew), the compute the step less its waits and the optimizer on the slower rank; medians."""
    per = {}
    for e in json.load(open(path))["traceEvents"]:
        if e.get("ph") == "X":
            d = per.setdefault((e["args"]["step"], e["pid"]), dict(comm=0.0, wait=0.0, step=0.0, optimizer=0.0))
            key = e["cat"] if e["cat"] in ("comm", "wait", "step") else e["name"]
            if key in d:
                d[key] += e["dur"] / 1e6
    steps = sorted({s for s, _ in per})
    comm = statistics.median(min(d["comm"] for (s, _), d in per.items() if s == st) for st in steps)
    compute = statistics.median(max(d["step"] - d["wait"] - d["optimizer"] for (s, _), d in per.items() if s == st)
                                for st in steps)
    return comm, compute


def trace_span(path, name, skip=0):
    """Median over the traced steps of the slowest rank's total time in spans called `name` (s)."""
    per = {}
    for e in json.load(open(path))["traceEvents"]:
        if e.get("name") == name and e.get("ph") == "X" and e["args"]["step"] >= skip:
            key = (e["args"]["step"], e["pid"])
            per[key] = per.get(key, 0) + e["dur"] / 1e6
    steps = sorted({s for s, _ in per})
    return statistics.median(max(v for (s, _), v in per.items() if s == st) for st in steps)


def synthetic_data(folder, vocab, n=200_000):
    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        rng.integers(0, vocab, n, dtype=np.uint16).tofile(os.path.join(folder, f"{split}.bin"))
    json.dump(dict(vocab_size=vocab), open(os.path.join(folder, "meta.json"), "w"))


def tp_preset(args, width):
    """The tensor-parallel sweep's model at `width` per rank: depth and heads fixed, so only the
    width changes (heads divide by the ranks, the width by the heads)."""
    return f"roofline_h{width * args.world}", dict(n_layer=args.tp_layers, n_head=args.tp_heads,
                                                   n_embd=width * args.world, block_size=args.block)


def measure(args, tmp):
    data = os.path.join(tmp, "data")
    os.makedirs(data)
    synthetic_data(data, args.vocab)
    common = [f"--model={args.model}", f"--block_size={args.block}", f"--data_dir={data}",
              f"--max_iters={args.iters}", "--eval_interval=0", "--log_interval=0", "--dtype=float32"]
    traced = f"--trace_steps=1-{args.iters - 1}"  # iteration 0 is warm-up
    mib = 1 << 20
    sizes = [mib // 4, mib // 2, mib, 2 * mib, 4 * mib]  # around ddp.py's buckets (--bucket_mb)
    # Every job runs in the one launch of 2 ranks, in order; keys name their results.
    # Each x's compute rate is measured just before its ddp.py runs: on a shared machine the load
    # drifts over minutes, and a rate taken once at the start would predict for another machine
    keys, jobs = [], []

    def add(key, fn, *a):
        keys.append(key)
        jobs.append((fn, a))
    add("link", "job_link", sizes, args.reps)
    for rows in args.rows:
        b = rows * args.world
        add(("rate", rows), "job_compute", args.model, args.vocab, args.block, [rows], args.reps)
        add(("ddp", rows), "job_main", "ddp", [
            common + [f"--bucket_mb={args.bucket_mb}", f"--batch_size={b}", "--mode=bucketed",
                      f"--trace={tmp}/b{rows}.json", traced],
            common + [f"--bucket_mb={args.bucket_mb}", f"--batch_size={b}", "--mode=overlap"]])
        if args.fsdp:  # ZeRO-3 with nothing prefetched: every gather waited for, its time in the trace
            add(("fsdp", rows), "job_main", "fsdp", [common + [f"--batch_size={b}", "--prefetch=0",
                                                               f"--trace={tmp}/f{rows}.json", traced]])
    if args.tp:  # the whole batch on every rank; the rate of the whole model at that width just before
        presets = dict(tp_preset(args, w) for w in args.tp_widths)
        M.PRESETS.update(presets)  # here too: the predictions read the same configs
        add("presets", "job_presets", presets)
        for w in args.tp_widths:
            name = tp_preset(args, w)[0]
            add(("tp_rate", w), "job_compute", name, args.vocab, args.block, [args.tp_rows], args.reps)
            add(("tp", w), "job_main", "tensor_parallel", [common[1:] + [
                f"--model={name}", f"--batch_size={args.tp_rows}", f"--trace={tmp}/t{w}.json", traced]])
    if args.pp:  # p = the ranks, micro-batches of one sequence
        add("pp", "job_main", "pipeline_parallel", [common + [f"--n_micro={m}", f"--batch_size={m}", "--schedule=1f1b"]
                                                    for m in args.pp_micro])
    if args.cp:  # one sequence of c a rank, the ring's hops traced
        add("cp", "job_main", "context_parallel", [
            [a for a in common if "block_size" not in a] + [f"--block_size={c * args.world}", "--batch_size=1",
                                                            "--method=ring", f"--trace={tmp}/c{c}.json", traced]
            for c in args.cp_seq])
    t0 = time.time()
    got = dict(zip(keys, launch(jobs, args.world)))
    took = time.time() - t0

    def med(recs, key, pick=max):
        return statistics.median(pick(r[key]) if isinstance(r[key], list) else r[key] for r in recs[1:]) / 1000
    compute = [c for rows in args.rows for c in got[("rate", rows)]]
    sweep = []
    for rows in args.rows:
        bucketed, overlap = got[("ddp", rows)]
        # the all-reduce's time is the rank that arrived last's wait (min over ranks): the others
        # also wait for it to finish its backward, which is skew between the ranks, not the wire
        sweep.append(dict(tokens=rows * args.block, comm_s=med(bucketed, "exposed_comm_ms", min),
                          backward_s=trace_span(f"{tmp}/b{rows}.json", "backward"),
                          step_s=med(overlap, "dt_ms"), exposed_s=med(overlap, "exposed_comm_ms"),
                          bucketed_step_s=med(bucketed, "dt_ms")))
        if args.fsdp:
            sweep[-1]["fsdp_comm_s"], sweep[-1]["fsdp_compute_s"] = trace_comm_compute(f"{tmp}/f{rows}.json")
    other = {}
    if args.tp:
        other["tp"] = []
        for w in args.tp_widths:
            (x, f, b), = got[("tp_rate", w)]
            comm, comp = trace_blocking(f"{tmp}/t{w}.json")
            other["tp"].append(dict(x=w, rate=M.flops_per_token(M.make_config(tp_preset(args, w)[0], args.vocab))
                                    * x / (f + b), comm_s=comm, compute_s=comp))
    if args.pp:
        # the pipeline's idle share, mean over the stages: (idle, busy) as fractions of the step
        other["pp"] = []
        for m, log in zip(args.pp_micro, got["pp"]):
            idle = statistics.median(statistics.mean(r["idle_frac"]) for r in log[1:])
            other["pp"].append(dict(x=m, comm_s=idle, compute_s=1 - idle, step_s=med(log, "dt_ms")))
    if args.cp:
        # the hops against the attention they overlap: N-1 of each pass's N blocks (zigzag: all
        # the same size), (N-1)/N of the log's attn_ms -- what cp_costs computes, read off the run
        other["cp"] = []
        for c, log in zip(args.cp_seq, got["cp"]):
            other["cp"].append(dict(x=c, comm_s=trace_named(f"{tmp}/c{c}.json", "ring step"),
                                    compute_s=(args.world - 1) / args.world * med(log, "attn_ms"),
                                    wait_s=med(log, "attn_wait_ms"), step_s=med(log, "dt_ms")))
    return compute, got["link"], sweep, other, took


# ---------------------------------------------------------------------------------- reporting
def picture(path, sweep, predicted, found):
    """The sweep as an SVG, written by hand (no plotting dependency): at each x the overlap
    run's step, compute below and exposed communication above; the bucketed run's all-reduce
    and backward as lines; the predicted and found thresholds as dashed verticals."""
    W, H, L, B = 640, 360, 60, 50  # canvas, left and bottom margins
    xs = [s["tokens"] for s in sweep]
    top = 1000 * max(max(s["step_s"], s["comm_s"], s["backward_s"]) for s in sweep) * 1.1
    lx = lambda x: L + (W - L - 20) * (math.log(x / xs[0]) / math.log(xs[-1] / xs[0]))  # noqa: E731
    ly = lambda ms: H - B - (H - B - 30) * ms / top  # noqa: E731
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="11">',
           f'<text x="{L}" y="16">ddp.py, 2 CPU ranks: step time against tokens per rank (ms)</text>',
           f'<line x1="{L}" y1="{H - B}" x2="{W - 10}" y2="{H - B}" stroke="black"/>',
           f'<line x1="{L}" y1="{H - B}" x2="{L}" y2="24" stroke="black"/>']
    for s in sweep:
        x, comp, exp_ = lx(s["tokens"]), 1000 * (s["step_s"] - s["exposed_s"]), 1000 * s["exposed_s"]
        out += [f'<rect x="{x - 9:.1f}" y="{ly(comp):.1f}" width="18" height="{ly(0) - ly(comp):.1f}" fill="#4c72b0"/>',
                f'<rect x="{x - 9:.1f}" y="{ly(comp + exp_):.1f}" width="18" height="{ly(comp) - ly(comp + exp_):.1f}" '
                'fill="#dd8452"/>', f'<text x="{x:.1f}" y="{H - B + 15}" text-anchor="middle">{s["tokens"]}</text>']
    for key, color in (("comm_s", "black"), ("backward_s", "green")):
        pts = " ".join(f"{lx(s['tokens']):.1f},{ly(1000 * s[key]):.1f}" for s in sweep)
        out.append(f'<polyline points="{pts}" fill="none" stroke="{color}" stroke-width="2"/>')
    for x, dash, name in ((predicted, "6,3", "predicted"), (found, "2,2", "found")):
        if x:
            out += [f'<line x1="{lx(x):.1f}" y1="{H - B}" x2="{lx(x):.1f}" y2="28" stroke="red" stroke-dasharray="{dash}"/>',
                    f'<text x="{lx(x) + 3:.1f}" y="{40 if name == "found" else 54}" fill="red">{name} {x:.0f}</text>']
    for ms in (0, top / 2.2, top / 1.1):
        out.append(f'<text x="{L - 5}" y="{ly(ms) + 4:.1f}" text-anchor="end">{ms:.0f}</text>')
    legend = (("#4c72b0", "compute (overlap)"), ("#dd8452", "exposed comm (overlap)"), ("black", "all-reduce (bucketed)"),
              ("green", "backward (bucketed)"))
    for k, (color, text) in enumerate(legend):
        out += [f'<rect x="{L + 150 * k}" y="{H - 18}" width="10" height="10" fill="{color}"/>',
                f'<text x="{L + 150 * k + 14}" y="{H - 9}">{text}</text>']
    with open(path, "w") as f:
        f.write("\n".join(out + ["</svg>"]) + "\n")
    print(f"picture: {path}")


def shown(x, how):
    """A threshold as the table prints it: the crossing, or past which end of the sweep it lies."""
    x = f"{x:,.0f}" if x >= 10 else f"{x:.1f}"
    return {"found": x, "below": f"< {x}", "above": f"> {x}"}[how]


def swept_others(args, other, config, rates, alpha, beta):
    """tp, pp and cp's rows of the table, and each sweep point by point: predicted from their costs
    at each swept point and read as the measured curves are (crossing_loglog), one definition on
    both sides; α an all-reduce's, half of it a send's (2 ring steps at 2 ranks); F the rate
    measured at that point's tokens -> name -> thresholds and sweep, for --json."""
    def rate_at(x):  # F of the whole model at x tokens, read off the DDP sweep (log-log)
        return math.exp(np.interp(math.log(x), *np.log(np.array(rates)).T))
    specs = dict(
        tp=("width per rank", lambda r: tp_costs(M.make_config(tp_preset(args, r["x"])[0], args.vocab), args.world,
                                                r["rate"], alpha, beta, args.tp_rows, "float32")),
        pp=("micro-batches", lambda r: pp_costs(config, args.world, rate_at(args.block), alpha / 2, beta, 1)),
        cp=("sequence/rank", lambda r: cp_costs(config, args.world, rate_at(r["x"]), alpha / 2, beta, 1, "float32")))
    rows = {}
    for name, (quantity, costs) in specs.items():
        if name not in other:
            print(f"{name:>8} {quantity:>15} {'-':>10} {'not swept':>9} {'-':>6}")
            continue
        pts = other[name]
        for r in pts:
            r["pred_comm_s"], r["pred_compute_s"] = costs(r)(r["x"])
        xs = [r["x"] for r in pts]
        pred, pred_how = crossing_loglog(xs, [r["pred_comm_s"] for r in pts], [r["pred_compute_s"] for r in pts])
        meas, meas_how = crossing_loglog(xs, [r["comm_s"] for r in pts], [r["compute_s"] for r in pts])
        ratio = meas / pred if pred_how == meas_how == "found" else None
        rows[name] = dict(predicted=pred, predicted_how=pred_how, measured=meas, measured_how=meas_how,
                          ratio=ratio, sweep=pts)
        print(f"{name:>8} {quantity:>15} {shown(pred, pred_how):>10} {shown(meas, meas_how):>9} "
              f"{f'{ratio:.2f}' if ratio else '-':>6}")
    print(f"(tp: {args.tp_layers} layers, {args.tp_heads} heads, {args.tp_rows} x {args.block} tokens on every rank; "
          f"pp: --model={args.model}, 1f1b, micro-batches of 1 sequence; cp: --model={args.model}, ring, 1 sequence; "
          "all float32)")
    for name, unit, what in (("tp", "width/rank", ("all-reduces", "compute")), ("pp", "micro", ("idle", "busy")),
                             ("cp", "seq/rank", ("ring hops", "attn overlapped"))):
        if name not in rows:
            continue
        scale, fmt = (1, "{:>16.2f}") if name == "pp" else (1000, "{:>16.1f}")
        tail = "   (pp: fractions of the step; predicted idle = step less compute)" if name == "pp" else " (ms)"
        print(f"\n{name}: {unit:>10} {'pred ' + what[0]:>16} {'pred ' + what[1]:>16} "
              f"{'meas ' + what[0]:>16} {'meas ' + what[1]:>16}{tail}")
        for r in rows[name]["sweep"]:
            pc, pk = r["pred_comm_s"], r["pred_compute_s"]
            if name == "pp":  # the prediction as shares of its step, as the log's idle_frac
                pc, pk = pc / (pc + pk), pk / (pc + pk)
            print(f"    {r['x']:>10} " + " ".join(fmt.format(scale * v) for v in (pc, pk, r["comm_s"], r["compute_s"])))
    return rows


def print_gpu(rows):
    print("\nData parallelism on GPUs: compute-bound above x* tokens per GPU (same threshold, data-sheet C and W)")
    print(f"{'GPU':>5} {'link':>7} {'C TFLOP/s':>10} {'W GB/s':>7} {'book assumptions':>17} {'published':>10} "
          f"{'error':>6} {'ddp.py (fp32 grads)':>20}")
    for r in rows:
        pub = f"{r['published']:,}" if r["published"] else "-"
        err = f"{100 * (r['book'] / r['published'] - 1):+.0f}%" if r["published"] else ""
        print(f"{r['gpu']:>5} {r['where']:>7} {r['peak'] / 1e12:>10.0f} {r['bw'] / 1e9:>7.0f} {r['book']:>17,.0f} "
              f"{pub:>10} {err:>6} {r['code']:>20,.0f}")


def print_gpu_other(rows):
    c = M.GPTConfig(**BIG)
    print(f"\nTensor parallel, the pipeline, context parallel on GPUs: compute-bound above (bf16, peak C, "
          f"{c.n_layer} layers of h={c.n_embd}, s={c.block_size}; 8 ranks in a node, or 1 a node across 8)")
    print(f"{'GPU':>5} {'link':>7} {'tp width/rank':>14} {'tp ranks at h':>14} {'book':>5} "
          f"{'pp micro-batches':>17} {'cp seq/rank':>12}")
    for r in rows:
        fmt = lambda x: "never" if x == math.inf else f"{x:,}"  # noqa: E731
        print(f"{r['gpu']:>5} {r['where']:>7} {fmt(r['tp_width']):>14} {r['tp_max']:>14} {r['tp_published'] or '-':>5} "
              f"{fmt(r['pp_micro']):>17} {fmt(r['cp_seq']):>12}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny")
    p.add_argument("--block", type=int, default=16, help="tokens a sequence; the sweep varies the rows")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32], help="sequences per rank, swept")
    p.add_argument("--vocab", type=int, default=256, help="the synthetic data's vocabulary")
    p.add_argument("--bucket_mb", type=float, default=1.0)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--json", default="", help="write every number here")
    p.add_argument("--svg", default="", help="draw the sweep here")
    p.add_argument("--fsdp", action=argparse.BooleanOptionalAction, default=True,
                   help="sweep fsdp.py (ZeRO-3) too (--no-fsdp: DDP alone, a third faster)")
    for name, what in (("tp", "tensor_parallel.py over the width"), ("pp", "pipeline_parallel.py over the micro-batches"),
                       ("cp", "context_parallel.py --method=ring over the sequence")):
        p.add_argument(f"--{name}", action=argparse.BooleanOptionalAction, default=True, help=f"sweep {what}")
    p.add_argument("--tp_widths", type=int, nargs="+", default=[32, 64, 128, 256, 512],
                   help="hidden width per rank (n_embd / ranks), swept")
    p.add_argument("--tp_layers", type=int, default=4, help="the tensor-parallel sweep's depth, fixed")
    p.add_argument("--tp_heads", type=int, default=4, help="its heads, fixed (divisible by the ranks)")
    p.add_argument("--tp_rows", type=int, default=16, help="its batch: sequences of --block, on every rank")
    p.add_argument("--pp_micro", type=int, nargs="+", default=[1, 2, 4, 8], help="micro-batches of 1 sequence, swept")
    p.add_argument("--cp_seq", type=int, nargs="+", default=[16, 32, 64, 128, 256, 512, 1024],
                   help="positions per rank (block_size / ranks) of 1 sequence, swept")
    p.add_argument("--gpus_only", action="store_true")
    args = p.parse_args(argv)
    if args.iters < 3 or min(args.rows) < 1 or args.world < 2:
        sys.exit("error: --iters must be at least 3, --rows positive, --world at least 2")
    if args.tp and (args.tp_heads % args.world or any(w * args.world % args.tp_heads for w in args.tp_widths)):
        sys.exit(f"error: --tp_heads must divide by the {args.world} ranks, and every width x ranks by the heads")
    if args.cp and any(c % 2 or c < 2 for c in args.cp_seq):  # zigzag: two chunks a rank
        sys.exit("error: --cp_seq must be even (the zigzag layout gives each rank two chunks)")
    if args.pp and min(args.pp_micro) < 1:
        sys.exit("error: --pp_micro must be positive")
    import plan_cluster
    gpu = gpu_dp_rows(plan_cluster.CLUSTERS)
    result = dict(gpu=gpu)
    if not args.gpus_only:
        import ddp
        config = M.make_config(args.model, args.vocab, args.block)
        fpt = M.flops_per_token(config)
        with tempfile.TemporaryDirectory() as tmp:
            compute, link, sweep, other, took = measure(args, tmp)
        rates = [(x, fpt * x / (f + b)) for x, f, b in compute]
        alpha, beta = fit_link([2 * (args.world - 1) / args.world * s for s, _ in link], [t for _, t in link])
        cfg = argparse.Namespace(grad_accum=1)
        traffic = ddp.traffic_per_rank(config, cfg, args.world)
        buckets = math.ceil(4 * M.param_count(config) / (args.bucket_mb * 2**20))
        comm = buckets * alpha + traffic / beta
        # F is measured at each swept x: on a CPU the small shapes run far below the large ones'
        # rate (per-op overhead), so one F would put the crossing where no step runs at that rate
        xs = [s["tokens"] for s in sweep]
        predicted, predicted_how = crossing(xs, [comm] * len(xs), [(4 / 6) * fpt * x / f for x, f in rates])
        found, how = crossing(xs, [s["comm_s"] for s in sweep], [s["backward_s"] for s in sweep])
        print(f"measured on this machine ({args.world} CPU ranks over gloo, 1 thread each; {took:.0f} s), "
              f"--model={args.model} --block_size={args.block}, {M.param_count(config) / 1e6:.2f}M parameters")
        print("compute, FLOP/s a rank (forward+backward, both ranks at once): "
              + ", ".join(f"{x} tok {f / 1e9:.1f}G" for x, f in rates))
        print("all_reduce, 2 ranks: " + ", ".join(f"{s / 2**20:g} MiB {1000 * t:.1f} ms" for s, t in link)
              + f"  ->  alpha {1e6 * alpha:.0f} us, beta {beta / 1e9:.2f} GB/s")
        print(f"ddp: {traffic / 1e6:.2f} MB a rank a step in {buckets} buckets -> {1000 * comm:.1f} ms predicted "
              f"({1000 * statistics.median(s['comm_s'] for s in sweep):.1f} ms measured, median of the sweep)")
        print(f"\n{'tokens/rank':>11} {'all-reduce ms':>14} {'backward ms':>12} {'comm/bwd':>9} "
              f"{'overlap: step ms':>17} {'exposed ms':>11} {'bucketed step ms':>17}")
        for s in sweep:
            print(f"{s['tokens']:>11} {1000 * s['comm_s']:>14.1f} {1000 * s['backward_s']:>12.1f} "
                  f"{s['comm_s'] / s['backward_s']:>9.2f} {1000 * s['step_s']:>17.1f} {1000 * s['exposed_s']:>11.1f} "
                  f"{1000 * s['bucketed_step_s']:>17.1f}")
        ratio = found / predicted if how == predicted_how == "found" else None
        print(f"\n{'strategy':>8} {'quantity':>15} {'predicted':>10} {'measured':>9} {'ratio':>6}")
        print(f"{'ddp':>8} {'tokens per rank':>15} {shown(predicted, predicted_how):>10} {shown(found, how):>9} "
              f"{f'{ratio:.2f}' if ratio else '-':>6}")
        # ZeRO-3 (fsdp.py): each of the L+1 units all-gathered twice and reduce-scattered once a step,
        # which prefetching hides behind forward and backward both
        import fsdp
        fs_traffic = fsdp.traffic_per_rank(config, argparse.Namespace(dtype="float32", zero_stage=3, grad_accum=1,
                                                                      grad_clip=1.0), args.world)
        # α is an all-reduce's, 2(N-1) ring steps; an all-gather or a reduce-scatter takes N-1
        fs_comm = 3 * (config.n_layer + 1) * alpha / 2 + fs_traffic / beta
        fs_pred, fs_how = crossing(xs, [fs_comm] * len(xs), [fpt * x / f for x, f in rates])
        fs_found, fs_found_how, fs_ratio = None, None, None
        if args.fsdp:
            fs_found, fs_found_how = crossing(xs, [s["fsdp_comm_s"] for s in sweep], [s["fsdp_compute_s"] for s in sweep])
            fs_ratio = fs_found / fs_pred if fs_how == fs_found_how == "found" else None
        print(f"{'fsdp':>8} {'tokens per rank':>15} {shown(fs_pred, fs_how):>10} "
              f"{shown(fs_found, fs_found_how) if args.fsdp else 'not swept':>9} {f'{fs_ratio:.2f}' if fs_ratio else '-':>6}")
        other_rows = swept_others(args, other, config, rates, alpha, beta)
        result.update(model=args.model, block=args.block, world=args.world, params=M.param_count(config),
                      flops_per_token=fpt, compute=rates, link=link, alpha_s=alpha, beta_Bps=beta, seconds=took,
                      ddp=dict(traffic=traffic, buckets=buckets, comm_s=comm, predicted=predicted,
                               predicted_how=predicted_how, measured=found, measured_how=how, sweep=sweep),
                      fsdp=dict(traffic=fs_traffic, comm_s=fs_comm, predicted=fs_pred, predicted_how=fs_how,
                                measured=fs_found, measured_how=fs_found_how), **other_rows)
        if args.svg:
            picture(args.svg, sweep, predicted if predicted_how == "found" else None, found if how == "found" else None)
    print_gpu(gpu)
    other = gpu_other_rows(plan_cluster.CLUSTERS)
    result["gpu_other"] = [{k: (None if v == math.inf else v) for k, v in r.items()} for r in other]
    print_gpu_other(other)
    if args.json:
        json.dump(result, open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
