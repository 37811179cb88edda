"""
Fully sharded data parallel (ZeRO-3, Rajbhandari et al. 2020): data parallel training
in which no rank holds the whole model. Parameters, gradients and Adam's state are
split N ways, and a unit's full weights exist only while it computes.

    python fsdp.py                                    # one process
    torchrun --nproc_per_node=4 fsdp.py               # four ranks (CPU processes over gloo, or GPUs over NCCL)
    torchrun --nproc_per_node=8 fsdp.py --model=gpt2-xl --batch_size=64 --prefetch=2
    torchrun --nproc_per_node=4 fsdp.py --zero_stage=2    # a lighter variant, to compare memory

What it splits. The model is cut into units: each block, and the model's two ends
(embeddings, final norm, and the head, which reuses the token embedding: the tied
matrix lives in one unit, so it is stored, gathered and reduced once). A unit's
parameters lie end to end in a flat buffer, padded to a multiple of N, and rank r
keeps slice r, its shard, in fp32: the master weights the optimizer updates. Each unit
is built alone from model.py's seeded init and only the shard is kept. The batch is
split as in ddp.py.

What it sends, and when, for each micro-batch (zero3_micro_step):
  forward   all-gather a unit's shards into its full weights just before it runs, free
            them right after: the ends (embedding), blocks 0..L-1, the ends (head)
  head      forward and backward at once, so that one gather serves both
  backward  all-gather each block again (L-1 down to 0), recompute it, backpropagate,
            free it, and reduce-scatter its gradient into this rank's gradient shard
            (avg: the mean over the global batch, as DDP's). The embedding's backward
            needs no weights (the output gradient is added into the rows the lookup
            read), so the ends' gradient, head and embedding, is reduce-scattered once.
A ring all-gather or reduce-scatter of S bytes makes each rank send (N-1)/N·S, so with
Ψ parameters (padded), per rank per step in fp32

    3(N-1)/N · 4Ψ · grad_accum    + one float for the global gradient norm

(the README's "The numbers behind the strategies"): one gather more than DDP's
2(N-1)/N·4Ψ, to hold 16Ψ/N bytes of state per rank (weight, gradient, Adam's m and v)
instead of 16Ψ.

Prefetch. When a unit starts computing, the all-gathers of the next --prefetch units
are issued and travel while it computes; a block's reduce-scatter travels while the
next block's backward computes. So 1 + prefetch units' full weights exist at most
(max_gathered_units in the log, counted from the buffers); --prefetch=0 waits for each.

Recompute. Autograd keeps what backward needs, for a linear layer its weight, and would
keep every gathered unit alive. So forward runs each block without autograd and keeps
only its input; backward gathers the block again and recomputes it with autograd.

Mixed precision (--dtype=bfloat16): the same model as ddp.py's autocast run. Autocast
computes a linear layer in bf16 and LayerNorm and the embedding lookup in fp32, so a
block's linear weights and biases are cast to bf16 before they are gathered (half the
bytes, the very rounding autocast does), its LayerNorms travel in fp32 as a second
small part, and the ends in fp32 (the lookup reads wte in fp32; the head casts it as
autocast does). Gradients are reduce-scattered and accumulated in fp32. With Ψ_lin the
blocks' linear parameters: (N-1)/N · (2(2Ψ_lin + 4(Ψ - Ψ_lin)) + 4Ψ) · grad_accum.
(PyTorch FSDP's MixedPrecision(param_dtype=bf16) gathers everything in bf16: fewer
bytes, but its embedding and norms run on rounded weights, a slightly other model.)

--zero_stage=1|2 (zero12_step): every rank keeps every unit's full weights (nothing
gathered in forward or backward, no recompute) and shards Adam's state (1), or the
gradients too (2: a unit's gradient is reduce-scattered as soon as it is complete; 1
keeps the full fp32 gradient and reduce-scatters it once a step). After the step each
rank all-gathers its updated shards (into the full weights, in the dtypes above): in
fp32 2(N-1)/N·4Ψ per step, DDP's traffic (ZeRO-2 with grad_accum: (grad_accum + 1)
(N-1)/N·4Ψ). State per rank in fp32: ZeRO-1 8Ψ + 16Ψ/N bytes, ZeRO-2 4Ψ + 16Ψ/N,
ZeRO-3 16Ψ/N.

Checkpoints: every rank writes its shards, each a ("flat", start, stop) piece of a
global parameter, so any strategy at any world size can load them.
"""
import weakref
from collections import deque, namedtuple
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

import collectives as C
import model as M

DEFAULTS = dict(M.TRAIN_DEFAULTS, zero_stage=3, prefetch=1, grad_accum=1)


def traffic_per_rank(config, cfg, world):
    """The docstring's formula, per rank per step: each part of each unit (padded to a
    multiple of N) gathered twice and reduce-scattered once per micro-step (ZeRO-3), or
    reduce-scattered (ZeRO-2: per micro-step) and gathered once a step (ZeRO-1/2). A
    gather sends the part's dtype, a reduce-scatter fp32. Plus the norm's one float."""
    d, L = config.n_embd, config.n_layer
    norms = (4 if config.bias else 2) * d                # ln_1, ln_2: autocast keeps LayerNorm in fp32
    linear = 12 * d * d + (9 * d if config.bias else 0)  # c_attn, attn.c_proj, c_fc, mlp.c_proj
    ends = M.param_count(config) - L * (norms + linear)     # wte (tied), wpe, ln_f
    if cfg.dtype == "bfloat16":  # (elements, bytes each when gathered)
        parts = [(ends, 4)] + L * [(norms, 4), (linear, 2)]
    else:
        parts = [(ends, 4)] + L * [(norms + linear, 4)]
    padded = [(-(-n // world) * world, b) for n, b in parts]
    gather, reduce = sum(n * b for n, b in padded), sum(n * 4 for n, _ in padded)
    a = cfg.grad_accum
    gathers, reduces = {3: (2 * a, a), 2: (1, a), 1: (1, 1)}[cfg.zero_stage]
    norm = 2 * (world - 1) / world * 4 if cfg.grad_clip else 0
    return (world - 1) / world * (gathers * gather + reduces * reduce) + norm


# -----------------------------------------------------------------------------
# the model as functions of its weights: a unit runs on whatever full weights it is
# handed, and one compiled function serves every block (the weights are arguments)


def embed(w, idx):
    """model.embed: token and position embeddings, looked up in fp32 (as autocast does)."""
    pos = torch.arange(idx.shape[1], device=idx.device)
    return F.embedding(idx, w["wte.weight"]) + F.embedding(pos, w["wpe.weight"])


def block_forward(x, flats, layout, n_head):
    """model.Block's forward on one unit's full flat buffers (dropout 0)."""
    w = layout.views(flats)
    B, T, d = x.shape
    a = F.layer_norm(x, (d,), w["ln_1.weight"], w.get("ln_1.bias"))
    q, k, v = F.linear(a, w["attn.c_attn.weight"], w.get("attn.c_attn.bias")).chunk(3, dim=2)
    q, k, v = (t.view(B, T, n_head, d // n_head).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, d)
    x = x + F.linear(y, w["attn.c_proj.weight"], w.get("attn.c_proj.bias"))
    m = F.layer_norm(x, (d,), w["ln_2.weight"], w.get("ln_2.bias"))
    m = F.gelu(F.linear(m, w["mlp.c_fc.weight"], w.get("mlp.c_fc.bias")), approximate="tanh")
    return x + F.linear(m, w["mlp.c_proj.weight"], w.get("mlp.c_proj.bias"))


def head_loss(h, flats, layout, targets):
    """model.head: final norm, logits through the tied matrix, the mean cross-entropy in fp32."""
    w = layout.views(flats)
    logits = F.linear(F.layer_norm(h, (h.size(-1),), w["ln_f.weight"], w.get("ln_f.bias")), w["wte.weight"])
    return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))


def embedding_backward(g, idx, gh):
    """The embedding's gradient without its weights: token t's row of wte and position p's
    row of wpe receive the output gradient at every place they were used. The lookup's
    gradient is summed apart, then added to the head's (g holds it), as autograd does for
    the tied matrix: the same rounding as the one-process run."""
    gh = gh.float()  # the residual stream's gradient: fp32 under autocast too
    g["wte.weight"] += torch.zeros_like(g["wte.weight"]).index_add_(0, idx.view(-1), gh.view(-1, gh.size(-1)))
    g["wpe.weight"][:idx.size(1)] += gh.sum(0)


# -----------------------------------------------------------------------------
# units: flat buffers, split N ways

Part = namedtuple("Part", "dtype numel shard_size params")  # params: [(name, offset, numel, shape)]


def gather_dtype(name, low):
    """What a unit's full copy of a parameter is in: what autocast computes with. A block's
    linear weights and biases in `low` (bf16 in a bf16 run); LayerNorm and the ends fp32."""
    return low if name.startswith(("attn.", "mlp.")) else torch.float32


class Layout:
    """Where a unit's parameters lie: one flat buffer per gather dtype (a part: one in fp32
    runs; a bf16 block has its linear weights and its LayerNorms), each padded to a multiple
    of the group's size N so that it splits into N equal shards. Every block has the same
    layout, and shares this one object, so one compiled block function serves them all."""

    def __init__(self, module, low, world):
        by_dtype = {}
        for name, p in module.named_parameters():
            by_dtype.setdefault(gather_dtype(name, low), []).append((name, p.numel(), tuple(p.shape)))
        self.parts = []
        for dtype, params in by_dtype.items():
            offsets = [0]
            for _, n, _ in params:
                offsets.append(offsets[-1] + n)
            self.parts.append(Part(dtype, offsets[-1], -(-offsets[-1] // world),
                                   [(name, o, n, shape) for (name, n, shape), o in zip(params, offsets)]))

    def views(self, flats):
        """name -> that parameter's view into the unit's full flat buffers (weights or gradients)."""
        return {name: flat[o:o + n].view(shape)
                for part, flat in zip(self.parts, flats) for name, o, n, shape in part.params}


class Unit:
    """One unit of sharding on this rank: its shard of each part (fp32 master weights, which
    the optimizer updates) and the shard's gradient. ZeRO-1/2 also keep `full`, the full
    weights; ZeRO-1 `full_grad`, the full fp32 gradient."""

    def __init__(self, module, prefix, layout, group, device):
        rank, world = C.get_rank(group), C.get_world_size(group)
        params = dict(module.named_parameters())
        self.prefix, self.layout, self.shards = prefix, layout, []
        self.starts = [rank * part.shard_size for part in layout.parts]  # where this rank's shard begins in each part
        for part, start in zip(layout.parts, self.starts):
            flat = torch.zeros(part.shard_size * world)
            for name, o, n, _ in part.params:
                flat[o:o + n] = params[name].detach().reshape(-1)
            self.shards.append(flat[start:start + part.shard_size].clone().to(device))
        self.grads = [torch.zeros_like(s) for s in self.shards]
        self.full = self.full_grad = None

    def optimizer_params(self):
        """[(GPT's parameter name, view, ("flat", start, stop))] for the piece of each parameter
        in this rank's shards: global.view(-1)[start:stop]. The optimizer updates the shard in
        place through these views and reads the gradient shard through their .grad. nanoGPT's
        decay rule (model.decays) looks at the shape, so a piece of a matrix is a one-row matrix."""
        out = []
        for part, start, shard, grad in zip(self.layout.parts, self.starts, self.shards, self.grads):
            for name, o, n, shape in part.params:
                lo, hi = max(o, start), min(o + n, start + part.shard_size)
                if lo >= hi:
                    continue  # this parameter lies in other ranks' shards
                p, g = shard[lo - start:hi - start], grad[lo - start:hi - start]
                if len(shape) >= 2:
                    p, g = p.view(1, -1), g.view(1, -1)
                p.grad = g
                out.append((self.prefix + name, p, ("flat", lo - o, hi - o)))
        return out


def build_units(config, cfg, group, device):
    """The ends and the blocks, one at a time from model.py's seeded init; only the shards stay."""
    low = torch.bfloat16 if cfg.dtype == "bfloat16" else torch.float32
    world = C.get_world_size(group)
    emb = M.build_unit(config, "embed", cfg.seed)
    ends = nn.ModuleDict(dict(wte=emb.wte, wpe=emb.wpe, ln_f=M.build_unit(config, "ln_f", cfg.seed)))
    units = [Unit(ends, "transformer.", Layout(ends, low, world), group, device)]
    block_layout = None
    for i in range(config.n_layer):
        block = M.build_unit(config, i, cfg.seed)
        block_layout = block_layout or Layout(block, low, world)
        units.append(Unit(block, f"transformer.h.{i}.", block_layout, group, device))
    return units


# -----------------------------------------------------------------------------
# ZeRO-3's communication: gather a unit, free it, reduce-scatter its gradient


def leaf(t):
    """A new autograd leaf on the same memory: backward stops there and returns its gradient."""
    return t.detach().requires_grad_()


class LiveUnits:
    """How many units' full weights exist right now, and the most at once. Counted from the
    buffers themselves, at each allocation (the only moment the count can rise): a unit is
    alive while any of its buffers still holds memory, whoever refers to it."""

    def __init__(self):
        self.alive, self.peak = [], 0  # per gathered unit, weak references to its buffers

    def allocated(self, buffers):
        self.alive = [refs for refs in self.alive if any(self._holds_memory(r()) for r in refs)]
        self.alive.append([weakref.ref(b) for b in buffers])
        self.peak = max(self.peak, len(self.alive))

    @staticmethod
    def _holds_memory(t):
        return t is not None and t.untyped_storage().nbytes() > 0


def gather_unit(u, group, live):
    """Start all-gathering unit u's shards into its full weights, one buffer per part in the
    part's dtype (a bf16 part is cast before it is sent: half the bytes). -> (buffers, handles)"""
    world = C.get_world_size(group)
    full, handles = [], []
    for part, shard in zip(u.layout.parts, u.shards):
        buf = torch.empty(part.shard_size * world, dtype=part.dtype, device=shard.device)
        handles.append(C.all_gather(buf, shard.to(part.dtype), group=group, async_op=True))
        full.append(buf)
    live.allocated(full)
    return full, handles


def free(full):
    """A unit's full weights go now: the memory is released even where a reference to the
    tensor remains (autograd's graph, the communication thread's last job), as PyTorch's
    FSDP frees it, by shrinking the storage to nothing."""
    for t in full:
        t.untyped_storage().resize_(0)


class Gathers:
    """The all-gathers of one pass over the units, issued in `schedule`, the order in which
    the units will compute, and at most `prefetch` ahead of the unit computing.
    take(u): u's full weights, its all-gather done (issued now if it was not ahead).
    prefetch(): issue the next units' all-gathers, to travel while u computes."""

    def __init__(self, schedule, prefetch, group, live):
        self.todo, self.ahead = deque(schedule), deque()  # not issued yet; issued, not yet taken
        self.prefetch_depth, self.group, self.live = prefetch, group, live

    def take(self, u):
        if not self.ahead:
            self._issue()
        unit, full, handles = self.ahead.popleft()
        assert unit is u, "units taken out of schedule order"  # every rank must gather in one order
        for h in handles:
            h.wait()
        return full

    def prefetch(self):
        while len(self.ahead) < self.prefetch_depth and self.todo:
            self._issue()

    def _issue(self):
        u = self.todo.popleft()
        self.ahead.append((u, *gather_unit(u, self.group, self.live)))


def reduce_scatter_grad(u, grads, group):
    """Start reduce-scattering unit u's full gradient (one buffer per part) into this rank's
    gradient shard, in fp32: avg, the sum over ranks / N, so the gradient is the mean over
    the global batch. -> what add_reduced() needs to finish it."""
    pending = []
    for g in grads:
        g = g.float()  # a bf16 part's gradient is summed over ranks in fp32
        out = torch.empty(g.numel() // C.get_world_size(group), device=g.device)
        pending.append((out, g, C.reduce_scatter(out, g, op="avg", group=group, async_op=True)))
    return u, pending


def add_reduced(reducing):
    """Wait for a reduce-scatter from reduce_scatter_grad and add it into the gradient shard
    (the sum over micro-steps, in fp32)."""
    if reducing is None:
        return
    u, pending = reducing
    for (out, _, handle), grad in zip(pending, u.grads):  # the full gradient is freed only once sent
        handle.wait()
        grad += out


# -----------------------------------------------------------------------------
# the ZeRO-3 step


@torch.no_grad()
def zero3_forward(units, idx, gathers, compute, inputs=None):
    """The embedding and the blocks without autograd, each on its just-gathered weights,
    freed as soon as it is done. inputs: a list to fill with each block's input, all that
    backward keeps to recompute it (b·s·h numbers a block)."""
    ends, blocks = units[0], units[1:]
    full = gathers.take(ends)
    gathers.prefetch()  # the next units' all-gathers travel while the embedding computes
    h = embed(ends.layout.views(full), idx)
    free(full)
    for u in blocks:
        full = gathers.take(u)
        gathers.prefetch()
        if inputs is not None:
            inputs.append(h)
        h = compute.block(h, full, u.layout, compute.n_head)
        free(full)
    return h


def zero3_micro_step(units, x, y, scale, run, group, live, compute):
    """One micro-batch forward and backward; every unit's gradient ends up reduce-scattered
    into its gradient shard. scale: 1/grad_accum, so the shards sum to the mean."""
    ends, blocks = units[0], units[1:]
    gathers = Gathers([ends, *blocks, ends, *reversed(blocks)], run.cfg.prefetch, group, live)
    inputs = []
    with run.autocast:
        h = leaf(zero3_forward(units, x, gathers, compute, inputs))
        # the head: forward and backward at once, on one gather of the ends
        full = [leaf(t) for t in gathers.take(ends)]
        gathers.prefetch()
        loss = compute.head(h, full, ends.layout, y)
    gh, *g_ends = torch.autograd.grad(loss * scale, [h, *full])
    free(full)
    reducing = None
    for u, h_in in zip(reversed(blocks), reversed(inputs)):
        full = [leaf(t) for t in gathers.take(u)]
        gathers.prefetch()  # the next blocks' all-gathers travel while this one recomputes
        h_in = leaf(h_in)
        with run.autocast:
            out = compute.block(h_in, full, u.layout, compute.n_head)  # recompute, with autograd this time
        gh, *g = torch.autograd.grad(out, [h_in, *full], gh)
        free(full)
        add_reduced(reducing)  # the previous block's reduce-scatter, done while this one computed
        reducing = reduce_scatter_grad(u, g, group)
    embedding_backward(ends.layout.views(g_ends), x, gh)
    add_reduced(reducing)
    add_reduced(reduce_scatter_grad(ends, g_ends, group))  # the tied matrix: head and embedding, reduced once
    return loss.detach()


def zero3_step(units, run, it, group, live, compute):
    """The gradients of one optimizer step, reduce-scattered into the units' gradient shards. -> the loss"""
    cfg = run.cfg
    loss = torch.zeros((), device=run.device)
    for m in range(cfg.grad_accum):
        x, y = M.batch(run, it, "train", m, cfg.grad_accum, C.get_rank(group), C.get_world_size(group))
        loss += zero3_micro_step(units, x, y, 1.0 / cfg.grad_accum, run, group, live, compute) / cfg.grad_accum
    return loss


@torch.no_grad()
def zero3_loss(units, x, y, run, group, live, compute):
    """The loss of a batch without gradients (validation): gathers in forward only."""
    ends = units[0]
    gathers = Gathers([*units, ends], run.cfg.prefetch, group, live)
    with run.autocast:
        h = zero3_forward(units, x, gathers, compute)
        full = gathers.take(ends)
        loss = compute.head(h, full, ends.layout, y)
    free(full)
    return loss


# -----------------------------------------------------------------------------
# the ZeRO-1/2 step: full weights kept on every rank, nothing gathered until the update


def zero12_micro_step(units, x, y, scale, stage, run, group, compute):
    """One micro-batch forward and backward on the kept full weights. Each block keeps its
    autograd graph (no recompute); backward goes block by block, so that ZeRO-2 can
    reduce-scatter a block's gradient as soon as it is complete; ZeRO-1 adds it to the full
    fp32 gradient, reduce-scattered once per step."""
    ends, blocks = units[0], units[1:]
    saved = []
    with run.autocast:
        with torch.no_grad():
            h = embed(ends.layout.views(ends.full), x)
        for u in blocks:
            h_in, w = leaf(h), [leaf(t) for t in u.full]
            out = compute.block(h_in, w, u.layout, compute.n_head)
            saved.append((h_in, w, out))
            h = out.detach()
        h, w_ends = leaf(h), [leaf(t) for t in ends.full]
        loss = compute.head(h, w_ends, ends.layout, y)
    gh, *g_ends = torch.autograd.grad(loss * scale, [h, *w_ends])
    reducing = None
    for u, (h_in, w, out) in zip(reversed(blocks), reversed(saved)):
        gh, *g = torch.autograd.grad(out, [h_in, *w], gh)
        if stage == 1:
            for full_grad, gi in zip(u.full_grad, g):
                full_grad += gi  # in fp32
        else:
            add_reduced(reducing)
            reducing = reduce_scatter_grad(u, g, group)  # travels while the next block's backward computes
    embedding_backward(ends.layout.views(g_ends), x, gh)
    if stage == 1:
        for full_grad, gi in zip(ends.full_grad, g_ends):
            full_grad += gi
    else:
        add_reduced(reducing)
        add_reduced(reduce_scatter_grad(ends, g_ends, group))
    return loss.detach()


def zero12_step(units, run, it, stage, group, compute):
    """The gradients of one optimizer step, reduce-scattered into the units' gradient shards. -> the loss"""
    cfg = run.cfg
    for u in units:
        for t in u.full_grad or []:
            t.zero_()
    loss = torch.zeros((), device=run.device)
    for m in range(cfg.grad_accum):
        x, y = M.batch(run, it, "train", m, cfg.grad_accum, C.get_rank(group), C.get_world_size(group))
        loss += zero12_micro_step(units, x, y, 1.0 / cfg.grad_accum, stage, run, group, compute) / cfg.grad_accum
    if stage == 1:  # one reduce-scatter a unit per step, whatever grad_accum is
        reducing = None
        for u in units:
            add_reduced(reducing)
            reducing = reduce_scatter_grad(u, u.full_grad, group)
        add_reduced(reducing)
    return loss


@torch.no_grad()
def zero12_loss(units, x, y, run, compute):
    """The loss of a batch without gradients (validation), on the kept full weights."""
    ends, blocks = units[0], units[1:]
    with run.autocast:
        h = embed(ends.layout.views(ends.full), x)
        for u in blocks:
            h = compute.block(h, u.full, u.layout, compute.n_head)
        return compute.head(h, ends.full, ends.layout, y)


def gather_full_weights(units, group):
    """ZeRO-1/2: every rank all-gathers every unit's shards into its full weights (after each
    optimizer step, and once at the start, from the initial or the loaded shards)."""
    world = C.get_world_size(group)
    for u in units:
        if u.full is None:
            u.full = [torch.empty(p.shard_size * world, dtype=p.dtype, device=s.device)
                      for p, s in zip(u.layout.parts, u.shards)]
        for part, full, shard in zip(u.layout.parts, u.full, u.shards):
            C.all_gather(full, shard.to(part.dtype), group=group)


# -----------------------------------------------------------------------------
# shared by every stage: the global norm and the state


def clip_grad_shards(units, max_norm, group):
    """Clip by the global gradient norm. Every element lies in exactly one rank's shard (the
    padding's gradient is 0), so the sum of the ranks' squared norms is the global one,
    nothing counted twice. -> the norm (a tensor: reading it would wait for the device)."""
    sq = torch.stack([g.pow(2).sum() for u in units for g in u.grads]).sum()
    C.all_reduce(sq, group=group)
    norm = sq.sqrt()
    coef = M.clip_coef(norm, max_norm)
    for u in units:
        for g in u.grads:
            g.mul_(coef)
    return norm


def state_bytes(units, optimizer):
    """Parameters, gradients and Adam's state resident on this rank."""
    kept = [t for u in units for t in u.shards + u.grads + (u.full or []) + (u.full_grad or [])]
    return M.tensor_bytes(kept) + M.optimizer_state_bytes(optimizer)


# -----------------------------------------------------------------------------
# the run


def main(argv=None):
    cfg = M.parse_args(DEFAULTS, argv, __doc__)
    if cfg.zero_stage not in (1, 2, 3):
        M.die(f"--zero_stage takes 1, 2 or 3, not {cfg.zero_stage}")
    if cfg.prefetch < 0 or cfg.grad_accum < 1:
        M.die("--prefetch must be at least 0 and --grad_accum at least 1")
    if cfg.dropout:
        M.die("fsdp.py needs --dropout=0: backward recomputes the blocks and would need forward's random masks")
    run = M.start(cfg, "fsdp")
    rank, world, device, config = run.rank, run.world, run.device, run.config
    if cfg.batch_size % (world * cfg.grad_accum):
        M.die(f"--batch_size={cfg.batch_size} does not divide into {world} rank{'s' * (world > 1)} x {cfg.grad_accum} micro-steps")
    group = None  # the whole world; parallel_3d.py runs the same pieces on a sub-group
    stage = cfg.zero_stage

    units = build_units(config, cfg, group, device)
    pieces = [piece for u in units for piece in u.optimizer_params()]
    optimizer = M.make_optimizer([(name, p) for name, p, _ in pieces], cfg, device)
    # a checkpoint holds every rank's shards: each is a ("flat", start, stop) piece of a global parameter
    M.restore(run, [(name, p, index, True) for name, p, index in pieces], optimizer)
    if stage < 3:
        for u in units:
            if stage == 1:
                u.full_grad = [torch.zeros(p.shard_size * world, device=device) for p in u.layout.parts]
        with C.untracked():
            gather_full_weights(units, group)  # from the shards, loaded ones included
    # the weights are arguments, so one compiled block serves every block, whatever its weights
    compute = SimpleNamespace(block=torch.compile(block_forward) if cfg.compile else block_forward,
                              head=torch.compile(head_loss) if cfg.compile else head_loss, n_head=config.n_head)
    live = LiveUnits()
    if rank == 0:
        n_params = M.param_count(config)
        shard = sum(p.shard_size for u in units for p in u.layout.parts)
        print(f"fsdp: {world} rank{'s' * (world > 1)}, ZeRO-{stage}, prefetch {cfg.prefetch}, {n_params / 1e6:.2f}M parameters "
              f"in {len(units)} units, {shard / 1e6:.2f}M per rank ({shard * world - n_params} padding), "
              f"{cfg.batch_size // (world * cfg.grad_accum)} x {config.block_size} tokens per rank per micro-step")

    @torch.no_grad()
    def evaluate():
        losses = torch.zeros(cfg.eval_iters, cfg.grad_accum, device=device)
        with C.untracked():  # evaluation's gathers and the loss average are not training traffic
            for k in range(cfg.eval_iters):
                for m in range(cfg.grad_accum):  # the same rows as a training step: the whole global batch
                    x, y = M.batch(run, k, "val", m, cfg.grad_accum, C.get_rank(group), C.get_world_size(group))
                    losses[k, m] = zero3_loss(units, x, y, run, group, live, compute) if stage == 3 \
                        else zero12_loss(units, x, y, run, compute)
            C.all_reduce(losses, op="avg", group=group)
        return losses.mean().item()

    for it in range(run.start_iter, cfg.max_iters):
        M.begin_iter(run, it, evaluate)
        live.peak = 0
        # ---------------------------------------------------------------- the training step
        for u in units:
            for g in u.grads:
                g.zero_()
        if stage == 3:
            loss = zero3_step(units, run, it, group, live, compute)
        else:
            loss = zero12_step(units, run, it, stage, group, compute)
        norm = clip_grad_shards(units, cfg.grad_clip, group) if cfg.grad_clip else 0.0
        optimizer.step()  # on this rank's shards only
        if stage < 3:
            gather_full_weights(units, group)  # every rank needs every unit's updated weights again
        # ---------------------------------------------------------------- end of the training step
        M.end_iter(run, loss=loss, grad_norm=norm, state_bytes=state_bytes(units, optimizer),
                   max_gathered_units=live.peak if stage == 3 else len(units))
    return M.finish(run)


if __name__ == "__main__":
    M.main_guard(main)
