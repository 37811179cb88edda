"""
Which (dp, tp, pp)? For a model and a cluster, every factorization of the GPU count,
with its memory per GPU and its step time predicted from first principles; what does
not fit is marked, the rest ranked.

    python bench/plan_3d.py --model gpt2-xl --gpus 64
    python bench/plan_3d.py --model 70b --gpus 1024 --batch 1024 --recompute selective
    python bench/plan_3d.py --model 70b --gpus 64 --gpus_per_node 8 --intra_bw 450e9 --inter_bw 50e9 --mem 80e9

The model (the README's "The numbers behind the strategies"):
  memory   16 bytes a parameter (mixed-precision Adam: 2 weight + 2 gradient + 12
           fp32 master and moments; ZeRO, Rajbhandari et al. 2020, table 1), for the
           parameters a rank of the stage holds (parallel_3d.stage_params: 1/tp of the
           matrices, the small replicas whole, the tied copy on the last stage);
           activations s·b·h·(34 + 5·a·s/h)/tp bytes per layer with sequence parallelism
           (Korthikanti et al. 2022; --recompute=selective drops the 5·a·s/h attention
           scores, as selective recomputation or flash attention do), times the layers of
           the stage, times the micro-batches it holds (1F1B: p - stage; GPipe: m), plus
           the last stage's b·s·V/tp logits (bf16, and the float32 copy the loss takes).
  traffic  parallel_3d.axis_messages: the very messages parallel_3d.py sends (the tests
           hold its byte count to the measured bytes at 8 ranks, for every factorization
           of 8), each timed in the alpha-beta model on the link its axis gets: a ring
           all-reduce 2(N-1)·(α + S/(N·β)) (a tree, 2·⌈log2 N⌉·(α + S/β), under 64 KB as
           collectives.py does), a message α + S/β. The mesh puts tp innermost: inside a
           node when tp <= GPUs per node; dp next: inside a node when tp·dp fits in one;
           pp across nodes unless the whole job fits in one.
  time     compute at a stated MFU of the dense peak: (6N + 12·L·h·s) FLOPs a token
           (PaLM, appendix B); a stage's share of one micro-batch takes t_c. Each pipeline
           slot is t_c plus the slot's tp all-reduces (on the critical path) plus its two
           boundary messages; a step is (m + p - 1) slots, so the bubble (p-1)/(m+p-1) is in
           it; then what of the dp all-reduce (in 25 MB buckets) outlasts the last
           micro-batch's backward (2/3 of t_c), and the tie's exchange.
It is a model: no kernel efficiency by size, no overlap of tp with compute, no
interleaved schedule, no contention between axes on a node's NICs. Compare its ranking,
not its seconds, with what a cluster measures.
"""
import argparse
import math
import os
import sys
from types import SimpleNamespace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import collectives as C  # noqa: E402
import model as M  # noqa: E402
import pipeline_parallel as PP  # noqa: E402
from parallel_3d import axis_messages, axis_bytes, stage_params  # noqa: E402,F401  (axis_bytes: the tests' entry)

MODELS = dict(M.PRESETS, **{
    # a 70B-class GPT (Llama-2-70B's depth, width and heads at 4k context); in this GPT's
    # shape (4h MLP, full multi-head attention, GPT-2's vocabulary) it has 65B parameters
    "70b": dict(n_layer=80, n_head=64, n_embd=8192, block_size=4096),
})
# 8 x H100 SXM 80 GB per node: NVLink 4 at 900 GB/s (450 each way), one 400 Gb/s
# InfiniBand NIC per GPU (50 GB/s each way), 989 TFLOP/s dense bf16
H100 = dict(gpus_per_node=8, intra_bw=450e9, intra_lat=3e-6, inter_bw=50e9, inter_lat=10e-6, mem=80e9,
            peak=989e12)


def factorizations(n):
    return [(dp, tp, n // (dp * tp)) for dp in range(1, n + 1) if n % dp == 0
            for tp in range(1, n // dp + 1) if (n // dp) % tp == 0]


def links(dp, tp, pp, cl):
    """(latency, bandwidth) each axis's groups get, on the mesh parallel_3d.py lays out."""
    intra, inter = (cl.intra_lat, cl.intra_bw), (cl.inter_lat, cl.inter_bw)
    g = cl.gpus_per_node
    return dict(tp=intra if tp <= g else inter, dp=intra if tp * dp <= g else inter,
                pp=intra if tp * dp * pp <= g else inter)


def op_time(op, n, nbytes, link, bucket=25 << 20):
    """One op of axis_messages on a group of n ranks, alpha-beta."""
    alpha, beta = link
    if op == "p2p":
        return alpha + nbytes / beta
    if op == "all_reduce" and nbytes < C.SMALL_ALL_REDUCE_BYTES:  # collectives.py's tree
        return 2 * math.ceil(math.log2(n)) * (alpha + nbytes / beta)
    buckets = max(1, math.ceil(nbytes / bucket)) if op == "all_reduce" else 1
    return 2 * (n - 1) * (buckets * alpha + nbytes / (n * beta))


def activation_bytes(config, cfg, tp, pp, stage):
    """Bytes of activations stage `stage` holds at its peak (see the docstring)."""
    s, h, a, b = config.block_size, config.n_embd, config.n_head, cfg.micro_batch
    m = cfg.batch_size // (cfg.dp * b)
    scores = 0 if cfg.recompute == "selective" else 5 * a * s / h
    per_layer = s * b * h * (34 + scores) / tp
    held = m if cfg.schedule == "gpipe" else min(pp - stage, m)
    logits = s * b * config.vocab_size / tp * (2 + 4) if stage == pp - 1 else 0
    return per_layer * len(PP.stage_layers(config.n_layer, pp, stage)) * held + logits


def evaluate(config, cl, args, dp, tp, pp):
    """-> a row of the table for (dp, tp, pp): with --micro_batch=0 the micro-batch size b
    (a power of two up to 16) that is fastest among those that fit; None if none can run."""
    if config.n_head % tp or config.vocab_size % tp or config.block_size % tp or pp > config.n_layer:
        return None
    sizes = [args.micro_batch] if args.micro_batch else [2**i for i in range(5)]
    rows = [evaluate_b(config, cl, args, dp, tp, pp, b) for b in sizes if args.batch % (dp * b) == 0]
    return min(rows, key=lambda r: (not r["fits"], r["step"] if r["fits"] else r["mem"]), default=None)


def evaluate_b(config, cl, args, dp, tp, pp, b):
    m = args.batch // (dp * b)
    cfg = SimpleNamespace(batch_size=args.batch, n_micro=m, dtype="bfloat16", sequence_parallel=True,
                          grad_clip=1.0, micro_batch=b, recompute=args.recompute, schedule=args.schedule, dp=dp)
    state = [16 * sum(stage_params(config, tp, pp, k)) for k in range(pp)]
    act = [activation_bytes(config, cfg, tp, pp, k) for k in range(pp)]
    mem = max(st + ac for st, ac in zip(state, act))
    worst = max(range(pp), key=lambda k: state[k] + act[k])
    # time: compute of one micro-batch's share of one stage, at the stated MFU
    flops = M.flops_per_token(config) * args.batch * config.block_size
    t_c = flops / (dp * m * tp * pp) / (cl.peak * args.mfu)
    link = links(dp, tp, pp, cl)
    per_stage = {(a, k): 0.0 for a in ("tp", "dp") for k in range(pp)}
    t_tie = t_pp_msg = 0.0
    for msg in axis_messages(config, cfg, dp, tp, pp):
        t = msg.count * op_time(msg.op, msg.n, msg.nbytes, link[msg.axis])
        if msg.axis != "pp":
            per_stage[msg.axis, msg.stage] += t
        elif msg.what == "activations":
            t_pp_msg = op_time(msg.op, msg.n, msg.nbytes, link["pp"])
        else:
            t_tie += t  # the tie's exchange and the norm, after the pipeline drains
    t_tp = max(per_stage["tp", k] for k in range(pp)) / m  # per slot
    t_slot = t_c + t_tp + 2 * t_pp_msg * (pp > 1)  # its activation out, its gradient back
    t_pipe = (m + pp - 1) * t_slot
    t_dp = max(per_stage["dp", k] for k in range(pp))
    t_dp_exposed = max(0.0, t_dp - 2 / 3 * t_c)
    step = t_pipe + t_dp_exposed + t_tie
    return dict(dp=dp, tp=tp, pp=pp, b=b, m=m, bubble=(pp - 1) / (m + pp - 1), state=state[worst], act=act[worst],
                mem=mem, fits=mem <= args.headroom * cl.mem, compute=m * t_c, tp_s=m * t_tp,
                pp_s=t_pipe - m * (t_c + t_tp), dp_s=t_dp_exposed + t_tie, step=step,
                mfu=flops / (step * dp * tp * pp * cl.peak), links=link)


def plan(config, cl, args):
    rows = [r for r in (evaluate(config, cl, args, *f) for f in factorizations(args.gpus)) if r]
    return sorted(rows, key=lambda r: (not r["fits"], r["step"]))


def show(rows, config, cl, args):
    kind = lambda link: "N" if link[1] == cl.intra_bw else "I"  # noqa: E731  NVLink, or InfiniBand
    print(f"{args.model}: {M.param_count(config) / 1e9:.2f}B parameters, {config.n_layer} layers, h={config.n_embd}, "
          f"{config.n_head} heads, s={config.block_size}; {args.gpus} GPUs ({cl.gpus_per_node} per node, "
          f"{cl.mem / 1e9:.0f} GB, NVLink {cl.intra_bw / 1e9:.0f} GB/s, IB {cl.inter_bw / 1e9:.0f} GB/s per GPU); "
          f"batch {args.batch} sequences, micro-batches of b = {args.micro_batch or 'the best of 1..16'}, "
          f"{args.schedule}, compute at {args.mfu:.0%} MFU, recompute {args.recompute}")
    print(f"{'rank':>4} {'dp':>4} {'tp':>3} {'pp':>3} {'b':>3} {'m':>5} {'bubble':>6} {'state GB':>8} {'act GB':>7} "
          f"{'mem GB':>7} {'links':>6} {'compute s':>9} {'tp s':>6} {'pp+bub s':>8} {'dp s':>6} {'step s':>7} "
          f"{'MFU':>5}")
    fit = [r for r in rows if r["fits"]]
    unfit = sorted((r for r in rows if not r["fits"]), key=lambda r: r["step"])
    for i, r in enumerate(fit[:args.top] + unfit[:args.top]):
        links = "/".join(kind(r["links"][a]) for a in ("tp", "dp", "pp"))
        print(f"{i + 1 if r['fits'] else '-':>4} {r['dp']:>4} {r['tp']:>3} {r['pp']:>3} {r['b']:>3} {r['m']:>5} "
              f"{r['bubble']:>6.1%} {r['state'] / 1e9:>8.1f} {r['act'] / 1e9:>7.1f} {r['mem'] / 1e9:>7.1f} "
              f"{links:>6} {r['compute']:>9.2f} {r['tp_s']:>6.2f} {r['pp_s']:>8.2f} {r['dp_s']:>6.2f} "
              f"{r['step']:>7.2f} {r['mfu']:>5.1%}" + ("" if r["fits"] else "  does not fit"))
    hidden = max(0, len(fit) - args.top) + max(0, len(unfit) - args.top)
    print(f"({len(fit)} layouts fit, {len(unfit)} do not{f'; {hidden} not shown' if hidden else ''}. links: tp/dp/pp "
          f"groups on NVLink (N) or InfiniBand (I); dp s: what of the dp all-reduce backward does not hide, and the "
          f"tie's exchange)")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt2-xl", choices=sorted(MODELS))
    ap.add_argument("--vocab", type=int, default=50257, help="padded to a multiple of 64, as model.py does")
    ap.add_argument("--gpus", type=int, default=64)
    ap.add_argument("--batch", type=int, default=512, help="global batch, sequences")
    ap.add_argument("--micro_batch", type=int, default=0, help="sequences per micro-batch (b); 0: the best of 1..16")
    ap.add_argument("--schedule", default="1f1b", choices=PP.SCHEDULES)
    ap.add_argument("--recompute", default="none", choices=["none", "selective"])
    ap.add_argument("--mfu", type=float, default=0.45, help="fraction of the peak the matmuls reach")
    ap.add_argument("--headroom", type=float, default=0.9, help="usable fraction of GPU memory")
    ap.add_argument("--top", type=int, default=8, help="fitting layouts to print (all that do not fit are)")
    for k, v in H100.items():
        ap.add_argument(f"--{k}", type=type(v), default=v)
    args = ap.parse_args(argv)
    config = M.GPTConfig(**MODELS[args.model], vocab_size=M.pad_vocab(args.vocab))
    cl = SimpleNamespace(**{k: getattr(args, k) for k in H100})
    rows = plan(config, cl, args)
    show(rows, config, cl, args)
    return rows


if __name__ == "__main__":
    main()
