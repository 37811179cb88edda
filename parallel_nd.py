"""
Every axis on one mesh: pipeline x data (replicated, and sharded) x context x tensor, on
pp·dp_replicate·dp_shard·cp·tp ranks (Megatron-LM's "PTD-P", Narayanan et al. 2021, grown as
torchtitan grows it). Nothing here is a new mechanism: main() assembles the strategy files'
own pieces on sub-groups of the world, axis by axis (as torchtitan's parallelize_llama): the
groups; a pipeline_parallel.Stage of tensor_parallel's blocks, with context_parallel's
attention and expert_parallel's layer (--n_expert, on ep ranks borrowed from dp_shard x cp);
dp_shard, fsdp.py's units; dp_replicate, ddp.py's buckets (HSDP when both are > 1); the loop
of pipeline_parallel's Executor.

    torchrun --nproc_per_node=8 parallel_nd.py --dp_replicate=2 --tp=2 --pp=2 --n_micro=4
    torchrun --nproc_per_node=8 parallel_nd.py --dp_shard=2 --tp=2 --pp=2            # FSDP x TP x PP
    torchrun --nproc_per_node=8 parallel_nd.py --dp_shard=2 --cp=2 --tp=2 --n_expert=8 --ep=4  # + EP

The mesh. rank = (((pp_rank·R + rep_rank)·S + shard_rank)·CP + cp_rank)·TP + tp_rank: the axis
that sends the most, most often, innermost, on the fastest links (tp, then cp, dp_shard,
dp_replicate, and pp outermost: one activation a micro-batch, to one neighbour).

The lesson is everything above main(); below the fences after it: the instruments (the mesh
printed, the log's fields) and axis_bytes(), what each axis sends per step, which the tests hold
the log to and bench/plan_cluster.py uses. The order's reasons, the experts' groups, ZeRO in a
pipeline and the flags: docs/parallel_nd.md.
"""
import math
from collections import namedtuple
from functools import partial
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

import collectives as C
import context_parallel as CP
import ddp as DDP
import fsdp as FSDP
import expert_parallel as EP
import model as M
import pipeline_parallel as PP
import tensor_parallel as TP

DEFAULTS = dict(
    M.TRAIN_DEFAULTS,
    pp=1,                     # pipeline stages (outermost axis)
    dp_replicate=0,           # data parallel replicas, ddp.py's buckets (0: the rest of the world)
    dp_shard=1,               # data parallel ranks that shard each stage's units (fsdp.py's ZeRO)
    cp=1,                     # context parallel ranks: each holds 1/cp of every sequence
    tp=1,                     # tensor parallel ranks (innermost axis)
    zero_stage=3,             # dp_shard's ZeRO stage: 1, 2 or 3 (fsdp.py's)
    layout="zigzag",          # cp: how a sequence is cut, zigzag or contiguous (context_parallel.py's)
    schedule="1f1b",          # the pipeline's schedule: gpipe, 1f1b, interleaved, zb, zbv
    n_micro=0,                # micro-batches a step (0: 2·pp with a pipeline, else 1)
    virtual_stages=2,         # chunks a rank holds under --schedule=interleaved
    sequence_parallel=False,  # tp: LayerNorm and dropout on 1/tp of the positions
    bucket_mb=25.0,           # dp_replicate: gradient bucket size in MB (ddp.py's)
    overlap=True,             # dp_replicate's buckets and dp_shard's reduce-scatters launched in backward
    prefetch=1,               # dp_shard: how many units' all-gathers run ahead (fsdp.py's; 0: none)
    ep=1,                     # experts split over ep ranks borrowed from dp_shard x cp (--n_expert)
    dispatch="alltoall",      # the experts' dispatch: alltoall or allgather
    attention="ring",         # cp's attention: ring or ulysses
)
Mesh = namedtuple("Mesh", "pp dp_replicate dp_shard cp tp")  # outermost to innermost
AXES = Mesh._fields
CREATED = AXES[::-1]  # the order every rank creates the groups in: innermost first
EP_AXES = ("ep", "ep_dp")  # a mixture of experts' two groups, borrowed from dp_shard x cp, made after the mesh's


def axes(config):  # the axes a run logs bytes for: the mesh's, and with --n_expert the experts' two
    return AXES + (EP_AXES if config.n_expert else ())

# -----------------------------------------------------------------------------
# the mesh


world_of = math.prod  # the ranks of a mesh


def coords(rank, mesh):
    """-> Mesh of this rank's coordinate on each axis: tp innermost (stride 1), pp outermost."""
    return Mesh(*(rank // world_of(mesh[i + 1:]) % n for i, n in enumerate(mesh)))


def rank_of(c, mesh):
    return sum(x * world_of(mesh[i + 1:]) for i, x in enumerate(c))


def mesh_groups(mesh):
    """Every group of each axis, as lists of global ranks, in the order they are created:
    the ranks that differ only in that axis' coordinate, one group per rank at coordinate 0."""
    out = {}
    for axis in CREATED:
        out[axis] = [[rank_of(c._replace(**{axis: i}), mesh) for i in range(getattr(mesh, axis))]
                     for c in map(partial(coords, mesh=mesh), range(world_of(mesh))) if getattr(c, axis) == 0]
    return out


def ep_groups(mesh, ep):
    """The experts' groups, borrowed from the data and context axes: with j a rank's index in
    its dp_shard x cp block, "ep" is a run of ep consecutive j, each holding E/ep experts; "ep_dp"
    the ranks at the same j mod ep, which hold the same experts (Megatron's expert data parallel)."""
    out = {"ep": [], "ep_dp": []}
    n = mesh.dp_shard * mesh.cp

    def at(c, j):
        return rank_of(c._replace(dp_shard=j // mesh.cp, cp=j % mesh.cp), mesh)
    for c in map(partial(coords, mesh=mesh), range(world_of(mesh))):
        j = c.dp_shard * mesh.cp + c.cp
        if j % ep == 0:
            out["ep"].append([at(c, j + i) for i in range(ep)])
        if j < ep:
            out["ep_dp"].append([at(c, i) for i in range(j, n, ep)])
    return out


def make_groups(rank, mesh, ep=0):
    """This rank's group on each axis (ep > 0: and the experts' two). Every rank creates every
    group in the same order (torch.distributed numbers groups by creation; on NCCL each is a
    collective over the world). An axis of size 1 gets a group too: None means the world."""
    mine = {}
    for axis, groups in list(mesh_groups(mesh).items()) + (list(ep_groups(mesh, ep).items()) if ep else []):
        for ranks in groups:
            group = C.new_group(ranks)
            if rank in ranks:
                mine[axis] = group
    return {a: mine[a] for a in AXES + (EP_AXES if ep else ())}


# -----------------------------------------------------------------------------
# a pipeline stage made of tensor parallel pieces


class ParallelLayers(PP.Whole):
    """pipeline_parallel.Stage's pieces on the mesh: each unit built whole from the seed, cut to
    this rank's tp slice and run in tensor_parallel's (s, b, h) layout. pos: this cp rank's
    global positions (None: all); ring: context_parallel's; moe: MoE -> expert_parallel's layer."""

    def __init__(self, config, seed, group, sp, pos=None, ring=None, attention="ring", moe=None):
        super().__init__(config, seed)
        self.group, self.sp, self.pos, self.ring, self.attention, self.moe = group, sp, pos, ring, attention, moe

    def block(self, i):
        block = TP.parallel_block(M.build_unit(self.config, i, self.seed), self.group, self.sp, self.moe)
        if self.ring is not None:  # model.py's attend() hook, as context_parallel.use_ring
            block.attn.attend = partial(CP.ATTENTION[self.attention], ring=self.ring)
        return block

    def embedding(self):
        emb = M.build_unit(self.config, "embed", self.seed)
        return TP.VocabParallelEmbedding(emb.wte, self.group, self.sp), emb.wpe

    def head(self, wte):
        return wte if wte is not None else TP.VocabParallelEmbedding(
            M.build_unit(self.config, "embed", self.seed).wte, self.group, self.sp)

    def embed(self, stage, x):
        t, dropout = stage.transformer, self.config.dropout
        if self.pos is None:
            return TP.embed_forward(t["wte"], t["wpe"], x, self.group, self.sp, dropout, stage.training)
        # a cp rank's positions: the GLOBAL ones, as context_parallel.forward
        return F.dropout(t["wte"](x.t()) + t["wpe"](self.pos)[:, None], dropout, stage.training)

    def run_block(self, block, x):
        return TP.block_forward(block, x)

    def loss(self, stage, x, targets):
        return TP.head_forward(stage.transformer["ln_f"], stage.lm_head, x, targets, self.group, self.sp)

    def deferred(self, executor, mod):  # --schedule=zb: tensor_parallel's f and g, the matmul's dW to W
        if isinstance(mod, (TP.ColumnParallelLinear, TP.RowParallelLinear)):
            (f, g), slot, w, b = TP.region_ops(self.sp), executor.defer(mod.weight), mod.weight, mod.bias
            if isinstance(mod, TP.ColumnParallelLinear):
                return lambda x: PP.deferred_linear(executor, f(x, self.group), w, b, slot)
            return lambda x: g(PP.deferred_linear(executor, x, w, None, slot), self.group) + (0 if b is None else b)


def stage_units(stage):
    """fsdp's units, [(key, [(name, parameter)])]: the stage's ends (if any), then each block."""
    named = [(n, p) for n, p in stage.named_parameters() if not hasattr(p, "ep_index")]
    ends = [(n, p) for n, p in named if not n.startswith("transformer.h.")]
    blocks = [(int(i), [(n, p) for n, p in named if n.startswith(f"transformer.h.{i}.")])
              for i in stage.transformer["h"]]
    return ([("ends", ends)] if ends else []) + blocks


# -----------------------------------------------------------------------------
# dp_shard: a stage's units sharded over the shard group (fsdp.py's Unit, Gathers, GradReduces)


def unit_of(dp, key):
    """fsdp's unit that computes `key` (the head is the ends' unit, computing again)."""
    return dp.by_key["ends" if key == "head" else key]


def shard_hooks(dp, stage, reshard):
    """The stage's ZeRO-3 hooks on fsdp.Gathers (dp.gathers, made per pass): gather(key) before
    unit `key` computes waits for its all-gather and issues the next ones. In a pipeline a unit
    is kept to the step's end (torchtitan's reshard_after_forward=False: one gather for every
    micro-batch). With one micro-batch and no pipeline (reshard) done(key, x) frees it after its
    forward and a Handoff on x gathers it again for backward, as fsdp.py: two all-gathers a step."""
    @torch.compiler.disable  # under --compile: messages, run as they are between the graphs
    def gather(key):
        dp.gathers.take(unit_of(dp, key))
        dp.gathers.prefetch()  # the next units' all-gathers travel while this one computes

    @torch.compiler.disable
    def done(key, x):
        if not reshard:
            return x
        dp.gathers.free(unit_of(dp, key))
        if not torch.is_grad_enabled():
            return x
        j = dp.forward_order.index(key)

        def then():  # backward reached key's output: the unit after it is done, key's begins
            dp.gathers.free(unit_of(dp, dp.forward_order[j + 1]))
            if j > 0:
                gather(key)
        return FSDP.Handoff.apply(x, then)
    stage.hooks(gather, done)


def new_pass(dp, train):
    """The all-gathers of one pass (a step, a validation batch): the units as they compute, or
    once each in a pipeline."""
    if dp.zero == 3:
        units = [unit_of(dp, k) for k in dp.forward_order]
        if dp.reshard:
            units += units[-2:0:-1] if train else []
        dp.gathers = FSDP.Gathers(list(dict.fromkeys(units)) if not dp.reshard else units, dp.prefetch)


def checkpoint_entries(stage, tp_group, writer, expert_writer=False):
    """tensor_parallel's entries, written by the first rank of the data and context axes only
    (writer); the last stage's tied copy loaded, never written (pipeline_parallel's rule); the
    experts' slices written by the first ep group of those axes (expert_writer)."""
    return [("transformer.wte.weight", p, index, False) if name == "lm_head.weight" else
            (name, p, p.ep_index, write and expert_writer) if hasattr(p, "ep_index") else
            (name, p, index, write and writer)
            for name, p, index, write in TP.checkpoint_entries(stage, tp_group)]


def clip(dp, stage, max_norm, groups, me):
    """The norm of the whole model's gradient, each element once, and the clip by it; summed
    never over cp or dp_replicate, which hold copies. Whole parameters: tensor_parallel's
    squared norm (shards, and replicas on tp rank 0), without the last stage's tied copy,
    summed over tp, then pp. Shards: every element of a unit lies in one rank's shard of the
    dp_shard group, so summed over dp_shard, tp and pp. A mixture's experts: each ep group holds
    every expert of its stage once, so their squares summed over ep (one float) are the stage's,
    counted on one rank of the sums that follow (tp rank 0 at dp_shard 0)."""
    if not max_norm:
        return 0.0
    if dp.units:
        sq = torch.stack([p.grad.pow(2).sum() if on else p.grad.new_zeros(()) for _, p, on in dp.pieces]).sum()
        grads, over = [p.grad for _, p, _ in dp.pieces], ("dp_shard", "tp", "pp")
    else:
        sharded, replicated = TP.split_params(stage)
        replicated = [p for p in replicated if not hasattr(p, "ep_index")]
        copy = stage.tied() if stage.last and not stage.first else None
        sq = TP.grad_sq_norm([p for p in sharded if p is not copy], replicated, groups["tp"])
        grads, over = [p.grad for p in sharded + replicated], ("tp", "pp")
    if dp.experts:
        experts = torch.stack([p.grad.pow(2).sum() for p in dp.experts]).sum()
        C.all_reduce(experts, group=groups["ep"])
        sq, grads = sq + experts * (me.tp == me.dp_shard == 0), grads + [p.grad for p in dp.experts]
    return M.clip_by_global_norm(sq, grads, max_norm, [groups[a] for a in over])


# -----------------------------------------------------------------------------
# the run


def layout(cfg, config, world, check=True):
    """-> the Mesh, or (check) one line and exit on every rank (before any message)."""
    pp, R, S, cp, tp = cfg.pp, cfg.dp_replicate, cfg.dp_shard, cfg.cp, cfg.tp
    rest = pp * S * cp * tp
    if not R and world % rest:
        M.die(f"--pp={pp} x --dp_shard={S} x --cp={cp} x --tp={tp} = {rest} ranks does not divide the world "
              f"size {world}")
    mesh = Mesh(pp, R or world // rest, S, cp, tp)
    if not check:
        return mesh
    if world_of(mesh) != world:
        M.die(" x ".join(f"--{a}={n}" for a, n in mesh._asdict().items()) + f" = {world_of(mesh)} ranks, "
              f"but the world has {world}: their product must equal the world size")
    if config.n_head % tp or config.vocab_size % tp:
        M.die(f"--tp={tp} must divide the {config.n_head} heads and the padded vocabulary ({config.vocab_size})")
    if cfg.sequence_parallel and config.block_size % tp:
        M.die(f"--sequence_parallel needs --block_size ({config.block_size}) divisible by --tp={tp}")
    if cfg.attention == "ulysses" and config.n_head % (tp * cp):
        M.die(f"--attention=ulysses needs --tp x --cp = {tp * cp} to divide the {config.n_head} heads")
    parts = cp * (2 if cfg.layout == "zigzag" else 1)
    if config.block_size % parts:
        M.die(f"--cp={cp} needs --block_size ({config.block_size}) divisible into {parts} equal chunks "
              f"({cfg.layout} layout{', two chunks a rank' if cfg.layout == 'zigzag' else ''})")
    if pp > config.n_layer:
        M.die(f"--pp={pp} stages but the model has {config.n_layer} blocks: each stage needs at least one")
    v = PP.virtual_stages(cfg)
    if cfg.schedule == "interleaved" and (v < 1 or cfg.n_micro % pp or pp * v > config.n_layer):
        M.die(f"--schedule=interleaved needs --n_micro ({cfg.n_micro}) divisible by --pp={pp} and --pp x "
              f"--virtual_stages={v} chunks of at least one of the {config.n_layer} blocks each")
    ep, E = cfg.ep, config.n_expert
    if E and (E % ep or S * cp % ep):
        M.die(f"--ep={ep} must divide the {E} experts (--n_expert) and --dp_shard x --cp = {S * cp}, "
              f"the ranks it borrows")
    if E and (cfg.schedule in ("zb", "zbv") or cfg.recompute == "full" or cfg.sequence_parallel or cfg.capacity_factor):
        M.die("--n_expert here: not with --schedule=zb or zbv, or --recompute=full (each runs the experts' all-to-alls "
              "again), --sequence_parallel (not yet), or --capacity_factor (its drop order is the whole global "
              "micro-batch's, which no ep group sees: expert_parallel.py has it)")
    dp = mesh.dp_replicate * S
    if cfg.batch_size % (dp * cfg.n_micro):
        M.die(f"--batch_size={cfg.batch_size} does not divide into {dp} data parallel ranks "
              f"(--dp_replicate x --dp_shard) x {cfg.n_micro} micro-batches")
    return mesh


def check_flags(cfg):
    """The flags alone, before any message: one line and exit on every rank."""
    if min(cfg.tp, cfg.pp, cfg.cp, cfg.dp_shard) < 1 or cfg.dp_replicate < 0:
        M.die("--pp, --dp_shard, --cp and --tp must be at least 1, --dp_replicate at least 0 (0: the rest)")
    for flag, allowed in (("schedule", PP.SCHEDULES), ("layout", CP.LAYOUTS), ("attention", tuple(CP.ATTENTION)),
                          ("dispatch", EP.DISPATCH), ("zero_stage", (1, 2, 3))):
        if getattr(cfg, flag) not in allowed:
            M.die(f"--{flag} takes {', '.join(map(str, allowed[:-1]))} or {allowed[-1]}, not {getattr(cfg, flag)!r}")
    cfg.n_micro = cfg.n_micro or (2 * cfg.pp if cfg.pp > 1 else 1)  # a pipeline needs m >= pp to fill
    if cfg.n_micro < 1 or cfg.bucket_mb <= 0 or cfg.prefetch < 0:
        M.die("--n_micro must be at least 1, --bucket_mb positive and --prefetch at least 0")
    if cfg.cp > 1 and (cfg.sequence_parallel or cfg.dropout):
        M.die("--cp > 1 needs --sequence_parallel=False and --dropout=0: the ring holds whole sequences' "
              "chunks, and its backward recomputes the attention weights without forward's masks")
    if cfg.ep < 1 or (cfg.ep > 1 and not cfg.n_expert):
        M.die(f"--ep={cfg.ep} must be at least 1, and more than 1 only with --n_expert (a mixture of experts)")


def build_stage(cfg, config, mesh, me, groups, device):
    """This rank's pipeline stage: its blocks cut over tp, their attention on the cp ring, the experts on ep."""
    ring = CP.Ring(groups["cp"], cfg.layout) if mesh.cp > 1 else None
    pos = CP.positions(config.block_size, me.cp, mesh.cp, cfg.layout, device) if ring else None
    make_moe = None
    if config.n_expert:
        wire = torch.bfloat16 if cfg.dtype == "bfloat16" else None  # the rows travel in the compute dtype
        make_moe = partial(EP.ExpertParallelMoE, mode=cfg.dispatch, wire_dtype=wire, group=groups["ep"], cp_group=groups["cp"],
                           aux_scale=config.aux_loss_coef / (config.n_layer * cfg.n_micro))
    layers = ParallelLayers(config, cfg.seed, groups["tp"], cfg.sequence_parallel, pos, ring, cfg.attention, make_moe)
    stage = PP.Stage(config, me.pp, mesh.pp, cfg.seed, PP.virtual_stages(cfg), cfg.schedule, layers, cfg.recompute)
    return stage.to(device), pos


def build_data_parallel(run, cfg, mesh, me, groups, stage):
    """What the data axes keep of `stage`, and its optimizer, loaded from --resume if given: fsdp's
    units, or the parameters whole with ddp's buckets. A mixture's experts stay whole, in neither."""
    dp = SimpleNamespace(units=[], buckets=None, pieces=[], zero=cfg.zero_stage if mesh.dp_shard > 1 else 0)
    expert_named = EP.named_experts(stage)
    dp.experts = [p for _, p in expert_named]
    dp.params = [p for p in stage.parameters() if not hasattr(p, "ep_index")]
    dp.replicated = TP.split_params(stage)[1]
    if dp.zero:
        dp.reshard = frees_after_forward(cfg, mesh)
        # gathered in the compute dtype where freed after forward, as fsdp.py (in fp32 each linear's
        # autocast copy would be saved for backward); in a pipeline the weights' gradients accumulate
        # over micro-batches in fp32, so the units stay fp32 there
        low = torch.bfloat16 if cfg.dtype == "bfloat16" and dp.reshard else torch.float32
        dp.live = FSDP.LiveUnits()  # an instrument: the most units gathered at once in a step
        dp.by_key = {key: FSDP.Unit(named, groups["dp_shard"], dp.zero, run.device, low, str(key), dp.live)
                     for key, named in stage_units(stage)}
        dp.units = list(dp.by_key.values())
        tied = stage.tied()
        # the units whose reduce-scatter may start in backward: not those whose gradients change after
        # it (the tied ends: the tie's sum; all under sequence parallelism: tp's sum of the replicas)
        early = [] if cfg.sequence_parallel else [u for u in dp.units if all(p is not tied for p in u.params)]
        dp.reduces = FSDP.GradReduces(early if cfg.overlap else [])
        dp.forward_order = [k for c in stage.chunks for k in ["ends"] * (c in (0, stage.n_chunks - 1))
                            + list(stage.chunks[c]) if k in dp.by_key] + ["head"] * dp.reshard
        dp.prefetch = cfg.prefetch
        if dp.zero == 3:
            shard_hooks(dp, stage, dp.reshard)
        # the clip counts each element once: each tp slice, the replicas on tp rank 0, not the last stage's tied copy
        copy, first = tied if stage.last and not stage.first else None, C.get_rank(groups["tp"]) == 0
        dp.pieces = [(name, piece, p is not copy and (hasattr(p, "tp_index") or first))
                     for u in dp.units for name, piece, p, _, _ in u.pieces()]
        dp.optimizer = M.make_optimizer([(name, p) for name, p, _ in dp.pieces] + expert_named, cfg, run.device)
    else:
        if mesh.dp_replicate > 1:
            dp.buckets = DDP.GradBuckets(dp.params, cfg.bucket_mb, cfg.overlap, groups["dp_replicate"])
        dp.optimizer = M.make_optimizer(stage.named_parameters(), cfg, run.device)
    writer = me.dp_replicate == me.dp_shard == me.cp == 0
    entries = checkpoint_entries(stage, groups["tp"], writer,
                                 me.dp_replicate == 0 and me.dp_shard * mesh.cp + me.cp < cfg.ep)
    if not dp.zero:
        M.restore(run, entries, dp.optimizer)  # both tied copies are loaded
        return dp
    dp.full_state = FSDP.FullState(dp.optimizer)  # the checkpoint holds full tensors: loaded whole, then cut
    masters = FSDP.full_params(dp.units)  # a parameter -> its fp32 full weights (a bf16 part's: apart)
    M.restore(run, [(name, masters.get(p, p), *rest) for name, p, *rest in entries], dp.full_state)
    FSDP.reshard(dp.units, dp.full_state, dp.optimizer)
    dp.optimizer.state.update({p: dp.full_state.state[p] for p in dp.experts if p in dp.full_state.state})
    dp.full_state.state.clear()
    free_units(dp)
    return dp


def free_units(dp):
    """ZeRO-3 at the step's end, and after validation: a pipeline's units; a checkpoint's fp32 copies."""
    for u in dp.units:
        if dp.zero == 3:
            u.free()
        u.free_masters()


def unshard(dp):
    """The full weights and Adam's moments, for a checkpoint (the experts' moments, kept whole)."""
    dp.full_state.state.update({p: dp.optimizer.state[p] for p in dp.experts})
    FSDP.unshard(dp.units, dp.optimizer, dp.full_state)


def frees_after_forward(cfg, mesh):
    """ZeRO-3 with one micro-batch and no pipeline frees each unit after its forward, as fsdp.py."""
    return getattr(cfg, "zero_stage", 3) == 3 and mesh.pp == 1 and cfg.n_micro == 1


def train_step(dp, stage, executor, plan, rows, cfg, groups, me):
    """One optimizer step: the schedule, the gradients reduced over every axis, the clip, the update."""
    if dp.buckets:
        dp.buckets.zero()
        dp.buckets.sync = not cfg.overlap
    elif dp.units:
        for u in dp.units:
            u.zero_grad()
    else:
        dp.optimizer.zero_grad(set_to_none=True)
    for p in dp.experts if dp.units or dp.buckets else []:
        p.grad = None
    if dp.units:
        new_pass(dp, train=True)
        dp.reduces.waits, dp.live.peak = [], 0
    losses = executor.run(plan, rows)
    reduce_gradients(dp, stage, cfg, groups)
    norm = clip(dp, stage, cfg.grad_clip, groups, me)
    dp.optimizer.step()
    if dp.zero in (1, 2):
        for u in dp.units:
            u.gather()  # every rank needs the updated full weights again
    return losses, norm


def reduce_gradients(dp, stage, cfg, groups):
    """Each gradient summed over the ranks that hold a copy of it, after the last backward."""
    if dp.buckets:
        dp.buckets.reduce()  # dp_replicate: the average over the replicas (waits for the overlapped ones)
    if cfg.sequence_parallel:
        C.all_reduce_flat([p.grad for p in dp.replicated], op="sum", group=groups["tp"])  # tp: replicas saw only their positions
    PP.sum_tied_grads(stage, groups["pp"])  # pp: the tie, between the two ends
    if dp.units:
        dp.reduces.finish(dp.units)  # dp_shard: each unit's gradient into this rank's shard
        free_units(dp)
        grads = [g for u in dp.units for g in u.grad_shards()]
        C.all_reduce_flat(grads, group=groups["cp"])  # cp: each rank saw its positions' share of the tokens
        C.all_reduce_flat(grads, group=groups["dp_replicate"])  # dp_replicate: HSDP's all-reduce of the shards
    else:
        C.all_reduce_flat(dp.buckets.buffers if dp.buckets else [p.grad for p in dp.params], group=groups["cp"])
    if not dp.experts:
        return
    grads = [p.grad for p in dp.experts]  # from the ep group's tokens: summed over the other data ranks
    C.all_reduce_flat(grads, group=groups["ep_dp"])  # ep_dp: the ranks that hold the same experts
    C.all_reduce_flat(grads, group=groups["dp_replicate"])
    for g in grads:  # the mean over the R·S·cp data ranks: ep of them were summed already
        g.div_(cfg.ep)


def main(argv=None):
    cfg = M.parse_args(DEFAULTS, argv, __doc__)
    check_flags(cfg)
    run = M.start(cfg, "parallel_nd", moe=True)
    rank, world, device, config = run.rank, run.world, run.device, run.config
    # 1. the groups: every group of every axis, made by every rank in one order
    mesh = layout(cfg, config, world)
    me, moe, n_micro, S, R = coords(rank, mesh), bool(config.n_expert), cfg.n_micro, mesh.dp_shard, mesh.dp_replicate
    groups = make_groups(rank, mesh, cfg.ep if moe else 0)
    print_mesh(groups, mesh)
    # 2. the stage: tensor parallel's blocks, with context parallel's ring and the experts' layer
    stage, pos = build_stage(cfg, config, mesh, me, groups, device)
    # 3. data parallelism applied to it: dp_shard's units or dp_replicate's buckets; the optimizer
    dp = build_data_parallel(run, cfg, mesh, me, groups, stage)
    # 4. the pipeline's runtime and its schedules; then 5. the loop
    b, s = cfg.batch_size // (R * S * n_micro), config.block_size // mesh.cp
    act_shape = (s // mesh.tp if cfg.sequence_parallel else s, b, config.n_embd)
    executor = PP.Executor(stage, act_shape, n_micro, run.autocast, torch.compile(stage) if cfg.compile else None,
                        groups["pp"], armed=[dp.buckets, dp.reduces if dp.units else None] if cfg.overlap else [])
    v = PP.virtual_stages(cfg)
    train_plan = PP.plan(cfg.schedule, mesh.pp, n_micro, me.pp, v)
    eval_plan = PP.plan(cfg.schedule, mesh.pp, n_micro, me.pp, v, train=False)
    head = PP.owner(cfg.schedule, mesh.pp, mesh.pp * v - 1)  # the pp rank with the last chunk (ZB-V: 0)
    last_stage = [r for r in range(world) if coords(r, mesh).pp == head]
    run.layout = dict(mesh._asdict(), zero_stage=cfg.zero_stage, layout=cfg.layout, schedule=cfg.schedule,
                      n_micro=n_micro, sequence_parallel=cfg.sequence_parallel,
                      **(dict(ep=cfg.ep, dispatch=cfg.dispatch) if moe else {}))
    if rank == 0:
        print(f"parallel_nd: {' '.join(f'{k}={x}' for k, x in run.layout.items())}, {world} ranks, "
              f"{M.param_count(config) / 1e6:.2f}M parameters, {n_micro} micro-batches of {b} x {s} tokens, "
              f"bubble {PP.bubble(cfg.schedule, mesh.pp, n_micro, v):.1%}")

    def rows(step, split):  # this data rank's rows of the global batch, its cp positions, in micro-batches
        batch = partial(M.batch, run, step, split, n_micro=n_micro, dp_rank=me.dp_replicate * S + me.dp_shard,
                        dp_size=R * S)
        return batch if pos is None else lambda k: tuple(t[:, pos] for t in batch(k))

    @torch.no_grad()
    def evaluate():
        stage.eval()
        losses = []
        with C.untracked():  # bookkeeping, not training traffic
            for k in range(cfg.eval_iters):
                if dp.units and (k == 0 or dp.reshard):  # a pipeline keeps its units to the end
                    new_pass(dp, train=False)
                losses += executor.run(eval_plan, rows(k, "val"), train=False)
            free_units(dp)
            loss = torch.stack(losses).mean() if stage.last else torch.zeros((), device=device)
            for axis in ("cp", "dp_shard", "dp_replicate"):  # equal shares of tokens
                C.all_reduce(loss, op="avg", group=groups[axis])
            C.broadcast(loss, src=C.group_ranks(groups["pp"])[head], group=groups["pp"])  # the last chunk's rank has it
        stage.train()
        return loss.item()

    for it in range(run.start_iter, cfg.max_iters):
        M.begin_iter(run, it, evaluate)
        # ---------------------------------------------------------------- the training step
        losses, norm = train_step(dp, stage, executor, train_plan, rows(it, "train"), cfg, groups, me)
        # ---------------------------------------------------------------- end of the training step
        state = state_bytes(dp, stage)
        waits = dp.reduces.waits + (dp.gathers.waits if dp.zero == 3 else []) if dp.units else []
        exposed = dict(exposed_shard_ms=1000 * sum(M.elapsed(t0, t1) for t0, t1 in waits),  # waited on dp_shard
                       max_gathered_units=dp.live.peak) if dp.units else {}  # as fsdp.py logs it
        if dp.units and M.checkpoint_due(cfg, it + 1):
            unshard(dp)  # the full weights and moments, for end_iter's checkpoint
        logged = moe_stats(run, stage, me, groups["ep"], cfg.dispatch) if moe else {}
        M.end_iter(run, loss=torch.stack(losses).mean() if losses else 0.0, grad_norm=norm, state_bytes=state,
                   loss_ranks=last_stage, axes=groups,
                   **formula_bytes(config, cfg, mesh, me.pp, logged.pop("routed", None)),
                   peak_micro=executor.peak_held, act_bytes=executor.peak_bytes, **exposed, **logged)
        free_units(dp)
    if dp.units and cfg.save_path:
        unshard(dp)
    return M.finish(run)

# -----------------------------------------------------------------------------
# instruments: the mesh printed, what the log records


def print_mesh(groups, mesh):
    """Rank 0 prints every rank's coordinates and groups, as the groups report them, one line a rank."""
    sizes = {a: len(C.group_ranks(g)) for a, g in groups.items()}
    me = coords(C.get_rank(), mesh)._asdict() | {f"{a}_{i}": r for a, g in groups.items()
                                                for i, r in enumerate(C.group_ranks(g))}
    rows = C.gather_stats(me)
    if rows is None:
        return
    strides = [world_of(mesh[i + 1:]) for i in range(len(AXES))]
    print("mesh: rank = " + " + ".join(f"{a}_rank*{s}" for a, s in zip(AXES, strides) if s > 1) + " + tp_rank")
    for r in range(len(rows["pp"])):
        if r == 16 and len(rows["pp"]) > 20:
            print(f"  ... {len(rows['pp']) - 16} more")
            break
        group = {a: [int(rows[f"{a}_{i}"][r]) for i in range(n)] for a, n in sizes.items()}
        print(f"  rank {r:4d} ({', '.join(AXES)}) = ({', '.join(str(int(rows[a][r])) for a in AXES)})  "
              + "  ".join(f"{a} group {group[a]}" for a in CREATED + tuple(a for a in EP_AXES if a in group)))


def state_bytes(dp, stage):
    """Parameters, gradients and Adam's state resident on this rank, each storage counted once."""
    if not dp.units:
        grads = (dp.buckets.buffers if dp.buckets else [p.grad for p in dp.params]) + [p.grad for p in dp.experts]
        return (M.tensor_bytes(dp.params + dp.experts) + M.tensor_bytes(grads)
                + M.optimizer_state_bytes(dp.optimizer))
    params = list(stage.parameters())  # the units' (views of their full weights) and the experts
    return FSDP.state_bytes(dp.units, dp.optimizer, params + [p.grad for p in params if p.grad is not None])


def formula_bytes(config, cfg, mesh, stage, routed=None):
    """The log's formula_bytes_<axis>: what axis_bytes says a rank of `stage` sends on each axis
    (alltoall: the ep rows as its group routed them this step)."""
    ep = {"ep": cfg.ep, "ep_dp": mesh.dp_shard * mesh.cp // cfg.ep} if config.n_expert else {}
    sizes, sent = dict(mesh._asdict(), **ep), axis_bytes(config, cfg, mesh, stage, routed)
    return {f"formula_bytes_{a}": sent[a] / n for a, n in sizes.items()}


def moe_stats(run, stage, me, ep_group, dispatch):
    """model.moe_log's fields (the experts' loads counted once: tp rank 0's), and under
    alltoall `routed`, the rows this rank's ep group dispatched to each other in the step,
    for the formula (an untracked all-reduce of one number: bookkeeping)."""
    logged = M.moe_log(run, stage, count_experts=me.tp == 0)
    if dispatch == "alltoall":
        routed = torch.tensor([logged["sent_tokens"]], dtype=torch.float64, device=run.device)
        with C.untracked():
            C.all_reduce(routed, group=ep_group)
        logged["routed"] = int(routed.item())
    return logged


# -----------------------------------------------------------------------------
# the traffic, in code: shared with bench/plan_cluster.py


def held(config, pp, stage, schedule=None, v=1):
    """(blocks, first, last) of pipeline rank `stage`: how many blocks its chunks hold
    (pipeline_parallel.chunks_of), whether it holds the embedding and the head."""
    chunks = PP.chunks_of(schedule, pp, stage, v)
    return sum(len(PP.stage_layers(config.n_layer, pp * v, c)) for c in chunks), 0 in chunks, pp * v - 1 in chunks


def block_params(config):
    """(sharded, replicated) elements of one block, a mixture's experts left out: tp splits
    c_attn, c_fc and the c_proj weights; norms, row-parallel biases and a router it replicates."""
    h, bias, E = config.n_embd, int(config.bias), config.n_expert
    if E:
        return 4 * h * h + 3 * h * bias, 2 * h + 3 * h * bias + E * h
    return 12 * h * h + 7 * h * bias, 2 * h + 4 * h * bias


def stage_params(config, tp, pp, stage, schedule=None, v=1):
    """(sharded, replicated): the elements a rank of `stage` holds but a mixture's experts:
    its 1/tp of what tp splits (the tied matrix's copy on a last stage too), and the rest."""
    h, bias = config.n_embd, int(config.bias)
    n_blocks, first, last = held(config, pp, stage, schedule, v)
    sharded, replicated = (n_blocks * n for n in block_params(config))
    sharded += config.vocab_size * h * (first + (last and not first))  # wte, or its copy as the head
    replicated += config.block_size * h * first + (h + h * bias) * last  # wpe; ln_f
    return sharded // tp, replicated


def expert_params(config, ep, pp, stage, schedule=None, v=1):
    """The experts' elements a rank of `stage` holds: E/ep of each of its blocks' experts
    (an expert is the dense MLP's 8h² + 5h), neither tp-split nor ZeRO-sharded."""
    h, bias, E = config.n_embd, int(config.bias), config.n_expert
    return held(config, pp, stage, schedule, v)[0] * E // ep * (8 * h * h + 5 * h * bias)


def unit_parts(config, cfg, mesh, stage, place=(None, 1)):
    """Each ZeRO unit of `stage` on one tp rank, its ends (if any) then its blocks (a mixture's
    experts left out), as fsdp.Unit lays out its parts, each padded apart: [[(elements, bytes
    each when gathered)]]. One fp32 part; under bf16 with the units freed after forward, a
    block's linear layers in bf16 (fsdp.gather_dtype), its norms (and a router) apart."""
    tp, h, bias, V = mesh.tp, config.n_embd, int(config.bias), config.vocab_size
    n_blocks, first, last = held(config, mesh.pp, stage, *place)
    ends = (V * h // tp + config.block_size * h) * first + (h + h * bias) * last + V * h // tp * (last and not first)
    sharded, replicated = block_params(config)
    low = getattr(cfg, "dtype", "float32") == "bfloat16" and frees_after_forward(cfg, mesh)
    linear = sharded // tp + (1 if config.n_expert else 2) * h * bias  # + row-parallel biases
    block = [(linear, 2), (sharded // tp + replicated - linear, 4)] if low else [(sharded // tp + replicated, 4)]
    return [[(ends, 4)]] * (first or last) + [block] * n_blocks


Message = namedtuple("Message", "axis stage what op n nbytes count")


def axis_messages(config, cfg, mesh, routed=None):
    """Every message of one training step: Message(axis, stage, what, op, n, nbytes, count):
    each group of `axis` on pipeline `stage` (None: the pipeline groups, which span the
    stages) sends `count` of op ("all_reduce"; "rs_ag", a reduce-scatter and an all-gather
    of nbytes; "all_gather", "reduce_scatter" of nbytes in all; "p2p", one message) among its
    n ranks. Activations travel in the compute dtype in tp regions and the ring, float32 across
    a stage boundary and in the embedding's region; gradients, weights and norms in float32.
    The experts' rows (ep, per MoE layer and micro-batch): alltoall, 4 passes (dispatch,
    combine, both backward) of `routed`, the rows one ep group's ranks dispatched to each
    other's experts in the step (None: uniform routing's (N-1)·b·s·k); allgather, the
    all-gathers and reduce-scatters of expert_parallel.exchange_bytes."""
    pp, R, S, cp, tp = mesh
    d, m, v = 2 if cfg.dtype == "bfloat16" else 4, cfg.n_micro, PP.virtual_stages(cfg)  # v: p·v-1 boundaries
    place = getattr(cfg, "schedule", None), v  # which chunks each rank holds (a plan's cfg may not say)
    vee = place[0] == "zbv"  # its chunks p-1 and p share a rank, and so do both ends of the tie
    b, s, h, V = cfg.batch_size // (R * S * m), config.block_size // cp, config.n_embd, config.vocab_size
    sp, clip = cfg.sequence_parallel, bool(cfg.grad_clip)
    # --recompute=full: backward reruns each block's forward, which stops once it has what
    # backward reads (torch's checkpoint "early stop"): the ring again, and every tp message
    # but the block's last g (an all-reduce; with sequence parallelism a reduce-scatter)
    rerun = getattr(cfg, "recompute", "none") == "full"  # (a plan's cfg may not say)
    region = "rs_ag" if sp else "all_reduce"  # f and g: the same bytes either way
    kv = 2 * b * s * h // tp  # K and V of one rank's positions and heads
    E, k_top, ep = config.n_expert, config.top_k, getattr(cfg, "ep", 1)  # (a plan's cfg may not say)
    alltoall = getattr(cfg, "dispatch", "alltoall") != "allgather"
    ulysses = getattr(cfg, "attention", "ring") == "ulysses"  # q, k, v, out by all-to-all, and back
    gathers = 2 if frees_after_forward(cfg, mesh) else 1  # freed after forward: gathered again for backward
    out = []
    for k in range(pp):
        n_blocks, first, last = held(config, pp, k, *place)
        sharded, replicated = stage_params(config, tp, pp, k, *place)
        parts = [p for unit in unit_parts(config, cfg, mesh, k, place) for p in unit] if S > 1 else []
        kept = sum(-(-n // S) for n, _ in parts) if S > 1 else sharded + replicated
        ring = m * n_blocks * cp * (cp - 1)  # every rank of the ring, every hop, every block, every micro-batch
        out += [Message("tp", k, "blocks, head", region, tp, b * s * h * d, m * ((2 if E else 4) * n_blocks + last)),
                Message("tp", k, "rerun", "all_gather" if sp else "all_reduce", tp, b * s * h * d,
                        m * n_blocks * (3 if sp else 1) * rerun),  # sp: 3 halves of a region (AG, RS, AG)
                Message("tp", k, "embedding", region, tp, b * s * h * 4, m * first),
                Message("tp", k, "loss", "all_reduce", tp, b * s * 4, 3 * m * last),
                Message("tp", k, "norm", "all_reduce", tp, 4, clip),
                Message("tp", k, "replicas", "all_reduce", tp, 4 * replicated, sp),  # sequence parallel's
                Message("cp", k, "k, v", "p2p", cp, kv * d, (2 + rerun) * ring * (not ulysses)),  # fwd, (rerun,) bwd
                Message("cp", k, "dk, dv", "p2p", cp, kv * 4, ring * (not ulysses)),
                Message("cp", k, "q, k, v, out", "p2p", cp, kv // 2 // cp * d, 4 * (2 + rerun) * ring * ulysses),
                Message("cp", k, "gradients", "all_reduce", cp, 4 * kept, 1),
                Message("dp_shard", k, "weights", "all_gather", S, sum(S * -(-n // S) * b for n, b in parts), gathers),
                Message("dp_shard", k, "gradients", "reduce_scatter", S, 4 * S * kept, 1),
                Message("dp_shard", k, "norm", "all_reduce", S, 4, clip),
                Message("dp_replicate", k, "gradients", "all_reduce", R, 4 * kept, 1)]
        if E:  # a mixture of experts: every block's MLP
            layers, n, experts = m * n_blocks, b * s, 4 * expert_params(config, ep, pp, k, *place)
            rows = (ep - 1) * n * k_top * layers if routed is None else routed
            out += [Message("ep", k, "counts", "all_gather", ep, ep * E * k_top * 8, layers * alltoall),
                    Message("ep", k, "rows", "p2p", ep, h * d, 4 * rows * alltoall),
                    Message("ep", k, "choices", "all_gather", ep, ep * n * k_top * 8, layers * (not alltoall)),
                    Message("ep", k, "rows", "rs_ag", ep, ep * n * h * d, layers * (not alltoall)),
                    Message("ep", k, "outputs", "rs_ag", ep, ep * n * k_top * h * d, layers * (not alltoall)),
                    Message("ep", k, "norm", "all_reduce", ep, 4, clip),
                    Message("ep_dp", k, "experts' gradients", "all_reduce", S * cp // ep, experts, 1),
                    Message("dp_replicate", k, "experts' gradients", "all_reduce", R, experts, 1),
                    Message("cp", k, "balance", "all_reduce", cp, b * 2 * E * 4, layers)]
    act = b * (s // tp if sp else s) * h * PP.BOUNDARY_DTYPE.itemsize
    out += [Message("pp", None, "activations", "p2p", pp, act, 2 * (pp * v - 1 - vee) * m),  # and their gradients
            Message("pp", None, "tie", "p2p", pp, V // tp * h * 4, 2 * (pp > 1 and not vee)),  # each end its half
            Message("pp", None, "norm", "all_reduce", pp, 4, clip)]
    return [msg for msg in out if msg.count and msg.n > 1]


def axis_bytes(config, cfg, mesh, stage=None, routed=None):
    """{axis: bytes per step}, summed over axis_messages(). stage=None: sent by every rank of
    the world on that axis; stage=k: by the ranks of one group of the axis that a rank of
    stage k is in (its pp group spans the stages). routed: as axis_messages()."""
    world = world_of(mesh)
    out = dict.fromkeys(axes(config), 0)
    for msg in axis_messages(config, cfg, mesh, routed):
        if stage is None or msg.stage in (None, stage):
            groups = 1 if stage is not None else world // msg.n // (1 if msg.axis == "pp" else mesh.pp)
            # what a group's N ranks send for one op of S bytes (docs/formulas.md): an all-reduce (or rs_ag)
            # 2(N-1)·S, an all-gather or reduce-scatter (N-1)·S, a message S
            sent = msg.nbytes if msg.op == "p2p" else (msg.n - 1) * msg.nbytes * (
                1 if msg.op in ("all_gather", "reduce_scatter") else 2)
            out[msg.axis] += msg.count * sent * groups
    return out


def traffic_per_rank(config, cfg, world):
    """Bytes a rank sends per step, on average over the world."""
    return sum(axis_bytes(config, cfg, layout(cfg, config, world, check=False)).values()) / world


def state_per_rank(config, cfg, mesh, stage, shard_rank):
    """Bytes of parameters, gradients and Adam's state on a rank of `stage` at dp_shard
    coordinate shard_rank: what state_bytes() measures. 16 bytes an element (weight, gradient,
    Adam's m and v) of the experts, and of the rest without dp_shard; with it fsdp.state_per_rank's
    rule on each part of this stage's units (P = S·⌈n/S⌉ padded, 8 bytes for each real element):
    ZeRO-3 4P/S + 4P/S, ZeRO-2 4P + 4P/S, ZeRO-1 4P + 4P."""
    S = mesh.dp_shard
    place = getattr(cfg, "schedule", None), PP.virtual_stages(cfg)
    total = 16 * expert_params(config, getattr(cfg, "ep", 1), mesh.pp, stage, *place) if config.n_expert else 0
    if S == 1:
        return total + 16 * sum(stage_params(config, mesh.tp, mesh.pp, stage, *place))
    for n, _ in [p for unit in unit_parts(config, cfg, mesh, stage, place) for p in unit]:
        size = -(-n // S)
        real = min(max(n - shard_rank * size, 0), size)
        total += {3: 8 * size, 2: 4 * S * size + 4 * size, 1: 8 * S * size}[cfg.zero_stage] + 8 * real
    return total


if __name__ == "__main__":
    M.main_guard(main)
