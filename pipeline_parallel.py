"""
Pipeline parallel training: the model is cut by depth. Each of the p ranks is a
stage that owns consecutive blocks (the embedding also lives on the first stage,
the final norm and the head on the last), and the global batch is cut into
--n_micro micro-batches that flow through the stages like cars down an assembly
line: while stage 1 works on micro-batch 0, stage 0 already works on micro-batch 1.

    python pipeline_parallel.py                                  # one stage: the reference run
    torchrun --nproc_per_node=4 pipeline_parallel.py --n_micro=8 --schedule=1f1b --timeline=True
    torchrun --nproc_per_node=2 pipeline_parallel.py --schedule=gpipe

What it sends, and when. Between neighbours, point to point: for each micro-batch
of b = batch_size/m sequences of s tokens, the activation (b·s·h floats) goes
forward across every stage boundary, and its gradient (same size) comes back. A
step therefore moves 2·m·b·s·h·4 bytes across each of the p-1 boundaries (float32
activations), whatever m is: stage k < p-1 sends m activations, stage k > 0 sends
m gradients. Once per step, after the pipeline has drained: the first and the last
stage each hold a copy of the tied embedding/head matrix (V·h), and sum their two
gradients in an all-reduce over just those two ranks (each sends V·h·4 bytes: an
all-reduce at N=2 sends S per rank); and one float, each stage's squared gradient
norm, is summed over all stages for the clipping. Nothing else: no stage ever sees
another's weights.

The price is the bubble. A stage cannot start micro-batch 0 before the stages in
front of it have done theirs, and the last backward reaches stage 0 only after
passing every stage: out of the step's (m+p-1) slots, each stage idles p-1, a
fraction (p-1)/(m+p-1), for both schedules below (FORMULAS.md). More
micro-batches shrink it; what the schedule changes is memory:

  gpipe  all m forwards, then all m backwards: every stage holds the activations
         of all m micro-batches at once.
  1f1b   stage k runs p-1-k forwards (warm-up), then alternates one forward and
         one backward (steady state), then finishes the backwards (cool-down):
         a backward frees a micro-batch as soon as possible, so a stage never
         holds more than p of them, however large m is.

Each schedule is a plain list of actions per stage (schedule(), plan()), which the
training loop executes one by one; simulate() runs all the lists on paper and
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
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn as nn

import collectives as C
import model as M

DEFAULTS = dict(M.TRAIN_DEFAULTS, schedule="1f1b", n_micro=4, timeline=False)
SCHEDULES = ("gpipe", "1f1b")

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
    """(rank to send to, rank to receive from) for an exchange of plan()."""
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
    """Bytes a stage sends per step, on average over the stages. Each of the p-1
    boundaries carries every micro-batch's activation forward and its gradient back:
    2·m·(b·s·h·4) = 2·B·s·h·4 bytes, whatever m is. The first and the last stage each
    send the V·h·4 bytes of the tied gradient, and the clipping's one-float all-reduce
    sends 2(p-1)·4 bytes in all."""
    if world == 1:
        return 0
    act = 4 * cfg.batch_size * config.block_size * config.n_embd
    tie = 4 * config.vocab_size * config.n_embd
    return (2 * (world - 1) * act + 2 * tie + (2 * (world - 1) * 4 if cfg.grad_clip else 0)) / world

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
            # before every step (see the training loop), and AdamW then does the same to both
            self.lm_head.weight = self.transformer["wte"].weight if self.first else \
                nn.Parameter(M.build_unit(config, "embed", seed).wte.weight.detach())

    def forward(self, x, targets=None):
        """Token ids on the first stage, else the previous stage's activation. Returns
        the activation for the next stage, or on the last stage the mean loss."""
        t = self.transformer
        if self.first:
            x = M.embed(t.wte, t.wpe, x, self.config.dropout, self.training)
        for i in self.layers:
            x = t.h[str(i)](x)
        return M.head(t.ln_f, self.lm_head.weight, x, targets)[1] if self.last else x


def saved_bytes(params):
    """A context that counts the bytes autograd keeps for backward (the activations
    a micro-batch holds until its backward), leaving out the parameters, which it
    saves by reference. -> (context, dict storage -> bytes)."""
    skip = {p.untyped_storage().data_ptr() for p in params}
    seen = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            seen[storage.data_ptr()] = storage.nbytes()
        return t
    return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), seen


def gather_state(stage, config, seed, rank, world, device):
    """The full state_dict on rank 0 (None elsewhere): each other stage sends all its
    tensors in one flat message, and rank 0 builds a stage of the same shape to know
    their names and sizes. Bookkeeping: untracked."""
    mine = stage.state_dict()
    with C.untracked():
        if rank != 0:
            C.send(torch.cat([v.detach().reshape(-1) for v in mine.values()]), dst=0)
            return None
        full = {k: v.detach().cpu().clone() for k, v in mine.items()}
        for s in range(1, world):
            shapes = Stage(config, s, world, seed).state_dict()
            flat = torch.empty(sum(v.numel() for v in shapes.values()), device=device)
            C.recv(flat, src=s)
            for (k, v), piece in zip(shapes.items(), flat.split([v.numel() for v in shapes.values()])):
                full[k] = piece.view(v.shape).cpu().clone()
    return full

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
    rank, world, _, device = C.init_distributed()
    config, train_data, val_data, autocast = M.setup_run(cfg, device)
    if world > config.n_layer:
        M.die(f"{world} stages but the model has {config.n_layer} blocks: each stage needs at least one")
    b, n_micro = cfg.batch_size // cfg.n_micro, cfg.n_micro  # sequences per micro-batch
    act_shape = (b, config.block_size, config.n_embd)  # what crosses a stage boundary, each way

    stage = Stage(config, rank, world, cfg.seed).to(device)
    # the tied matrix's two copies meet in a group of just the first and last stage
    # (new_group must be called by every rank, even those outside the group)
    tie_group = dist.new_group([0, world - 1]) if world > 1 else None
    tied = stage.lm_head.weight if stage.last else stage.transformer["wte"].weight if stage.first else None
    params = list(stage.parameters())  # a tensor used twice (one stage: the tie) is listed once
    # the global norm counts the tied matrix once: on the first stage, not the last stage's copy
    norm_params = [p for p in params if not (p is tied and stage.last and not stage.first)]
    optimizer = M.make_optimizer(stage.named_parameters(), cfg, device)
    step_stage = torch.compile(stage) if cfg.compile else stage

    n_params = M.param_count(config)  # the whole model's, the tie counted once
    flops_per_step = M.flops_per_token(config, n_params) * cfg.batch_size * config.block_size
    peak = M.peak_flops(device, cfg.peak_flops)
    bubble = (world - 1) / (n_micro + world - 1)
    log = M.Logger(cfg, rank)
    if rank == 0:
        blocks = [len(stage_layers(config.n_layer, world, s)) for s in range(world)]
        print(f"pipeline: {world} stages with {blocks} blocks, schedule {cfg.schedule}, {n_micro} micro-batches "
              f"of {b} x {config.block_size} tokens, {n_params / 1e6:.2f}M parameters, bubble (p-1)/(m+p-1) = "
              f"{bubble:.1%}")
    train_plan, eval_plan = plan(cfg.schedule, world, n_micro, rank), plan("forward", world, n_micro, rank)

    def micro_batch(step, m, data, split):
        x, y = M.get_batch(data, cfg.seed, step, cfg.batch_size, config.block_size,
                           rows=slice(m * b, (m + 1) * b), split=split)
        return x.to(device, non_blocking=True), y.to(device, non_blocking=True)

    def run(step, actions, data, split, train=True):
        """Execute one plan. -> (the losses of the micro-batches on the last stage,
        [(start, end)] of each compute action, peak micro-batches held, peak bytes held)."""
        inbox, outbox, held = {}, {}, {}  # received tensors, tensors to send, micro-batches awaiting backward
        losses, events, live_bytes, peak_held, peak_bytes = [], [], {}, 0, 0
        for action in actions:
            if action[0] == "X":
                _, send, recv = action
                dst, src = peers(rank, send, recv)
                buf = torch.empty(act_shape, device=device) if recv else None
                C.sendrecv(outbox.pop(send) if send else None, dst, buf, src)
                if recv:
                    inbox[recv] = buf
                continue
            kind, m = action
            start = M.timer(device)
            if kind == "F":
                x, y = micro_batch(step, m, data, split)
                inp = x if stage.first else inbox.pop(("act", m)).requires_grad_(train)
                counting, saved = saved_bytes(params) if train and not cfg.compile else (nullcontext(), {})
                with autocast, counting:
                    out = step_stage(inp, y)
                if stage.last:
                    losses.append(out.detach())
                    out = out / n_micro  # each micro-batch's mean, scaled: their sum is the global batch's mean
                else:
                    outbox[("act", m)] = out.detach().float()  # float32 across the boundary, autocast or not
                if train:
                    held[m], live_bytes[m] = (inp, out), sum(saved.values())
                    peak_held, peak_bytes = max(peak_held, len(held)), max(peak_bytes, sum(live_bytes.values()))
            else:
                inp, out = held.pop(m)
                del live_bytes[m]
                out.backward(None if stage.last else inbox.pop(("grad", m)))
                if not stage.first:
                    outbox[("grad", m)] = inp.grad
            events.append((start, M.timer(device)))
        return losses, events, peak_held, peak_bytes

    @torch.no_grad()
    def evaluate():
        stage.eval()
        with C.untracked():  # bookkeeping, not training traffic
            losses = [loss for k in range(cfg.eval_iters) for loss in run(k, eval_plan, val_data, "val", False)[0]]
            loss = torch.stack(losses).mean() if stage.last else torch.zeros((), device=device)
            C.broadcast(loss, src=world - 1)  # only the last stage has it
        stage.train()
        return loss.item()

    last_timelines = None
    for it in range(cfg.max_iters):
        record = {"iter": it}
        if cfg.eval_interval and (it % cfg.eval_interval == 0 or it == cfg.max_iters - 1):
            record["val_loss"] = evaluate()
        lr = M.get_lr(it, cfg)
        M.set_lr(optimizer, lr)
        C.reset_bytes()
        t0 = M.timer(device)

        optimizer.zero_grad(set_to_none=True)
        losses, events, peak_held, peak_bytes = run(it, train_plan, train_data, "train")
        if world > 1 and tied is not None:
            # each copy of the tied matrix has only half its gradient: the embedding's
            # use on the first stage, the head's on the last. The true gradient is the
            # sum; both copies take it, so the same AdamW step keeps them equal
            C.all_reduce(tied.grad, op="sum", group=tie_group)
        norm = 0.0
        if cfg.grad_clip:
            # each stage has the squared norm of its own gradients; their sum is the global one
            sq = torch.zeros((), device=device)
            for p in norm_params:
                sq += p.grad.float().pow(2).sum()
            C.all_reduce(sq, op="sum")
            norm = sq.sqrt().item()
            for p in params:
                p.grad.mul_(M.clip_coef(norm, cfg.grad_clip))
        optimizer.step()

        dt = M.timer(device) - t0
        sent = C.bytes_sent()
        state = M.tensor_bytes(params) + M.tensor_bytes(p.grad for p in params) + M.optimizer_state_bytes(optimizer)
        peak_mem = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
        loss = torch.stack(losses).mean().item() if stage.last else 0.0
        rows = C.gather_stats([loss, sent, state, peak_mem, peak_held, peak_bytes] + [t for e in events for t in e])
        if rank == 0:
            # every stage's (start, end) of each compute action, on the machines' common clock
            timelines = [[(a, r[6 + 2 * i], r[7 + 2 * i]) for i, a in
                          enumerate(x for x in plan(cfg.schedule, world, n_micro, s) if x[0] != "X")]
                         for s, r in enumerate(rows)]
            record.update(loss=rows[-1][0], lr=lr, grad_norm=float(norm), dt_ms=1000 * dt,
                          tokens_per_s=cfg.batch_size * config.block_size / dt,
                          mfu=flops_per_step / dt / (world * peak) if peak else None,
                          comm_bytes=[int(r[1]) for r in rows], state_bytes=[int(r[2]) for r in rows],
                          idle_frac=idle_fractions(timelines), bubble_theory=bubble,
                          peak_micro=[int(r[4]) for r in rows], act_bytes=[int(r[5]) for r in rows])
            if device.type == "cuda":
                record["peak_bytes"] = [int(r[3]) for r in rows]
            last_timelines = timelines
        log(record)

    if cfg.timeline and rank == 0:
        print_timeline(cfg.schedule, world, n_micro, last_timelines)
    if cfg.save_path:
        state = gather_state(stage, config, cfg.seed, rank, world, device)
        if rank == 0:
            torch.save(state, cfg.save_path)
    C.shutdown()
    return log.records


if __name__ == "__main__":
    main()
