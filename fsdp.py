"""
Fully sharded data parallel (ZeRO-3, Rajbhandari et al. 2020): data parallel training in which
no rank holds the whole model; ZeRO-1 and ZeRO-2, the lighter rungs, beside it to compare.

    python fsdp.py                                    # one process
    torchrun --nproc_per_node=4 fsdp.py               # four ranks (CPU processes over gloo, or GPUs over NCCL)
    torchrun --nproc_per_node=8 fsdp.py --model=gpt2-xl --batch_size=64 --prefetch=2
    torchrun --nproc_per_node=4 fsdp.py --zero_stage=2    # or 1: a lighter rung, to compare memory

The lesson is everything above main(); below the fence after it: the instruments (LiveUnits,
state_bytes) and the formulas the tests hold the log to (traffic_per_rank, state_per_rank;
derived in docs/data_parallel.md and docs/formulas.md). parallel_nd.py drives the same Unit and
Gathers from its pipeline stage's hooks (Handoff, GradReduces, FullState: above main() too).

What is split: the batch, as in ddp.py, and the model in units (each block; the two ends, one
unit, so the tied matrix is gathered and reduced once): rank r keeps slice r of each, its shard
of the fp32 master weights, their gradient and Adam's m and v. What is sent, a micro-batch
(micro_step): ZeRO-3 all-gathers a unit just before it computes and frees it after, in forward
and again in backward (L-1 down to 0), where each block's gradient is then reduce-scattered
into the shards; --prefetch=k issues k all-gathers ahead (Gathers). ZeRO-1/2 keep the full
weights and all-gather them after the step; ZeRO-2 reduce-scatters in backward, ZeRO-1 once a
step. In bf16 a block's linear weights travel in bf16, the rest and every gradient in fp32.
"""
from collections import deque
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn as nn

import collectives as C
import model as M

DEFAULTS = dict(
    M.TRAIN_DEFAULTS,
    zero_stage=3,           # 3: weights, gradients and Adam's state sharded; 2: gradients and state; 1: state
    prefetch=1,             # ZeRO-3: units whose all-gathers run ahead of the one computing (0: none)
    n_micro=1,              # micro-batches per optimizer step (gradient accumulation)
)


@dataclass
class Sharded:
    """The model as this rank holds it, and what its steps need besides a batch."""
    units: list         # units[0]: the ends (embeddings, final norm, tied head); then the blocks in order
    cfg: object         # the flags: zero_stage, prefetch, recompute, compile
    autocast: object    # the run's autocast context (bf16), or a null one
    live: "LiveUnits"   # an instrument: which units' full weights exist now, the most at once (after main())


# -----------------------------------------------------------------------------
# the unit: a module's parameters as views into flat buffers, split N ways


def gather_dtype(name, low):
    """A unit's full copy of a parameter is what autocast computes with: a block's linear weights
    and biases in `low` (bf16: half the bytes sent); LayerNorm, a router and the ends in fp32
    (PyTorch FSDP's MixedPrecision(param_dtype=bf16) gathers all in bf16: a slightly other model).
    name: in the block, or in parallel_nd.py's stage ("transformer.h.3.attn.c_attn.weight")."""
    name = name.split(".", 3)[3] if name.startswith("transformer.h.") else name
    return low if name.startswith(("attn.", "mlp.")) and not name.startswith("mlp.router") else torch.float32


class Unit:
    """One unit on this rank: its parameters (`named`, a module's) become views into one flat
    buffer per gather dtype (a part), padded to a multiple of the group's N ranks. Rank r keeps
    slice r of each part in fp32 (its shard: the master weights the optimizer updates) and its
    gradient. ZeRO-3 holds the full buffers only from gather() to free(): freeing shrinks their
    storage to nothing under autograd's graph, gathering refills the same storage, so backward
    finds its weights there (as PyTorch's FSDP does). ZeRO-1/2 keep them, ZeRO-1 the full fp32
    gradient too. live: LiveUnits, or None."""

    def __init__(self, named, group, zero_stage, device, low=torch.float32, name="", live=None):
        self.group, self.zero_stage, self.name, self.live = group, zero_stage, name, live
        self.rank, self.world = C.get_rank(group), C.get_world_size(group)
        self.names, self.params = [n for n, _ in named], [p for _, p in named]
        by_dtype = {}
        for i, n in enumerate(self.names):
            by_dtype.setdefault(gather_dtype(n, low), []).append(i)
        self.parts, self.full, self.shards, self.grads, self.full_grad, self.masters = [], [], [], [], [], []
        for dtype, idx in by_dtype.items():  # (dtype, the parameters' indices, their offsets, shard size)
            offsets = [sum(self.params[j].numel() for j in idx[:k]) for k in range(len(idx))]
            size = -(-(offsets[-1] + self.params[idx[-1]].numel()) // self.world)
            flat = torch.zeros(size * self.world, device=device)
            for i, o in zip(idx, offsets):
                flat[o:o + self.params[i].numel()] = self.params[i].detach().reshape(-1)
            full = flat.to(dtype)  # fp32: the same tensor
            self.parts.append((dtype, idx, offsets, size))
            mine = slice(self.rank * size, (self.rank + 1) * size)
            self.shards.append(full[mine] if zero_stage < 3 and dtype == torch.float32 else flat[mine].clone())
            self.full_grad += [torch.zeros(size * self.world, device=device)] if zero_stage == 1 else []
            self.grads.append(self.full_grad[-1][mine] if zero_stage == 1 else torch.zeros(size, device=device))
            self.full.append(full)
            # a checkpoint's fp32 full weights: a fp32 part's are its full buffer; a bf16 part's a
            # buffer of their own, filled only for a save or a load (gather_masters)
            self.masters.append(full if dtype == torch.float32 else torch.empty(full.numel(), device=device))
        for p, view in zip(self.params, self.views(self.full)):
            p.data = view  # the module now computes on the full buffers
        self.free_masters()
        if zero_stage == 3:
            self.free()

    def views(self, flats):
        """Each parameter's view into buffers laid out as the full weights (one a part)."""
        out = [None] * len(self.params)
        for (_, idx, offsets, _), flat in zip(self.parts, flats):
            for i, o in zip(idx, offsets):
                out[i] = flat[o:o + self.params[i].numel()].view_as(self.params[i])
        return out

    def gather(self, async_op=False):
        """All-gather the shards into the full buffers (ZeRO-3: their memory given back first),
        each sent in its part's dtype (a bf16 part is cast before it is sent: half the bytes).
        -> the handles"""
        handles = []
        with M.span(f"all_gather {self.name}", comm=True):
            for full, shard in zip(self.full, self.shards):
                if not full.untyped_storage().nbytes():  # (resizing held memory would move it)
                    full.untyped_storage().resize_(full.numel() * full.element_size())
                handles.append(C.all_gather(full, shard.to(full.dtype), group=self.group, async_op=async_op))
        if self.live is not None:
            self.live.gathered(self)
        return handles

    def free(self):
        if self.live is not None:
            self.live.freed(self)
        for full in self.full:
            full.untyped_storage().resize_(0)

    def flat_grads(self, grads):
        """The full gradient, one flat fp32 buffer a part (the padding's gradient 0), from the
        parameters' gradients in order (a bf16 part's are summed over ranks in fp32)."""
        out = []
        for _, idx, offsets, size in self.parts:
            pad = size * self.world - offsets[-1] - self.params[idx[-1]].numel()
            out.append(torch.cat([grads[i].reshape(-1) for i in idx] + [grads[idx[0]].new_zeros(pad)]).float())
        return out

    def reduce_scatter(self, flats):
        """Start reduce-scattering the full gradient (flat_grads) into this rank's gradient
        shard: avg, the sum over ranks / N, the mean over the global batch. -> what
        add_reduced() needs to finish it."""
        pending = []
        for g in flats:
            out = torch.empty(g.numel() // self.world, device=g.device)
            with M.span(f"reduce_scatter {self.name}", comm=True):
                pending.append((out, g, C.reduce_scatter(out, g, op="avg", group=self.group, async_op=True)))
        return self, pending

    def pieces(self):
        """[(name, view, parameter, start, stop)]: each parameter's piece in this rank's shards,
        parameter.view(-1)[start:stop]; the optimizer updates the shard through these views and
        reads the gradient shard through their .grad (a matrix's piece a one-row matrix, for
        model.decays). Made once: the optimizer's state is keyed by these views."""
        if hasattr(self, "mine"):
            return self.mine
        out = []
        for (_, idx, offsets, size), shard, grad in zip(self.parts, self.shards, self.grads):
            start = self.rank * size
            for i, o in zip(idx, offsets):
                p = self.params[i]
                lo, hi = max(o, start), min(o + p.numel(), start + size)
                if lo >= hi:
                    continue  # this parameter lies in other ranks' shards
                piece, g = shard[lo - start:hi - start], grad[lo - start:hi - start]
                if p.dim() >= 2:
                    piece, g = piece.view(1, -1), g.view(1, -1)
                piece.grad = g
                out.append((self.names[i], piece, p, lo - o, hi - o))
        self.held = [(piece, piece.grad) for _, piece, *_ in out]
        self.mine = out
        return out

    # a module trained by backward() into .grad (parallel_nd.py's stage); fsdp.py's ZeRO-1 reduces
    # its full gradient once a step with start_reduce and finish_reduce too

    def grad_shards(self):
        """This rank's gradient shards, fp32, one a part (padding included)."""
        return self.grads

    def zero_grad(self):
        """Before a step: ZeRO-1's full gradient zeroed and handed to autograd as the parameters'
        .grad (it accumulates into them in place); ZeRO-2/3: none, autograd allocates."""
        if self.zero_stage == 1:
            for g in self.full_grad:
                g.zero_()
            for p, view in zip(self.params, self.views(self.full_grad)):
                p.grad = view

    def start_reduce(self):
        """Start reduce-scattering the parameters' .grad (every micro-batch's, summed), and drop
        it (ZeRO-2/3: the flat copy is on its way). ZeRO-1's .grad replaced by another tensor (a
        caller's zero_grad(set_to_none=True)) is added into the flat buffer, not lost. -> for finish_reduce()"""
        if self.zero_stage == 1:
            for p, view in zip(self.params, self.views(self.full_grad)):
                if p.grad is not None and p.grad.data_ptr() != view.data_ptr():
                    view += p.grad
            return self.reduce_scatter(self.full_grad)
        out = self.reduce_scatter(self.flat_grads([torch.zeros_like(p) if p.grad is None else p.grad
                                                   for p in self.params]))
        self.drop_grads()
        return out

    def finish_reduce(self, reducing):
        """The average over the group into the gradient shard (once a step: it replaces it)."""
        add_reduced(reducing, replace=True)
        self.drop_grads()

    def drop_grads(self):
        if self.zero_stage > 1:
            for p in self.params:
                p.grad = None

    # the fp32 full weights a checkpoint holds (a bf16 part's gathered apart from its full buffer)

    def gather_masters(self):
        for master, full, shard in zip(self.masters, self.full, self.shards):
            if master is not full:
                if not master.untyped_storage().nbytes():
                    master.untyped_storage().resize_(master.numel() * master.element_size())
                C.all_gather(master, shard, group=self.group)

    def free_masters(self):
        for master, full in zip(self.masters, self.full):
            if master is not full:
                master.untyped_storage().resize_(0)

    def master_params(self):
        """Each parameter's fp32 full weights (the parameter itself where it is fp32): made once,
        after a gather_masters(), and the same tensors from then on (a checkpoint's entries)."""
        if not hasattr(self, "master_views"):
            self.master_views = [p if p.dtype == torch.float32 else v
                                 for p, v in zip(self.params, self.views(self.masters))]
        return self.master_views


def add_reduced(reducing, replace=False):
    """Wait for a reduce-scatter from Unit.reduce_scatter and add it into the gradient shard (the
    sum over micro-steps, in fp32); replace: ZeRO-1's shard is a slice of the full gradient it was
    reduced from. The optimizer's pieces are pointed at the shard again: a caller's
    zero_grad(set_to_none=True) must not leave a piece without the gradient this rank reduced."""
    if reducing is None:
        return
    u, pending = reducing
    for (out, _, handle), grad in zip(pending, u.grads):  # the full gradient is freed only once sent
        handle.wait()
        grad.copy_(out) if replace else grad.add_(out)
    for piece, g in getattr(u, "held", []):
        piece.grad = g


class Gathers:
    """The all-gathers of one pass over the units, issued in `schedule` (the order the units
    compute in), at most `prefetch` ahead of the unit computing. take(u): u's full weights, its
    all-gather done (issued now if it was not ahead); a unit taken and not freed since is kept
    (parallel_nd.py's pipeline lists each unit once: every micro-batch reuses one gather).
    prefetch(): issue the next all-gathers, to travel while u computes. free(u): u's weights go,
    unless its next all-gather is already issued (the last block's, for backward, while its
    forward computes). waits: (start, end) of each wait, an instrument."""

    def __init__(self, schedule, prefetch):
        self.todo, self.ahead, self.n = deque(schedule), deque(), prefetch  # not issued yet; issued, not taken
        self.taken, self.waits = set(), []

    def take(self, u):
        if u in self.taken:
            return
        if not self.ahead:
            self._issue()
        unit, handles = self.ahead.popleft()
        assert unit is u, "units taken out of schedule order"  # every rank must gather in one order
        t0 = M.now(u.full[0].device)
        for h in handles:
            h.wait()
        self.waits.append((t0, M.now(u.full[0].device)))
        self.taken.add(u)

    def prefetch(self):
        while len(self.ahead) < self.n and self.todo:
            self._issue()

    def free(self, u):
        self.taken.discard(u)
        if all(unit is not u for unit, _ in self.ahead):
            u.free()

    def _issue(self):
        u = self.todo.popleft()
        self.ahead.append((u, u.gather(async_op=True)))


class Kept:
    """ZeRO-1/2's Gathers: every unit's full weights are kept; nothing to gather or free."""
    take = prefetch = free = staticmethod(lambda *_: None)


def leaf(t):
    """A new autograd leaf on the same memory: backward stops there and returns its gradient."""
    return t.detach().requires_grad_()


# -----------------------------------------------------------------------------
# a step, every ZeRO stage: ZeRO-3's units hold their full weights only while they compute


def forward(net, idx, gathers):
    """The embedding and the blocks, each on its just-gathered weights, freed as soon as it is
    done. -> (the output, per block (input, output) and, outside no_grad, the graph between them
    on weights since freed: backward re-gathers them into the same memory). What the graph keeps
    of the activations is --recompute's (model.recompute_block; full: the input only, the block
    rerun in backward on the re-gathered weights)."""
    ends = net.units[0]
    gathers.take(ends)
    gathers.prefetch()  # the next units' all-gathers travel while the embedding computes
    with torch.no_grad():
        h = ends.run(idx)
    gathers.free(ends)
    kept = []
    for k, u in enumerate(net.units[1:]):
        gathers.take(u)
        gathers.prefetch()
        with M.span(f"forward block {k}"):
            h_in = leaf(h)
            out = M.recompute_block(u.run, h_in, net.cfg.recompute)
            kept.append((h_in, out))
            h = out.detach()
        gathers.free(u)
    return h, kept


def micro_step(net, x, y, scale):
    """One micro-batch forward and backward, block by block; each unit's gradient, once
    complete, reduce-scattered into its gradient shard (ZeRO-1: added to its full gradient).
    scale: 1/n_micro, so the shards sum to the mean.
    -> (the loss, the bytes kept for backward at the head's backward)"""
    ends, blocks = net.units[0], net.units[1:]
    order = [ends, *blocks, ends, *reversed(blocks)]  # the order the units compute in
    gathers = Gathers(order, net.cfg.prefetch) if net.cfg.zero_stage == 3 else Kept()
    counting, saved = M.saved_bytes([], net.live.weights, on=not net.cfg.compile)  # gathered weights: not activations
    with net.autocast, counting:
        h, kept = forward(net, x, gathers)
        h = leaf(h)
        gathers.take(ends)  # the head: forward and backward at once, on one gather of the ends
        gathers.prefetch()
        loss = ends.run(h, y)
    gh, *g_ends = torch.autograd.grad(loss * scale, [h, *ends.params], allow_unused=True, materialize_grads=True)
    gathers.free(ends)
    reducing = None
    for k, u, (h_in, out) in zip(reversed(range(len(blocks))), reversed(blocks), reversed(kept)):
        gathers.take(u)  # the weights come back: into the memory the kept graph refers to
        gathers.prefetch()  # the next blocks' all-gathers travel while this one computes
        with M.span(f"backward block {k}"):
            gh, *g = torch.autograd.grad(out, [h_in, *u.params], gh)
        gathers.free(u)  # the weights go
        reducing = accumulate(net, u, g, reducing)
    # the embedding's gradient, without its weights: wte's row t and wpe's row p get the output
    # gradient wherever they were used, summed apart, then added to the head's (the tied matrix),
    # as autograd does: the one-process run's rounding
    gh, g = gh.float(), dict(zip(ends.names, g_ends))  # the residual stream's gradient: fp32 under autocast too
    g["wte.weight"] += torch.zeros_like(g["wte.weight"]).index_add_(0, x.view(-1), gh.view(-1, gh.size(-1)))
    g["wpe.weight"][:x.size(1)] += gh.sum(0)
    add_reduced(accumulate(net, ends, g_ends, reducing))  # the tied matrix: head and embedding, reduced once
    return loss.detach(), sum(saved.values())


def accumulate(net, u, grads, reducing):
    """ZeRO-1: u's gradient added to its full fp32 gradient (reduce-scattered once a step).
    ZeRO-2/3: the previous unit's reduce-scatter finished, u's started: it travels while the
    next block's backward computes. -> what is in flight"""
    if net.cfg.zero_stage == 1:
        for full_grad, g in zip(u.full_grad, u.flat_grads(grads)):
            full_grad += g  # in fp32
        return None
    add_reduced(reducing)
    return u.reduce_scatter(u.flat_grads(grads))


def train_step(net, run, it):
    """The gradients of one optimizer step, averaged into the units' gradient shards.
    -> (the loss, the most bytes a micro-step kept for backward)"""
    for u in net.units:
        for t in u.grads + u.full_grad:
            t.zero_()
    n = run.cfg.n_micro
    loss, act = torch.zeros((), device=run.device), 0
    for m in range(n):
        x, y = M.batch(run, it, "train", m, n, run.rank, run.world)
        micro_loss, micro_act = micro_step(net, x, y, 1.0 / n)
        loss, act = loss + micro_loss / n, max(act, micro_act)
    if net.cfg.zero_stage == 1:  # one reduce-scatter a unit per step, whatever n_micro is
        for u in net.units:
            u.finish_reduce(u.start_reduce())
    return loss, act


@torch.no_grad()
def val_loss(net, x, y):
    """The loss of a batch without gradients (validation): ZeRO-3 gathers in forward only."""
    ends = net.units[0]
    gathers = Gathers([*net.units, ends], net.cfg.prefetch) if net.cfg.zero_stage == 3 else Kept()
    with net.autocast:
        h, _ = forward(net, x, gathers)
        gathers.take(ends)
        loss = ends.run(h, y)
    gathers.free(ends)
    return loss


def gather_full_weights(net):
    """ZeRO-1/2: every unit's full weights all-gathered from the shards (at the start and after
    each optimizer step); a fp32 shard is already its slice of them: the others' are filled in."""
    for u in net.units:
        u.gather()


# -----------------------------------------------------------------------------
# the model as units


class Ends(nn.Module):
    """The model's two ends as one unit, so the tied matrix is stored, gathered and reduced once:
    ends(idx) is model.embed, ends(h, targets) model.head's loss."""

    def __init__(self, emb, ln_f):
        super().__init__()
        self.wte, self.wpe, self.ln_f = emb.wte, emb.wpe, ln_f

    def forward(self, x, targets=None):
        if targets is None:
            return M.embed(self.wte, self.wpe, x)
        return M.head(self.ln_f, self.wte.weight, x, targets)[1]


def build_units(config, cfg, device, live):
    """The ends and the blocks, one at a time from model.py's seeded init, each a Unit over the
    whole world whose module computes on its views. --compile: one compiled function runs every
    block (dynamo lifts a module's parameters to inputs, so the blocks share its graph)."""
    low = torch.bfloat16 if cfg.dtype == "bfloat16" else torch.float32
    # dynamic=False: the shapes never change, but the ends and the blocks share run's code,
    # and dynamo would take their different shapes for dynamic ones (symbolic graphs, slower to build)
    call = torch.compile(lambda module, *args: module(*args), dynamic=False) if cfg.compile else None
    units = []
    for i in range(-1, config.n_layer):
        if i < 0:
            module = Ends(M.build_unit(config, "embed", cfg.seed), M.build_unit(config, "ln_f", cfg.seed))
        else:
            module = M.build_unit(config, i, cfg.seed)
        module = module.to(device).eval()
        u = Unit(list(module.named_parameters()), None, cfg.zero_stage, device, low, f"h.{i}" if i >= 0 else "ends",
                 live)
        u.prefix = "transformer." + (f"h.{i}." if i >= 0 else "")
        u.run = partial(call, module) if call else module
        units.append(u)
    return units


def clip_global_norm(units, max_norm, group=None):
    """Clip by the global gradient norm. Every element lies in exactly one rank's shard (the
    padding's gradient is 0), so the sum of the ranks' squared norms is the global one,
    nothing counted twice. -> the norm (a tensor: reading it would wait for the device)."""
    grads = [g for u in units for g in u.grads]
    return M.clip_by_global_norm(torch.stack([g.pow(2).sum() for g in grads]).sum(), grads, max_norm, [group])


# -----------------------------------------------------------------------------
# for a module trained by one backward() into .grad (parallel_nd.py's stage): the unit's
# hand-offs in backward, its overlapped reduce-scatters, and the sharded state as full tensors


class Handoff(torch.autograd.Function):
    """x unchanged; when its gradient comes back, `then()` runs: the point where the unit
    after x is done with its weights and the unit that made x begins (free the one, take the other)."""

    @staticmethod
    def forward(ctx, x, then):
        ctx.then = then
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.then()
        return grad, None


class GradReduces:
    """The reduce-scatters of units whose gradients backward() accumulates in .grad: `overlap`'s
    units each start once the last micro-batch's backward (`sync`, set by the caller) has reached
    all their parameters: the previous unit's finished, this one's started and its .grad dropped,
    so backward holds one unit's gradient in flight, not two copies of all. finish(units): the
    one in flight waited for, the rest sent now. waits, as Gathers'."""

    def __init__(self, overlap):
        self.sync, self.seen, self.sent, self.reducing, self.waits = False, {}, set(), None, []
        for u in overlap:
            for p in u.params:
                p.register_post_accumulate_grad_hook(partial(self._accumulated, u))

    def _accumulated(self, u, p):
        if self.sync:
            self.seen[u] = self.seen.get(u, 0) + 1
            if self.seen[u] == len(u.params):  # u's gradient is complete: on its way now
                self._finish()
                self.reducing, self.sent = (u, u.start_reduce()), self.sent | {u}

    def _finish(self):
        if self.reducing:
            self.reducing[0].finish_reduce(self.reducing[1])
            self.reducing = None

    def finish(self, units):
        t0 = M.now(units[0].full[0].device)
        self._finish()
        for u in units:
            if u not in self.sent:
                u.finish_reduce(u.start_reduce())
        self.seen, self.sent = {}, set()
        self.waits.append((t0, M.now(units[0].full[0].device)))


class FullState:
    """What model.py's checkpoints see of a sharded optimizer: its param_groups (the learning
    rate) and a `state` keyed by the units' full fp32 parameters (Unit.master_params), filled by
    unshard() before a save, or by model.restore() before reshard(): full tensors, which any
    layout loads (parallel_nd.py's entries are tensor parallel slices: no flat piece names them)."""

    def __init__(self, optimizer):
        self.optimizer, self.state = optimizer, {}

    @property
    def param_groups(self):
        return self.optimizer.param_groups


@torch.no_grad()
def full_params(units):
    """{parameter: its full fp32 weights}, every unit gathered (a bf16 part's masters too), to
    load a checkpoint into. Untracked: not training traffic."""
    with C.untracked():
        for u in units:
            u.gather()
            u.gather_masters()
    return {p: m for u in units for p, m in zip(u.params, u.master_params())}


@torch.no_grad()
def unshard(units, optimizer, full_state):
    """Every unit's full weights (full_params) and Adam's moments all-gathered over the group
    into full-parameter tensors, into full_state, for a checkpoint. Untracked."""
    full_params(units)
    with C.untracked():
        for u in units:
            moments = {}
            for m in M.MOMENTS:
                mine = [torch.zeros_like(t) for t in u.masters]  # this rank's pieces, where they lie in the full part
                views = dict(zip(map(id, u.params), u.views(mine)))
                for _, piece, p, lo, hi in u.pieces():
                    views[id(p)].view(-1)[lo:hi] = optimizer.state[piece][m].reshape(-1)
                moments[m] = [torch.empty_like(t) for t in mine]
                for out, flat, (*_, size) in zip(moments[m], mine, u.parts):
                    C.all_gather(out, flat[u.rank * size:(u.rank + 1) * size].clone(), group=u.group)
            for p, *views in zip(u.master_params(), *(u.views(moments[m]) for m in M.MOMENTS)):
                full_state.state[p] = dict(zip(M.MOMENTS, views))


@torch.no_grad()
def reshard(units, full_state, optimizer):
    """After model.restore() loaded the full parameters (full_params) and their moments: each
    rank keeps its shard of both (and the step count), as the run had them when it saved."""
    for u in units:
        for shard, master, (*_, size) in zip(u.shards, u.masters, u.parts):
            shard.copy_(master[u.rank * size:(u.rank + 1) * size])
        master_of = dict(zip(map(id, u.params), u.master_params()))
        for _, piece, p, lo, hi in u.pieces():
            state = full_state.state.get(master_of[id(p)])
            if state:
                optimizer.state[piece] = dict(step=state["step"].clone(), **{
                    m: state[m].reshape(-1)[lo:hi].reshape(piece.shape).clone() for m in M.MOMENTS})


# -----------------------------------------------------------------------------
# the run


def main(argv=None):
    cfg = M.parse_args(DEFAULTS, argv, __doc__)
    if cfg.zero_stage not in (1, 2, 3):
        M.die(f"--zero_stage takes 1, 2 or 3, not {cfg.zero_stage}")
    if cfg.prefetch < 0 or cfg.n_micro < 1:
        M.die("--prefetch must be at least 0 and --n_micro at least 1")
    if cfg.dropout:
        M.die("fsdp.py needs --dropout=0: backward recomputes the blocks and would need forward's random masks")
    run = M.start(cfg, "fsdp")
    rank, world, device, config = run.rank, run.world, run.device, run.config
    if cfg.batch_size % (world * cfg.n_micro):
        M.die(f"--batch_size={cfg.batch_size} does not divide into {world} rank{'s' * (world > 1)} x {cfg.n_micro} micro-steps")
    zero_stage = cfg.zero_stage
    live = LiveUnits()
    net = Sharded(build_units(config, cfg, device, live), cfg, run.autocast, live)
    units = net.units
    # the optimizer's pieces, and a checkpoint's (every rank's shards): ("flat", start, stop) of a global parameter
    pieces = [(u.prefix + name, p, ("flat", lo, hi)) for u in units for name, p, _, lo, hi in u.pieces()]
    optimizer = M.make_optimizer([(name, p) for name, p, _ in pieces], cfg, device)
    M.restore(run, [(name, p, index, True) for name, p, index in pieces], optimizer)
    if zero_stage < 3:
        with C.untracked():
            gather_full_weights(net)  # from the shards, loaded ones included
    if rank == 0:
        n_params = M.param_count(config)
        shard = sum(size for u in units for *_, size in u.parts)
        print(f"fsdp: {world} rank{'s' * (world > 1)}, ZeRO-{zero_stage}, prefetch {cfg.prefetch}, {n_params / 1e6:.2f}M parameters "
              f"in {len(units)} units, {shard / 1e6:.2f}M per rank ({shard * world - n_params} padding), "
              f"{cfg.batch_size // (world * cfg.n_micro)} x {config.block_size} tokens per rank per micro-step")

    @torch.no_grad()
    def evaluate():
        losses = torch.zeros(cfg.eval_iters, cfg.n_micro, device=device)
        with C.untracked():  # evaluation's gathers and the loss average are not training traffic
            for k in range(cfg.eval_iters):
                for m in range(cfg.n_micro):  # the same rows as a training step: the whole global batch
                    losses[k, m] = val_loss(net, *M.batch(run, k, "val", m, cfg.n_micro, rank, world))
            C.all_reduce(losses, op="avg")
        return losses.mean().item()

    for it in range(run.start_iter, cfg.max_iters):
        M.begin_iter(run, it, evaluate)
        net.live.peak = 0
        # ---------------------------------------------------------------- the training step
        loss, act = train_step(net, run, it)
        with M.span("optimizer"):
            norm = clip_global_norm(units, cfg.grad_clip) if cfg.grad_clip else 0.0
            optimizer.step()  # on this rank's shards only
        if zero_stage < 3:
            gather_full_weights(net)  # every rank needs every unit's updated weights again
        # ---------------------------------------------------------------- end of the training step
        M.end_iter(run, loss=loss, grad_norm=norm, state_bytes=state_bytes(units, optimizer),
                   act_bytes=act, max_gathered_units=net.live.peak if zero_stage == 3 else len(units))
    return M.finish(run)


# -----------------------------------------------------------------------------
# instruments: what is alive, what is kept, and the formulas they are held to


class LiveUnits:
    """Which units' full weights hold memory now, and the most at once: told by each unit's
    gather and free. weights: their storages, which saved_bytes leaves out (autograd keeps
    weights by reference: they are no activations)."""

    def __init__(self):
        self.units, self.weights, self.peak = set(), set(), 0

    def gathered(self, u):
        self.units.add(u)
        self.weights.update(t.untyped_storage().data_ptr() for t in u.full)
        self.peak = max(self.peak, len(self.units))

    def freed(self, u):
        if u in self.units:
            self.units.discard(u)
            self.weights.difference_update(t.untyped_storage().data_ptr() for t in u.full)


def state_bytes(units, optimizer, extra=()):
    """Parameters, gradients and Adam's state resident on this rank, each storage counted once:
    a shard that is a slice of the full weights, or of the full gradient, is no copy. extra:
    other tensors held (parallel_nd.py's: the parameters and their .grad)."""
    kept = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
            for t in [t for u in units for t in u.shards + u.grads + u.full + u.full_grad] + list(extra)}
    return sum(kept.values()) + M.optimizer_state_bytes(optimizer)


def unit_parts(config, cfg, world):
    """Every unit's parts from the config alone: (padded elements, bytes each when gathered)."""
    d, L = config.n_embd, config.n_layer
    norms = (4 if config.bias else 2) * d                # ln_1, ln_2: autocast keeps LayerNorm in fp32
    linear = 12 * d * d + (9 * d if config.bias else 0)  # c_attn, attn.c_proj, c_fc, mlp.c_proj
    ends = M.param_count(config) - L * (norms + linear)     # wte (tied), wpe, ln_f
    if cfg.dtype == "bfloat16":
        found = [(ends, 4)] + L * [(norms, 4), (linear, 2)]
    else:
        found = [(ends, 4)] + L * [(norms + linear, 4)]
    return [(n, -(-n // world) * world, b) for n, b in found]  # (elements, padded, bytes)


def traffic_per_rank(config, cfg, world):
    """Bytes one rank sends per step (the average over ranks): each unit's padded parts all-gathered
    in their dtype, reduce-scattered in fp32, plus the norm's float; ZeRO-3 3(N-1)/N·4Ψ·n_micro in
    fp32 (docs/formulas.md)."""
    found = unit_parts(config, cfg, world)
    gather, reduce = sum(p * b for _, p, b in found), sum(p * 4 for _, p, _ in found)
    a = cfg.n_micro
    gathers, reduces = {3: (2 * a, a), 2: (1, a), 1: (1, 1)}[cfg.zero_stage]
    norm = 2 * (world - 1) / world * 4 if cfg.grad_clip else 0
    return (world - 1) / world * (gathers * gather + reduces * reduce) + norm


def state_per_rank(config, cfg, world):
    """Bytes of parameters, gradients and Adam's state on each rank (what state_bytes() measures):
    P padded elements, S = P/N a rank's, R_r of them real, W the full weights, _lo the bf16 parts;
    ZeRO-3 8S + 8R_r, in fp32 16Ψ/N (docs/formulas.md). -> [bytes on rank r for r in range(N)]"""
    found = unit_parts(config, cfg, world)
    P = sum(p for _, p, _ in found)
    P_lo = sum(p for _, p, b in found if b == 2)
    S, S_lo, W = P // world, P_lo // world, 2 * P_lo + 4 * (P - P_lo)
    kept = {3: 8 * S, 2: W + 4 * S_lo + 4 * S, 1: W + 4 * S_lo + 4 * P}[cfg.zero_stage]
    real = [sum(min(max(n - r * (p // world), 0), p // world) for n, p, _ in found) for r in range(world)]
    return [kept + 8 * R for R in real]


if __name__ == "__main__":
    M.main_guard(main)
