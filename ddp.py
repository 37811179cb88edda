"""
Data parallel training: every rank holds the whole model, takes its slice of the
global batch, and the gradients are averaged before the optimizer step.

    python ddp.py                                 # one process: the reference run
    torchrun --nproc_per_node=2 ddp.py            # two ranks (CPU processes over gloo, or GPUs over NCCL)
    torchrun --nproc_per_node=8 ddp.py --model=gpt2 --batch_size=64 --n_micro=4

What it sends: one all-reduce of the gradients per optimizer step. A ring
all-reduce of S bytes makes every rank send 2(N-1)/N·S, so the traffic per rank
is about twice the model's gradient bytes whatever N is; what N changes is how
long it takes, and whether backward can hide it. Two flags pick one of the three
stages of DDP, so the difference can be measured:

  --bucket_mb=0 --overlap=False   naive: after backward, one all-reduce per parameter:
            many small messages, each paying the latency α, none overlapping compute
  --overlap=False                 bucketed: gradients live in flat buckets of --bucket_mb,
            in reverse parameter order; after backward, one all-reduce per bucket
  (the default)                   overlapped: each bucket's all-reduce starts asynchronously
            the moment its last gradient is ready, while backward goes on computing the
            gradients of earlier layers; the step waits for them at the end

--n_micro=k runs k micro-steps per optimizer step and communicates only after
the last: the same bytes per step, k times the tokens.

--n_expert=E trains model.py's mixture of experts with every expert replicated;
its one-process run is the reference that expert_parallel.py reproduces.

The lesson is everything above main(); after it, the byte formula the tests hold the log to.
"""

import torch

import collectives as C
import model as M

DEFAULTS = dict(
    M.TRAIN_DEFAULTS,
    overlap=True,           # launch each bucket's all-reduce from backward's hooks (False: after backward)
    bucket_mb=25.0,         # gradient bucket size; 0: no buckets, one all-reduce per parameter
    n_micro=1,              # micro-batches per optimizer step (gradient accumulation)
)


def all_reduce_each(params, group=None):
    """Naive DDP, the whole algorithm: after backward, average each gradient over the
    ranks, one message per parameter (148 for the tiny preset). A frozen parameter is
    skipped (on every rank alike); one that got no gradient this step sends zeros, since
    another rank may have used it, and every rank must send the same messages in order."""
    for p in params:
        if p.requires_grad:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            C.all_reduce(p.grad, op="avg", group=group)


class GradBuckets:
    """The gradients of all parameters, packed into flat buffers ("buckets").

    Each parameter's .grad is a view into its bucket, so backward writes straight into
    the buffer that is all-reduced: no copy in or out (PyTorch DDP's
    gradient_as_bucket_view). Parameters go in reverse order of registration, roughly the
    order backward produces their gradients, so the first bucket fills first.
    overlap=True launches each bucket's all-reduce from a gradient hook as soon as it is
    full; otherwise reduce() sends them all after backward. If the caller sets .grad to
    None (optimizer.zero_grad()'s default), backward writes a new tensor outside the
    bucket: claim() copies it into its view, as PyTorch's DDP does."""

    def __init__(self, params, bucket_mb, overlap, group=None):
        self.group, self.overlap = group, overlap
        params = [p for p in params if p.requires_grad][::-1]  # a frozen parameter has nothing to average
        cap = int(bucket_mb * 2**20)
        buckets, size = [[]], 0
        for p in params:
            if buckets[-1] and size + p.numel() * p.element_size() > cap:
                buckets.append([])
                size = 0
            buckets[-1].append(p)
            size += p.numel() * p.element_size()
        self.buffers, self.members, self.bucket_of, self.view = [], buckets, {}, {}
        for b, members in enumerate(buckets):
            flat = torch.zeros(sum(p.numel() for p in members), dtype=params[0].dtype, device=params[0].device)
            offset = 0
            for p in members:
                self.view[p] = p.grad = flat[offset:offset + p.numel()].view_as(p)
                self.bucket_of[p] = b
                offset += p.numel()
            self.buffers.append(flat)
        self.sizes = [len(members) for members in buckets]
        self.sync = True  # False on the micro-steps of gradient accumulation that don't communicate
        self.handles, self.ready, self.launched = [], [0] * len(self.buffers), 0
        if overlap:
            for p in params:
                # fires once per backward, after p's gradient has been accumulated:
                # a tied weight used twice fires once, with both uses summed
                p.register_post_accumulate_grad_hook(self._ready)

    def zero(self):
        for flat in self.buffers:
            flat.zero_()

    def claim(self, p):
        """Make p's gradient its bucket view again: zeros if it has none this step (p unused,
        or its .grad set to None and not used since), a copy if backward wrote a tensor of its
        own (after zero_grad(set_to_none=True), or p.grad = None)."""
        view, grad = self.view[p], p.grad
        if grad is view:  # the common case, from every parameter's hook every step: nothing to do
            return
        if grad is None:
            view.zero_()
        elif grad.data_ptr() != view.data_ptr():
            view.copy_(grad)
        p.grad = view

    def _ready(self, p):
        self.claim(p)  # on every micro-step: later ones then accumulate into the view
        if not self.sync:
            return
        self.ready[self.bucket_of[p]] += 1
        # launch strictly in bucket order, even if a later bucket fills first: every
        # rank must issue its all-reduces in the same order, or rank 0's bucket 3
        # meets rank 1's bucket 2 and the ring exchanges the wrong data (or hangs)
        while self.launched < len(self.buffers) and self.ready[self.launched] == self.sizes[self.launched]:
            self.launch()

    def launch(self):
        b = self.launched
        with M.span(self.name(b), comm=True):
            self.handles.append(C.all_reduce(self.buffers[b], op="avg", group=self.group, async_op=True))
        self.launched += 1

    def name(self, b):  # what the trace calls bucket b's all-reduce
        return f"all_reduce bucket {b} ({self.buffers[b].numel() * self.buffers[b].element_size() / 1e6:.1f} MB)"

    def reduce(self):
        """After backward: every bucket averaged over the ranks, on return, and every .grad
        its bucket view. A parameter no hook saw (unused this step, on this rank) holds its
        bucket back: the hooks stop at it, and the buckets from there on are launched here,
        still in bucket order, so every rank issues bucket 0, 1, 2, ... whichever of its
        buckets the hooks launched and whichever this function did."""
        if self.overlap:
            while self.launched < len(self.buffers):
                for p in self.members[self.launched]:
                    self.claim(p)  # claimed already by its hook if it fired: a no-op
                self.launch()
            for h in self.handles:
                h.wait()
            self.handles, self.ready, self.launched = [], [0] * len(self.buffers), 0
        else:
            for b, flat in enumerate(self.buffers):
                for p in self.members[b]:
                    self.claim(p)
                with M.span(self.name(b), comm=True):
                    C.all_reduce(flat, op="avg", group=self.group)


def compile_blocks(model, **options):
    """torch.compile each block on its own, in place, and the head with its loss. Compiled
    whole, the model's backward is one autograd node: every gradient appears at its end,
    and no bucket could be sent while backward runs. One graph per block lets each block's
    bucket go while earlier blocks are differentiated (as torchtitan compiles; PyTorch's DDP
    splits its graph at bucket boundaries). The head is a graph of its own: eager, its float
    logits and their cross-entropy are the step's largest memory traffic (3.3 GB at GPT-2
    size, 16 x 1024 x 50304), which a whole-model compile would fuse. The embedding stays eager."""
    n = len(model.transformer.h)
    if tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 5):
        # Before 2.5 dynamo guards on the module object: each block is a recompile of the one
        # Block.forward code object, and at cache_size_limit (8) it gives up and runs the
        # rest eagerly. Inlining the module (2.4's flag) makes one graph serve every block.
        config = torch._dynamo.config
        if hasattr(config, "inline_inbuilt_nn_modules"):
            config.inline_inbuilt_nn_modules = True
        else:
            config.cache_size_limit = max(config.cache_size_limit, n + 1)
    for block in model.transformer.h:
        block.compile(**options)
    model.head = torch.compile(M.head, **options)
    return model


def main(argv=None):
    cfg = M.parse_args(DEFAULTS, argv, __doc__)
    if cfg.n_micro < 1 or cfg.bucket_mb < 0:
        M.die("--n_micro must be at least 1 and --bucket_mb at least 0")
    run = M.start(cfg, "ddp", moe=True)
    rank, world, device, config = run.rank, run.world, run.device, run.config
    if cfg.batch_size % (world * cfg.n_micro):
        M.die(f"--batch_size={cfg.batch_size} does not divide into {world} rank{'s' * (world > 1)} x {cfg.n_micro} micro-steps")
    if config.capacity_factor and world > 1:  # GShard's drop rule needs the routing of every rank's rows
        M.die("--capacity_factor needs the whole micro-batch's routing, which ddp.py's ranks don't share: "
              "use expert_parallel.py, or one process")
    group = None  # the whole world; parallel_nd.py runs the same pieces on a sub-group

    # every rank builds the same model from the seed; the broadcast from rank 0
    # makes that true even if a user changes the seed per rank (a common bug)
    model = M.GPT(config, seed=cfg.seed).to(device)
    model.recompute = cfg.recompute
    params = list(model.parameters())  # the tied matrix once
    if world > 1:
        for t in params + list(model.buffers()):
            C.broadcast(t.data, src=0, group=group)
    # one process: nothing to average, so no buckets, no hooks, no collective at all
    naive = cfg.bucket_mb == 0 and not cfg.overlap  # all_reduce_each after backward
    buckets = GradBuckets(params, cfg.bucket_mb, cfg.overlap, group) if world > 1 and not naive else None
    optimizer = M.make_optimizer(model.named_parameters(), cfg, device)
    # a checkpoint holds every tensor once: rank 0 writes, every rank reads
    M.restore(run, [(n, p, None, rank == 0) for n, p in model.named_parameters()], optimizer)
    step_model = compile_blocks(model) if cfg.compile else model
    if rank == 0:
        print(f"ddp: {world} rank{'s' * (world > 1)}, {'naive' if naive else 'overlapped' if cfg.overlap else 'bucketed'}, {M.param_count(config) / 1e6:.2f}M parameters, "
              f"{len(buckets.buffers) if buckets else 'no'} bucket{'' if buckets and len(buckets.buffers) == 1 else 's'}, "
              f"{cfg.batch_size // (world * cfg.n_micro)} x {config.block_size} tokens per rank per micro-step")

    @torch.no_grad()
    def evaluate():
        model.eval()
        losses = torch.zeros(cfg.eval_iters, cfg.n_micro, device=device)
        for k in range(cfg.eval_iters):
            for m in range(cfg.n_micro):  # the same rows as a training step: the whole global batch
                with run.autocast:
                    losses[k, m] = step_model(*M.batch(run, k, "val", m, cfg.n_micro, rank, world))[1]
        model.train()
        if world > 1:
            with C.untracked():  # bookkeeping, not training traffic
                C.all_reduce(losses, op="avg", group=group)
        return losses.mean().item()

    for it in range(run.start_iter, cfg.max_iters):
        M.begin_iter(run, it, evaluate)
        # ---------------------------------------------------------------- the training step
        if buckets:
            buckets.zero()
        else:
            optimizer.zero_grad(set_to_none=True)
        loss, act = torch.zeros((), device=device), 0
        for m in range(cfg.n_micro):
            if buckets:  # communicate only after the last micro-step: one all-reduce serves them all
                buckets.sync = m == cfg.n_micro - 1
            x, y = M.batch(run, it, "train", m, cfg.n_micro, rank, world)
            counting, saved = M.saved_bytes(params, on=not cfg.compile)
            with M.span("forward"), run.autocast, counting:
                _, micro_loss = step_model(x, y)
            act = max(act, sum(saved.values()))  # what this micro-step's backward will read
            # the mean over the global batch; plus, with --n_expert, the load-balancing loss (0.0 if dense)
            with M.span("backward"):
                ((micro_loss + M.moe_loss(model)) / cfg.n_micro).backward()
            loss += micro_loss.detach() / cfg.n_micro
        t_comm = M.now(device)
        if buckets:
            buckets.reduce()
        elif world > 1:
            all_reduce_each(params, group)
        exposed = M.now(device)  # communication that backward did not hide: from here back to t_comm
        M.span_between("exposed communication", t_comm, exposed)  # in the trace, the interval logged
        # after the all-reduce every rank holds the same gradients, so the local norm is the global norm
        with M.span("optimizer"):
            norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip) if cfg.grad_clip else 0.0
            optimizer.step()
        # ---------------------------------------------------------------- end of the training step
        if it == run.start_iter:  # the same every step from here on (Adam's moments exist after its first step)
            grads = buckets.buffers if buckets else [p.grad for p in params]
            state = M.tensor_bytes(params) + M.tensor_bytes(grads) + M.optimizer_state_bytes(optimizer)
        M.end_iter(run, loss=loss.item(), grad_norm=norm, state_bytes=state, act_bytes=act,
                   exposed_comm_ms=1000 * M.elapsed(t_comm, exposed), **M.moe_log(run, model))
    return M.finish(run)

# ----------------------------------------------------------------------------- the bytes

def traffic_per_rank(config, cfg, world):
    """Bytes a rank sends per optimizer step, whatever --n_micro is: one ring all-reduce of the
    gradients, 2(N-1)/N·4Ψ (the mean over ranks when the chunks are uneven)."""
    return 2 * (world - 1) / world * 4 * M.param_count(config)


if __name__ == "__main__":
    M.main_guard(main)
