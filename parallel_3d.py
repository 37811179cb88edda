"""
3-D parallelism: data x tensor x pipeline on one mesh of dp·tp·pp ranks (Megatron-LM's
"PTD-P", Narayanan et al. 2021). The pipeline cuts the model into pp stages by depth;
tensor parallelism cuts each stage's matrices over tp ranks; and that whole pipeline of
tp·pp ranks is replicated dp times, each replica on its own rows of the batch. Nothing
here is new: the pieces are ddp.py's, tensor_parallel.py's and pipeline_parallel.py's,
run on sub-groups.

    torchrun --nproc_per_node=8 parallel_3d.py --dp=2 --tp=2 --pp=2 --n_micro=4
    torchrun --nproc_per_node=8 parallel_3d.py --tp=2 --pp=2 --sequence_parallel=True   # --dp: the rest
    torchrun --nnodes=16 --nproc_per_node=8 ... parallel_3d.py --model=gpt2-xl --pp=4   # see bench/plan_3d.py

The mesh. rank = pp_rank·(dp·tp) + dp_rank·tp + tp_rank: tensor parallel innermost
(neighbouring ranks: one node), then data, then pipeline outermost. The order follows
what each axis sends, and how often:
  tp  4 all-reduces of b·s·h activations per layer per micro-batch (2 forward, 2
      backward), each on the critical path: the most bytes, most often, and nothing
      can hide them. They get the fastest links, NVLink inside a node.
  dp  one all-reduce of the stage's gradients per step, 2(dp-1)/dp·4Ψ/(tp·pp) bytes,
      started from the gradient hooks of the last micro-batch's backward so that it
      overlaps it (ddp.py's buckets). Large but rare and hideable: the next links.
  pp  one activation per micro-batch per boundary forward and its gradient back,
      b·s·h each, point to point to one neighbour: the least, and it tolerates the
      slowest links, between nodes (or between racks).
Every group is made by C.new_group(ranks), every rank making every group in the same
order (tp groups, then dp, then pp), even those it is not in. The tie between the
embedding (first stage) and the head (last stage) is summed between the first and the
last rank of each pipeline group: the same dp and tp coordinates, so the same vocabulary
rows.

What each axis sends per step is derived in axis_bytes(), which the tests hold the log to
and bench/plan_3d.py uses to predict every (dp, tp, pp) of a cluster.

The step: the dp rank's rows are cut into m micro-batches for any of pipeline_parallel's
schedules, each stage running tensor parallel's pieces on its tp group; then the dp
all-reduce, the tie's sum, and the clip (squared norms over tp and pp, never over dp).

Flags: --dp, --tp, --pp (--dp=0: the world size over tp·pp); --schedule, --n_micro,
--virtual_stages as pipeline_parallel.py's (zb with --tp=1: its W walks backward again, which
would repeat tensor parallel's all-reduces); --sequence_parallel as tensor_parallel.py's;
--bucket_mb and --overlap (the dp all-reduce during the last backward, or after it) as ddp.py's.
"""
from collections import namedtuple
from functools import partial

import torch
import torch.nn as nn

import collectives as C
import ddp as DDP
import model as M
import pipeline_parallel as PP
import tensor_parallel as TP

DEFAULTS = dict(M.TRAIN_DEFAULTS, dp=0, tp=1, pp=1, schedule="1f1b", n_micro=4, virtual_stages=2,
                sequence_parallel=False, bucket_mb=25.0, overlap=True)
AXES = ("dp", "tp", "pp")

# -----------------------------------------------------------------------------
# the mesh


def coords(rank, dp, tp, pp):
    """(pp_rank, dp_rank, tp_rank) of a global rank: tp innermost, pp outermost."""
    return rank // (dp * tp), rank // tp % dp, rank % tp


def rank_of(p, d, t, dp, tp):
    return p * dp * tp + d * tp + t


def mesh_groups(dp, tp, pp):
    """Every group of each axis, as lists of global ranks, in the order they are created."""
    return dict(
        tp=[[rank_of(p, d, t, dp, tp) for t in range(tp)] for p in range(pp) for d in range(dp)],
        dp=[[rank_of(p, d, t, dp, tp) for d in range(dp)] for p in range(pp) for t in range(tp)],
        pp=[[rank_of(p, d, t, dp, tp) for p in range(pp)] for d in range(dp) for t in range(tp)])


def make_groups(rank, dp, tp, pp):
    """This rank's group on each axis. Every rank calls new_group for every group of every
    axis, in the same order (torch.distributed numbers groups by creation; on NCCL each
    creation is a collective over the world). An axis of size 1 still gets a group, of
    this rank alone: None would mean the whole world to the pieces below."""
    mine = {}
    for axis, groups in mesh_groups(dp, tp, pp).items():
        for ranks in groups:
            group = C.new_group(ranks)
            if rank in ranks:
                mine[axis] = group
    return mine


def print_mesh(groups, dp, tp, pp):
    """Rank 0 prints every rank's coordinates and groups, as the groups themselves report
    them (gathered, untracked), one line a rank."""
    me = dict(zip(("pp", "dp", "tp"), coords(C.get_rank(), dp, tp, pp)))
    for axis in AXES:
        me.update({f"{axis}_{i}": r for i, r in enumerate(C.group_ranks(groups[axis]))})
    rows = C.gather_stats(me)
    if rows is None:
        return
    print(f"mesh: rank = pp_rank*{dp * tp} + dp_rank*{tp} + tp_rank")
    for r in range(len(rows["pp"])):
        if r == 16 and len(rows["pp"]) > 20:
            print(f"  ... {len(rows['pp']) - 16} more")
            break
        group = {a: [int(rows[k][r]) for k in rows if k.startswith(a + "_")] for a in AXES}
        print(f"  rank {r:4d} (pp, dp, tp) = ({int(rows['pp'][r])}, {int(rows['dp'][r])}, {int(rows['tp'][r])})  "
              + "  ".join(f"{a} group {group[a]}" for a in ("tp", "dp", "pp")))

# -----------------------------------------------------------------------------
# the traffic, in code: shared with bench/plan_3d.py


def stage_params(config, tp, pp, stage):
    """(sharded, replicated): the parameters a rank of `stage` holds, in elements. Sharded:
    its 1/tp of every matrix tensor parallelism splits (and the tied matrix's copy on a
    last stage); replicated: LayerNorms, row-parallel biases, the position embedding."""
    h, bias = config.n_embd, int(config.bias)
    n_blocks = len(PP.stage_layers(config.n_layer, pp, stage))
    sharded = n_blocks * (12 * h * h + 7 * h * bias)     # c_attn, c_fc, the two c_proj weights
    replicated = n_blocks * (2 * h + 4 * h * bias)        # ln_1, ln_2, the two c_proj biases
    first, last = stage == 0, stage == pp - 1
    sharded += config.vocab_size * h * (first + (last and not first))  # wte, or its copy as the head
    replicated += config.block_size * h * first + (h + h * bias) * last  # wpe; ln_f
    return sharded // tp, replicated


Message = namedtuple("Message", "axis stage what op n nbytes count")


def axis_messages(config, cfg, dp, tp, pp):
    """Every message of one training step: Message(axis, stage, what, op, n, nbytes, count):
    each group of `axis` on pipeline `stage` (None: the pipeline groups, which span the
    stages) sends `count` of op ("all_reduce"; "rs_ag", a reduce-scatter and an all-gather
    of nbytes; "p2p", one message) among its n ranks. Activations travel in the compute
    dtype inside tensor parallel regions, float32 across a stage boundary (pipeline_parallel.
    BOUNDARY_DTYPE) and in the embedding's region; gradients and norms in float32."""
    d = 2 if cfg.dtype == "bfloat16" else 4
    m = cfg.n_micro
    v = PP.virtual_stages(cfg)  # interleaved: p·v-1 chunk boundaries
    b, s, h, V = cfg.batch_size // (dp * m), config.block_size, config.n_embd, config.vocab_size
    sp, clip = cfg.sequence_parallel, bool(cfg.grad_clip)
    region = "rs_ag" if sp else "all_reduce"  # f and g: the same bytes either way
    out = []
    for k in range(pp):
        first, last = k == 0, k == pp - 1
        n_blocks = len(PP.stage_layers(config.n_layer, pp, k))
        sharded, replicated = stage_params(config, tp, pp, k)
        out += [Message("tp", k, "blocks, head", region, tp, b * s * h * d, m * (4 * n_blocks + last)),
                Message("tp", k, "embedding", region, tp, b * s * h * 4, m * first),
                Message("tp", k, "loss", "all_reduce", tp, b * s * 4, 3 * m * last),
                Message("tp", k, "norm", "all_reduce", tp, 4, clip),
                Message("tp", k, "replicas", "all_reduce", tp, 4 * replicated, sp),  # sequence parallel's
                Message("dp", k, "gradients", "all_reduce", dp, 4 * (sharded + replicated), 1)]
    act = b * (s // tp if sp else s) * h * PP.BOUNDARY_DTYPE.itemsize
    out += [Message("pp", None, "activations", "p2p", pp, act, 2 * (pp * v - 1) * m),  # and their gradients
            Message("pp", None, "tie", "p2p", pp, V // tp * h * 4, 2 * (pp > 1)),  # each end its half
            Message("pp", None, "norm", "all_reduce", pp, 4, clip)]
    return [msg for msg in out if msg.count and msg.n > 1]


def group_bytes(op, n, nbytes):
    """Bytes the n ranks of a group send in all for one op: a ring or a tree all-reduce
    2(N-1)·S, a reduce-scatter plus an all-gather (N-1)·S each, a message S."""
    return nbytes if op == "p2p" else 2 * (n - 1) * nbytes


def axis_bytes(config, cfg, dp, tp, pp, stage=None):
    """{axis: bytes per step}. stage=None: sent by every rank of the world on that axis;
    stage=k: sent by the ranks of one group of the axis that a rank of stage k is in (its
    tp and dp groups live on stage k; its pp group spans the stages).

    What each axis sends per step (per group, summed over its ranks; collectives.py's ring
    and tree all-reduces both send 2(N-1)·S in all; B the global batch, m = --n_micro,
    b = B/(dp·m), s the sequence, h the width, V the vocabulary, L_k the blocks of stage k,
    d the compute dtype's bytes):
      tp (stage k)  m · (4·L_k + [first] + [last]) all-reduces of b·s·h (d; the embedding's 4),
                    + [last] m·3 all-reduces of b·s floats (the loss) + 1 float (the norm)
                    (--sequence_parallel: each all-reduce a reduce-scatter + all-gather, the
                    same bytes, + the replicated parameters' gradients once)
      dp (stage k)  one all-reduce of every gradient the rank holds, float32
      pp            2·(pp-1)·m activations of b·s·h floats (b·s·h/tp with sequence parallel:
                    each tp rank sends its own positions), + 2·V/tp·h floats (the tie) + 1 float
    bench/plan_3d.py uses this same function to predict the step time of every
    (dp, tp, pp) on a cluster. Without --sequence_parallel every
    tp rank sends the whole activation across a boundary: tp copies of the same bytes
    (Megatron's scatter/gather optimisation sends 1/tp and all-gathers after); with it,
    each sends only its own positions.
    """
    n_groups = dict(tp=dp, dp=tp, pp=dp * tp)  # groups of the axis on one stage (pp: in all)
    out = dict.fromkeys(AXES, 0)
    for msg in axis_messages(config, cfg, dp, tp, pp):
        if stage is None or msg.stage in (None, stage):
            out[msg.axis] += msg.count * group_bytes(msg.op, msg.n, msg.nbytes) * (1 if stage is not None
                                                                                else n_groups[msg.axis])
    return out


def traffic_per_rank(config, cfg, world):
    """Bytes a rank sends per step, on average over the world."""
    dp = cfg.dp or world // (cfg.tp * cfg.pp)
    return sum(axis_bytes(config, cfg, dp, cfg.tp, cfg.pp).values()) / world

# -----------------------------------------------------------------------------
# a pipeline stage made of tensor parallel pieces


class Stage(nn.Module):
    """Stage `stage` of `n_stages` (pipeline_parallel.Stage's blocks), each unit built
    whole from the seed and cut to this rank's tensor parallel slice (tensor_parallel's
    build), under model.GPT's parameter names. The last stage's head is its own copy of
    this tp rank's slice of the tied matrix (lm_head.weight); one stage: the same one."""

    def __init__(self, config, stage, n_stages, seed, group, sp, n_virtual=1):
        super().__init__()
        self.config, self.group, self.sp = config, group, sp
        self.first, self.last = stage == 0, stage == n_stages - 1
        self.n_chunks = n_stages * n_virtual  # pipeline_parallel.Stage's chunks: r, r+p, ...
        self.chunks = {c: PP.stage_layers(config.n_layer, self.n_chunks, c)
                       for c in range(stage, self.n_chunks, n_stages)}
        self.transformer = nn.ModuleDict(dict(h=nn.ModuleDict(
            {str(i): TP.parallel_block(M.build_unit(config, i, seed), group, sp) for c in self.chunks
             for i in self.chunks[c]})))
        if self.first:
            emb = M.build_unit(config, "embed", seed)
            self.transformer["wte"] = TP.VocabParallelEmbedding(emb.wte, group, sp)
            self.transformer["wpe"] = emb.wpe
        if self.last:
            self.transformer["ln_f"] = M.build_unit(config, "ln_f", seed)
            if not self.first:
                self.lm_head = TP.VocabParallelEmbedding(M.build_unit(config, "embed", seed).wte, group, sp)

    def head(self):
        return self.transformer["wte"] if self.first else self.lm_head

    def tied(self):
        """This stage's copy of the tied matrix (its tp slice), None in the middle."""
        return self.head().weight if self.first or self.last else None

    def forward(self, x, targets=None, chunk=None):
        """Token ids (b, s) on the first stage, else the previous stage's (s, b, h) (with
        sequence parallelism (s/tp, b, h)); -> the same for the next stage, or the loss."""
        t, g, sp, chunk = self.transformer, self.group, self.sp, next(iter(self.chunks)) if chunk is None else chunk
        if chunk == 0:
            x = TP.embed_forward(t["wte"], t["wpe"], x, g, sp, self.config.dropout, self.training)
        for i in self.chunks[chunk]:
            x = TP.block_forward(t["h"][str(i)], x)
        return TP.head_forward(t["ln_f"], self.head(), x, targets, g, sp) if chunk == self.n_chunks - 1 else x


class Executor(PP.Executor):
    """pipeline_parallel's executor, which also arms the dp buckets' gradient hooks (None:
    none) for the last micro-batch's weight gradients only (its backward, or its W under
    --schedule=zb): the gradients are complete then, and the all-reduce of each bucket starts
    as soon as they have filled it (ddp.py's overlap); earlier micro-batches only accumulate."""

    def __init__(self, *args, buckets=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.buckets = buckets

    def backward(self, a, *args):
        if self.buckets is not None:
            self.buckets.sync = a.micro == self.n_micro - 1
        super().backward(a, *args)

    def weight_grad(self, a, *args):
        if self.buckets is not None:
            self.buckets.sync = a.micro == self.n_micro - 1
        super().weight_grad(a, *args)


def checkpoint_entries(stage, tp_group, dp_rank):
    """tensor_parallel's entries (global names, tp slices, replicas written by tp rank 0),
    written by dp rank 0 only; the last stage's tied copy is transformer.wte.weight again,
    loaded but never written (pipeline_parallel's rule)."""
    return [("transformer.wte.weight", p, index, False) if name == "lm_head.weight" else
            (name, p, index, write and dp_rank == 0)
            for name, p, index, write in TP.checkpoint_entries(stage, tp_group)]


def clip_global_norm(stage, max_norm, tp_group, pp_group):
    """The norm of the whole model's gradient, each parameter once: tensor_parallel's
    squared norm over the tp group (shards, and replicas on tp rank 0), without the last
    stage's tied copy; summed over tp, then over pp (one float each); never over dp."""
    if not max_norm:
        return 0.0
    sharded, replicated = TP.split_params(stage)
    copy = stage.tied() if stage.last and not stage.first else None
    sq = TP.grad_sq_norm([p for p in sharded if p is not copy], replicated, tp_group)
    return M.clip_by_global_norm(sq, [p.grad for p in sharded + replicated], max_norm, [tp_group, pp_group])

# -----------------------------------------------------------------------------
# the run


def check_layout(cfg, config, world):
    """-> (dp, tp, pp), or one line and exit on every rank (before any message)."""
    tp, pp = cfg.tp, cfg.pp
    dp = cfg.dp or world // (tp * pp)
    if not cfg.dp and world % (tp * pp):
        M.die(f"--tp={tp} x --pp={pp} = {tp * pp} ranks does not divide the world size {world}")
    if dp * tp * pp != world:
        M.die(f"--dp={dp} x --tp={tp} x --pp={pp} = {dp * tp * pp} ranks, "
              f"but the world has {world}: their product must equal the world size")
    if config.n_head % tp or config.vocab_size % tp:
        M.die(f"--tp={tp} must divide the {config.n_head} heads and the padded vocabulary ({config.vocab_size})")
    if cfg.sequence_parallel and config.block_size % tp:
        M.die(f"--sequence_parallel needs --block_size ({config.block_size}) divisible by --tp={tp}")
    if pp > config.n_layer:
        M.die(f"--pp={pp} stages but the model has {config.n_layer} blocks: each stage needs at least one")
    if cfg.schedule == "zb" and tp > 1:  # W walks backward again: tp's backward all-reduces would run twice
        M.die("--schedule=zb needs --tp=1 here: its W re-runs the backward, tensor parallel's all-reduces with it")
    v = PP.virtual_stages(cfg)
    if cfg.schedule == "interleaved" and (v < 1 or cfg.n_micro % pp or pp * v > config.n_layer):
        M.die(f"--schedule=interleaved needs --n_micro ({cfg.n_micro}) divisible by --pp={pp} and --pp x "
              f"--virtual_stages={v} chunks of at least one of the {config.n_layer} blocks each")
    if cfg.batch_size % (dp * cfg.n_micro):
        M.die(f"--batch_size={cfg.batch_size} does not divide into {dp} data parallel ranks x "
              f"{cfg.n_micro} micro-batches")
    return dp, tp, pp


def main(argv=None):
    cfg = M.parse_args(DEFAULTS, argv, __doc__)
    if min(cfg.tp, cfg.pp) < 1 or cfg.dp < 0:
        M.die(f"--tp and --pp must be at least 1 and --dp at least 0 (0: the rest), not {cfg.dp}, {cfg.tp}, {cfg.pp}")
    if cfg.schedule not in PP.SCHEDULES:
        M.die(f"--schedule takes {', '.join(PP.SCHEDULES)}, not {cfg.schedule!r}")
    if cfg.n_micro < 1 or cfg.bucket_mb <= 0:
        M.die("--n_micro must be at least 1 and --bucket_mb positive")

    run = M.start(cfg, "parallel_3d")
    rank, world, device, config = run.rank, run.world, run.device, run.config
    dp, tp, pp = check_layout(cfg, config, world)
    v = PP.virtual_stages(cfg)  # the chunks a stage holds
    sp, n_micro = cfg.sequence_parallel, cfg.n_micro
    pp_rank, dp_rank, tp_rank = coords(rank, dp, tp, pp)
    groups = make_groups(rank, dp, tp, pp)
    tp_group, dp_group, pp_group = groups["tp"], groups["dp"], groups["pp"]
    last_stage = [r for r in range(world) if coords(r, dp, tp, pp)[0] == pp - 1]
    print_mesh(groups, dp, tp, pp)

    stage = Stage(config, pp_rank, pp, cfg.seed, tp_group, sp, v).to(device)
    params = list(stage.parameters())
    sharded, replicated = TP.split_params(stage)
    # the dp all-reduce: ddp.py's buckets on this rank's parameters, over its dp group
    buckets = DDP.GradBuckets(params, cfg.bucket_mb, cfg.overlap, dp_group) if dp > 1 else None
    optimizer = M.make_optimizer(stage.named_parameters(), cfg, device)
    run.layout = dict(dp=dp, tp=tp, pp=pp, schedule=cfg.schedule, n_micro=n_micro, sequence_parallel=sp)
    M.restore(run, checkpoint_entries(stage, tp_group, dp_rank), optimizer)  # both tied copies are loaded
    act_shape = (config.block_size // tp if sp else config.block_size, cfg.batch_size // (dp * n_micro), config.n_embd)
    executor = Executor(stage, act_shape, n_micro, run.autocast, torch.compile(stage) if cfg.compile else None,
                        pp_group, buckets=buckets if cfg.overlap else None)
    train_plan = PP.plan(cfg.schedule, pp, n_micro, pp_rank, v)
    eval_plan = PP.plan(cfg.schedule, pp, n_micro, pp_rank, v, train=False)
    formula = {a: axis_bytes(config, cfg, dp, tp, pp, stage=pp_rank)[a] / n for a, n in zip(AXES, (dp, tp, pp))}
    if rank == 0:
        print(f"parallel_3d: dp={dp} x tp={tp} x pp={pp} = {world} ranks{', sequence parallel' if sp else ''}, "
              f"{M.param_count(config) / 1e6:.2f}M parameters, schedule {cfg.schedule}, {n_micro} micro-batches of "
              f"{act_shape[1]} x {config.block_size} tokens per pipeline, bubble "
              f"{PP.bubble(cfg.schedule, pp, n_micro, v):.1%}")

    def rows(step, split):  # this dp rank's rows of the global batch, cut into the micro-batches
        return partial(M.batch, run, step, split, n_micro=n_micro, dp_rank=dp_rank, dp_size=dp)

    @torch.no_grad()
    def evaluate():
        stage.eval()
        losses = []
        with C.untracked():  # bookkeeping, not training traffic
            for k in range(cfg.eval_iters):
                losses += executor.run(eval_plan, rows(k, "val"), train=False)
            loss = torch.stack(losses).mean() if stage.last else torch.zeros((), device=device)
            C.all_reduce(loss, op="avg", group=dp_group)  # the dp ranks' rows: equal shares
            C.broadcast(loss, src=C.group_ranks(pp_group)[-1], group=pp_group)  # only the last stage has it
        stage.train()
        return loss.item()

    for it in range(run.start_iter, cfg.max_iters):
        M.begin_iter(run, it, evaluate)
        # ---------------------------------------------------------------- the training step
        if buckets:
            buckets.zero()
            buckets.sync = not cfg.overlap
        else:
            optimizer.zero_grad(set_to_none=True)
        losses = executor.run(train_plan, rows(it, "train"))
        if buckets:
            buckets.reduce()             # dp: the average over the replicas (waits for the overlapped ones)
        if sp:
            TP.sum_replicated_grads(replicated, tp_group)  # tp: replicas saw only their positions
        PP.sum_tied_grads(stage, pp_group)                   # pp: the tie, between the two ends
        norm = clip_global_norm(stage, cfg.grad_clip, tp_group, pp_group)
        optimizer.step()
        # ---------------------------------------------------------------- end of the training step
        grads = buckets.buffers if buckets else [p.grad for p in params]
        state = M.tensor_bytes(params) + M.tensor_bytes(grads) + M.optimizer_state_bytes(optimizer)
        M.end_iter(run, loss=torch.stack(losses).mean() if losses else 0.0, grad_norm=norm, state_bytes=state,
                   loss_ranks=last_stage, axes=groups, **{f"formula_bytes_{a}": formula[a] for a in AXES},
                   peak_micro=executor.peak_held, act_bytes=executor.peak_bytes)
    return M.finish(run)


if __name__ == "__main__":
    M.main_guard(main)
