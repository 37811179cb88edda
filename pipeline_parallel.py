"""
Pipeline parallel training: the model is cut by depth into chunks of consecutive blocks,
each rank holds one chunk (or v), and the global batch is cut into --n_micro = m
micro-batches that flow through the chunks like cars down an assembly line.

    python pipeline_parallel.py                                  # one stage: the reference run
    torchrun --nproc_per_node=4 pipeline_parallel.py --n_micro=8 --schedule=1f1b --timeline=True
    torchrun --nproc_per_node=4 pipeline_parallel.py --n_micro=8 --schedule=interleaved --virtual_stages=2
    torchrun --nproc_per_node=2 pipeline_parallel.py --schedule=zb

The schedules (p ranks; the bubble is the idle share of the step, at unit costs):
  gpipe        all m forwards, then all m backwards (Huang et al. 2019): holds m micro-batches.
  1f1b         p-1-r forwards, then one forward one backward (PipeDream-Flush, Narayanan et al.
               2021): the same bubble (p-1)/(m+p-1), at most p micro-batches held.
  interleaved  rank r holds the v chunks r, r+p, ... of p·v (--virtual_stages; Megatron-LM,
               Narayanan et al. 2021): bubble (p-1)/(v·m+p-1), for v times the boundary
               crossings; needs m % p == 0.
  zb           ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism"): each backward split in
               B (the input's gradient, which the previous rank waits for) and W (the weights',
               which nobody waits for), W deferred into the cool-down's bubble: with F = B = W
               and m >= p, (p-1)/(3m+p-1), and 1F1B's memory.

What it sends: only point to point, to the rank that holds the next (previous) chunk: each
micro-batch's activation, b·s·h float32 numbers (b = batch_size/m), forward across every
chunk boundary, and its gradient back; float32 under bf16 too, since the boundary cuts the
residual stream, which autocast keeps in float32. After the pipeline drains: the first and
the last rank swap their copies' gradients of the tied embedding/head (V·h each way), and
one float (the squared gradient norm) is summed over the ranks. traffic_per_rank() counts it.

Each schedule is a list of actions per rank (schedule(), plan()), run one by one by the
Executor; simulate() runs them all on paper, and --timeline=True prints the plans, the
paper timeline and the measured one.
"""
import time
from collections import namedtuple
from contextlib import nullcontext
from functools import partial

import torch
import torch.nn as nn

import collectives as C
import model as M

DEFAULTS = dict(M.TRAIN_DEFAULTS, schedule="1f1b", n_micro=4, virtual_stages=2, timeline=False)
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb")
# zb's B (autograd.grad) and W (autograd.backward) are two graph tasks, and torch's non-reentrant
# checkpoint reruns a block's forward once per graph task that reads it: two reruns, not one
ZB_FULL = ("--schedule=zb with --recompute=full: B and W are two backward passes and each would rerun "
           "every block's forward (two reruns per micro-batch, not one): use --recompute=gelu or none, "
           "or another schedule")
BOUNDARY_DTYPE = torch.float32  # the residual stream: float32 under bf16 autocast, as in the one-process run

# -----------------------------------------------------------------------------
# the schedules, as data: pure functions, printable and testable without a model
#
# The model is cut into p·v chunks of consecutive blocks; rank r holds chunks r, r+p, ...
# (v = 1 but for interleaved). A compute action is Compute("F"|"B"|"W", chunk, micro): a
# forward of micro-batch `micro` through `chunk`; its backward (the whole of it, or with W
# split off only the input's gradient); W, the weights' gradient.

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


def interleaved(p, m, r, v):
    """Megatron-LM's interleaved 1F1B, as steps: forwards go through the chunks p micro-batches
    at a time (chunk r for micro-batches 0..p-1, then chunk r+p for them, ...), backwards the
    other way; the warm-up covers the time for micro-batch 0 to pass all p·v chunks and come
    back. With m == p there is no steady state: all forwards first, as Megatron does."""
    total = v * m  # forwards (and backwards) of this rank

    def at(k, forward):  # the k-th forward (backward): (chunk, micro-batch)
        j = k // p % v
        return r + p * (j if forward else v - 1 - j), k // (p * v) * p + k % p
    warmup = total if m == p else min(2 * (p - 1 - r) + (v - 1) * p, total)
    out = [[Compute("F", *at(k, True))] for k in range(warmup)]
    out += [[Compute("F", *at(warmup + k, True)), Compute("B", *at(k, False))] for k in range(total - warmup)]
    return out + [[Compute("B", *at(k, False))] for k in range(total - warmup, total)]


def plan(name, p, m, r, v=1, train=True):
    """steps() with their messages: before each step one Exchange that sends what the
    previous step produced and receives what this one needs, from and to the ranks that hold
    the neighbouring chunks (a neighbour on this rank needs no message). W needs no message:
    the W's go before the exchange in front of a forward (the partner is still busy with its
    own forward), and between the sends and the receive in front of a backward (ZB-H1's
    cool-down, where they fill the wait for the gradient). train=False: the forwards only.

    Why this pairing cannot deadlock: in 1F1B's steady state rank r has just finished a
    forward and must send its activation to r+1, while r+1 has just finished a backward and
    must send a gradient to r. If both sent first and then received, each could wait for
    the other to post its receive (NCCL's blocking send does). Posting "send activation +
    receive gradient" together on r, and "send gradient + receive activation" on r+1 (one
    batch_isend_irecv each), lets both pairs complete at once. simulate() checks, for every
    schedule, that every exchange completes and that messages between two ranks match in
    posting order, which is how NCCL and gloo pair them."""
    n = p * v

    def needs(a):  # [(Message, from rank)] that compute a waits for
        c = a.chunk - 1 if a.kind == "F" else a.chunk + 1 if a.kind == "B" else -1
        return [(Message("act" if a.kind == "F" else "grad", c, a.micro), c % p)] if 0 <= c < n and c % p != r else []

    def makes(a):  # [(Message, to rank)] that compute a produces for another rank
        c = a.chunk + 1 if a.kind == "F" else a.chunk - 1 if a.kind == "B" else -1
        return [(Message("act" if a.kind == "F" else "grad", a.chunk, a.micro), c % p)] if 0 <= c < n and c % p != r \
            else []
    actions, pending, weights = [], [], []
    for step in steps(name, p, m, r, v):
        step = [a for a in step if train or a.kind == "F"]
        if not step or step[0].kind == "W":
            weights += step
            continue
        recvs = [x for a in step for x in needs(a)]
        if weights and step[0].kind == "B" and pending:  # the cool-down: B's gradient leaves at once
            actions.append(Exchange(tuple(pending), ()))
            pending = []
        actions += weights + ([Exchange(tuple(pending), tuple(recvs))] if pending or recvs else []) + step
        weights, pending = [], [x for a in step for x in makes(a)]
    return actions + ([Exchange(tuple(pending), ())] if pending else []) + weights

# -----------------------------------------------------------------------------
# the model, cut by depth


def stage_layers(n_layer, n_chunks, chunk):
    """The blocks of `chunk`: consecutive, and as even as possible (when the chunks do not
    divide n_layer, the first n_layer % n_chunks take one block more)."""
    q, r = divmod(n_layer, n_chunks)
    start = chunk * q + min(chunk, r)
    return range(start, start + q + (chunk < r))


class Stage(nn.Module):
    """One rank's chunks of the GPT (r, r+p, ... of p·v), under the GPT's own
    parameter names, so that its state_dict is a piece of GPT(config).state_dict() and the
    pieces of all ranks make the whole, whatever p and v. Every unit is built from the same
    seed as model.py builds it. The first rank holds the embedding, the last the head."""

    def __init__(self, config, stage, n_stages, seed, n_virtual=1):
        super().__init__()
        self.config, self.first, self.last = config, stage == 0, stage == n_stages - 1
        self.n_chunks = n_stages * n_virtual
        self.recompute = "none"  # --recompute: what each block keeps for backward (model.recompute_block)
        self.chunks = {c: stage_layers(config.n_layer, self.n_chunks, c) for c in range(stage, self.n_chunks, n_stages)}
        self.transformer = nn.ModuleDict(dict(h=nn.ModuleDict({str(i): M.build_unit(config, i, seed)
                                                               for c in self.chunks for i in self.chunks[c]})))
        if self.first:
            emb = M.build_unit(config, "embed", seed)
            self.transformer["wte"], self.transformer["wpe"] = emb.wte, emb.wpe
        if self.last:
            self.transformer["ln_f"] = M.build_unit(config, "ln_f", seed)
            self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False, device="meta")
            # the tie. One stage: one matrix, two uses, as in GPT. Several: the last
            # stage cannot use the first stage's matrix, so it holds its own copy of the
            # same init; the two copies stay equal because their gradients are summed
            # before every step (sum_tied_grads), and AdamW then does the same to both
            self.lm_head.weight = self.transformer["wte"].weight if self.first else \
                nn.Parameter(M.build_unit(config, "embed", seed).wte.weight.detach())

    def tied(self):
        """This stage's copy of the tied embedding/head matrix, None in the middle."""
        return self.transformer["wte"].weight if self.first else self.lm_head.weight if self.last else None

    def forward(self, x, targets=None, chunk=None):
        """Token ids into chunk 0, else the previous chunk's activation. Returns the
        activation for the next chunk, or out of the last chunk the mean loss."""
        t, chunk = self.transformer, next(iter(self.chunks)) if chunk is None else chunk
        if chunk == 0:
            x = M.embed(t.wte, t.wpe, x, self.config.dropout, self.training)
        for i in self.chunks[chunk]:
            x = M.recompute_block(t.h[str(i)], x, self.recompute)
        return M.head(t.ln_f, self.lm_head.weight, x, targets)[1] if chunk == self.n_chunks - 1 else x


def checkpoint_entries(stage, write=True):
    """What this stage holds, for model.py's checkpoints: each parameter whole, under
    its global name. The last stage's copy of the tied matrix is the first stage's
    "transformer.wte.weight" again: not written (the first stage writes it), but loaded,
    so a resumed run restores both copies, and their Adam moments, from one tensor.
    write=False makes every entry a replica another rank saves (3-D: a data parallel copy)."""
    entries = []
    for name, p in stage.named_parameters():  # one stage: the tie once, as transformer.wte.weight
        if name == "lm_head.weight":
            entries.append(("transformer.wte.weight", p, None, False))
        else:
            entries.append((name, p, None, write))
    return entries

# -----------------------------------------------------------------------------
# the executor: one rank's plan, action by action


class Executor:
    """Runs one rank's plan. The pipeline is `group` (None: the whole world): this rank is
    stage C.get_rank(group) of C.get_world_size(group), so the same code runs one pipeline
    of a larger mesh. `model` is what computes (the stage, or the stage compiled); act_shape
    is one micro-batch's activation, (b, s, h), of n_micro. Messages wait in one mailbox,
    keyed by Message: what a compute produces goes in, what an exchange sends comes out.

    After run(): peak_held, the most (chunk, micro-batch) activations held at once (forward
    done, weights' gradient not yet), and peak_bytes, the most bytes autograd held for them."""

    def __init__(self, stage, act_shape, n_micro, autocast=nullcontext(), model=None, group=None):
        self.stage, self.autocast, self.group = stage, autocast, group
        self.model = stage if model is None else model  # not `model or stage`: a compiled module has no truth value
        self.act_shape, self.n_micro, self.ranks = act_shape, n_micro, C.group_ranks(group)
        self.params = list(stage.parameters())
        self.device = self.params[0].device
        self.count_saved = model is None  # compiled graphs don't take saved-tensor hooks

    def run(self, actions, batch, train=True, stamps=None):
        """Execute a plan. batch(m) -> (inputs, targets) of micro-batch m. stamps: a list
        that gets (M.now(), M.now()) around each compute (CUDA events on a GPU: the CPU
        does not wait). -> the micro-batches' losses on the last stage, [] elsewhere."""
        self.mail, self.held, self.losses = {}, {}, []  # held: (chunk, m) -> (input, output, bytes, grad)
        self.peak_held = self.peak_bytes = 0
        self.split = any(isinstance(a, Compute) and a.kind == "W" for a in actions)  # B leaves the weights' to W
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

    def exchange(self, a):
        """send_forward (an activation to the next chunk's rank), send_backward (a gradient
        to the previous one), recv_forward, recv_backward: all of an exchange posted together
        (plan() says why), as one C.sendrecv, or for interleaved's steady state (up to two
        of each) one C.batch_sendrecv."""
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
        with self.autocast, counting:
            out = self.model(inp, y, chunk=c)
        if last:
            self.losses.append(out.detach())
            out = out / self.n_micro  # each micro-batch's mean, scaled: their sum is the global batch's mean
        else:
            self.mail[Message("act", c, k)] = out.detach().to(BOUNDARY_DTYPE)  # a no-op: the stream is float32
        if train:
            self.held[c, k] = (inp, out, sum(saved.values()))
            self.peak_held = max(self.peak_held, len(self.held))
            self.peak_bytes = max(self.peak_bytes, sum(h[2] for h in self.held.values()))

    def backward(self, a, batch=None, train=True):
        c, k = a.chunk, a.micro
        inp, out, _ = self.held[c, k]
        grad = None if c == self.stage.n_chunks - 1 else self.mail.pop(Message("grad", c + 1, k))
        if not self.split:  # the whole backward: the input's gradient and the weights'
            del self.held[c, k]
            out.backward(grad)
            if c > 0:
                self.mail[Message("grad", c, k)] = inp.grad
            return
        # B: the input's gradient only, which the previous rank is waiting for. The graph is
        # kept (retain_graph) for W, and so are the activations it saved: held until W
        if c > 0:
            self.mail[Message("grad", c, k)] = torch.autograd.grad(out, inp, grad, retain_graph=True)[0]
        self.held[c, k] += (grad,)

    def weight_grad(self, a, batch=None, train=True):
        # W: the weights' gradients, from the same graph and the same incoming gradient,
        # accumulated into .grad. Exact, but autograd walks the chain of activation
        # gradients again to reach the weights (stopping a backward at the weights' edges
        # takes graph surgery: torch.distributed.pipelining's stage_backward_weight), so
        # here W costs about what B does: the order and the memory are ZB-H1's, the saving
        # of B's work is not
        inp, out, _, grad = self.held.pop((a.chunk, a.micro))
        torch.autograd.backward(out, grad, inputs=[p for p in self.params if p.requires_grad])

COMPUTE_NAMES = {"F": "forward", "B": "backward", "W": "weight_grad"}


def exchange_name(a):
    """The trace's name for an exchange: "send_forward mb 3 + recv_backward mb 1"."""
    sends = [f"send_{'forward' if m.kind == 'act' else 'backward'} mb {m.micro}" for m, _ in a.sends]
    recvs = [f"recv_{'forward' if m.kind == 'act' else 'backward'} mb {m.micro}" for m, _ in a.recvs]
    return " + ".join(sends + recvs)

# -----------------------------------------------------------------------------
# after the pipeline drains: the tie, the norm


def sum_tied_grads(stage, group=None):
    """The first and the last stage of the pipeline `group` each hold a copy of the tied
    matrix with half its gradient: the embedding's use on the first, the head's on the
    last. The true gradient is the sum; both copies take it, so the same AdamW step
    keeps them equal. The two ends swap their halves (one C.sendrecv, V·h each way) and
    add: g_first + g_last on one end, g_last + g_first on the other, the same bits.

    Why a swap, not an all_reduce over a group of the two ends: that group would have to
    be created by every rank of the world, in the same order (dist.new_group), and before
    torch 2.5 NCCL built its communicator lazily on the members and eagerly on the others,
    so a pipeline of 3+ stages hung in the creation. The swap needs no group but the
    pipeline's own, and sends the same bytes (an all_reduce of S at N=2 sends S per rank)."""
    ranks = C.group_ranks(group)
    if len(ranks) == 1 or stage.tied() is None:
        return  # one stage: one matrix, whose two uses autograd already summed
    mine = stage.tied().grad
    theirs = torch.empty_like(mine)
    other_end = ranks[-1] if stage.first else ranks[0]
    C.sendrecv(mine, other_end, theirs, other_end, group=group)
    mine += theirs


def clip_global_norm(stage, max_norm, group=None):
    """Clip every gradient by the norm of the whole model's: each stage sums the squares
    of its own gradients (the tied matrix once: on the first stage, not the last stage's
    copy), and one all_reduce of that float over the pipeline `group` adds them up.
    The scale is applied on the device, as torch.nn.utils.clip_grad_norm_ does, so the
    CPU need not wait for the norm. -> the norm, a tensor (0.0 with max_norm=0)."""
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


def check_schedule(cfg):
    """-> v, the chunks a rank holds; or one line and exit on every rank, before any message."""
    if cfg.schedule not in SCHEDULES:
        M.die(f"--schedule takes {', '.join(SCHEDULES)}, not {cfg.schedule!r}")
    if cfg.n_micro < 1:
        M.die("--n_micro must be at least 1")
    if cfg.batch_size % cfg.n_micro:
        M.die(f"--batch_size={cfg.batch_size} does not divide into --n_micro={cfg.n_micro} micro-batches")
    if cfg.schedule == "interleaved" and cfg.virtual_stages < 1:
        M.die(f"--virtual_stages must be at least 1, not {cfg.virtual_stages}")
    if cfg.schedule == "zb" and getattr(cfg, "recompute", "none") == "full":
        M.die(ZB_FULL)
    return virtual_stages(cfg)


def virtual_stages(cfg):
    """v, the chunks a stage holds: --virtual_stages under interleaved, else 1."""
    return cfg.virtual_stages if getattr(cfg, "schedule", None) == "interleaved" else 1


def bubble(name, p, m, v=1):
    """The idle share of the step at unit costs (F = 1, B = 2 unsplit; F = B = W = 1 split).
    Interleaved: each of the v·m forwards of a rank is 1/v of a stage's, the fill still p-1
    of them. ZB-H1 with m < p never reaches its steady state: the first W's have nothing to
    fill, and p-m more units pass before the last gradient is back."""
    if name == "interleaved":
        return (p - 1) / (v * m + p - 1)
    if name != "zb":
        return (p - 1) / (m + p - 1)
    idle = p - 1 + max(p - m, 0)
    return idle / (3 * m + idle)


def main(argv=None):
    cfg = M.parse_args(DEFAULTS, argv, __doc__)
    v = check_schedule(cfg)
    run = M.start(cfg, "pipeline")
    rank, device, config = run.rank, run.device, run.config
    group = None  # the whole world is one pipeline; parallel_nd.py runs these pieces on a sub-group
    n_stages, me, last_rank = C.get_world_size(group), C.get_rank(group), C.group_ranks(group)[-1]
    if n_stages * v > config.n_layer:
        what = f"{n_stages} stages x {v} chunks" if v > 1 else f"{n_stages} stages"
        M.die(f"{what} but the model has {config.n_layer} blocks: each {'chunk' if v > 1 else 'stage'} needs at least one")
    if cfg.schedule == "interleaved" and cfg.n_micro % n_stages:  # Megatron's: the micro-batches go p at a time
        M.die(f"--schedule=interleaved needs --n_micro ({cfg.n_micro}) divisible by the {n_stages} stages")
    n_micro = cfg.n_micro
    run.layout = dict(stages=n_stages, schedule=cfg.schedule) | (dict(virtual_stages=v) if v > 1 else {})

    stage = Stage(config, me, n_stages, cfg.seed, v).to(device)
    stage.recompute = cfg.recompute
    params = list(stage.parameters())  # a tensor used twice (one stage: the tie) is listed once
    optimizer = M.make_optimizer(stage.named_parameters(), cfg, device)
    M.restore(run, checkpoint_entries(stage), optimizer)  # both copies of the tied matrix are loaded
    act_shape = (cfg.batch_size // n_micro, config.block_size, config.n_embd)  # crosses a boundary, each way
    executor = Executor(stage, act_shape, n_micro, run.autocast, torch.compile(stage) if cfg.compile else None, group)
    train_plan, eval_plan = (plan(cfg.schedule, n_stages, n_micro, me, v, train) for train in (True, False))
    if rank == 0:
        print_layout(cfg, config, n_stages, v, act_shape)

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


def simulate(name, p, m, v=1, cost=None, train=True):
    """Execute every rank's plan on paper, all together: a compute takes its cost (default
    F = 1 and B = 2, or B = W = 1 when the schedule splits them), a message nothing, and an
    exchange completes only once the other end of each of its messages has been posted (the
    strictest semantics, so what completes here completes on NCCL and gloo). Messages
    between two ranks match in posting order. Returns each rank's timeline
    [(Compute, start, end)]; raises if messages mismatch or the ranks deadlock."""
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
    """One text line per rank, `width` columns over the span: F, B or W where one runs,
    '.' where the rank waits."""
    t0 = min(t[0][1] for t in timelines)
    dt = (max(t[-1][2] for t in timelines) - t0) / width
    lines = []
    for r, (t, idle) in enumerate(zip(timelines, idle_fractions(timelines))):
        row = ["."] * width
        for a, start, end in t:
            for c in range(round((start - t0) / dt), round((end - t0) / dt)):
                row[min(c, width - 1)] = a.kind
        lines.append(f"  stage {r}: {''.join(row)}  idle {idle:.0%}")
    return "\n".join(lines)


def paper_width(name, p, m, v=1):
    """Columns for draw(): one per unit of the simulated span."""
    t = simulate(name, p, m, v)
    return round(max(x[-1][2] for x in t) - min(x[0][1] for x in t))


def print_layout(cfg, config, n_stages, v, act_shape):
    blocks = [len(stage_layers(config.n_layer, n_stages * v, c)) for c in range(n_stages * v)]
    print(f"pipeline: {n_stages} stages{f' x {v} chunks' if v > 1 else ''} with {blocks} blocks, "
          f"schedule {cfg.schedule}, "
          f"{cfg.n_micro} micro-batches of {act_shape[0]} x {config.block_size} tokens, "
          f"{M.param_count(config) / 1e6:.2f}M parameters, bubble {bubble(cfg.schedule, n_stages, cfg.n_micro, v):.1%}")


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
    """The stamps of one step as (start, end) in seconds of the wall clock, which is
    common to the ranks (and, NTP-synchronized, roughly to the machines). On a GPU a
    stamp is a CUDA event, recorded without waiting; they are read here, once, at the
    end of the step: wait for one last event, read the clock, date each event back."""
    last = M.now(device)
    M.elapsed(last, last)  # the step's one wait for the device (end_iter would wait here anyway)
    wall = time.time()
    return [(wall - M.elapsed(a, last), wall - M.elapsed(b, last)) for a, b in stamps]


def idle_fraction(times, device, group=None):
    """The share of the step this stage waited: 1 - busy / span, the span being the whole
    pipeline's (the first compute anywhere to the last anywhere), agreed on by one
    all_reduce(max) of two numbers over `group`. Bookkeeping, not training traffic."""
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
    """The bytes autograd keeps for backward on each stage at its peak (the log's act_bytes),
    one pipeline of `world` stages without virtual stages: the micro-batches it holds at most
    (GPipe m, 1F1B min(p - r, m), ZB-H1 min(p, m): max_held) x one micro-batch's bytes for
    its blocks (model.activation_bytes), the embedding on the first stage, the head on the last."""
    d = 2 if cfg.dtype == "bfloat16" else 4
    n, out = cfg.batch_size // cfg.n_micro * config.block_size, []
    for r in range(world):
        layers = len(stage_layers(config.n_layer, world, r))
        micro = (M.activation_bytes(config, n, getattr(cfg, "recompute", "none"), dtype_bytes=d, layers=layers)
                 + M.ends_bytes(config, n, config.block_size, embed=r == 0, head=r == world - 1, dtype_bytes=d))
        out.append(max_held(schedule(cfg.schedule, world, cfg.n_micro, r)) * micro)
    return out


def traffic_per_rank(config, cfg, world):
    """Bytes a rank sends per step, on average over the p ranks. What is sent, and in which
    dtype under each --dtype:

      message                        numbers per step                       float32  bfloat16
      activations, their gradients   2·B·s·h across each of the p·v-1 chunk  float32  float32 (1)
                                     boundaries (m·b·s·h each way): v = 1
                                     but for interleaved, whose v chunks a
                                     rank multiply the p-1 crossings by
                                     (p·v-1)/(p-1), about v
      the tied matrix's gradient     V·h from each of the two ends          float32  float32 (2)
      the squared gradient norm      1 per stage, all_reduced: a tree       float32  float32
                                     sends 2(p-1) in all
    (1) BOUNDARY_DTYPE: the residual stream, which bf16 autocast keeps in float32.
    (2) autocast computes in bf16 but keeps the parameters and their gradients float32.
    So a step sends the same bytes under both."""
    if world == 1:
        return 0
    act = 2 * (world * virtual_stages(cfg) - 1) * cfg.batch_size * config.block_size * config.n_embd * BOUNDARY_DTYPE.itemsize
    tie = 2 * config.vocab_size * config.n_embd * 4
    norm = 2 * (world - 1) * 4 if cfg.grad_clip else 0
    return (act + tie + norm) / world


if __name__ == "__main__":
    M.main_guard(main)
