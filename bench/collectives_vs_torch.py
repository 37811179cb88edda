"""
collectives.py's hand-written collectives against torch.distributed's own, in one run.

    torchrun --nproc_per_node=4 bench/collectives_vs_torch.py
    torchrun --nproc_per_node=4 bench/collectives_vs_torch.py --sizes=16M,64M --segment_bytes=1M
    torchrun --nproc_per_node=4 bench/collectives_vs_torch.py --backend=gloo   # CPU ranks on a GPU machine
    torchrun --nproc_per_node=2 bench/collectives_vs_torch.py --quick          # about a minute on 2 CPU cores

S is the whole buffer, as in nccl-tests. time: the median over --iters runs of the slowest
rank (a collective takes as long as its slowest rank), the best of --rounds rounds (ours
and the built-in alternate within each); ours/builtin is ours' time over the built-in's
(above 1: ours is slower), best over best, and
range the lowest and highest of the rounds' own ratios (the machine's noise). host us: the
Python (and adding) of one of ours with no wire, every message returning at once (the
issuing thread's CPU time per op, best of the rounds): what each op costs before a byte
moves, the whole cost on a GPU, where the wire takes tens of microseconds. algbw = S/time; busbw = algbw times
the op's factor from nccl-tests' PERFORMANCE.md (2(N-1)/N for all_reduce, (N-1)/N for
reduce_scatter, all_gather and all_to_all, 1 for broadcast and reduce), so that every op's
busbw can be held against the link's bandwidth. --small_all_reduce_bytes and the other
knobs override collectives.py's, to measure its choices.
"""
import argparse
import os
import statistics
import sys
import time
import warnings

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import collectives as C  # noqa: E402

OPS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast", "reduce", "scatter", "gather")
KNOBS = ("SMALL_ALL_REDUCE_BYTES", "LARGE_REDUCE_BYTES", "PAIR_EXCHANGE_BYTES", "SEGMENT_BYTES", "PIPELINE_DEPTH")


def _size(text):  # "64K" -> 65536; a bad value is argparse's one-line error, not a traceback
    t = text.strip().upper()
    scale = 1024 ** ("KMG".index(t[-1]) + 1) if t and t[-1] in "KMG" else 1
    try:
        b = int(float(t[:-1] if scale > 1 else t) * scale)
    except (ValueError, OverflowError):
        b = -1
    if b < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (bytes, or with K, M or G: 4096, 64K, 1.5M)")
    return b


def _sizes(text):
    return [_size(s) for s in text.split(",")]


def _ops(text):
    ops = text.split(",")
    bad = [op for op in ops if op not in OPS]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown op {bad[0]!r}: choose from {','.join(OPS)}")
    return ops


def _count(text):
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of at least 1")
    return int(text)


def _size_name(b):  # 65536 -> "64K"
    for unit, shift in (("G", 30), ("M", 20), ("K", 10)):
        if b >= 1 << shift and b % (1 << shift) == 0:
            return f"{b >> shift}{unit}"
    return str(b)


def _cases(op, S, n, rank, device):
    """-> (ours, built-in, busbw factor) for S bytes; S is the whole buffer, as in nccl-tests."""
    full = torch.randn(max(n, S // 4 // n * n), device=device)
    part, out, ring = torch.randn(full.numel() // n, device=device), torch.empty_like(full), (n - 1) / n
    pieces = list(full.chunk(n)) if rank == 0 else None
    return {"all_reduce": (lambda: C.all_reduce(full), lambda: dist.all_reduce(full), 2 * ring),
            "reduce_scatter": (lambda: C.reduce_scatter(part, full),
                               lambda: dist.reduce_scatter_tensor(part, full), ring),
            "all_gather": (lambda: C.all_gather(full, part), lambda: dist.all_gather_into_tensor(full, part), ring),
            "all_to_all": (lambda: C.all_to_all(out, full), lambda: dist.all_to_all_single(out, full), ring),
            "broadcast": (lambda: C.broadcast(full, 0), lambda: dist.broadcast(full, 0), 1.0),
            "reduce": (lambda: C.reduce(full, 0), lambda: dist.reduce(full, 0), 1.0),
            "scatter": (lambda: C.scatter(part, full, 0), lambda: dist.scatter(part, pieces, src=0), ring),
            "gather": (lambda: C.gather(full, part, 0), lambda: dist.gather(part, pieces, dst=0), ring)}[op]


def _round(fns, iters, sync, device):
    """-> {name: median seconds of the slowest rank} over `iters` runs of each, alternating."""
    times = {name: [] for name in fns}
    for _ in range(iters):  # alternate the two, so drift in the machine's load hits both
        for name, fn in fns.items():
            C.barrier()
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            times[name].append(time.perf_counter() - t0)
    med = {}
    for name, ts in times.items():
        t = torch.tensor(ts, dtype=torch.float64, device=device)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a collective takes as long as its slowest rank
        med[name] = statistics.median(t.tolist())
    return med


def host_us(fn, iters, rounds, sync):
    """Microseconds of the issuing thread's CPU per call of fn with no wire: each message is
    counted and returns at once (collectives' dry run, what --collectives=torch counts bytes
    with). The scratch it receives into holds garbage, so denormals are flushed, or adding them
    would be timed. The flight record's entry (~1 us) is left out with the wire."""
    torch.set_flush_denormal(True)
    best = float("inf")
    try:
        for _ in range(rounds):
            C._running.dry = 0
            t0 = time.thread_time()
            for _ in range(iters):
                fn()
            sync()
            best = min(best, (time.thread_time() - t0) / iters)
    finally:
        C._running.dry = None
        torch.set_flush_denormal(False)
    return best * 1e6


def main(argv=None):
    p = argparse.ArgumentParser(prog="collectives_vs_torch.py",
                                description="hand-written collectives against torch.distributed's own")
    p.add_argument("--sizes", type=_sizes, default="4,4K,295K,4M,64M")
    p.add_argument("--max_size", type=_size, default="64M")
    p.add_argument("--iters", type=_count, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--ops", type=_ops, default=",".join(OPS))
    p.add_argument("--backend", choices=("auto", "gloo"), default="auto",
                   help="auto: NCCL on GPUs, else gloo; gloo: CPU ranks even on a GPU machine")
    for knob in KNOBS:  # --segment_bytes=4M and so on, to measure the choices in collectives.py
        p.add_argument("--" + knob.lower(), type=_count if knob == "PIPELINE_DEPTH" else _size,
                       default=getattr(C, knob))
    p.add_argument("--rounds", type=_count, default=3)
    p.add_argument("--quick", action="store_true",
                   help="all_reduce, reduce_scatter and all_gather at 4K, 295K (a tensor-parallel activation) and 4M")
    args = p.parse_args(argv)  # before any process group: a bad flag fails every rank at once
    if args.quick:
        args.ops, args.sizes, args.iters = ["all_reduce", "reduce_scatter", "all_gather"], _sizes("4K,295K,4M"), 20
    for knob in KNOBS:
        setattr(C, knob, getattr(args, knob.lower()))
    warnings.filterwarnings("ignore", category=FutureWarning)  # all_gather_into_tensor & co. on torch >= 2.12
    rank, n, _, device = C.init_distributed(backend=None if args.backend == "auto" else args.backend)
    grouped = dist.is_available() and dist.is_initialized()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    if rank == 0:
        print(f"{n} ranks, {dist.get_backend() if grouped else 'no group'} on {device}; "
              + ", ".join(f"{k.lower()}={getattr(C, k)}" for k in KNOBS))
        print(f"time: median over {args.iters} runs of the slowest rank, best of {args.rounds} rounds; algbw = "
              "S/time, busbw = algbw * nccl-tests' factor, in GB/s; host us: ours with no wire")
        print(f"{'op':<15}{'size':>5} |{'ours ms':>10}{'algbw':>8}{'busbw':>8} |{'builtin ms':>11}{'algbw':>8}"
              f"{'busbw':>8} |{'ours/builtin':>13}{'range':>12}|{'host us':>8}")
    for op in args.ops:
        for S in [s for s in args.sizes if s <= args.max_size]:
            ours, builtin, factor = _cases(op, S, n, rank, device)
            fns = {"ours": ours, "builtin": builtin}
            try:
                for _ in range(args.warmup):
                    builtin()
            except (RuntimeError, ValueError):  # a built-in this backend lacks: n/a
                del fns["builtin"]
            for _ in range(args.warmup):
                ours()
            best, ratios = {}, []
            for _ in range(args.rounds):
                med = _round(fns, args.iters, sync, device)
                best = {k: min(best.get(k, v), v) for k, v in med.items()}
                if len(med) == 2:
                    ratios.append(med["ours"] / med["builtin"])
            host = host_us(ours, args.iters, args.rounds, sync)
            if rank == 0:
                cols = [f"{best[k] * 1e3:>{w}.3f}{S / best[k] / 1e9:>8.3f}{S / best[k] / 1e9 * factor:>8.3f}"
                        if k in best else f"{'n/a':>{w + 16}}" for k, w in (("ours", 10), ("builtin", 11))]
                ratio = f"{best['ours'] / best['builtin']:>13.2f}{min(ratios):>6.2f}-{max(ratios):<5.2f}" \
                    if ratios else f"{'n/a':>13}{'':12}"
                print(f"{op:<15}{_size_name(S):>5} |{cols[0]} |{cols[1]} |{ratio}|{host:>8.0f}", flush=True)
    C.shutdown()


if __name__ == "__main__":
    main()
