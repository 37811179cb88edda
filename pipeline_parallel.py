"""
Pipeline parallel training: the model is cut by depth into chunks of consecutive blocks,
each rank holds one chunk (or v), and the global batch is cut into --n_micro = m
micro-batches that flow through the chunks like cars down an assembly line.

    python pipeline_parallel.py                                  # one stage: the reference run
    torchrun --nproc_per_node=4 pipeline_parallel.py --n_micro=8 --schedule=1f1b --timeline=True
    torchrun --nproc_per_node=4 pipeline_parallel.py --n_micro=8 --schedule=interleaved --virtual_stages=2
    torchrun --nproc_per_node=4 pipeline_parallel.py --n_micro=8 --schedule=zbv --timeline=True

The schedules (p ranks; bubble() gives each one's idle share, docs/pipeline_parallel.md its table):
  gpipe        all m forwards, then all m backwards (Huang et al. 2019): holds m micro-batches.
  1f1b         p-1-r forwards, then one forward one backward (PipeDream-Flush): at most p held.
  interleaved  v chunks a rank, r, r+p, ... (--virtual_stages; Megatron-LM): a v-th of the bubble.
  zb           ZB-H1 (Qi et al. 2023): backward split in B (the input's gradient, which the previous
               rank waits for) and W (the weights'), the W's in the cool-down's bubble.
  zbv          ZB-V (the same paper): two chunks a rank in a V, r and 2p-1-r; half ZB-H1's idle time.

What it sends: point to point only, each micro-batch's activation (b·s·h float32: the residual
stream, float32 under bf16 too) across every chunk boundary and its gradient back; then the tied
embedding/head's gradient swapped between the two ends (V·h each way; none under ZB-V) and the
norm's float: traffic_per_rank().

The lesson is everything above main(): the schedules as data (plan()), the Stage, the W store,
the Executor that runs a plan, the tie. Below main(): the instruments, simulate() (every plan
run on paper), the drawing of --timeline, the measured bubble, the byte formulas the tests check.
"""
import math
import time
from collections import namedtuple
from contextlib import nullcontext
from functools import lru_cache, partial

import torch
import torch.nn as nn
from torch.utils import flop_counter

import collectives as C
import model as M

DEFAULTS = dict(
    M.TRAIN_DEFAULTS,
    schedule="1f1b",    # the pipeline's schedule: gpipe, 1f1b, interleaved, zb, zbv
    n_micro=4,          # micro-batches a step
    virtual_stages=2,   # chunks a rank holds under --schedule=interleaved
    timeline=False,     # print each rank's plan, its timeline on paper and the measured one
)
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb", "zbv")
BOUNDARY_DTYPE = torch.float32  # the residual stream: float32 under bf16 autocast, as in the one-process run

# -----------------------------------------------------------------------------
# the schedules, as data: pure functions, printable and testable without a model. The model is
# cut into p·v chunks (chunks_of); Compute("F"|"B"|"W", chunk, micro) is a forward of micro-batch
# `micro` through `chunk`, its backward (with W split off: the input's gradient only), or W.

Compute = namedtuple("Compute", "kind chunk micro")
Message = namedtuple("Message", "kind chunk micro")  # "act": chunk's output; "grad": the gradient of its input
Exchange = namedtuple("Exchange", "sends recvs")  # ((Message, to rank), ...), ((Message, from rank), ...)


def schedule(name, p, m, r, v=1):
    """The compute actions of rank r of p, in order, for m micro-batches."""
    return [a for step in steps(name, p, m, r, v) for a in step]


def steps(name, p, m, r, v=1):
    """schedule() cut into the runs of computes between two exchanges: one compute each, but
    interleaved's steady state, which exchanges once per forward-backward pair."""
    F, B, W = (partial(Compute, kind) for kind in "FBW")
    if name == "gpipe":
        return [[F(r, k)] for k in range(m)] + [[B(r, k)] for k in range(m)]
    if name == "interleaved":
        return interleaved(p, m, r, v)
    if name == "zbv":
        return zbv(p, m, r)
    # 1F1B: the gradient of micro-batch 0 reaches rank r only after it has passed the p-1-r
    # ranks behind it and come back: time for p-1-r forwards (the warm-up)
    warmup = min(p - 1 - r, m)
    order = [F(r, k) for k in range(warmup)]
    if name == "1f1b":
        for k in range(m - warmup):
            order += [F(r, warmup + k), B(r, k)]
        return [[a] for a in order + [B(r, k) for k in range(m - warmup, m)]]
    if name != "zb":
        raise ValueError(f"unknown schedule {name!r}")
    # ZB-H1: 1F1B with each backward split into B and W. Rank r holds r micro-batches fewer
    # than p in 1F1B, so it defers its first r W's and still holds at most p; they fill the
    # r steps it would idle at the end, waiting for the last gradients to come back
    for k in range(m - warmup):
        order += [F(r, warmup + k), B(r, k)] + ([W(r, k - r)] if k >= r else [])
    for k in range(m - warmup, m):
        order += [B(r, k)] + ([W(r, k - r)] if k >= r else [])
    return [[a] for a in order + [W(r, k) for k in range(max(m - r, 0), m)]]


def zbv(p, m, r):
    """ZB-V (Qi et al. 2023, section 6), as torch.distributed.pipelining's ScheduleZBVZeroBubble
    orders it, in steps of one compute, chunk r down ("0") and 2p-1-r back up ("1"): 2(p-r)-1 F0,
    r pairs F1 F0 while the ranks below fill, p-r times F1 B1 W1, the steady state F0 B0 W0 F1 B1
    W1; in the cool-down the B's first (the previous rank waits for them), the W's in the wait.
    Written for m >= 2p-1; with fewer, the missing micro-batches' actions are dropped."""
    Fd, Bd, Wd = (partial(Compute, kind, r) for kind in "FBW")  # chunk r, down
    Fu, Bu, Wu = (partial(Compute, kind, 2 * p - 1 - r) for kind in "FBW")  # chunk 2p-1-r, up
    n = max(m, 2 * p - 1)
    order = [Fd(k) for k in range(2 * (p - r) - 1)]
    f0, f1, b0, b1 = len(order), 0, 0, 0  # the next F (B) of each chunk
    for _ in range(r):
        order += [Fu(f1), Fd(f0)]
        f0, f1 = f0 + 1, f1 + 1
    for _ in range(p - r):
        order += [Fu(f1), Bu(b1), Wu(b1)]
        f1, b1 = f1 + 1, b1 + 1
    while f1 < n:  # the steady state
        if f0 < n:
            order.append(Fd(f0))
            f0 += 1
        order += [Bd(b0), Wd(b0), Fu(f1), Bu(b1), Wu(b1)]
        f1, b0, b1 = f1 + 1, b0 + 1, b1 + 1
    w0, w1 = b0, b1
    for _ in range(r):
        order += [Bd(b0), Bu(b1)]
        b0, b1 = b0 + 1, b1 + 1
    for _ in range(p - r):
        order += [Bd(b0), Wd(w0)]
        b0, w0 = b0 + 1, w0 + 1
    order += [Wu(k) for k in range(w1, b1)] + [Wd(k) for k in range(w0, b0)]
    return [[a] for a in order if a.micro < m]


def chunks_of(name, p, r, v=1):
    """The chunks rank r holds, of p·v: r, r+p, ... (interleaved), or ZB-V's V, r and 2p-1-r,
    which puts the first and the last chunk, and so the tied embedding and head, on rank 0."""
    return [r, 2 * p - 1 - r] if name == "zbv" else list(range(r, p * v, p))


def owner(name, p, c):
    """The rank that holds chunk c."""
    return min(c, 2 * p - 1 - c) if name == "zbv" else c % p


def interleaved(p, m, r, v):
    """Megatron-LM's interleaved 1F1B, as steps: forwards go through the chunks p micro-batches
    at a time (chunk r for micro-batches 0..p-1, then chunk r+p, ...), backwards the other way;
    the warm-up lets micro-batch 0 pass all p·v chunks and come back (m == p: all forwards first)."""
    total = v * m  # forwards (and backwards) of this rank

    def at(k, forward):  # the k-th forward (backward): (chunk, micro-batch)
        j = k // p % v
        return r + p * (j if forward else v - 1 - j), k // (p * v) * p + k % p
    warmup = total if m == p else min(2 * (p - 1 - r) + (v - 1) * p, total)
    out = [[Compute("F", *at(k, True))] for k in range(warmup)]
    out += [[Compute("F", *at(warmup + k, True)), Compute("B", *at(k, False))] for k in range(total - warmup)]
    return out + [[Compute("B", *at(k, False))] for k in range(total - warmup, total)]


def plan(name, p, m, r, v=1, train=True):
    """steps() with their messages: before each step one Exchange that sends what the previous
    step produced and receives what this one needs (messages()). The W's go before the exchange
    in front of a forward, and between the sends and the receive in front of a backward (ZB-H1's
    cool-down: they fill the wait). train=False: forwards only. Why it cannot deadlock: in 1F1B's
    steady state r must send an activation to r+1 while r+1 sends r a gradient; each sending first
    could wait for the other's receive (NCCL's blocking send does), but "send + receive" posted
    together on both completes at once. simulate() checks every schedule: every exchange
    completes, and messages between two ranks match in posting order, as NCCL and gloo pair them."""
    if name == "zbv":
        return vee_plan(p, m, r, train)
    actions, pending, weights = [], [], []
    for step in steps(name, p, m, r, v):
        step = [a for a in step if train or a.kind == "F"]
        if not step or step[0].kind == "W":
            weights += step
            continue
        recvs = [x for a in step for x in messages(name, p, v, a, needs=True)]
        if weights and step[0].kind == "B" and pending:  # the cool-down: B's gradient leaves at once
            actions.append(Exchange(tuple(pending), ()))
            pending = []
        actions += weights + ([Exchange(tuple(pending), tuple(recvs))] if pending or recvs else []) + step
        weights, pending = [], [x for a in step for x in messages(name, p, v, a, needs=False)]
    return actions + ([Exchange(tuple(pending), ())] if pending else []) + weights


def vee_plan(p, m, r, train=True):
    """plan() for ZB-V. Rank r sends r+1 both the activations going down and the gradients coming
    back up, and makes the activation of micro-batch 2p-r-2 before the first gradient, which
    r+1 needs the other way round: as messages match in posting order, r+1 takes it early, into
    its mailbox. Each receive goes in the exchange before the receiver's first compute that
    starts, on paper at unit costs (vee_times), after the message was made: a receiver takes one
    sender's messages in the order they were made. simulate() checks it as the other plans."""
    orders, start, made = vee_times(p, m, train)
    mine = sorted((t, msg, src) for msg, (t, src) in made.items() if owner("zbv", p, msg.chunk + (
        1 if msg.kind == "act" else -1)) == r and src != r)
    actions, pending = [], []
    for a, t in zip(orders[r], start[r]):
        recvs = tuple((msg, src) for made_at, msg, src in mine if made_at <= t)
        mine = mine[len(recvs):]
        if pending or recvs:
            actions.append(Exchange(tuple(pending), recvs))
        actions.append(a)
        pending = messages("zbv", p, 2, a, needs=False)
    return actions + ([Exchange(tuple(pending), ())] if pending else [])


@lru_cache
def vee_times(p, m, train):
    """Every rank's ZB-V computes on paper at unit costs, a message available from the end of
    the compute that made it. -> (the computes, each one's start, {Message: (made at, by)})."""
    orders = [[a for a in schedule("zbv", p, m, s) if train or a.kind == "F"] for s in range(p)]
    made, start = {}, [[] for _ in range(p)]  # Message -> (the time it is made, its sender); each compute's start
    pos, clock = [0] * p, [0] * p
    while any(i < len(o) for i, o in zip(pos, orders)):
        for s in range(p):
            while pos[s] < len(orders[s]):
                a = orders[s][pos[s]]
                need = [made.get(msg, (None,))[0] for msg, _ in messages("zbv", p, 2, a, needs=True)]
                if None in need:
                    break
                start[s].append(max([clock[s]] + need))
                clock[s] = start[s][-1] + 1
                for msg, _ in messages("zbv", p, 2, a, needs=False):
                    made[msg] = (clock[s], s)
                pos[s] += 1
    return orders, start, made


def messages(name, p, v, a, needs):
    """[(Message, rank)] that compute a waits for (needs: the activation into a forward, the
    gradient into a backward) or makes for another rank; none for W, or a neighbour on its rank."""
    step = (-1 if a.kind == "F" else 1) * (1 if needs else -1)
    c = a.chunk + step if a.kind != "W" else -1
    if not 0 <= c < p * v or owner(name, p, c) == owner(name, p, a.chunk):
        return []
    return [(Message("act" if a.kind == "F" else "grad", c if needs else a.chunk, a.micro), owner(name, p, c))]

# -----------------------------------------------------------------------------
# the model, cut by depth


def stage_layers(n_layer, n_chunks, chunk):
    """The blocks of `chunk`: consecutive, and as even as possible (when the chunks do not
    divide n_layer, the first n_layer % n_chunks take one block more)."""
    q, r = divmod(n_layer, n_chunks)
    start = chunk * q + min(chunk, r)
    return range(start, start + q + (chunk < r))


class Whole:
    """How a Stage builds and runs its pieces: whole, as model.py does (parallel_nd.py passes
    its own: tensor parallel's, with context parallel's attention and the experts' layer)."""

    def __init__(self, config, seed):
        self.config, self.seed = config, seed

    def block(self, i):
        return M.build_unit(self.config, i, self.seed)

    def embedding(self):
        emb = M.build_unit(self.config, "embed", self.seed)
        return emb.wte, emb.wpe

    def head(self, wte):
        """The last stage's head: the first stage's matrix (one stage: one matrix, two uses, as in
        GPT), or its own copy of the same init, kept equal by sum_tied_grads."""
        head = nn.Linear(self.config.n_embd, self.config.vocab_size, bias=False, device="meta")
        head.weight = wte.weight if wte is not None else \
            nn.Parameter(M.build_unit(self.config, "embed", self.seed).wte.weight.detach())
        return head

    def embed(self, stage, x):
        return M.embed(stage.transformer.wte, stage.transformer.wpe, x, self.config.dropout, stage.training)

    def run_block(self, block, x):
        return block(x)

    def loss(self, stage, x, targets):
        return M.head(stage.transformer.ln_f, stage.lm_head.weight, x, targets)[1]

    def deferred(self, executor, module):
        """A forward for `module` through deferred_linear (zb, zbv: the W store), or None."""
        if isinstance(module, nn.Linear):
            slot = executor.defer(module.weight)
            return lambda x: deferred_linear(executor, x, module.weight, module.bias, slot)


class Stage(nn.Module):
    """One rank's chunks of the GPT (chunks_of), under the GPT's parameter names: its state_dict
    is a piece of GPT(config).state_dict(). Each unit built from model.py's seed by `layers`
    (Whole). hooks(before, after): before(unit) before a unit ("ends", "head", a block's index)
    computes, after(unit, x) on its output: parallel_nd.py's ZeRO-3 gathers and frees there."""

    def __init__(self, config, stage, n_stages, seed, n_virtual=1, schedule=None, layers=None, recompute="none"):
        super().__init__()
        self.layers = layers or Whole(config, seed)
        self.n_chunks = n_stages * n_virtual
        self.recompute = recompute  # --recompute: what each block keeps for backward (model.recompute_block)
        self.before, self.after = lambda unit: None, lambda unit, x: x
        self.chunks = {c: stage_layers(config.n_layer, self.n_chunks, c)
                       for c in chunks_of(schedule, n_stages, stage, n_virtual)}
        self.config, self.first, self.last = config, 0 in self.chunks, self.n_chunks - 1 in self.chunks
        self.transformer = nn.ModuleDict(dict(h=nn.ModuleDict({str(i): self.layers.block(i)
                                                               for c in self.chunks for i in self.chunks[c]})))
        if self.first:
            self.transformer["wte"], self.transformer["wpe"] = self.layers.embedding()
        if self.last:
            self.transformer["ln_f"] = M.build_unit(config, "ln_f", seed)
            self.lm_head = self.layers.head(self.transformer["wte"] if self.first else None)

    def hooks(self, before, after):
        self.before, self.after = before, after

    def tied(self):
        """This stage's copy of the tied embedding/head matrix, None in the middle."""
        return self.transformer["wte"].weight if self.first else self.lm_head.weight if self.last else None

    def forward(self, x, targets=None, chunk=None):
        """Token ids into chunk 0, else the previous chunk's activation. Returns the
        activation for the next chunk, or out of the last chunk the mean loss."""
        t, chunk = self.transformer, next(iter(self.chunks)) if chunk is None else chunk
        if chunk == 0 or chunk == self.n_chunks - 1:
            self.before("ends")
        if chunk == 0:
            x = self.after("ends", self.layers.embed(self, x))
        for i in self.chunks[chunk]:
            self.before(i)
            x = self.after(i, M.recompute_block(partial(self.layers.run_block, t.h[str(i)]), x, self.recompute))
        if chunk != self.n_chunks - 1:
            return x
        self.before("head")
        return self.layers.loss(self, x, targets)


def checkpoint_entries(stage):
    """What this stage holds, for model.py's checkpoints: each parameter whole, under its global
    name. The last stage's copy of the tied matrix is "transformer.wte.weight" again: loaded,
    not written, so a resumed run restores both copies, and their moments, from one tensor."""
    return [("transformer.wte.weight", p, None, False) if name == "lm_head.weight" else (name, p, None, True)
            for name, p in stage.named_parameters()]  # one stage: the tie once, as transformer.wte.weight

# -----------------------------------------------------------------------------
# the W store: B computes the input's gradient only, W the weights' later
#
# A linear layer's backward is two matmuls: dx = dY W, which the previous chunk waits for, and
# dW = dYᵀ x, which nobody waits for. Under zb and zbv each linear of the blocks computes through
# DeferredLinear: B returns dx (and the bias's gradient) and leaves (W, x, dY) in the
# micro-batch's store, W multiplies them out (docs/pipeline_parallel.md, "the W store").


class DeferredLinear(torch.autograd.Function):
    """y = x Wᵀ + b; backward: x's and b's gradients, (param, x, dY) left for W (input_grad; `slot`
    names the param, Executor.defer). The weight comes detached: as an input of B's graph its
    gradient hooks would run in B, and data parallel's buckets would send it before W computed it."""

    @staticmethod
    def forward(ctx, x, weight, bias, slot):
        ctx.save_for_backward(x, weight)
        ctx.slot = slot
        return nn.functional.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        db = dy.flatten(0, -2).sum(0) if ctx.needs_input_grad[2] else None
        return input_grad(x, dy, weight, ctx.slot), None, db, None


_backward = None  # the Executor whose backward runs now: input_grad fills its store


# B's one side effect, the store's append, is an operator of its own: in the compiled backward a
# Python append is a graph break (each linear, and its block, back to eager); an operator runs as
# it is. (Each import of this file defines its own: the exercises import a fresh copy.)
@torch.library.custom_op(f"pipeline_parallel_{id(globals())}::input_grad", mutates_args=())
def input_grad(x: torch.Tensor, dy: torch.Tensor, weight: torch.Tensor, slot: int) -> torch.Tensor:
    """dX = dY W; (x, dY) left in the running backward's store for W. Detached: a store that
    held x's grad_fn would hold the graph, and every step's stores would leak."""
    _backward.store.append((_backward.deferred[slot], x.detach(), dy.detach()))
    return dy @ weight


@input_grad.register_fake
def _(x, dy, weight, slot):  # the shape, for the compiler's tracing
    return dy.new_empty(*dy.shape[:-1], weight.shape[-1])


@flop_counter.register_flop_formula(input_grad._opoverload.overloadpacket)
def _(x_shape, dy_shape, weight_shape, slot, out_shape=None, **kw):  # --trace's FLOP count: the op hides its matmul
    return 2 * math.prod(dy_shape) * weight_shape[-1]


def deferred_linear(executor, x, weight, bias=None, slot=None):
    """F.linear(x, weight, bias) through DeferredLinear, into the store of the micro-batch the
    executor runs (slot: executor.defer(weight)); under autocast its inputs cast as F.linear's."""
    if executor.store is None:  # a forward without W (evaluation; a plan that does not split)
        return nn.functional.linear(x, weight, bias)
    w, b = weight.detach(), bias  # the weight's gradient is W's: no edge to it in B
    if torch.is_autocast_enabled(x.device.type):
        dtype = torch.get_autocast_dtype(x.device.type)
        x, w, b = x.to(dtype), w.to(dtype), None if b is None else b.to(dtype)
    return DeferredLinear.apply(x, w, b, slot)


@torch.no_grad()  # x is a tensor of the forward's graph: no graph for its product
def weight_grads(store):
    """W: dW = dYᵀ x for each linear of a micro-batch, into .grad by one autograd run on the
    parameters (leaves: nothing walked), which runs their gradient hooks too."""
    if store:
        torch.autograd.backward([param for param, _, _ in store],
                                [(dy.flatten(0, -2).t() @ x.flatten(0, -2)).to(param.dtype) for param, x, dy in store])


def store_bytes(store):
    """The bytes a W store holds: its tensors' storages, each once."""
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for _, x, dy in store
                for t in (x, dy)}.values())

# -----------------------------------------------------------------------------
# the executor: one rank's plan, action by action


class Executor:
    """Runs one rank's plan on the pipeline `group` (None: the world; parallel_nd.py: one
    pipeline of the mesh). `model` computes (the stage, or the stage compiled); act_shape is one
    micro-batch's activation. Messages wait in one mailbox, keyed by Message. After run():
    peak_held, the most (chunk, micro-batch) activations held at once, peak_bytes their bytes."""

    def __init__(self, stage, act_shape, n_micro, autocast=nullcontext(), model=None, group=None, armed=()):
        self.stage, self.autocast, self.group = stage, autocast, group
        self.armed = [x for x in armed if x is not None]
        self.model = stage if model is None else model  # not `model or stage`: a compiled module has no truth value
        self.act_shape, self.n_micro, self.ranks = act_shape, n_micro, C.group_ranks(group)
        self.params = list(stage.parameters())
        self.device = self.params[0].device
        self.count_saved = model is None  # compiled graphs don't take saved-tensor hooks
        self.store = None  # the W store of the micro-batch computing now (zb, zbv)
        self.deferred = []  # the weights whose gradient W computes, by slot (defer)
        self.deferring = False  # the blocks' linears go through deferred_linear

    def run(self, actions, batch, train=True, stamps=None):
        """Execute a plan. batch(m) -> (inputs, targets) of micro-batch m. stamps: a list that gets
        (M.now(), M.now()) around each compute. -> the micro-batches' losses on the last stage."""
        self.mail, self.held, self.losses = {}, {}, []  # held: (chunk, m) -> (input, output, bytes, W store)
        self.peak_held = self.peak_bytes = 0
        self.split = any(isinstance(a, Compute) and a.kind == "W" for a in actions)  # B leaves the weights' to W
        if self.split and not self.deferring:  # from now on (evaluation too: the same forward)
            self.defer_weight_grads()
        for a in actions:
            if isinstance(a, Exchange):
                with M.span(exchange_name(a), comm=True):
                    self.exchange(a)
                continue
            start = M.now(self.device) if stamps is not None else None
            chunk = f" chunk {a.chunk}" if len(self.stage.chunks) > 1 else ""  # interleaved: which of mine
            with M.span(f"{COMPUTE_NAMES[a.kind]} mb {a.micro}{chunk}"):
                {"F": self.forward, "B": self.backward, "W": self.weight_grad}[a.kind](a, batch, train)
            if stamps is not None:
                stamps.append((start, M.now(self.device)))
        return self.losses

    def defer_weight_grads(self):  # each linear of the blocks through deferred_linear, as Whole.deferred says
        for module in self.stage.transformer["h"].modules():
            forward = self.stage.layers.deferred(self, module)
            if forward is not None:
                module.forward = forward
        self.deferring = True

    def defer(self, weight):
        """-> the slot by which B's store names `weight` (an int: the compiled graph holds it as a constant)"""
        self.deferred.append(weight)
        return len(self.deferred) - 1

    def exchange(self, a):
        """All of an exchange's sends and receives posted together (plan() says why): one
        C.sendrecv, or for interleaved's steady state (up to two of each) one C.batch_sendrecv."""
        sends = [(self.mail.pop(msg), self.ranks[dst]) for msg, dst in a.sends]
        recvs = [(torch.empty(self.act_shape, dtype=BOUNDARY_DTYPE, device=self.device), self.ranks[src])
                 for _, src in a.recvs]
        if len(sends) > 1 or len(recvs) > 1:
            C.batch_sendrecv(sends, recvs, group=self.group)
        else:
            C.sendrecv(*(sends[0] if sends else (None, None)), *(recvs[0] if recvs else (None, None)), group=self.group)
        for (msg, _), (buf, _) in zip(a.recvs, recvs):
            self.mail[msg] = buf

    def forward(self, a, batch, train):
        stage, c, k = self.stage, a.chunk, a.micro
        last = c == stage.n_chunks - 1
        x, y = batch(k) if c == 0 or last else (None, None)  # the middle needs no tokens
        inp = x if c == 0 else self.mail.pop(Message("act", c - 1, k)).requires_grad_(train)
        counting, saved = M.saved_bytes(self.params, on=train and self.count_saved)
        self.store = [] if train and self.split else None
        with self.autocast, counting:
            out = self.model(inp, y, chunk=c)
        if last:
            self.losses.append(out.detach())
            out = out / self.n_micro  # each micro-batch's mean, scaled: their sum is the global batch's mean
        else:
            self.mail[Message("act", c, k)] = out.detach().to(BOUNDARY_DTYPE)  # a no-op: the stream is float32
        if train:
            self.held[c, k] = (inp, out, sum(saved.values()), self.store)
            self.count_held()

    def count_held(self):
        self.peak_held = max(self.peak_held, len(self.held))
        self.peak_bytes = max(self.peak_bytes, sum(h[2] for h in self.held.values()))

    def backward(self, a, batch=None, train=True):
        """The whole backward, or with W split off B: the blocks' linears leave their weights'
        gradients in the micro-batch's store."""
        c, k = a.chunk, a.micro
        self.arm(a)
        inp, out, _, store = self.held.pop((c, k))
        grad = None if c == self.stage.n_chunks - 1 else self.mail.pop(Message("grad", c + 1, k))
        global _backward
        self.store, _backward = store, self  # --recompute=full reruns the forward here: into the same store
        try:
            out.backward(grad)
        finally:
            _backward = None
        if c > 0:
            self.mail[Message("grad", c, k)] = inp.grad
        if self.split:  # autograd has freed the graph; the store is held until W
            self.held[c, k] = (None, None, store_bytes(store) if self.count_saved else 0, store)
            self.count_held()

    def arm(self, a):
        """`armed`: data parallel's gradient messages (ddp.GradBuckets, fsdp.GradReduces), whose
        `sync` is set for the last micro-batch's weight gradients only (its backward, or its W):
        complete then, each starts in backward (ddp.py's overlap); earlier ones accumulate."""
        for x in self.armed:
            x.sync = a.micro == self.n_micro - 1

    def weight_grad(self, a, batch=None, train=True):
        self.arm(a)
        store = self.held.pop((a.chunk, a.micro))[3]
        weight_grads(store)
        store.clear()  # its tensors go now (self.store may still name it)

COMPUTE_NAMES = {"F": "forward", "B": "backward", "W": "weight_grad"}


def exchange_name(a):
    """The trace's name for an exchange: "send_forward mb 3 + recv_backward mb 1"."""
    sends = [f"send_{'forward' if m.kind == 'act' else 'backward'} mb {m.micro}" for m, _ in a.sends]
    recvs = [f"recv_{'forward' if m.kind == 'act' else 'backward'} mb {m.micro}" for m, _ in a.recvs]
    return " + ".join(sends + recvs)

# -----------------------------------------------------------------------------
# after the pipeline drains: the tie, the norm


def sum_tied_grads(stage, group=None):
    """The first and the last stage of the pipeline `group` each hold a copy of the tied matrix
    with half its gradient: both take the sum (a swap of halves, V·h each way, the same bits on
    both), so AdamW keeps them equal. A swap, not an all_reduce on a group of the two ends: every
    rank of the world would have to create that group; the swap needs only the pipeline's."""
    ranks = C.group_ranks(group)
    if stage.tied() is None or (stage.first and stage.last):
        return  # one stage, or ZB-V's rank 0: one matrix, whose two uses autograd already summed
    mine = stage.tied().grad
    theirs = torch.empty_like(mine)
    other_end = ranks[-1] if stage.first else ranks[0]
    C.sendrecv(mine, other_end, theirs, other_end, group=group)
    mine += theirs


def clip_global_norm(stage, max_norm, group=None):
    """Clip every gradient by the whole model's norm: each stage sums its gradients' squares
    (the tied matrix once: not the last stage's copy), one all_reduce of that float over the
    pipeline `group` adds them up. -> the norm, a tensor (0.0 with max_norm=0)."""
    if not max_norm:
        return 0.0
    params = list(stage.parameters())
    copy = stage.tied() if stage.last and not stage.first else None
    sq = torch.zeros((), device=params[0].device)
    for p in params:
        if p is not copy:
            sq += p.grad.float().pow(2).sum()
    return M.clip_by_global_norm(sq, [p.grad for p in params], max_norm, [group])


# -----------------------------------------------------------------------------
# the run


def virtual_stages(cfg):
    """v, the chunks a stage holds: --virtual_stages under interleaved, 2 under zbv, else 1."""
    name = getattr(cfg, "schedule", None)
    return cfg.virtual_stages if name == "interleaved" else 2 if name == "zbv" else 1


def main(argv=None):
    cfg = M.parse_args(DEFAULTS, argv, __doc__)
    if cfg.schedule not in SCHEDULES:  # the flags alone: one line and exit on every rank, before any message
        M.die(f"--schedule takes {', '.join(SCHEDULES)}, not {cfg.schedule!r}")
    if cfg.n_micro < 1:
        M.die("--n_micro must be at least 1")
    if cfg.schedule == "interleaved" and cfg.virtual_stages < 1:
        M.die(f"--virtual_stages must be at least 1, not {cfg.virtual_stages}")
    if cfg.batch_size % cfg.n_micro:
        M.die(f"--batch_size={cfg.batch_size} does not divide into --n_micro={cfg.n_micro} micro-batches")
    v = virtual_stages(cfg)
    run = M.start(cfg, "pipeline")
    rank, device, config = run.rank, run.device, run.config
    group = None  # the whole world is one pipeline; parallel_nd.py runs these pieces on a sub-group
    n_stages, me = C.get_world_size(group), C.get_rank(group)
    last_rank = C.group_ranks(group)[owner(cfg.schedule, n_stages, n_stages * v - 1)]  # the loss's: ZB-V's rank 0
    if n_stages * v > config.n_layer:
        M.die(f"{n_stages} stages{f' x {v} chunks' if v > 1 else ''} but the model has {config.n_layer} blocks: "
              f"each {'chunk' if v > 1 else 'stage'} needs at least one")
    if cfg.schedule == "interleaved" and cfg.n_micro % n_stages:  # Megatron's: the micro-batches go p at a time
        M.die(f"--schedule=interleaved needs --n_micro ({cfg.n_micro}) divisible by the {n_stages} stages")
    n_micro = cfg.n_micro
    run.layout = dict(stages=n_stages, schedule=cfg.schedule) | (dict(virtual_stages=v) if v > 1 else {})

    stage = Stage(config, me, n_stages, cfg.seed, v, cfg.schedule, recompute=cfg.recompute).to(device)
    params = list(stage.parameters())  # a tensor used twice (one stage: the tie) is listed once
    optimizer = M.make_optimizer(stage.named_parameters(), cfg, device)
    M.restore(run, checkpoint_entries(stage), optimizer)  # both copies of the tied matrix are loaded
    act_shape = (cfg.batch_size // n_micro, config.block_size, config.n_embd)  # crosses a boundary, each way
    executor = Executor(stage, act_shape, n_micro, run.autocast, torch.compile(stage) if cfg.compile else None, group)
    train_plan, eval_plan = (plan(cfg.schedule, n_stages, n_micro, me, v, train) for train in (True, False))
    if rank == 0:
        blocks = [len(stage_layers(config.n_layer, n_stages * v, c)) for c in range(n_stages * v)]
        print(f"pipeline: {n_stages} stages{f' x {v} chunks' if v > 1 else ''} with {blocks} blocks, schedule "
              f"{cfg.schedule}, {n_micro} micro-batches of {act_shape[0]} x {config.block_size} tokens, "
              f"{M.param_count(config) / 1e6:.2f}M parameters, bubble {bubble(cfg.schedule, n_stages, n_micro, v):.1%}")

    @torch.no_grad()
    def evaluate():
        stage.eval()
        losses = []
        with C.untracked():  # bookkeeping, not training traffic
            for k in range(cfg.eval_iters):  # the same rows as a training step: the whole global batch
                losses += executor.run(eval_plan, partial(M.batch, run, k, "val", n_micro=n_micro), train=False)
            loss = torch.stack(losses).mean() if stage.last else torch.zeros((), device=device)
            C.broadcast(loss, src=last_rank, group=group)  # only the last stage has it
        stage.train()
        return loss.item()

    measured = None
    for it in range(run.start_iter, cfg.max_iters):
        M.begin_iter(run, it, evaluate)
        # ---------------------------------------------------------------- the training step
        optimizer.zero_grad(set_to_none=True)
        stamps = []  # around each compute: the measured bubble, and --timeline
        losses = executor.run(train_plan, partial(M.batch, run, it, "train", n_micro=n_micro), stamps=stamps)
        with M.span("optimizer"):
            sum_tied_grads(stage, group)
            norm = clip_global_norm(stage, cfg.grad_clip, group)
            optimizer.step()
        # ---------------------------------------------------------------- end of the training step
        times = action_times(stamps, device)
        if cfg.timeline and it == cfg.max_iters - 1:
            measured = gather_timelines(times, cfg.schedule, n_micro, v, device, group)
        state = M.tensor_bytes(params) + M.tensor_bytes(p.grad for p in params) + M.optimizer_state_bytes(optimizer)
        run.record["bubble_theory"] = bubble(cfg.schedule, n_stages, n_micro, v)  # one number for the run
        M.end_iter(run, loss=torch.stack(losses).mean() if losses else 0.0, grad_norm=norm, state_bytes=state,
                   loss_ranks=[last_rank], idle_frac=idle_fraction(times, device, group),
                   peak_micro=executor.peak_held, act_bytes=executor.peak_bytes)
    if measured is not None:
        print_timeline(cfg.schedule, n_stages, n_micro, v, measured)
    return M.finish(run)

# -----------------------------------------------------------------------------
# instruments: the simulator, the measured bubble, the timeline


def bubble(name, p, m, v=1):
    """The idle share of the step at unit costs (F = 1, B = 2 unsplit; F = B = W = 1 split):
    (p-1)/(m+p-1); interleaved's v·m forwards of 1/v a stage; ZB-H1's 3m of work, with p-m more
    idle if m < p; ZB-V's 6m in chunk units (half a stage), 3p-1-2m more idle if m < (3p-1)/2."""
    if name == "interleaved":
        return (p - 1) / (v * m + p - 1)
    if name == "zbv":
        idle = p - 1 + max(3 * p - 1 - 2 * m, 0)
        return idle / (6 * m + idle)
    if name != "zb":
        return (p - 1) / (m + p - 1)
    idle = p - 1 + max(p - m, 0)
    return idle / (3 * m + idle)


def simulate(name, p, m, v=1, cost=None, train=True):
    """Execute every rank's plan on paper, all together: a compute takes its cost (default F = 1
    and B = 2, or B = W = 1 split), a message nothing; an exchange completes once the other end of
    each of its messages is posted (the strictest semantics: what completes here completes on
    NCCL and gloo), messages between two ranks matched in posting order. -> each rank's
    timeline [(Compute, start, end)]; raises if messages mismatch or the ranks deadlock."""
    plans = [plan(name, p, m, r, v, train) for r in range(p)]
    split = any(isinstance(a, Compute) and a.kind == "W" for pl in plans for a in pl)
    cost = cost or dict(F=1, B=1 if split else 2, W=1)
    pos, clock, posted = [0] * p, [0] * p, [None] * p
    timelines = [[] for _ in range(p)]
    channels = {}  # (src, dst) -> ([sends posted: (message, time)], [receives posted])
    moved = True
    while moved:
        moved = False
        for r in range(p):
            while pos[r] < len(plans[r]):
                a = plans[r][pos[r]]
                if isinstance(a, Compute):
                    timelines[r].append((a, clock[r], clock[r] + cost[a.kind]))
                    clock[r] += cost[a.kind]
                elif posted[r] is None:  # post both messages of the exchange, then wait for them
                    posted[r] = []
                    for side, key, msg in ([(0, (r, dst), msg) for msg, dst in a.sends] +
                                           [(1, (src, r), msg) for msg, src in a.recvs]):
                        if msg:
                            mine = channels.setdefault(key, ([], []))[side]
                            mine.append((msg, clock[r]))
                            posted[r].append((side, key, len(mine) - 1, msg))
                    moved = True  # a rank waiting on these may now go on
                    continue
                else:
                    other_ends = [channels[key][1 - side] for side, key, _, _ in posted[r]]
                    if any(len(o) <= i for o, (_, _, i, _) in zip(other_ends, posted[r])):
                        break  # a message's other end is not posted yet: wait
                    for o, (_, key, i, msg) in zip(other_ends, posted[r]):
                        if o[i][0] != msg:
                            raise RuntimeError(f"rank {r}: {show(msg)} on {key} met {show(o[i][0])}")
                        clock[r] = max(clock[r], o[i][1])
                    posted[r] = None
                pos[r] += 1
                moved = True
    if pos != [len(pl) for pl in plans]:
        raise RuntimeError(f"deadlock: ranks stuck at {[show(pl[i]) for pl, i in zip(plans, pos) if i < len(pl)]}")
    return timelines


def show(a, v=1):
    """F3, B3, W3 (micro-batch 3; with v > 1 chunks, F5.3: chunk 5's), or an exchange such
    as [>a3 <g1]: send activation 3, receive gradient 1."""
    if isinstance(a, (Compute, Message)):
        return f"{a.kind[0]}{a.chunk}.{a.micro}" if v > 1 else f"{a.kind[0]}{a.micro}"
    return "[" + " ".join([">" + show(x, v) for x, _ in a.sends] + ["<" + show(x, v) for x, _ in a.recvs]) + "]"


def idle_fractions(timelines):
    """Per rank: 1 - busy / span, the span being the whole pipeline's, first start to last end."""
    t0 = min(t[0][1] for t in timelines)
    span = max(t[-1][2] for t in timelines) - t0
    return [1 - sum(e - s for _, s, e in t) / span for t in timelines]


def max_held(actions):
    """Most (chunk, micro-batch) activations held at once along a rank's compute actions:
    from the forward to the end of the backward (to W, when the backward is split)."""
    split = any(a.kind == "W" for a in actions)
    held = peak = 0
    for a in actions:
        held += 1 if a.kind == "F" else -1 if a.kind == ("W" if split else "B") else 0
        peak = max(peak, held)
    return peak


def draw(timelines, width):
    """One text line per rank, `width` columns over the span: F, B or W where one runs (f, b, w:
    a chunk of the rank's but its first, as ZB-V's way back up), '.' where it waits. Every
    action gets a column at least (a measured W shorter than half a column would vanish)."""
    t0 = min(t[0][1] for t in timelines)
    dt = (max(t[-1][2] for t in timelines) - t0) / width
    lines = []
    for r, (t, idle) in enumerate(zip(timelines, idle_fractions(timelines))):
        row, free = ["."] * width, 0  # free: the first column no action of this rank has taken
        for a, start, end in t:
            first = min(max(round((start - t0) / dt), free), width - 1)
            free = max(round((end - t0) / dt), first + 1)
            for c in range(first, min(free, width)):
                row[c] = a.kind if a.chunk < len(timelines) else a.kind.lower()
        lines.append(f"  stage {r}: {''.join(row)}  idle {idle:.0%}")
    return "\n".join(lines)


def paper_width(name, p, m, v=1):
    """Columns for draw(): one per unit of the simulated span."""
    t = simulate(name, p, m, v)
    return round(max(x[-1][2] for x in t) - min(x[0][1] for x in t))


def print_timeline(name, p, m, v, measured):
    """The plan of every rank, its timeline on paper, and the measured one."""
    width = paper_width(name, p, m, v)
    print(f"schedule {name}, {p} stages, {m} micro-batches (> send, < receive; a: activation, g: gradient):")
    for r in range(p):
        print(f"  stage {r}: " + " ".join(show(a, v) for a in plan(name, p, m, r, v)))
    print("on paper (a forward takes 1 unit, a backward 2, or B and W 1 each):")
    print(draw(simulate(name, p, m, v), width))
    span = max(t[-1][2] for t in measured) - min(t[0][1] for t in measured)
    print(f"measured, last step ({1000 * span:.1f} ms from the first compute to the last):")
    print(draw(measured, width))


def action_times(stamps, device):
    """The stamps of one step as (start, end) in seconds of the wall clock, common to the ranks:
    on a GPU CUDA events, read once at the step's end (wait for one last, date each back)."""
    last = M.now(device)
    M.elapsed(last, last)  # the step's one wait for the device (end_iter would wait here anyway)
    wall = time.time()
    return [(wall - M.elapsed(a, last), wall - M.elapsed(b, last)) for a, b in stamps]


def idle_fraction(times, device, group=None):
    """The share of the step this stage waited: 1 - busy / span, the span the whole pipeline's,
    agreed on by one all_reduce(max) of two numbers over `group` (bookkeeping, untracked)."""
    edges = torch.tensor([-times[0][0], times[-1][1]], dtype=torch.float64, device=device)
    with C.untracked():
        C.all_reduce(edges, op="max", group=group)
    return 1 - sum(b - a for a, b in times) / edges.sum().item()


def gather_timelines(times, name, n_micro, v, device, group=None):
    """Every rank's measured [(Compute, start, end)] on the pipeline's first rank (None
    elsewhere), for --timeline. Bookkeeping, not training traffic."""
    ranks, me = C.group_ranks(group), C.get_rank(group)
    mine = torch.tensor(times, dtype=torch.float64, device=device).view(-1)
    rows = torch.empty(len(ranks) * mine.numel(), dtype=torch.float64, device=device) if me == 0 else None
    with C.untracked():
        C.gather(rows, mine, ranks[0], group=group)
    if me != 0:
        return None
    return [[(a, t0, t1) for a, (t0, t1) in zip(schedule(name, len(ranks), n_micro, r, v), row.view(-1, 2).tolist())]
            for r, row in enumerate(rows.view(len(ranks), -1))]


def activation_per_rank(config, cfg, world):
    """The bytes held for backward on each stage at its peak (the log's act_bytes), one pipeline
    of `world` stages: along the rank's actions each (chunk, micro-batch) holds from its forward
    what autograd keeps for its blocks and ends (model.activation_bytes, ends_bytes), and with W
    split off, from B to W, the store's w_store_bytes."""
    d = 2 if cfg.dtype == "bfloat16" else 4
    n, v = cfg.batch_size // cfg.n_micro * config.block_size, virtual_stages(cfg)
    layers = lambda c: len(stage_layers(config.n_layer, world * v, c))  # noqa: E731

    def forward(c):
        return (M.activation_bytes(config, n, getattr(cfg, "recompute", "none"), dtype_bytes=d, layers=layers(c))
                + M.ends_bytes(config, n, config.block_size, embed=c == 0, head=c == world * v - 1, dtype_bytes=d))
    out = []
    for r in range(world):
        actions, held, peak = schedule(cfg.schedule, world, cfg.n_micro, r, v), {}, 0
        split = any(a.kind == "W" for a in actions)
        for a in actions:
            if a.kind == "F" or (a.kind == "B" and split):
                held[a.chunk, a.micro] = forward(a.chunk) if a.kind == "F" else w_store_bytes(config, n, layers(a.chunk), d)
            else:
                del held[a.chunk, a.micro]
            peak = max(peak, sum(held.values()))
        out.append(peak)
    return out


def w_store_bytes(config, tokens, layers, dtype_bytes=4):
    """What a micro-batch's W store holds between B and W: each linear's input and its
    output's gradient, 7h + 9h numbers a token a layer, in the autocast dtype."""
    return layers * tokens * 16 * config.n_embd * dtype_bytes


def traffic_per_rank(config, cfg, world):
    """Bytes a rank sends per step, on average over the p ranks: 2·B·s·h float32 across each of
    the p·v-1 boundaries (ZB-V: p·v-2), V·h floats from each end of the tie (not ZB-V), the norm."""
    if world == 1:
        return 0
    vee = getattr(cfg, "schedule", "1f1b") == "zbv"  # its chunks p-1 and p share a rank, and so do both ends of the tie
    crossings = world * virtual_stages(cfg) - 1 - vee
    act = 2 * crossings * cfg.batch_size * config.block_size * config.n_embd * BOUNDARY_DTYPE.itemsize
    tie = 0 if vee else 2 * config.vocab_size * config.n_embd * 4
    norm = 2 * (world - 1) * 4 if cfg.grad_clip else 0
    return (act + tie + norm) / world


if __name__ == "__main__":
    M.main_guard(main)
