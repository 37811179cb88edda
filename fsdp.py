"""
Fully sharded data parallel (ZeRO-3): data parallel training in which no rank ever
holds the whole model. Parameters, gradients and Adam's state are each split N ways,
and a unit's full weights exist only while it computes.

    python fsdp.py                                    # one process: the reference run
    torchrun --nproc_per_node=4 fsdp.py               # four ranks (CPU processes over gloo, or GPUs over NCCL)
    torchrun --nproc_per_node=8 fsdp.py --model=gpt2-xl --batch_size=64 --prefetch=2
    torchrun --nproc_per_node=4 fsdp.py --zero_stage=2    # a lighter variant, to compare memory

What it splits. The model is cut into units: each transformer block, and the model's
two ends (token and position embeddings, final norm, and the head, which reuses the
token embedding matrix: the tied matrix lives in this one unit, so it is stored,
gathered and reduced once). A unit's parameters are laid end to end in one flat fp32
buffer, padded to a multiple of N, and rank r keeps slice r of it, its shard. The
model is built one unit at a time from model.py's seeded init, and only the shard is
kept. The batch is split as in ddp.py: rank r takes contiguous rows.

What it sends, and when, for each micro-batch:
  forward   all-gather a unit's shards into its full weights just before it runs,
            free them right after it: the ends (embedding), blocks 0..L-1, the ends (head)
  head      forward and backward at once, so that one gather serves both
  backward  all-gather each block again (L-1 down to 0), recompute its forward,
            backpropagate, reduce-scatter its gradient into this rank's gradient shard
            (op avg: the sum over ranks / N, the mean over the global batch, as DDP's)
            and free the full weights and gradient. The embedding's backward needs no
            weights (a lookup's gradient is the output gradient added into the rows it
            read), so the ends' gradient, collected from the head and the embedding, is
            reduce-scattered once, at the end.
Every unit is gathered twice and reduce-scattered once. A ring all-gather or
reduce-scatter of S bytes makes each rank send (N-1)/N·S, so per rank per step

    3(N-1)/N · Ψ · --grad_accum    + one float for the global gradient norm

with Ψ the model's parameter bytes, padded (FORMULAS.md's ZeRO-3 line). DDP sends
2(N-1)/N·Ψ: ZeRO-3 pays one more gather to hold 16Ψ/N bytes of state per rank (fp32
param 4 + grad 4 + Adam's m and v 8 per parameter) instead of DDP's 16Ψ. The padding is
at most N-1 elements a unit; the optimizer never sees it.

Prefetch. Before a unit runs, the all-gathers of the next --prefetch units are issued
asynchronously and travel while it computes, in forward and in backward; a unit's
reduce-scatter travels while the next one's backward computes. At most 1 + prefetch
units are alive in gathered form (logged as max_gathered_units); --prefetch=0
gathers each unit when it is needed, and the computation waits for it.

Recompute. Autograd keeps what backward needs, and for a linear layer that is its
weight: it would keep every gathered unit alive. So this is FSDP with activation
recomputation, the way large models are usually trained: forward runs each block
without autograd and keeps only its input; backward gathers the block again and
recomputes it with autograd. (FSDP without recomputation lets autograd keep its
saved tensors, which are views of the gathered buffer, frees the buffer's memory by
resizing its storage to zero after forward, and in backward resizes it back and
all-gathers into the same storage, so the saved views see the weights again.)

Mixed precision (--dtype=bfloat16, the default on a GPU). The shard is cast to bf16
before it is gathered and gradients are reduce-scattered in bf16, so every message
is half the bytes (Ψ above counts 2 bytes a parameter); the master weights, the
gradient shard and Adam's state stay fp32.

--zero_stage=1|2, the lighter variants, share the code: every rank keeps every unit's
full weights (no gathers in forward or backward, no recompute) and shards Adam's state
(1), or the gradients too (2: each unit's gradient is reduce-scattered as soon as it
is complete; 1 keeps full gradients and reduce-scatters them once per step). After
the step each rank all-gathers its updated shards: 2(N-1)/N·Ψ per step, DDP's traffic
(stage 2 with grad_accum: (grad_accum + 1)(N-1)/N·Ψ). State per rank in fp32, with
the master shard kept apart from the full weights: ZeRO-1 8Ψ + 16Ψ/N, ZeRO-2
4Ψ + 16Ψ/N, ZeRO-3 16Ψ/N (Ψ in parameters here).
"""
import torch
import torch.nn as nn

import collectives as C
import model as M

DEFAULTS = dict(M.TRAIN_DEFAULTS, zero_stage=3, prefetch=1, grad_accum=1)


class Ends(nn.Module):
    """The model's two ends as one unit of sharding: the embeddings and the head (final
    norm, then logits through the token embedding matrix: the tie)."""

    def __init__(self, config, seed):
        super().__init__()
        emb = M.build_unit(config, "embed", seed)
        self.wte, self.wpe = emb.wte, emb.wpe
        self.ln_f = M.build_unit(config, "ln_f", seed)

    def forward(self, x, targets=None):
        """Token ids -> embeddings; or, given targets, the last block's output -> the loss."""
        if targets is None:
            return M.embed(self.wte, self.wpe, x)
        return M.head(self.ln_f, self.wte.weight, x, targets)[1]


class Unit:
    """One unit's parameters as a flat buffer split N ways, of which this rank keeps its
    shard (fp32, the master weights the optimizer updates) and the shard's gradient."""

    def __init__(self, module, prefix, rank, world, device, keep_full_dtype=None):
        named = list(module.named_parameters())
        self.prefix, self.names = prefix, [n for n, _ in named]
        self.shapes = [p.shape for _, p in named]
        self.sizes = [p.numel() for _, p in named]
        self.offsets = [sum(self.sizes[:i]) for i in range(len(named))]
        self.numel = sum(self.sizes)
        self.shard_size = -(-self.numel // world)  # padded, so the flat buffer divides evenly
        flat = torch.zeros(self.shard_size * world)
        flat[:self.numel] = torch.cat([p.detach().reshape(-1) for _, p in named])
        self.start = rank * self.shard_size  # where this rank's shard begins in the flat buffer
        self.shard = flat[self.start:self.start + self.shard_size].clone().to(device)
        self.grad = torch.zeros_like(self.shard)
        # ZeRO-1/2 keep the full weights (in the compute dtype) on every rank; ZeRO-3 drops them
        self.full = flat.to(device, keep_full_dtype) if keep_full_dtype else None
        self.full_grad = None  # ZeRO-1's full gradient, kept through the step
        self.skeleton = module.to("meta")  # the unit's code and shapes, no memory: it runs on gathered views

    def views(self, flat):
        """name -> that parameter's view into a full flat buffer of this unit (weights or gradient)."""
        return {name: flat[offset:offset + size].view(shape)
                for name, offset, size, shape in zip(self.names, self.offsets, self.sizes, self.shapes)}

    def optimizer_params(self):
        """(GPT state_dict name, view) for the part of each parameter in this rank's shard.
        The optimizer updates the shard in place through these views, and reads the
        gradient shard through their .grad. nanoGPT's decay rule (model.decays) looks at
        the parameter's shape, so a slice of a matrix goes in as a one-row matrix."""
        out = []
        for name, shape, offset, size in zip(self.names, self.shapes, self.offsets, self.sizes):
            lo, hi = max(offset, self.start), min(offset + size, self.start + self.shard_size)
            if lo >= hi:
                continue  # this parameter lies in other ranks' shards
            p, g = (t[lo - self.start:hi - self.start] for t in (self.shard, self.grad))
            if len(shape) >= 2:
                p, g = p.view(1, -1), g.view(1, -1)
            p.grad = g
            out.append((self.prefix + name, p))
        return out


def run(unit, full, *args):
    """The unit's forward on full weights: views into one flat buffer."""
    return torch.func.functional_call(unit.skeleton, unit.views(full), args)


class Gatherer:
    """Full weights on demand. ZeRO-3: all-gather a unit just before it runs, with the next
    `prefetch` units' gathers already on the way, and free it right after. ZeRO-1/2: every
    unit's full weights stay, there is nothing to gather."""

    def __init__(self, units, prefetch, dtype, sharded):
        self.units, self.prefetch, self.dtype, self.sharded = units, prefetch, dtype, sharded
        self.alive = {}  # unit index -> (full buffer, handle of its all-gather)
        self.max_alive = 0

    def _gather(self, i):
        if i in self.alive:
            return
        u = self.units[i]
        full = torch.empty(u.shard_size * C.get_world_size(), dtype=self.dtype, device=u.shard.device)
        # cast before communicating: a bf16 run sends half the bytes
        self.alive[i] = (full, C.all_gather(full, u.shard.to(self.dtype), async_op=True))
        self.max_alive = max(self.max_alive, len(self.alive))

    def walk(self, order):
        """Yields the full weights of units order[0], order[1], ... in turn. Every rank walks
        the same order, so every rank issues the same collectives in the same order."""
        for k, i in enumerate(order):
            if not self.sharded:
                yield self.units[i].full
                continue
            for j in order[k:k + 1 + self.prefetch]:
                self._gather(j)  # async: the next units' gathers travel while unit i computes
            full, handle = self.alive[i]
            handle.wait()
            yield full
            del self.alive[i]  # reshard: the full weights go as soon as the unit is done


class Reducer:
    """Reduce-scatters a unit's full gradient into its shard's gradient, asynchronously, with
    one in flight: unit k's reduce-scatter travels while backward computes unit k-1."""

    def __init__(self):
        self.pending = None

    def __call__(self, unit, grad):
        self.finish()
        out = torch.empty(unit.shard_size, dtype=grad.dtype, device=grad.device)
        # avg: the sum over ranks / N, so the gradient is the mean over the global batch
        self.pending = (unit, out, grad, C.reduce_scatter(out, grad, op="avg", async_op=True))

    def finish(self):
        if self.pending:
            unit, out, _, handle = self.pending  # the full gradient is freed only once it has been sent
            handle.wait()
            unit.grad += out  # accumulates over micro-steps, in fp32
            self.pending = None


def leaf(t):
    """A new autograd leaf on the same memory: backward stops there and returns its gradient."""
    return t.detach().requires_grad_()


def traffic_per_rank(config, cfg, world):
    """The docstring's formula, per rank per step: every unit's padded parameter bytes
    gathered twice and reduce-scattered once per micro-step (ZeRO-3), or reduce-scattered
    and gathered once a step (ZeRO-1/2), plus the gradient norm's one float."""
    with torch.device("meta"):
        block = sum(p.numel() for p in M.Block(config).parameters())
    units = [M.param_count(config) - config.n_layer * block] + [block] * config.n_layer  # the ends, the blocks
    padded = sum(-(-n // world) * world for n in units)
    elem = 2 if cfg.dtype == "bfloat16" else 4  # bf16 runs gather and reduce in bf16
    passes = {3: 3 * cfg.grad_accum, 2: cfg.grad_accum + 1, 1: 2}[cfg.zero_stage]
    norm = 2 * (world - 1) / world * 4 if cfg.grad_clip else 0
    return passes * (world - 1) / world * padded * elem + norm


def main(argv=None):
    cfg = M.parse_args(DEFAULTS, argv, __doc__)
    if cfg.zero_stage not in (1, 2, 3):
        M.die(f"--zero_stage takes 1, 2 or 3, not {cfg.zero_stage}")
    if cfg.prefetch < 0 or cfg.grad_accum < 1:
        M.die("--prefetch must be at least 0 and --grad_accum at least 1")
    if cfg.dropout:
        M.die("fsdp.py needs --dropout=0: backward recomputes the blocks and would need forward's random masks")
    rank, world, _, device = C.init_distributed()
    if cfg.batch_size % (world * cfg.grad_accum):
        M.die(f"--batch_size={cfg.batch_size} does not divide into {world} ranks x {cfg.grad_accum} micro-steps")
    config, train_data, val_data, autocast = M.setup_run(cfg, device)
    micro = cfg.batch_size // (world * cfg.grad_accum)  # sequences per rank per micro-step
    dtype = torch.bfloat16 if cfg.dtype == "bfloat16" else torch.float32  # of the gathered weights
    stage, recompute = cfg.zero_stage, cfg.zero_stage == 3

    # one unit at a time: build it from the seed, keep this rank's shard, drop the rest
    keep = dtype if stage < 3 else None
    units = [Unit(Ends(config, cfg.seed), "transformer.", rank, world, device, keep)]
    units += [Unit(M.build_unit(config, i, cfg.seed), f"transformer.h.{i}.", rank, world, device, keep)
              for i in range(config.n_layer)]
    if stage == 1:
        for u in units:
            u.full_grad = torch.zeros_like(u.full)
    gather = Gatherer(units, cfg.prefetch, dtype, sharded=stage == 3)
    reduce = Reducer()
    optimizer = M.make_optimizer([p for u in units for p in u.optimizer_params()], cfg, device)
    if cfg.compile:  # every block has the same code and shapes: one compiled skeleton serves them all
        ends, block = torch.compile(units[0].skeleton), torch.compile(units[-1].skeleton)
        for u in units:
            u.skeleton = ends if u is units[0] else block

    n_params = sum(u.numel for u in units)  # the tied matrix once, as model.num_params counts it
    padding = sum(u.shard_size * world - u.numel for u in units)
    flops_per_step = M.flops_per_token(config, n_params) * cfg.batch_size * config.block_size
    peak = M.peak_flops(device, cfg.peak_flops)
    log = M.Logger(cfg, rank)
    if rank == 0:
        print(f"fsdp: {world} ranks, ZeRO-{stage}, prefetch {cfg.prefetch}, {n_params / 1e6:.2f}M parameters "
              f"in {len(units)} units, {sum(u.shard_size for u in units) / 1e6:.2f}M per rank ({padding} padding), "
              f"{micro} x {config.block_size} tokens per rank per micro-step")

    def batch(step, m, data=train_data, split="train"):
        first = (rank * cfg.grad_accum + m) * micro  # this rank's contiguous rows of the global batch
        x, y = M.get_batch(data, cfg.seed, step, cfg.batch_size, config.block_size,
                           rows=slice(first, first + micro), split=split)
        return x.to(device, non_blocking=True), y.to(device, non_blocking=True)

    def forward(x, steps, saved=None):
        """The embedding and the blocks, each on its just-gathered weights. saved: None when
        evaluating, else a list to fill with what each block's backward needs."""
        with autocast:
            with torch.no_grad():
                h = run(units[0], next(steps), x)
            for u in units[1:]:
                w = next(steps)
                if saved is None or recompute:  # ZeRO-3: the weights go, so keep only the input
                    if saved is not None:
                        saved.append(h)
                    with torch.no_grad():
                        h = run(u, w, h)
                else:  # ZeRO-1/2: the weights stay, so autograd may keep what it needs, as usual
                    h_in, w_in = leaf(h), leaf(w)
                    out = run(u, w_in, h_in)
                    saved.append((h_in, w_in, out))
                    h = out.detach()
        return h

    def grad_ready(unit, grad):
        """The unit's full gradient for this micro-step is complete."""
        if stage == 1:
            unit.full_grad += grad  # ZeRO-1 keeps it whole, and reduce-scatters once per step
        else:
            reduce(unit, grad)

    def micro_step(x, y, scale):
        ends, blocks = units[0], units[1:]
        order = [0, *range(1, len(units)), 0, *range(len(blocks), 0, -1)]  # forward, head, backward
        steps = gather.walk(order)
        saved = []
        h = leaf(forward(x, steps, saved))
        # the head: its forward and backward at once, on one gather of the ends
        w = leaf(next(steps))
        with autocast:
            loss = run(ends, w, h, y)
        gh, g_ends = torch.autograd.grad(loss * scale, (h, w))  # scale: the mean over all micro-steps
        for u, s in zip(reversed(blocks), reversed(saved)):
            w = next(steps)
            if recompute:
                h_in, w_in = leaf(s), leaf(w)
                with autocast:
                    out = run(u, w_in, h_in)
            else:
                h_in, w_in, out = s
            gh, g = torch.autograd.grad(out, (h_in, w_in), gh)
            grad_ready(u, g)
        next(steps, None)  # past the last step: frees block 0
        # the embedding's backward, without its weights: token t's row of wte and position
        # p's row of wpe receive the output gradient at every place they were used. The
        # lookup's gradient is summed apart, then added to the head's, as autograd does
        # for the tied matrix: the same rounding as the one-process run.
        v = ends.views(g_ends)
        gh = gh.to(g_ends.dtype)
        v["wte.weight"] += torch.zeros_like(v["wte.weight"]).index_add_(0, x.view(-1), gh.reshape(-1, gh.size(-1)))
        v["wpe.weight"][:x.size(1)] += gh.sum(0)
        grad_ready(ends, g_ends)  # the tied matrix: head and embedding together, reduced once
        return loss.detach()

    @torch.no_grad()
    def evaluate():
        losses = torch.zeros(cfg.eval_iters, cfg.grad_accum, device=device)
        with C.untracked():  # evaluation's gathers and the loss average are not training traffic
            for k in range(cfg.eval_iters):
                for m in range(cfg.grad_accum):  # the same rows as a training step: the whole global batch
                    x, y = batch(k, m, val_data, "val")
                    steps = gather.walk([*range(len(units)), 0])
                    h = forward(x, steps)
                    with autocast:
                        losses[k, m] = run(units[0], next(steps), h, y)
                    next(steps, None)
            C.all_reduce(losses, op="avg")
        return losses.mean().item()

    for it in range(cfg.max_iters):
        record = {"iter": it}
        if cfg.eval_interval and (it % cfg.eval_interval == 0 or it == cfg.max_iters - 1):
            record["val_loss"] = evaluate()
        lr = M.get_lr(it, cfg)
        M.set_lr(optimizer, lr)
        C.reset_bytes()
        gather.max_alive = len(gather.alive) if recompute else len(units)
        t0 = M.timer(device)

        for u in units:
            u.grad.zero_()
            if u.full_grad is not None:
                u.full_grad.zero_()
        loss_sum = torch.zeros((), device=device)
        for m in range(cfg.grad_accum):
            loss_sum += micro_step(*batch(it, m), 1.0 / cfg.grad_accum) / cfg.grad_accum
        if stage == 1:
            for u in units:
                reduce(u, u.full_grad)
        reduce.finish()

        norm = 0.0
        if cfg.grad_clip:
            # every element lies in exactly one rank's shard (the padding's gradient is 0), so the
            # sum of the ranks' squared norms is the global one, nothing counted twice
            sq = torch.stack([u.grad.pow(2).sum() for u in units]).sum()
            C.all_reduce(sq)
            norm = sq.sqrt().item()
            coef = M.clip_coef(norm, cfg.grad_clip)
            for u in units:
                u.grad.mul_(coef)
        optimizer.step()  # on this rank's shards only
        if stage < 3:  # ZeRO-1/2: every rank needs every unit's updated weights again
            for u in units:
                C.all_gather(u.full, u.shard.to(dtype))

        dt = M.timer(device) - t0
        sent = C.bytes_sent()
        state = M.tensor_bytes([u.shard for u in units] + [u.grad for u in units]) + M.optimizer_state_bytes(optimizer)
        state += M.tensor_bytes([t for u in units for t in (u.full, u.full_grad) if t is not None])
        peak_mem = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
        rows = C.gather_stats([loss_sum.item(), sent, state, peak_mem, gather.max_alive])  # one row per rank, on rank 0
        if rank == 0:
            tokens_per_s = cfg.batch_size * config.block_size / dt
            record.update(loss=sum(r[0] for r in rows) / world, lr=lr, grad_norm=float(norm), dt_ms=1000 * dt,
                          tokens_per_s=tokens_per_s, mfu=flops_per_step / dt / (world * peak) if peak else None,
                          comm_bytes=[int(r[1]) for r in rows], state_bytes=[int(r[2]) for r in rows],
                          max_gathered_units=[int(r[4]) for r in rows])
            if device.type == "cuda":
                record["peak_bytes"] = [int(r[3]) for r in rows]
        log(record)

    if cfg.save_path:
        # every unit's full weights, gathered to rank 0 one unit at a time, under GPT's names
        state = {}
        with C.untracked():
            for u in units:
                full = torch.empty(u.shard_size * world, device=device) if rank == 0 else None
                C.gather(full, u.shard, dst=0)
                if rank == 0:
                    state.update({u.prefix + n: t.cpu().clone() for n, t in u.views(full).items()})
        if rank == 0:
            state["lm_head.weight"] = state["transformer.wte.weight"]  # the tie, as GPT's state_dict has it
            torch.save(state, cfg.save_path)
    C.shutdown()
    return log.records


if __name__ == "__main__":
    main()
