"""
Pipeline parallel training: the model is cut by depth. Each of the p ranks is a
stage that owns consecutive blocks (the embedding also lives on the first stage,
the final norm and the head on the last), and the global batch is cut into
--n_micro micro-batches that flow through the stages like cars down an assembly
line: while stage 1 works on micro-batch 0, stage 0 already works on micro-batch 1.
GPipe (Huang et al. 2019) and 1F1B (PipeDream, Narayanan et al. 2019; its flushed,
synchronous form PipeDream-Flush, Narayanan et al. 2021, is the one here).

    python pipeline_parallel.py                                  # one stage: the reference run
    torchrun --nproc_per_node=4 pipeline_parallel.py --n_micro=8 --schedule=1f1b --timeline=True
    torchrun --nproc_per_node=2 pipeline_parallel.py --schedule=gpipe

What it sends, and when. Only neighbours talk, point to point: for each micro-batch
of b = batch_size/m sequences of s tokens, the activation (b·s·h numbers) goes
forward across every stage boundary (send_forward / recv_forward), and its gradient
comes back (send_backward / recv_backward). A step moves 2·m·b·s·h·4 = 2·B·s·h·4
bytes across each of the p-1 boundaries, whatever m is; float32 under
--dtype=bfloat16 too, since what crosses is the residual stream, which bf16
autocast keeps in float32 (only the matmuls' outputs are bf16). Once per step,
after the pipeline has drained: the first and the last stage each hold a copy of the
tied embedding/head matrix (V·h) and swap their two gradients to sum them (V·h·4
bytes each way); and one float, each stage's squared gradient norm, is summed over
the stages for the clipping. Nothing else: no stage ever sees another's weights.
traffic_per_rank() states it in code; the README's "The numbers behind the
strategies" compares it with the other strategies.

The price is the bubble. A stage cannot start micro-batch 0 before the stages in
front of it have done theirs, and the last backward reaches stage 0 only after
passing every stage: out of the step's (m+p-1) slots, each stage idles p-1, a
fraction (p-1)/(m+p-1), for both schedules below. More micro-batches shrink it;
what the schedule changes is memory:

  gpipe  all m forwards, then all m backwards: every stage holds the activations
         of all m micro-batches at once.
  1f1b   stage k runs p-1-k forwards (warm-up), then alternates one forward and
         one backward (steady state), then finishes the backwards (cool-down):
         a backward frees a micro-batch as soon as possible, so a stage never
         holds more than p of them, however large m is.

Each schedule is a plain list of actions per stage (schedule(), plan()), which the
Executor runs one by one; simulate() runs all the lists on paper and
--timeline=True prints that, and the measured timeline of the last step, so the
bubble can be seen. On paper, p=4 and m=6 (a forward 1 unit, a backward 2; print
it with `draw(simulate("gpipe", 4, 6), 27)`):

  gpipe  stage 0: FFFFFF.........BBBBBBBBBBBB     1f1b  stage 0: FFFF......BBFBBFBB.BB.BB.BB
         stage 1: .FFFFFF......BBBBBBBBBBBB..           stage 1: .FFF....BBFBBFBBFBB.BB.BB..
         stage 2: ..FFFFFF...BBBBBBBBBBBB....           stage 2: ..FF..BBFBBFBBFBBFBB.BB....
         stage 3: ...FFFFFFBBBBBBBBBBBB......           stage 3: ...FBBFBBFBBFBBFBBFBB......

Same length, same 3 idle slots of 9 on every stage; but GPipe's stage 0 holds 6
micro-batches before its first backward, 1F1B's at most 4.
"""
import time
from collections import namedtuple
from contextlib import nullcontext
from functools import partial

import torch
import torch.nn as nn

import collectives as C
import model as M

DEFAULTS = dict(M.TRAIN_DEFAULTS, schedule="1f1b", n_micro=4, timeline=False)
SCHEDULES = ("gpipe", "1f1b")
# What crosses a stage boundary, whatever --dtype is. The boundary cuts the residual
# stream, and under bf16 autocast that stream is float32 in the one-process run too:
# the embedding, LayerNorm and the residual additions run in float32, and a block adds
# its bf16 matmul outputs to the float32 stream, which promotes back. Sending bf16
# would round what the reference keeps, and the loss would drift from it.
BOUNDARY_DTYPE = torch.float32

# -----------------------------------------------------------------------------
# the schedules, as data: pure functions, printable and testable without a model


def schedule(name, n_stages, n_micro, stage):
    """The compute actions of one stage, in order: ("F", m) and ("B", m) for each
    micro-batch m. "forward" (no backward) is the evaluation's."""
    if name in ("gpipe", "forward"):
        return [("F", m) for m in range(n_micro)] + ([("B", m) for m in range(n_micro)] if name == "gpipe" else [])
    if name != "1f1b":
        raise ValueError(f"unknown schedule {name!r}")
    # the gradient of micro-batch 0 reaches stage k only after that micro-batch has
    # passed the p-1-k stages behind it and come back: time for p-1-k forwards, the
    # warm-up, which also keeps those stages fed
    warmup = min(n_stages - 1 - stage, n_micro)
    order = [("F", m) for m in range(warmup)]
    for m in range(n_micro - warmup):
        order += [("F", warmup + m), ("B", m)]
    return order + [("B", m) for m in range(n_micro - warmup, n_micro)]


def plan(name, n_stages, n_micro, stage):
    """schedule() with its messages: before each compute action, one exchange
    ("X", send, recv) that sends what the previous action produced and receives
    what this one needs. send/recv are ("act", m) or ("grad", m) or None; the peer
    is implied: activations go to stage+1 and come from stage-1, gradients the
    other way.

    Why this pairing cannot deadlock: in 1F1B's steady state stage k has just
    finished forward m and must send its activation to k+1, while k+1 has just
    finished a backward and must send a gradient to k. If both sent first and then
    received, each could wait for the other to post its receive (a blocking send may
    not return before its receive is posted; NCCL's does not). Here stage k posts
    "send act m + receive grad" together and k+1 posts "send grad + receive act m"
    together (C.sendrecv, one batch_isend_irecv), so both pairs can complete at
    once. simulate() checks, for every schedule, that every exchange completes and
    that messages match in posting order, which is how NCCL and gloo pair them."""
    first, last = stage == 0, stage == n_stages - 1
    actions, pending = [], None
    for kind, m in schedule(name, n_stages, n_micro, stage):
        need = ("act", m) if kind == "F" and not first else ("grad", m) if kind == "B" and not last else None
        if pending or need:
            actions.append(("X", pending, need))
        actions.append((kind, m))
        pending = ("act", m) if kind == "F" and not last else ("grad", m) if kind == "B" and not first else None
    if pending:
        actions.append(("X", pending, None))
    return actions


def peers(stage, send, recv):
    """(stage to send to, stage to receive from) for an exchange of plan()."""
    dst = None if send is None else stage + 1 if send[0] == "act" else stage - 1
    src = None if recv is None else stage - 1 if recv[0] == "act" else stage + 1
    return dst, src


def show(action):
    """F3, B0, or an exchange such as [>a3 <g1]: send activation 3, receive gradient 1."""
    if action[0] != "X":
        return f"{action[0]}{action[1]}"
    _, send, recv = action
    marks = ([f">{send[0][0]}{send[1]}"] if send else []) + ([f"<{recv[0][0]}{recv[1]}"] if recv else [])
    return "[" + " ".join(marks) + "]"


def simulate(name, n_stages, n_micro, cost=(("F", 1), ("B", 2))):
    """Execute every stage's plan on paper, all together: a forward takes cost F,
    a backward cost B, a message nothing, and an exchange completes only once the
    other end of each of its messages has been posted (the strictest semantics, so
    what completes here completes on NCCL and gloo). Messages between two stages
    match in posting order. Returns each stage's timeline [((kind, m), start, end)];
    raises if messages mismatch or the stages deadlock."""
    cost = dict(cost)
    plans = [plan(name, n_stages, n_micro, s) for s in range(n_stages)]
    pos, clock, posted = [0] * n_stages, [0] * n_stages, [None] * n_stages
    timelines = [[] for _ in range(n_stages)]
    channels = {}  # (src, dst) -> ([sends posted: (label, time)], [receives posted])
    moved = True
    while moved:
        moved = False
        for s in range(n_stages):
            while pos[s] < len(plans[s]):
                action = plans[s][pos[s]]
                if action[0] != "X":
                    timelines[s].append((action, clock[s], clock[s] + cost[action[0]]))
                    clock[s] += cost[action[0]]
                elif posted[s] is None:  # post both messages of the exchange, then wait for them
                    dst, src = peers(s, action[1], action[2])
                    posted[s] = []
                    for side, key, label in ((0, (s, dst), action[1]), (1, (src, s), action[2])):
                        if label:
                            mine = channels.setdefault(key, ([], []))[side]
                            mine.append((label, clock[s]))
                            posted[s].append((side, key, len(mine) - 1, label))
                    moved = True  # a stage waiting on these may now go on
                    continue
                else:
                    other_ends = [channels[key][1 - side] for side, key, _, _ in posted[s]]
                    if any(len(o) <= i for o, (_, _, i, _) in zip(other_ends, posted[s])):
                        break  # a message's other end is not posted yet: wait
                    for o, (_, key, i, label) in zip(other_ends, posted[s]):
                        if o[i][0] != label:
                            raise RuntimeError(f"stage {s}: {label} on {key} met {o[i][0]}")
                        clock[s] = max(clock[s], o[i][1])
                    posted[s] = None
                pos[s] += 1
                moved = True
    if pos != [len(p) for p in plans]:
        raise RuntimeError(f"deadlock: stages stuck at {[show(p[i]) for p, i in zip(plans, pos) if i < len(p)]}")
    return timelines


def idle_fractions(timelines):
    """Per stage: 1 - busy / span, the span being the whole pipeline's, first start to last end."""
    t0 = min(t[0][1] for t in timelines)
    span = max(t[-1][2] for t in timelines) - t0
    return [1 - sum(e - s for _, s, e in t) / span for t in timelines]


def draw(timelines, width):
    """One text line per stage, `width` columns over the span: F or B where a
    forward or backward runs, '.' where the stage waits."""
    t0 = min(t[0][1] for t in timelines)
    dt = (max(t[-1][2] for t in timelines) - t0) / width
    lines = []
    for s, (t, idle) in enumerate(zip(timelines, idle_fractions(timelines))):
        row = ["."] * width
        for (kind, _), start, end in t:
            for c in range(round((start - t0) / dt), round((end - t0) / dt)):
                row[min(c, width - 1)] = kind
        lines.append(f"  stage {s}: {''.join(row)}  idle {idle:.0%}")
    return "\n".join(lines)


def print_timeline(name, n_stages, n_micro, measured):
    """The plan of every stage, its timeline on paper, and the measured one."""
    width = 3 * (n_micro + n_stages - 1)  # on paper one column per unit: m+p-1 slots of F + B = 3 units
    print(f"schedule {name}, {n_stages} stages, {n_micro} micro-batches (> send, < receive; a: activation, "
          f"g: gradient):")
    for s in range(n_stages):
        print(f"  stage {s}: " + " ".join(show(a) for a in plan(name, n_stages, n_micro, s)))
    print("on paper (a forward takes 1 unit, a backward 2):")
    print(draw(simulate(name, n_stages, n_micro), width))
    span = max(t[-1][2] for t in measured) - min(t[0][1] for t in measured)
    print(f"measured, last step ({1000 * span:.1f} ms from the first forward to the last backward):")
    print(draw(measured, width))


def traffic_per_rank(config, cfg, world):
    """Bytes a stage sends per step, on average over the p stages. What is sent, and
    in which dtype under each --dtype:

      message                        numbers per step                float32  bfloat16
      activations, their gradients   2·B·s·h across each of the p-1  float32  float32 (1)
                                     boundaries (m·b·s·h each way)
      the tied matrix's gradient     V·h from each of the two ends   float32  float32 (2)
      the squared gradient norm      1 per stage, all_reduced: a     float32  float32
                                     tree sends 2(p-1) in all
    (1) BOUNDARY_DTYPE: the residual stream, which bf16 autocast keeps in float32.
    (2) autocast computes in bf16 but keeps the parameters and their gradients float32.
    So a step sends the same bytes under both."""
    if world == 1:
        return 0
    act = 2 * (world - 1) * cfg.batch_size * config.block_size * config.n_embd * BOUNDARY_DTYPE.itemsize
    tie = 2 * config.vocab_size * config.n_embd * 4
    norm = 2 * (world - 1) * 4 if cfg.grad_clip else 0
    return (act + tie + norm) / world

# -----------------------------------------------------------------------------
# the model, cut by depth


def stage_layers(n_layer, n_stages, stage):
    """The blocks of `stage`: consecutive, and as even as possible (when p does not
    divide n_layer, the first n_layer % p stages take one block more)."""
    q, r = divmod(n_layer, n_stages)
    start = stage * q + min(stage, r)
    return range(start, start + q + (stage < r))


class Stage(nn.Module):
    """One rank's part of the GPT, under the GPT's own parameter names, so that its
    state_dict is a piece of GPT(config).state_dict() and the pieces of all stages
    make the whole. Every unit is built from the same seed as model.py builds it."""

    def __init__(self, config, stage, n_stages, seed):
        super().__init__()
        self.config, self.first, self.last = config, stage == 0, stage == n_stages - 1
        self.layers = stage_layers(config.n_layer, n_stages, stage)
        self.transformer = nn.ModuleDict(dict(h=nn.ModuleDict({str(i): M.build_unit(config, i, seed)
                                                               for i in self.layers})))
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

    def forward(self, x, targets=None):
        """Token ids on the first stage, else the previous stage's activation. Returns
        the activation for the next stage, or on the last stage the mean loss."""
        t = self.transformer
        if self.first:
            x = M.embed(t.wte, t.wpe, x, self.config.dropout, self.training)
        for i in self.layers:
            x = t.h[str(i)](x)
        return M.head(t.ln_f, self.lm_head.weight, x, targets)[1] if self.last else x


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
# the messages
#
# Named as picotron and Megatron-LM name them: "forward" is an activation travelling
# to the next stage, "backward" its gradient travelling back to the previous one.
# Every exchange of a plan is one of the eight below, and each is one C.sendrecv,
# which posts its send and its receive together (plan() says why that cannot
# deadlock). `nb` holds the neighbours' GLOBAL ranks; `group` is the pipeline's.

Neighbours = namedtuple("Neighbours", "prev next")


def neighbours(group=None):
    """The global ranks of the stages before and after this one (None at the ends)."""
    ranks, me = C.group_ranks(group), C.get_rank(group)
    return Neighbours(ranks[me - 1] if me > 0 else None, ranks[me + 1] if me + 1 < len(ranks) else None)


def send_forward(act, nb, group):
    C.sendrecv(act, nb.next, None, None, group=group)


def recv_forward(buf, nb, group):
    C.sendrecv(None, None, buf, nb.prev, group=group)


def send_backward(grad, nb, group):
    C.sendrecv(grad, nb.prev, None, None, group=group)


def recv_backward(buf, nb, group):
    C.sendrecv(None, None, buf, nb.next, group=group)


def send_forward_recv_backward(act, buf, nb, group):  # 1F1B's steady state, after a forward
    C.sendrecv(act, nb.next, buf, nb.next, group=group)


def send_backward_recv_forward(grad, buf, nb, group):  # ... and after a backward
    C.sendrecv(grad, nb.prev, buf, nb.prev, group=group)


def send_forward_recv_forward(act, buf, nb, group):  # between two forwards
    C.sendrecv(act, nb.next, buf, nb.prev, group=group)


def send_backward_recv_backward(grad, buf, nb, group):  # between two backwards
    C.sendrecv(grad, nb.prev, buf, nb.next, group=group)


# (what an exchange of plan() sends, what it receives) -> the message that does it
MESSAGES = {("act", None): send_forward, (None, "act"): recv_forward,
            ("grad", None): send_backward, (None, "grad"): recv_backward,
            ("act", "grad"): send_forward_recv_backward, ("grad", "act"): send_backward_recv_forward,
            ("act", "act"): send_forward_recv_forward, ("grad", "grad"): send_backward_recv_backward}

# -----------------------------------------------------------------------------
# the stage executor


class Executor:
    """Runs one stage's plan, action by action: its forwards and backwards, and its
    exchanges with the neighbours. The pipeline is `group` (None: the whole world):
    this rank is stage C.get_rank(group) of C.get_world_size(group), so the same code
    runs one pipeline of a larger mesh. `model` is what computes (the stage, or the
    stage compiled); act_shape is one micro-batch's activation, (b, s, h), of n_micro.

    After run(): peak_held, the most micro-batches held at once (forward done,
    backward not yet), and peak_bytes, the most bytes autograd held for them."""

    def __init__(self, stage, act_shape, n_micro, autocast=nullcontext(), model=None, group=None):
        self.stage, self.model, self.autocast, self.group = stage, model or stage, autocast, group
        self.act_shape, self.n_micro, self.nb = act_shape, n_micro, neighbours(group)
        self.params = list(stage.parameters())
        self.device = self.params[0].device
        self.count_saved = model is None  # compiled graphs don't take saved-tensor hooks

    def run(self, actions, batch, train=True, stamps=None):
        """Execute a plan. batch(m) -> (inputs, targets) of micro-batch m. stamps: a list
        that gets (M.now(), M.now()) around each forward and backward (CUDA events on a
        GPU: the CPU does not wait). -> the micro-batches' losses on the last stage, [] elsewhere."""
        self.inbox, self.outbox, self.held, self.losses = {}, {}, {}, []  # held: m -> (input, output, bytes)
        self.peak_held = self.peak_bytes = 0
        for action in actions:
            if action[0] == "X":
                self.exchange(action[1], action[2])
                continue
            start = M.now(self.device) if stamps is not None else None
            if action[0] == "F":
                self.forward(action[1], batch, train)
            else:
                self.backward(action[1])
            if stamps is not None:
                stamps.append((start, M.now(self.device)))
        return self.losses

    def exchange(self, send, recv):
        """One ("X", send, recv) of the plan: what the last action produced goes out,
        what the next one needs comes in, as one message pair (e.g. [>a3 <g1] is
        send_forward_recv_backward)."""
        message = MESSAGES[send and send[0], recv and recv[0]]
        out = [self.outbox.pop(send)] if send else []
        buf = [torch.empty(self.act_shape, dtype=BOUNDARY_DTYPE, device=self.device)] if recv else []
        message(*out, *buf, self.nb, self.group)
        if recv:
            self.inbox[recv] = buf[0]

    def forward(self, m, batch, train):
        stage = self.stage
        x, y = batch(m) if stage.first or stage.last else (None, None)  # the middle needs no tokens
        inp = x if stage.first else self.inbox.pop(("act", m)).requires_grad_(train)
        counting, saved = M.saved_bytes(self.params) if train and self.count_saved else (nullcontext(), {})
        with self.autocast, counting:
            out = self.model(inp, y)
        if stage.last:
            self.losses.append(out.detach())
            out = out / self.n_micro  # each micro-batch's mean, scaled: their sum is the global batch's mean
        else:
            self.outbox[("act", m)] = out.detach().to(BOUNDARY_DTYPE)  # a no-op: the stream is float32
        if train:
            self.held[m] = (inp, out, sum(saved.values()))
            self.peak_held = max(self.peak_held, len(self.held))
            self.peak_bytes = max(self.peak_bytes, sum(h[2] for h in self.held.values()))

    def backward(self, m):
        inp, out, _ = self.held.pop(m)
        out.backward(None if self.stage.last else self.inbox.pop(("grad", m)))
        if not self.stage.first:
            self.outbox[("grad", m)] = inp.grad

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
    C.all_reduce(sq, op="sum", group=group)
    norm = sq.sqrt()
    coef = M.clip_coef(norm, max_norm)
    for p in params:
        p.grad.mul_(coef)
    return norm

# -----------------------------------------------------------------------------
# measuring the bubble


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
    pipeline's (the first forward anywhere to the last backward anywhere), agreed on by one
    all_reduce(max) of two numbers over `group`. Bookkeeping, not training traffic."""
    edges = torch.tensor([-times[0][0], times[-1][1]], dtype=torch.float64, device=device)
    with C.untracked():
        C.all_reduce(edges, op="max", group=group)
    return 1 - sum(b - a for a, b in times) / edges.sum().item()


def gather_timelines(times, name, n_micro, device, group=None):
    """Every stage's measured [((kind, m), start, end)] on the pipeline's first rank (None
    elsewhere), for --timeline. Bookkeeping, not training traffic."""
    ranks, me = C.group_ranks(group), C.get_rank(group)
    mine = torch.tensor(times, dtype=torch.float64, device=device).view(-1)
    rows = torch.empty(len(ranks) * mine.numel(), dtype=torch.float64, device=device) if me == 0 else None
    with C.untracked():
        C.gather(rows, mine, ranks[0], group=group)
    if me != 0:
        return None
    return [[(a, t0, t1) for a, (t0, t1) in zip(schedule(name, len(ranks), n_micro, s), row.view(-1, 2).tolist())]
            for s, row in enumerate(rows.view(len(ranks), -1))]

# -----------------------------------------------------------------------------
# the run


def main(argv=None):
    cfg = M.parse_args(DEFAULTS, argv, __doc__)
    if cfg.schedule not in SCHEDULES:
        M.die(f"--schedule takes {' or '.join(SCHEDULES)}, not {cfg.schedule!r}")
    if cfg.n_micro < 1:
        M.die("--n_micro must be at least 1")
    if cfg.batch_size % cfg.n_micro:
        M.die(f"--batch_size={cfg.batch_size} does not divide into --n_micro={cfg.n_micro} micro-batches")
    run = M.start(cfg, "pipeline")
    rank, world, device, config = run.rank, run.world, run.device, run.config
    if world > config.n_layer:
        M.die(f"{world} stages but the model has {config.n_layer} blocks: each stage needs at least one")
    group = None  # the whole world is one pipeline; parallel_3d.py runs these pieces on a sub-group
    n_stages, me, last_rank = C.get_world_size(group), C.get_rank(group), C.group_ranks(group)[-1]
    n_micro, bubble = cfg.n_micro, (n_stages - 1) / (cfg.n_micro + n_stages - 1)
    run.layout = dict(stages=n_stages, schedule=cfg.schedule)

    stage = Stage(config, me, n_stages, cfg.seed).to(device)
    params = list(stage.parameters())  # a tensor used twice (one stage: the tie) is listed once
    optimizer = M.make_optimizer(stage.named_parameters(), cfg, device)
    M.restore(run, checkpoint_entries(stage), optimizer)  # both copies of the tied matrix are loaded
    act_shape = (cfg.batch_size // n_micro, config.block_size, config.n_embd)  # crosses a boundary, each way
    executor = Executor(stage, act_shape, n_micro, run.autocast, torch.compile(stage) if cfg.compile else None, group)
    train_plan, eval_plan = plan(cfg.schedule, n_stages, n_micro, me), plan("forward", n_stages, n_micro, me)
    if rank == 0:
        blocks = [len(stage_layers(config.n_layer, n_stages, s)) for s in range(n_stages)]
        print(f"pipeline: {n_stages} stages with {blocks} blocks, schedule {cfg.schedule}, {n_micro} micro-batches "
              f"of {act_shape[0]} x {config.block_size} tokens, {M.param_count(config) / 1e6:.2f}M parameters, "
              f"bubble (p-1)/(m+p-1) = {bubble:.1%}")

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
        stamps = []  # around each forward and backward: the measured bubble, and --timeline
        losses = executor.run(train_plan, partial(M.batch, run, it, "train", n_micro=n_micro), stamps=stamps)
        sum_tied_grads(stage, group)
        norm = clip_global_norm(stage, cfg.grad_clip, group)
        optimizer.step()
        # ---------------------------------------------------------------- end of the training step
        times = action_times(stamps, device)
        if cfg.timeline and it == cfg.max_iters - 1:
            measured = gather_timelines(times, cfg.schedule, n_micro, device, group)
        state = M.tensor_bytes(params) + M.tensor_bytes(p.grad for p in params) + M.optimizer_state_bytes(optimizer)
        run.record["bubble_theory"] = bubble  # one number for the run, not one per rank
        M.end_iter(run, loss=torch.stack(losses).mean() if losses else 0.0, grad_norm=norm, state_bytes=state,
                   loss_ranks=[last_rank], idle_frac=idle_fraction(times, device, group),
                   peak_micro=executor.peak_held, act_bytes=executor.peak_bytes)
    if measured is not None:
        print_timeline(cfg.schedule, n_stages, n_micro, measured)
    return M.finish(run)


if __name__ == "__main__":
    M.main_guard(main)
