"""
Which layout? For a GPT and a cluster, every (dp, tp, pp, cp) of the GPU count, each with
the best of its options (ZeRO stage, recompute mode, pipeline schedule, micro-batch), its
memory per GPU and its step time predicted from first principles; what does not fit is
marked, the rest ranked. --check holds the model to published runs (bench/published_runs.json).

    python bench/plan_cluster.py --model gpt2-xl --gpus 64
    python bench/plan_cluster.py --n_layer 80 --n_embd 8192 --n_head 64 --seq 4096 --gpus 1024 --batch 1024
    python bench/plan_cluster.py --cluster A100 --precision megatron --zero 1 --recompute selective --json
    python bench/plan_cluster.py --check

The model:
  state    bytes a parameter (STATE): this code's float32 Adam (DDP 16; ZeRO-1 8 + 8/N; ZeRO-2 4 + 12/N;
           ZeRO-3 16/N), Megatron's bf16 weights with float32 main gradients and optimizer (18 replicated,
           6 + 12/d with its distributed optimizer: Megatron-LM docs/user-guide/features/dist_optimizer.md),
           or ZeRO's fp16 accounting (Rajbhandari et al. 2020, Table 1), for the parameters a rank of the
           stage holds (parallel_nd.stage_params: 1/tp of the matrices, the small replicas whole); N is the
           ZeRO group, dp_shard (HSDP's shard group; without HSDP all of dp), as parallel_nd.py shards: the
           cp ranks of a sequence hold the same parameters whole and all-reduce their gradients, as HSDP's
           replicas do (parallel_nd.state_per_rank, axis_messages). ZeRO-3 adds the stage's full
           weights at the step's peak: parallel_nd.py gathers each unit just before its first use in
           a step and frees it when the step ends (torchtitan's reshard_after_forward=False, what a
           pipeline's many micro-batches want), so between steps it holds 16/N, during one 4 + 16/N.
           (Without a pipeline and with one micro-batch parallel_nd.py frees each unit after its
           forward, as fsdp.py does: a unit's weights at the peak and a second all-gather. The
           planner still charges the pipelined way there: an overestimate of that case's memory.)
  act      Korthikanti et al. 2022, tp with sequence parallelism: s·b·h·(34 + 5·a·s/h)/t bytes a
           layer; selective recomputation (or flash attention) drops the 5·a·s/h of the scores; full
           recomputation keeps the 2·s·b·h/t input of each layer and one layer's working set. s is the
           sequence a cp rank holds. Times the micro-batches a stage holds: 1F1B and ZB-H1 p - stage,
           interleaved p + (p-1)/v (Korthikanti et al. 2022: 1 + (p-1)/(p·v) times 1F1B's), GPipe m;
           plus the last stage's logits. With --precision fp32 (this code) a layer is model.activation_bytes,
           the bytes the strategies' logs count (selective: its --recompute=gelu).
  compute  (6N + 12·L·h·s) FLOPs a token (model.flops_per_token), the recomputed forward's on top, at
           `eff` of the dense peak, plus each layer's HBM traffic (layer_hbm_bytes) at the data sheet's
           bandwidth, unoverlapped.
  links    every group of an axis on the mesh tp (innermost), cp, dp_shard, dp_replicate, pp (outermost,
           parallel_nd.py's order): on NVLink when it fits in a node, else InfiniBand (per GPU, its own NIC). A ring collective of S bytes on n ranks
           over k nodes costs L + (steps - inter)·a_nvl + inter·a_ib + steps/n · S/beta, steps = 2(n-1)
           for an all-reduce, n-1 for a reduce-scatter or all-gather, inter = 2(k-1) or k-1 of them
           crossing nodes: the latency is paid per ring step and per call (a ring pipelines its segments),
           as NCCL's tuning model charges it; a bucketed collective pays L and the steps once a bucket.
  time     a pipeline slot is the slowest stage's micro-batch (compute, its tp collectives unless
           overlapped with its GEMMs, its 2·v boundary messages); a step is (m + p - 1) slots for 1F1B and
           GPipe, (m + (p-1)/v) interleaved (Narayanan et al. 2021: bubble (p-1)/(v·m + p - 1)),
           (m + (p-1)/3) for ZB-H1 (Qi et al. 2023: bubble about (p-1)/(3m)); then what of the dp
           collectives (with the cp ranks' and HSDP replicas' gradient all-reduces) outlasts the compute
           it overlaps (the last micro-batch's backward for gradients, the first one's forward for the
           parameters' all-gather): once a step at every ZeRO stage, as parallel_nd.py sends them.
`eff` is the one fitted knob (--check fits it on one published table and predicts the others with it).
Not modelled: matmul efficiency by shard size (one eff for every GEMM), the optimizer step's own time,
contention between axes on a node's NICs, NVLink SHARP, kernel launch gaps. Compare rankings first.

What --check prints, for each published table (bench/published_runs.json, each row with its
source): per row, the published layout (dp, tp, pp) with its options where the source gives them
(micro-batch, interleaving, recompute mode; else the planner's best for that layout) and its
measured MFU (model FLOPs, no recomputation counted; Narayanan's teraFLOP/s, counted with their
eq. 3 which includes recomputation, converted); the planner's best layout and its MFU; the
published layout's rank in the planner's list and whether it is within 3% of the best step; its
predicted MFU and error; and "free:" the options the planner chooses itself for the published
layout (any v dividing a stage's layers, micro-batch 1 to 16), with their MFU and error. A summary
line per table (published layouts first, within 3%, median MFU error), and ZeRO's Table 1 (model
state per GPU) against the planner's state model. --fit_on TABLE fits eff on another table.
"""
import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
from types import SimpleNamespace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import collectives as C  # noqa: E402
import model as M  # noqa: E402
import pipeline_parallel as PP  # noqa: E402
from parallel_nd import Mesh, axis_messages, axis_bytes, stage_params, state_per_rank  # noqa: E402,F401  (the tests' entry)

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "published_runs.json")
MODELS = dict(M.PRESETS, **{
    # a 70B-class GPT (Llama-2-70B's depth, width and heads at 4k context); in this GPT's
    # shape (4h MLP, full multi-head attention, GPT-2's vocabulary) it has 65B parameters
    "70b": dict(n_layer=80, n_head=64, n_embd=8192, block_size=4096),
})
# Per GPU, each way. H100 SXM: 989 TFLOP/s dense bf16, NVLink 4 900 GB/s both ways (H100 data sheet);
# DGX H100: one 400 Gb/s ConnectX-7 NIC per GPU (DGX H100 data sheet). A100 SXM 80 GB: 312 TFLOP/s bf16,
# NVLink 3 600 GB/s both ways (A100 data sheet); Selene's nodes: eight 200 Gb/s HDR NICs (Narayanan et al.
# 2021, section 5). HBM: H100 SXM 3.35 TB/s, A100 80 GB SXM 2.039 TB/s (data sheets). Line rates: what NCCL
# reaches is somewhat less (no efficiency factor is applied).
CLUSTERS = {
    "H100": dict(gpus_per_node=8, nvlink_bw=450e9, ib_bw=50e9, mem=80e9, peak=989e12, hbm_bw=3.35e12),
    "A100": dict(gpus_per_node=8, nvlink_bw=300e9, ib_bw=25e9, mem=80e9, peak=312e12, hbm_bw=2.039e12),
    # H200: the H100's chip, NVLink 4 and DGX NICs (ConnectX-7, 400 Gb/s a GPU), with 141 GB of HBM3e at
    # 4.8 TB/s; B200 (DGX B200): NVLink 5, 900 GB/s a GPU each way, the same ConnectX-7 NICs, 180 GB at
    # 8 TB/s, 2.25 PFLOP/s dense bf16 (model.PEAK_FLOPS)
    "H200": dict(gpus_per_node=8, nvlink_bw=450e9, ib_bw=50e9, mem=141e9, peak=989e12, hbm_bw=4.8e12),
    "B200": dict(gpus_per_node=8, nvlink_bw=900e9, ib_bw=50e9, mem=180e9, peak=2250e12, hbm_bw=8e12),
}
# Latency, NCCL's own tuning model (NVIDIA/nccl@5067397c src/graph/tuning.cc, ring, Simple protocol):
# 8.4 µs a call, 3.4 µs a ring step on NVLink, 14 µs a step that crosses the network
LAT_CALL, LAT_NVLINK, LAT_IB = 8.4e-6, 3.4e-6, 14e-6
# bytes a parameter: (replicated, sharded over the ZeRO group of N), for ZeRO stage 0 (plain data parallel) to 3
STATE = {
    "fp32": {0: (16, 0), 1: (8, 8), 2: (4, 12), 3: (0, 16)},      # this code: weight 4, gradient 4, Adam m, v 8
    # bf16 weight 2, fp32 main gradient 4, fp32 copy, m, v 12: Megatron's table gives stages 0 and 1; 2 and 3
    # shard the same bytes further, as ZeRO does
    "megatron": {0: (18, 0), 1: (6, 12), 2: (2, 16), 3: (0, 18)},
    "zero": {0: (16, 0), 1: (4, 12), 2: (2, 14), 3: (0, 16)},      # fp16 weight 2, gradient 2, K = 12
}
WEIGHT_BYTES = dict(fp32=4, megatron=2, zero=2)  # what a ZeRO all-gather of parameters sends
GRAD_BYTES = dict(fp32=4, megatron=4, zero=2)    # what the gradient reduction sends
SCHEDULES = ("1f1b", "interleaved", "zb", "gpipe")
RECOMPUTE = ("none", "selective", "full")
# the one fitted knob: the fraction of the dense peak compute reaches, fitted by --check on Narayanan et al.
# 2021's Table 1 (fit_eff; tests/test_plan_cluster.py holds this constant to the fit)
EFF = 0.613
CODE_BUCKET = 25 << 20  # bytes: this code's DDP buckets (Megatron's are counted in elements, run["bucket_elems"])


def factorizations(n):
    return [(dp, tp, n // (dp * tp)) for dp in range(1, n + 1) if n % dp == 0
            for tp in range(1, n // dp + 1) if (n // dp) % tp == 0]


def state_bytes(precision, zero, n):
    """Model-state bytes a parameter on one rank of a ZeRO group of n."""
    rep, shard = STATE[precision][zero]
    return rep + shard / n


def rank_state(params, precision, zero, lay):
    """Model-state bytes on a rank holding `params` parameters of its stage in layout lay = (dp, tp,
    pp, cp, dp_shard): sharded over dp_shard alone, as parallel_nd.py shards (cp ranks are replicas)."""
    return params * state_bytes(precision, zero, lay[4])


def layer_activations(s, b, h, a, tp, recompute, flash=False, precision=None):
    """Bytes one layer keeps for its backward (Korthikanti et al. 2022: tp with sequence parallelism, and
    what selective and full recomputation keep). precision "fp32": this code's float32 layer as the
    strategies keep it (model.activation_bytes, sequence parallel; selective is its --recompute=gelu)."""
    if precision == "fp32":
        mode = "gelu" if recompute == "selective" else recompute
        shape = SimpleNamespace(n_embd=h, n_head=a, n_layer=1)
        return M.activation_bytes(shape, s * b, mode, tp, sp=tp > 1, dtype_bytes=4)
    if recompute == "full":
        return 2 * s * b * h / tp
    scores = 0 if recompute == "selective" or flash else 5 * a * s / h
    return s * b * h * (34 + scores) / tp


def held(schedule, p, m, v, stage):
    """Micro-batches of a whole stage's activations that `stage` holds at its peak."""
    if schedule == "gpipe":
        return m
    if schedule == "interleaved":
        return min(m, p + (p - 1) / v) if stage == 0 else min(m, p - stage + (p - 1) / v)
    return min(m, p - stage)


def pipeline_slots(schedule, p, m, v):
    """A step's length in slots (one micro-batch through one stage, forward and backward)."""
    return {"gpipe": m + p - 1, "1f1b": m + p - 1, "interleaved": m + (p - 1) / v, "zb": m + (p - 1) / 3}[schedule]


def span(n, stride, cl):
    """(nodes, bandwidth) of a group of n ranks `stride` apart, the mesh filling nodes in rank order."""
    per_node = max(1, min(n, cl.gpus_per_node // stride))
    nodes = math.ceil(n / per_node)
    return nodes, (cl.nvlink_bw if nodes == 1 else cl.ib_bw)


def coll_time(op, n, nbytes, link, calls=1):
    """A collective on n ranks (see the docstring); op: all_reduce, rs_ag (a reduce-scatter and an
    all-gather: an all-reduce's bytes and steps), reduce_scatter, all_gather, p2p."""
    nodes, beta = link
    if op == "p2p":
        return calls * ((LAT_IB if nodes > 1 else LAT_NVLINK) + nbytes / beta)
    if n == 1:
        return 0.0
    if op == "all_reduce" and nbytes < C.SMALL_ALL_REDUCE_BYTES:  # a tree, as collectives.py and NCCL do
        steps = 2 * math.ceil(math.log2(n))
        return calls * (LAT_CALL + steps * ((LAT_IB if nodes > 1 else LAT_NVLINK) + nbytes / beta))
    twice = op in ("all_reduce", "rs_ag")
    steps = (2 if twice else 1) * (n - 1)
    inter = (2 if twice else 1) * (nodes - 1)
    return calls * (LAT_CALL + (steps - inter) * LAT_NVLINK + inter * LAT_IB) + steps / n * nbytes / beta


def stage_flops(config, s, tp, cp, pp, stage, recompute):
    """(model, hardware) FLOPs a rank of `stage` does for one sequence of s tokens (the whole sequence:
    a cp rank's tokens attend to all of it): its layers' share of model.flops_per_token (6N + 12·L·h·s)
    and the head's 6·V·h on the last stage, over tp·cp; full recomputation repeats a layer's forward
    (2·12h² + 4·h·s a token), selective its attention (4·h·s)."""
    h, V, L = config.n_embd, config.vocab_size, config.n_layer
    head = 6 * V * h
    per_layer = (M.flops_per_token(config) - head) / L
    extra = {"none": 0, "selective": 4 * h * s, "full": 24 * h * h + 4 * h * s}[recompute]
    n = len(PP.stage_layers(L, pp, stage))
    model = n * per_layer + head * (stage == pp - 1)
    return model * s / (tp * cp), (model + n * extra) * s / (tp * cp)


def layer_hbm_bytes(s, b, h, tp, recompute="none"):
    """Bytes one layer moves through HBM for one micro-batch, forward and backward (an estimate): its
    four GEMMs read and write their three operands in bf16 once forward and twice backward (the input
    and the weight gradients), with sequence parallelism's gathered input whole on every rank; and the
    element-wise work (norms, GeLU, dropout, residuals, attention's inputs and outputs) writes the
    34·s·b·h/t bytes Korthikanti et al. count in the forward and reads them in the backward. Full
    recomputation runs the forward twice."""
    M_ = s * b
    gemms = [(h, 3 * h / tp), (h / tp, h), (h, 4 * h / tp), (4 * h / tp, h)]  # (K, N): qkv, proj, fc, proj
    passes = 4 if recompute == "full" else 3
    return (passes * sum(2 * (M_ * K + K * N + M_ * N) for K, N in gemms)
            + passes / 3 * 2 * 34 * s * b * h / tp)


def stage_costs(config, cl, run, lay, b):
    """What a layout costs at micro-batch b whatever the other options: per stage (the first, which holds
    the most layers and micro-batches, and the last, which has the head): its parameters, layers, the
    times of one micro-batch's compute (by recompute mode), tp collectives (the forward's again when
    fully recomputed), boundary message, and the dp collectives (by ZeRO stage)."""
    dp, tp, pp, cp, shard = lay
    h, V, L = config.n_embd, config.vocab_size, config.n_layer
    m, s = run.batch // (dp * b), config.block_size // cp
    local = dataclasses.replace(config, block_size=s)
    prec = run.precision
    act_bytes = 4 if prec == "fp32" else 2
    repl = dp // shard  # ZeRO shards over the dp_shard group alone; cp ranks and HSDP's replicas all-reduce
    # links: strides on the mesh tp, cp, dp_shard, dp_replicate, pp (parallel_nd.py's)
    lk = dict(tp=span(tp, 1, cl), cp=span(cp, tp, cl), dp=span(shard, tp * cp, cl),
              rep=span(repl, tp * cp * shard, cl), pp=span(pp, tp * cp * dp, cl))
    cfg = SimpleNamespace(batch_size=run.batch, n_micro=m, dtype="bfloat16" if prec != "fp32" else "float32",
                          sequence_parallel=True, grad_clip=1.0)
    msgs = axis_messages(local, cfg, Mesh(pp, dp, 1, 1, tp)) if tp > 1 else []
    out = []
    for k in sorted({0, pp - 1}):
        params = sum(stage_params(config, tp, pp, k)) + (V * h // tp) * (pp == 1 and not run.tied)
        layers = len(PP.stage_layers(L, pp, k))
        t_c = {rc: stage_flops(config, config.block_size, tp, cp, pp, k, rc)[1] * b / (cl.peak * run.eff)
               + layers * layer_hbm_bytes(s, b, h, tp, rc) / cl.hbm_bw for rc in RECOMPUTE}
        blocks = rest = 0.0
        for msg in msgs:
            if msg.axis == "tp" and msg.stage == k and msg.what not in ("norm", "replicas"):
                t = msg.count / m * coll_time(msg.op, msg.n, msg.nbytes, lk["tp"])
                blocks, rest = (blocks + t, rest) if msg.what == "blocks, head" else (blocks, rest + t)
        if cp > 1:  # ring attention: K and V around the ring forward and backward, dK and dV (float32) back
            kv = 2 * b * s * h / tp  # parallel_nd.axis_messages' cp terms, per rank
            rest += layers * (2 * coll_time("p2p", 2, kv * act_bytes, lk["cp"], calls=cp - 1)
                              + coll_time("p2p", 2, kv * 4, lk["cp"], calls=cp - 1))
        t_pp = coll_time("p2p", 2, b * s * h / tp * act_bytes, lk["pp"]) if pp > 1 else 0.0
        calls = max(1, math.ceil(params / run.bucket_elems)) if run.bucket_elems else \
            max(1, math.ceil(params * GRAD_BYTES[prec] / CODE_BUCKET))
        g, w = params * GRAD_BYTES[prec], params * WEIGHT_BYTES[prec]
        held = {0: g, 1: g / shard}  # the gradient a rank holds after the dp_shard step, by ZeRO or not
        avg = {z: coll_time("all_reduce", repl, held[z], lk["rep"], calls)  # averaged over HSDP's replicas,
               + coll_time("all_reduce", cp, held[z], lk["cp"], calls) for z in held}  # and over the cp ranks
        dp_t = {0: (coll_time("all_reduce", shard, g, lk["dp"], calls) + avg[0], 0.0),
                1: (coll_time("reduce_scatter", shard, g, lk["dp"], calls) + avg[1],
                    coll_time("all_gather", shard, w, lk["dp"], calls))}
        out.append(dict(k=k, params=params, layers=layers, t_c=t_c, tp=(blocks, rest), pp=t_pp, dp=dp_t))
    return out


def evaluate(config, cl, run, lay, opt, cache=None):
    """One layout (dp, tp, pp, cp, dp_shard) with one choice of options (zero, recompute, schedule, v, b)
    -> its row, or None if it cannot run. cache: stage_costs by b, for one layout."""
    dp, tp, pp, cp, shard = lay
    s_full, h, a, V, L = config.block_size, config.n_embd, config.n_head, config.vocab_size, config.n_layer
    b, v, schedule, recompute, zero = opt["b"], opt["v"], opt["schedule"], opt["recompute"], opt["zero"]
    if run.batch % (dp * b):
        return None
    m = run.batch // (dp * b)
    if pp == 1 and schedule != "1f1b" or schedule == "interleaved" and (v < 2 or L % (pp * v) or m % pp):
        return None
    cache = {} if cache is None else cache
    if b not in cache:
        cache[b] = stage_costs(config, cl, run, lay, b)
    s, prec = s_full // cp, run.precision
    mem = slot = t_dp = 0.0
    worst = None
    for st in cache[b]:
        k, t_c = st["k"], st["t_c"][recompute]
        state = rank_state(st["params"], prec, zero, lay)
        act = layer_activations(s, b, h, a, tp, recompute, run.flash, prec) * st["layers"] * held(schedule, pp, m, v, k)
        if recompute == "full":
            act += layer_activations(s, b, h, a, tp, "selective", run.flash, prec)  # the layer being recomputed
        if zero == 3:  # the stage's units gathered at their first use in the step, freed at its end
            act += st["params"] * WEIGHT_BYTES[prec]
        act += s * b * V / tp * (2 + 4) * (k == pp - 1)  # logits, and the float32 copy the loss takes
        if state + act > mem:
            mem, worst = state + act, (state, act)
        blocks, rest = st["tp"]
        t_tp = blocks * (1.5 if recompute == "full" else 1) + rest
        exposed = max(0.0, t_tp - t_c) if run.tp_overlap else t_tp
        slot = max(slot, t_c + exposed + 2 * v * st["pp"])  # its activations out, their gradients back
        # once a step: the gradients behind the last backward, the parameters' all-gather behind the
        # first forward (ZeRO-1/2 after the update, ZeRO-3 each unit just before its first use)
        grads, gather = st["dp"][min(zero, 1)]
        hidden = (2 / 3 * t_c, 1 / 3 * t_c) if run.dp_overlap else (0.0, 0.0)
        t_dp = max(t_dp, max(0.0, grads - hidden[0]) + max(0.0, gather - hidden[1]))
    slots = pipeline_slots(schedule, pp, m, v)
    step = slots * slot + t_dp
    flops = M.flops_per_token(config) * run.batch * s_full
    return dict(dp_replicate=dp // shard, dp_shard=shard, zero=zero, tp=tp, pp=pp, cp=cp, schedule=schedule, v=v,
                recompute=recompute, b=b, m=m, bubble=(slots - m) / slots, state_gb=worst[0] / 1e9,
                act_gb=worst[1] / 1e9, mem_gb=mem / 1e9, fits=mem <= run.headroom * cl.mem, step_s=step,
                dp_s=t_dp, mfu=flops / (step * dp * tp * pp * cp * cl.peak))


def options(config, run, lay, fixed=None):
    """Every choice of ZeRO stage, recompute mode, schedule (interleaved: v any divisor of the layers a
    stage holds, as Megatron's --num-layers-per-virtual-pipeline-stage allows), micro-batch the run allows."""
    fixed = fixed or {}
    _, _, pp, _, _ = lay
    scheds = [fixed["schedule"]] if "schedule" in fixed else (["1f1b"] if pp == 1 else run.schedules)
    for zero in ([fixed["zero"]] if "zero" in fixed else run.zero):
        for rc in ([fixed["recompute"]] if "recompute" in fixed else run.recompute):
            for sc in scheds:
                per_stage = config.n_layer // pp
                vs = [fixed["v"]] if "v" in fixed else ([v for v in range(2, per_stage + 1) if per_stage % v == 0]
                                                       if sc == "interleaved" and config.n_layer % pp == 0 else (1,))
                for v in vs:
                    for b in ([fixed["b"]] if "b" in fixed else run.micro_batches):
                        yield dict(zero=zero, recompute=rc, schedule=sc, v=v, b=b)


def layouts(config, run):
    """(dp, tp, pp, cp, dp_shard): tp divides the heads, cp the sequence, pp at most the layers; HSDP's
    shard group the ranks of one node (ZeRO-3 only)."""
    out = []
    for cp in [c for c in range(1, run.cp + 1) if run.gpus % c == 0 and config.block_size % c == 0]:
        for dp, tp, pp in factorizations(run.gpus // cp):
            if config.n_head % tp or config.vocab_size % tp or pp > config.n_layer:
                continue
            out.append((dp, tp, pp, cp, dp))
            node = max((d for d in range(1, dp) if dp % d == 0 and d * tp * cp <= run.gpus_per_node), default=0)
            if 3 in run.zero and node > 1:
                out.append((dp, tp, pp, cp, node))
    return out


def best(config, cl, run, lay, fixed=None):
    cache = {}
    rows = [r for r in (evaluate(config, cl, run, lay, o, cache) for o in options(config, run, lay, fixed)) if r]
    rows = [r for r in rows if not (lay[4] < lay[0] and r["zero"] != 3)]  # HSDP: a ZeRO-3 layout
    return min(rows, key=lambda r: (not r["fits"], r["step_s"] if r["fits"] else r["mem_gb"]), default=None)


def plan(config, cl, run):
    rows = [r for r in (best(config, cl, run, lay) for lay in layouts(config, run)) if r]
    return sorted(rows, key=lambda r: (not r["fits"], r["step_s"]))


def describe(r):
    zero = f"z{r['zero']}" + (f" hsdp {r['dp_replicate']}x{r['dp_shard']}" if r["dp_replicate"] > 1 else "")
    sched = r["schedule"] + (f" v{r['v']}" if r["schedule"] == "interleaved" else "")
    return f"({r['dp_replicate'] * r['dp_shard']},{r['tp']},{r['pp']}" + (f",cp{r['cp']}" if r["cp"] > 1 else "") + \
        f") {zero} {sched} {r['recompute']} b{r['b']}"


def show(rows, config, run, cl, top):
    print(f"{M.param_count(config) / 1e9:.2f}B parameters, {config.n_layer} layers, h={config.n_embd}, "
          f"{config.n_head} heads, s={config.block_size}, V={config.vocab_size}; {run.gpus} GPUs ({cl.gpus_per_node} "
          f"a node, {cl.mem / 1e9:.0f} GB, NVLink {cl.nvlink_bw / 1e9:.0f} GB/s, IB {cl.ib_bw / 1e9:.0f} GB/s a GPU, "
          f"peak {cl.peak / 1e12:.0f} TFLOP/s at {run.eff:.1%}); batch {run.batch}; {run.precision} state")
    print(f"{'rank':>4}  {'layout (dp,tp,pp) zero schedule recompute b':<44} {'m':>5} {'bubble':>6} {'state':>6} "
          f"{'act':>6} {'mem GB':>7} {'dp s':>6} {'step s':>7} {'MFU':>6}")
    fit = [r for r in rows if r["fits"]]
    unfit = [r for r in rows if not r["fits"]]
    for i, r in enumerate(fit[:top] + unfit[:top]):
        print(f"{i + 1 if r['fits'] else '-':>4}  {describe(r):<44} {r['m']:>5} {r['bubble']:>6.1%} "
              f"{r['state_gb']:>6.1f} {r['act_gb']:>6.1f} {r['mem_gb']:>7.1f} {r['dp_s']:>6.3f} {r['step_s']:>7.3f} "
              f"{r['mfu']:>6.1%}" + ("" if r["fits"] else "  does not fit"))
    print(f"({len(fit)} layouts fit, {len(unfit)} do not; each with its best options)")


# -----------------------------------------------------------------------------
# --check: the published runs


def published_mfu(table, row, config):
    """The run's model-FLOPs utilization. Narayanan et al. 2021 count teraFLOP/s with their eq. 3,
    96·B·s·l·h²(1 + s/6h + V/16lh), which includes full recomputation's extra forward: the model's
    FLOPs are model.flops_per_token's, so the achieved rate is scaled by their ratio."""
    if table.get("flops_counted") == "narayanan_eq3":
        s, h, l, V = config.block_size, config.n_embd, config.n_layer, config.vocab_size
        counted = 96 * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))
        return row["tflops"] * 1e12 * M.flops_per_token(config) * s / counted / table["cluster"]["peak"]
    return row["mfu"]


def table_setup(table, row, eff):
    config = M.GPTConfig(n_layer=row["n_layer"], n_embd=row["n_embd"], n_head=row["n_head"],
                         block_size=table["run"]["seq"], vocab_size=table["run"]["vocab"], bias=False)
    cl = SimpleNamespace(**{k: v for k, v in CLUSTERS[table["cluster"]["gpu"]].items()})
    r = table["run"]
    run = SimpleNamespace(gpus=row["gpus"], batch=row["batch"], gpus_per_node=cl.gpus_per_node, eff=eff, cp=1,
                          precision=r["precision"], zero=r["zero"], recompute=r["recompute"], tied=r["tied"],
                          flash=r["flash"], tp_overlap=r["tp_overlap"], dp_overlap=row.get("dp_overlap", True),
                          bucket_elems=r["bucket_elems"], schedules=["1f1b", "interleaved"],
                          micro_batches=[1, 2, 4, 8, 16], headroom=0.95)
    dp = row["gpus"] // (row["tp"] * row["pp"])
    fixed = {"b": row["micro_batch"]} if "micro_batch" in row else {}  # the options the source gives
    if "v" in row:
        fixed.update(schedule="interleaved" if row["v"] > 1 else "1f1b", v=row["v"])
    return config, cl, run, (dp, row["tp"], row["pp"], 1, dp), fixed


def check_row(table, row, eff, ranked=True):
    config, cl, run, lay, fixed = table_setup(table, row, eff)
    mine = best(config, cl, run, lay, fixed)
    # free: the same published layout, the planner choosing its interleaving depth and micro-batch itself
    out = dict(row=row, measured=published_mfu(table, row, config), mine=mine,
               free=best(config, cl, run, lay) if fixed else mine)
    if ranked:
        rows = plan(config, cl, run)
        out["best"] = rows[0]
        key = lambda r: (r["dp_shard"] * r["dp_replicate"], r["tp"], r["pp"])  # noqa: E731
        out["rank"] = next((i + 1 for i, r in enumerate(rows) if key(r) == key(mine) and r["fits"]), None)
        # within 3%: the published layout, with its best options as the list ranks it, against the first
        out["within"] = out["rank"] is not None and rows[out["rank"] - 1]["step_s"] <= 1.03 * rows[0]["step_s"]
    return out


def fit_eff(table):
    """The one fitted knob: the compute efficiency that makes the median predicted MFU of the table's
    published layouts equal the measured one (bisection: predicted MFU rises with it)."""
    lo, hi = 0.2, 1.0
    for _ in range(16):  # to 1e-5
        mid = (lo + hi) / 2
        errs = [r["mine"]["mfu"] / r["measured"] - 1 for r in (check_row(table, row, mid, False)
                                                                for row in table["rows"])]
        lo, hi = (mid, hi) if statistics.median(errs) < 0 else (lo, mid)
    return (lo + hi) / 2


def check(fit_on="narayanan2021", eff=None):
    data = json.load(open(DATA))
    tables = {t["name"]: t for t in data["tables"]}
    eff = eff or fit_eff(tables[fit_on])
    print(f"compute efficiency eff = {eff:.3f} of the dense peak, fitted on {tables[fit_on]['title']} (the median "
          f"predicted MFU of its published layouts equals the measured one); the other tables predicted with it")
    summary = []
    for t in data["tables"]:
        print(f"\n{t['title']}\n  source: {t['source']}")
        print(f"  {'model':>6} {'GPUs':>5}  {'published (dp,tp,pp) options':<40} {'MFU':>6}  "
              f"{'planner best':<40} {'MFU':>6}  {'rank':>4} {'<=3%':>4}  {'its MFU':>7}  {'error':>6}  "
              f"{'free: options':<20} {'MFU':>6} {'error':>6}")
        res = [check_row(t, row, eff) for row in t["rows"]]
        for r in res:
            err = r["mine"]["mfu"] / r["measured"] - 1
            print(f"  {r['row']['model']:>6} {r['row']['gpus']:>5}  {describe(r['mine']):<40} {r['measured']:>6.1%}  "
                  f"{describe(r['best']):<40} {r['best']['mfu']:>6.1%}  {r['rank'] or '-':>4} "
                  f"{'yes' if r['within'] else 'no':>4}  "
                  f"{r['mine']['mfu']:>7.1%}  {err:>+6.1%}  {describe(r['free']).split(' ', 1)[-1]:<20} "
                  f"{r['free']['mfu']:>6.1%} {r['free']['mfu'] / r['measured'] - 1:>+6.1%}"
                  + ("" if r["mine"]["fits"] else "  (does not fit)"))
        exact = sum(r["rank"] == 1 for r in res)
        within = sum(bool(r["within"]) for r in res)
        med = statistics.median(abs(r["mine"]["mfu"] / r["measured"] - 1) for r in res)
        free = statistics.median(abs(r["free"]["mfu"] / r["measured"] - 1) for r in res)
        summary.append((t["name"], len(res), exact, within, med, free))
        print(f"  {t['name']}: {exact}/{len(res)} published layouts ranked first, {within}/{len(res)} within 3% "
              f"of the best step, median |MFU error| {med:.1%} with the published options, {free:.1%} with the "
              f"planner's own" + (" (eff fitted here)" if t["name"] == fit_on else ""))
    z = data["zero_table1"]
    print(f"\n{z['title']}\n  source: {z['source']}")
    worst = 0.0
    for row in z["rows"]:
        mine = [row["params"] * state_bytes("zero", k, row["dp"]) / 1e9 for k in range(4)]
        worst = max(worst, max(abs(a - b) / b for a, b in zip(mine, row["gb"])))
        print(f"  {row['params'] / 1e9:.1f}B, Nd={row['dp']:>4}: published {row['gb']}  "
              f"planner {[round(x, 2) for x in mine]}")
    print(f"  zero_table1: largest relative difference {worst:.1%} (the published figures are rounded)")
    return summary, worst


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="hold the model to the published runs, and stop")
    ap.add_argument("--fit_on", default="narayanan2021", help="--check: the table eff is fitted on (unless --eff)")
    ap.add_argument("--json", action="store_true", help="print the ranked layouts as one JSON document")
    ap.add_argument("--model", default="gpt2-xl", choices=sorted(MODELS))
    for k in ("n_layer", "n_embd", "n_head"):
        ap.add_argument(f"--{k}", type=int, default=0, help="overrides the preset's")
    ap.add_argument("--seq", type=int, default=0, help="sequence length; overrides the preset's block_size")
    ap.add_argument("--vocab", type=int, default=50257, help="padded to a multiple of 64, as model.py does")
    ap.add_argument("--untied", action="store_true", help="separate input and output embeddings (Megatron's runs)")
    ap.add_argument("--gpus", type=int, default=64)
    ap.add_argument("--batch", type=int, default=512, help="global batch, sequences")
    ap.add_argument("--micro_batch", type=int, default=0, help="sequences per micro-batch (b); 0: the best of 1..16")
    ap.add_argument("--cluster", default="H100", choices=sorted(CLUSTERS))
    for k in ("gpus_per_node", "mem", "peak", "nvlink_bw", "ib_bw", "hbm_bw"):
        ap.add_argument(f"--{k}", type=type(CLUSTERS["H100"][k]), default=None, help="overrides the cluster's")
    ap.add_argument("--precision", default="fp32", choices=sorted(STATE), help="fp32: this code's state")
    ap.add_argument("--zero", default="0,1,2,3", help="ZeRO stages to consider (3 includes HSDP)")
    ap.add_argument("--recompute", default=",".join(RECOMPUTE))
    ap.add_argument("--schedule", default="1f1b,interleaved,zb")
    ap.add_argument("--cp", type=int, default=1, help="largest context-parallel size to consider")
    ap.add_argument("--flash", action="store_true", help="attention never stores its scores")
    ap.add_argument("--tp_overlap", action="store_true", help="tp collectives hide behind the GEMMs")
    ap.add_argument("--no_dp_overlap", action="store_true", help="the dp collectives run after the backward")
    ap.add_argument("--eff", type=float, default=0.0, help="fraction of the peak compute reaches; 0: fitted")
    ap.add_argument("--headroom", type=float, default=0.9, help="usable fraction of GPU memory")
    ap.add_argument("--top", type=int, default=8, help="fitting layouts to print (and as many that do not fit)")
    args = ap.parse_args(argv)
    if args.check:
        names = [t["name"] for t in json.load(open(DATA))["tables"]]
        if args.fit_on not in names:
            M.die(f"--fit_on takes one of {', '.join(names)}, not {args.fit_on!r}")
        return check(args.fit_on, eff=args.eff or None)
    preset = dict(MODELS[args.model])
    for k in ("n_layer", "n_embd", "n_head"):
        preset[k] = getattr(args, k) or preset[k]
    preset["block_size"] = args.seq or preset["block_size"]
    if preset["n_embd"] % preset["n_head"]:
        M.die(f"--n_embd {preset['n_embd']} is not a multiple of --n_head {preset['n_head']}")
    try:
        zero = sorted({int(z) for z in args.zero.split(",")})
    except ValueError:
        M.die(f"--zero takes stages 0-3 separated by commas, not {args.zero!r}")
    recompute, schedules = args.recompute.split(","), args.schedule.split(",")
    for name, got, allowed in (("zero", zero, range(4)), ("recompute", recompute, RECOMPUTE),
                               ("schedule", schedules, SCHEDULES)):
        if any(x not in allowed for x in got):
            M.die(f"--{name} takes {', '.join(map(str, allowed))}, not {getattr(args, name)!r}")
    if min(args.gpus, args.batch, args.cp) < 1:
        M.die("--gpus, --batch and --cp must be positive")
    config = M.GPTConfig(**preset, vocab_size=M.pad_vocab(args.vocab))
    cl = SimpleNamespace(**{k: (getattr(args, k) if getattr(args, k) is not None else v)
                            for k, v in CLUSTERS[args.cluster].items()})
    run = SimpleNamespace(gpus=args.gpus, batch=args.batch, gpus_per_node=cl.gpus_per_node, cp=args.cp,
                          eff=args.eff or EFF, precision=args.precision, zero=zero, recompute=recompute,
                          tied=not args.untied, flash=args.flash, tp_overlap=args.tp_overlap,
                          dp_overlap=not args.no_dp_overlap, bucket_elems=0, schedules=schedules,
                          micro_batches=[args.micro_batch] if args.micro_batch else [1, 2, 4, 8, 16],
                          headroom=args.headroom)
    rows = plan(config, cl, run)
    if not rows:
        M.die(f"no layout of {args.gpus} GPUs can run this model with batch {args.batch}")
    if args.json:
        print(json.dumps(dict(model=dataclasses.asdict(config), cluster=vars(cl), eff=run.eff,
                              layouts=[dict(r, rank=i + 1 if r["fits"] else None) for i, r in enumerate(rows)]),
                         indent=1))
    else:
        show(rows, config, run, cl, args.top)
    return rows


if __name__ == "__main__":
    main()
