"""
Expert parallelism: the mixture-of-experts GPT (model.py, --n_expert=E) with its experts
split over the ranks, E/N each, and everything else replicated as in DDP.

    python ddp.py --n_expert=4                                  # one process: the reference run
    torchrun --nproc_per_node=2 expert_parallel.py --n_expert=4
    torchrun --nproc_per_node=4 expert_parallel.py --n_expert=8 --top_k=1 --capacity_factor=1.25

Every rank takes its contiguous rows of the global batch, as in ddp.py, and runs
attention and the routers on them itself. At each MoE layer a rank's tokens must
reach the ranks that hold the experts they chose, and come back:

  route     each token's top_k experts and weights, on its own rank
  counts    an all-gather of every rank's (E, k) choice counts, so every rank knows
            how many rows it will receive from whom, and can apply the capacity
            rule to the global order (Megatron-Core's all-to-all dispatcher gathers
            them the same way)
  dispatch  an all-to-all of unequal splits: rows grouped by expert, so by rank
  experts   each local expert on its rows, from every rank, in global token order
  combine   the reverse all-to-all brings the outputs home; the router weights
            mix them there. Backward is the same two all-to-alls, reversed.

--dispatch=allgather, the simple alternative: every rank all-gathers the global micro-batch
and its routing, runs its experts on the choices routed to them, and a reduce-scatter sums
the partial outputs back to their ranks; backward, the same pair reversed. An expert's
gradient arrives through these exchanges from every rank's tokens, so it is never
all-reduced; the replicated weights' gradients are averaged with one all-reduce a step.

The lesson is everything above main(); below the fence after it, the log's MoE fields (the
experts' loads, the drops) and the byte formulas the tests hold the log to.
"""

import torch
import torch.nn.functional as F

import collectives as C
import model as M

DEFAULTS = dict(
    M.TRAIN_DEFAULTS,
    n_expert=4,             # experts per MoE layer, E: a multiple of the ranks
    dispatch="alltoall",    # alltoall: each row to its expert's rank and back | allgather: every rank gets every row
)
DISPATCH = ("alltoall", "allgather")

# ----------------------------------------------------------------------------- the layer

class ExpertParallelMoE(M.MoE):
    """A MoE layer holding experts [first, first + E/N) and the (replicated) router.
    run_experts() is the only change: the one-process version runs every expert here.
    On parallel_nd.py's mesh (aux_scale given) it runs in tensor parallel's (s, b, h)
    layout, its balance loss per whole sequence (with context parallelism, the sums over
    cp_group: balance_loss), its gradient added where the layer is (_AuxLoss)."""

    def __init__(self, moe, mode="alltoall", wire_dtype=None, group=None, cp_group=None, aux_scale=None):
        with torch.device("meta"):  # MoE's fields, without allocating (or drawing) its weights: both come next
            super().__init__(moe.config)
        self.router = moe.router
        self.load = 0  # the training forwards' rows per expert (E,), every rank's, for the log
        self.mode, self.wire_dtype, self.group = mode, wire_dtype, group
        self.cp_group, self.aux_scale = cp_group, aux_scale
        self.world, self.rank = C.get_world_size(group), C.get_rank(group)
        self.local = self.config.n_expert // self.world
        self.first = self.rank * self.local
        self.experts = M.Experts(self.config, self.local)
        with torch.no_grad():
            for mine, full in zip(self.experts.parameters(), moe.experts.parameters()):
                mine.copy_(full[self.first:self.first + self.local])
                mine.ep_index = (0, self.first, self.first + self.local)  # the checkpoint's slice of the global tensor

    def forward(self, x):
        if self.aux_scale is None:  # model.MoE's forward; model.moe_loss adds the balance loss
            return super().forward(x)
        s, b, h = x.shape  # the mesh's layout
        tokens = x.reshape(-1, h)  # position-major: only a capacity's drop order would care, and it is refused
        probs, weights, chosen = M.route(self.router, tokens, self.config.top_k)
        self.aux = balance_loss(probs.view(s, b, -1), chosen.view(s, b, -1), self.cp_group)
        out, stats = self.run_experts(tokens, chosen)
        y = (weights.unsqueeze(-1) * out).sum(1)
        if self.training and not M.rerunning():
            for name, v in dict(stats, aux_loss=self.aux.detach(), forwards=1).items():
                self.tally[name] = self.tally.get(name, 0) + v
        if torch.is_grad_enabled():
            y = _AuxLoss.apply(y, self.aux, self.aux_scale)
        return y.view(s, b, h).to(x.dtype)

    def run_experts(self, tokens, chosen):
        """-> (the experts' outputs for this rank's choices (n, k, h), zeros where dropped; stats)."""
        n, k = chosen.shape
        N, me, mine = self.world, self.rank, slice(self.first, self.first + self.local)
        if self.mode == "alltoall":
            table = gather_all(M.choice_counts(chosen, self.config.n_expert), self.group)  # (N, E, k)
        else:
            everyone = gather_all(chosen, self.group)  # (N, n, k): every rank's routing, for my experts
            table = torch.stack([M.choice_counts(c, self.config.n_expert) for c in everyone])
            everyone = everyone.view(N * n, k)
        capacity = M.expert_capacity(self.config, N * n)
        kept = M.kept_counts(table, capacity).sum(-1).cpu()  # (N, E): the rows rank i's tokens bring expert e
        stats = dict(expert_tokens=kept[me], dropped_tokens=n * k - int(kept[me].sum()),
                     expert_load=int(kept[:, mine].sum()))
        if self.training and not M.rerunning():
            self.load = self.load + kept.sum(0)
        rows = tokens.to(self.wire_dtype) if self.wire_dtype else tokens  # they travel in the compute dtype
        if self.mode == "alltoall":
            keep = M.keep_mask(chosen, M.ahead(table)[me], capacity)
            return self.by_all_to_all(rows, chosen, keep, kept, stats), stats
        keep = M.keep_mask(everyone, M.ahead(table.sum(0)[None])[0], capacity)  # the rule on the whole batch
        return self.by_all_gather(rows, everyone, keep, kept.sum(0)), stats

    def by_all_to_all(self, tokens, chosen, keep, kept, stats):
        """Each kept choice's row to its expert's rank, through the experts, and back.
        kept (N, E): the rows rank i's tokens bring expert e."""
        N, me, k = self.world, self.rank, chosen.shape[1]
        order = M.by_expert(chosen, keep)  # my kept choices by expert, so by the rank holding it
        per_rank = kept.view(N, N, self.local).sum(-1)  # rows rank i sends rank j
        send, recv = per_rank[me].tolist(), per_rank[:, me].tolist()
        stats.update(sent_tokens=sum(send) - send[me], received_tokens=sum(recv) - recv[me])
        rows = C.all_to_all_rows(tokens[order // k], send, recv, self.group, name="dispatch")  # rank 0's rows by expert, rank 1's...
        counts = kept[:, self.first:self.first + self.local]  # (N, E/N)
        out = self.experts(transpose_blocks(rows, counts), counts.sum(0).tolist())  # by expert, then rank
        out = C.all_to_all_rows(transpose_blocks(out, counts.t()), recv, send, self.group, name="combine")
        return M.scatter_choices(out, order, chosen.shape)

    def by_all_gather(self, tokens, everyone, keep, per_expert):
        """--dispatch=allgather: every rank's tokens here, my experts on the choices routed to
        them, and the partial outputs summed back to their ranks. everyone (N·n, k): every
        rank's choices; per_expert (E,): the rows each expert keeps."""
        k = everyone.shape[1]
        batch = C.all_gather_rows(tokens, self.group)  # (N·n, h): the global micro-batch, rank-major
        start = int(per_expert[:self.first].sum())
        sizes = per_expert[self.first:self.first + self.local].tolist()
        order = M.by_expert(everyone, keep)[start:start + sum(sizes)]  # the kept choices of my experts
        out = M.scatter_choices(self.experts(batch[order // k], sizes), order, everyone.shape)  # 0: others' experts
        return C.reduce_scatter_rows(out.view(everyone.shape[0], -1), self.group).view(-1, k, out.shape[-1])


def transpose_blocks(x, counts):
    """x holds blocks of counts[i][j] rows in i-major order -> the same blocks j-major."""
    blocks = x.split(counts.reshape(-1).tolist())
    rows, cols = counts.shape
    return torch.cat([blocks[i * cols + j] for j in range(cols) for i in range(rows)])


@torch.compiler.disable
def gather_all(t, group=None):
    """Every rank's t on every rank, (N, *t.shape): an all-gather, no gradient (the choice
    counts, or under allgather the choices themselves)."""
    out = t.new_empty(C.get_world_size(group), *t.shape)
    C.all_gather(out, t.contiguous(), group=group)
    return out

# ----------------------------------------------------------------------------- on the mesh: the balance loss per whole sequence

def balance_loss(probs, chosen, cp_group=None):
    """model.balance_loss on (s, b, E) probabilities and (s, b, k) choices: E·Σ_e f_e·P_e per
    sequence, averaged. With cp a sequence's positions lie on cp ranks: the per-sequence
    counts and probability sums are summed over the ring first (one all-reduce of b·2E floats)."""
    s, b, E = probs.shape
    both = torch.cat([F.one_hot(chosen, E).sum((0, 2)).float(), probs.sum(0)], -1)  # (b, 2E)
    if C.get_world_size(cp_group) > 1:
        both = _SumShared.apply(both, cp_group)
    f, P = both.split(E, -1)
    T = s * C.get_world_size(cp_group)  # the whole sequence
    return E * (f / (T * chosen.shape[-1]) * (P / T)).sum(-1).mean()


class _SumShared(torch.autograd.Function):
    """The sum over the group, which every rank then uses alike. Backward: the gradient times
    n, no message: the n ranks' losses are the same function of the sum, so each rank's share
    gets the same gradient from each, and the gradients' mean over the cp group divides by n."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.n = C.get_world_size(group)
        out = x.clone()
        C.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.n, None


class _AuxLoss(torch.autograd.Function):
    """y unchanged; backward also gives the balance loss its gradient, `scale` (Megatron-Core's
    MoEAuxLossAutoScaler): each pipeline stage's layers add their term to the objective where
    they are, with nothing carried down the pipeline."""

    @staticmethod
    def forward(ctx, y, aux, scale):
        ctx.scale = torch.full_like(aux, scale)
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        return grad, ctx.scale, None

# ----------------------------------------------------------------------------- the step's gradient

def named_experts(model):
    """[(name, parameter)]: this rank's experts, E/N of each MoE layer."""
    return [(n, p) for n, p in model.named_parameters() if hasattr(p, "ep_index")]


def clip_global_norm(replicated, experts, max_norm, group=None):
    """The whole model's gradient norm: the replicas' squares once (every rank has the
    same), plus every rank's experts' squares (an all-reduce of one float); clipped by it.
    The coefficient stays a tensor on the device (1 when the norm is under max_norm): no host sync."""
    sq = torch.stack([p.grad.float().pow(2).sum() for p in experts]).sum().reshape(1)
    C.all_reduce(sq, group=group)
    sq = sq[0] + sum(p.grad.float().pow(2).sum() for p in replicated)
    return M.clip_by_global_norm(sq, [p.grad for p in replicated + experts], max_norm)


def main(argv=None):
    cfg = M.parse_args(DEFAULTS, argv, __doc__)
    if cfg.dispatch not in DISPATCH:
        M.die(f"--dispatch takes alltoall or allgather, not {cfg.dispatch!r}")
    if cfg.n_expert == 0:
        M.die("expert_parallel.py splits a mixture of experts: give --n_expert=E, a multiple of the ranks")
    run = M.start(cfg, "expert_parallel", moe=True)
    rank, world, device, config = run.rank, run.world, run.device, run.config
    if config.n_expert % world:
        M.die(f"--n_expert={config.n_expert} experts do not divide among {world} rank{'s' * (world > 1)}")
    if cfg.batch_size % world:
        M.die(f"--batch_size={cfg.batch_size} does not divide into {world} rank{'s' * (world > 1)}")
    group = None  # the whole world; every piece takes its group, so a mesh could run them on a sub-group

    model = M.GPT(config, seed=cfg.seed)
    model.recompute = cfg.recompute
    wire = torch.bfloat16 if cfg.dtype == "bfloat16" else None  # the rows travel in the compute dtype
    for block in model.transformer.h:  # keep this rank's experts of every layer, drop the others
        block.mlp = ExpertParallelMoE(block.mlp, cfg.dispatch, wire, group)
    model.to(device)
    named = list(model.named_parameters())  # the tied matrix once
    experts = [p for _, p in named_experts(model)]
    replicated = [p for _, p in named if not hasattr(p, "ep_index")]
    for p in replicated:  # the same replicas even if a user seeds ranks differently
        C.broadcast(p.data, src=0, group=group)
    optimizer = M.make_optimizer(named, cfg, device)
    # a checkpoint holds each rank's experts as dim-0 slices of the global stacked tensors; rank 0 writes the replicas
    M.restore(run, [(n, p, getattr(p, "ep_index", None), hasattr(p, "ep_index") or rank == 0) for n, p in named],
              optimizer)
    local = config.n_expert // world
    step_model = torch.compile(model) if cfg.compile else model
    if rank == 0:
        print(f"expert_parallel: {world} rank{'s' * (world > 1)}, {config.n_expert} experts ({local} a rank), top {config.top_k}, "
              f"dispatch {cfg.dispatch}, {M.param_count(config) / 1e6:.2f}M parameters "
              f"({M.active_params(config) / 1e6:.2f}M active), {cfg.batch_size // world} x {config.block_size} "
              f"tokens per rank", flush=True)

    @torch.no_grad()
    def evaluate():
        model.eval()
        losses = torch.zeros(cfg.eval_iters, device=device)
        for k in range(cfg.eval_iters):
            with run.autocast:
                losses[k] = step_model(*M.batch(run, k, "val", 0, 1, rank, world))[1]
        model.train()
        with C.untracked():  # bookkeeping, not training traffic
            C.all_reduce(losses, op="avg", group=group)
        return losses.mean().item()

    for it in range(run.start_iter, cfg.max_iters):
        M.begin_iter(run, it, evaluate)
        # ---------------------------------------------------------------- the training step
        optimizer.zero_grad(set_to_none=True)
        x, y = M.batch(run, it, "train", 0, 1, rank, world)
        counting, saved = M.saved_bytes(model.parameters(), on=not cfg.compile)
        with M.span("forward"), run.autocast, counting:
            _, loss = step_model(x, y)
        with M.span("backward"):
            (loss + M.moe_loss(model)).backward()  # the experts' gradients arrive through the all-to-alls
        with M.span("optimizer"):
            C.all_reduce_flat([p.grad for p in replicated], group=group)  # averaged over the ranks
            for p in experts:  # the sum over every rank's mean -> the gradient of the global mean
                p.grad.div_(world)
            norm = clip_global_norm(replicated, experts, cfg.grad_clip, group) if cfg.grad_clip else 0.0
            optimizer.step()
        # ---------------------------------------------------------------- end of the training step
        state = M.tensor_bytes(p for _, p in named) + M.tensor_bytes(p.grad for _, p in named) \
            + M.optimizer_state_bytes(optimizer)
        M.end_iter(run, loss=loss.item(), grad_norm=norm, state_bytes=state, act_bytes=sum(saved.values()),
                   **moe_stats(run, model, local))
    return M.finish(run)

# ----------------------------------------------------------------------------- the log and the bytes

def moe_stats(run, model, local):
    """The step's MoE fields for the log, besides the common ones: model.moe_log's by rank
    (expert_tokens, dropped_tokens, aux_loss, expert_load, sent_tokens/received_tokens: the
    rows exchanged with other ranks), dispatch_bytes (the MoE layers' share of comm_bytes),
    and on rank 0 the balance: load_max_over_mean of the ranks' loads, expert_max_over_mean
    of each layer's experts'. Resets the layers' load counters."""
    moe = M.moe_log(run, model)
    if run.rank == 0:
        loads = [sum(run.record["expert_tokens"][r * local:(r + 1) * local]) for r in range(run.world)]
        run.record["load_max_over_mean"] = max(loads) * run.world / max(1, sum(loads))
        run.record["expert_max_over_mean"] = [float(m.load.max() / m.load.float().mean().clamp(min=1))
                                              for m in M.moe_layers(model)]
    for m in M.moe_layers(model):
        m.load = 0
    return dict(moe, dispatch_bytes=sum(b for op, b in C.bytes_by_op().items() if op != "all_reduce"))


def exchange_bytes(config, cfg, world, sent=None, received=None):
    """Bytes a rank sends per step at the MoE layers (docs/expert_parallel.md, "The bytes",
    derives them). sent, received: the rows this rank dispatched to other ranks' experts and
    received from them in the step's forward, summed over the layers: then it is exact;
    without them, the expectation under uniform routing (allgather's is exact). n = b·s/N
    tokens a rank, k experts each, L layers, rows h wide, act bytes a number (4; 2 under bf16).
    alltoall: the counts' all-gather (N-1)·E·k·8 and 2·(sent + received)·h·act; allgather:
    2(N-1)·n·h·act·(1+k) + (N-1)·n·k·8 a layer. --recompute=full reruns every exchange of each
    layer's forward in backward (torch's checkpoint stops at the router weights' product with
    the combined outputs; the logged rows are the forward's, counted once)."""
    L, E, k, h, N = config.n_layer, config.n_expert, config.top_k, config.n_embd, world
    n = cfg.batch_size // N * config.block_size  # tokens a rank routes at each layer
    act = 2 if cfg.dtype == "bfloat16" else 4
    rerun = getattr(cfg, "recompute", "none") == "full"  # 1: the forward's exchanges again
    if cfg.dispatch == "allgather":
        choices, rows = (N - 1) * n * k * 8, (N - 1) * n * h * act * (1 + k)  # rows: the tokens, the outputs
        return L * ((1 + rerun) * (choices + rows) + rows)  # forward (and the rerun's), backward: rows reversed
    if sent is None:  # a rank keeps 1/N of its choices and sends the rest; as many arrive
        sent = received = L * (N - 1) / N * n * k
    return (1 + rerun) * L * (N - 1) * E * k * 8 + (2 + rerun) * (sent + received) * h * act


def activation_per_rank(config, cfg, world, rows=None, kept=None):
    """The bytes autograd keeps on a rank between forward and backward (act_bytes; docs/memory.md
    derives the MoE layer's, term by term). rows: the rows this rank's experts computed (the
    log's expert_load), kept: the choices of this rank's tokens their experts kept (L·n·k less
    the log's dropped_tokens), both summed over the layers: then it is exact in float32; without
    them, the expectation under uniform routing. One process (ddp.py --n_expert) keeps the same,
    with rows = kept; the exchanges keep nothing."""
    L, E, k, h, N = config.n_layer, config.n_expert, config.top_k, config.n_embd, world
    dtype = M.auto_dtype() if cfg.dtype == "auto" else cfg.dtype
    B, s, d = cfg.batch_size // N, config.block_size, 2 if dtype == "bfloat16" else 4
    n = B * s
    ends = M.ends_bytes(config, n, s, dtype_bytes=d)
    if cfg.recompute == "full":
        return M.activation_bytes(config, n, "full", dtype_bytes=d) + ends
    if rows is None:  # uniform: each expert takes N·n·k/E choices a layer, at most its capacity
        share = min(1.0, (M.expert_capacity(config, N * n) or N * n * k) * E / (N * n * k))
        rows = L * n * k * share  # E/N experts a rank, N·n·k/E·share rows each
        kept = rows * (N if cfg.dispatch == "allgather" else 1)
    mlp = (9 if cfg.recompute == "none" else 5) * d * h  # a token's in the dense block, a row's here
    dense = M.activation_bytes(config, n, cfg.recompute, dtype_bytes=d) - L * n * mlp
    # per token the router's input, its float32 softmax, the top-k indices and weights (for k > 1 also
    # their sum and the renormalized ones) and the k expert outputs; per sequence the balance loss's f
    router = n * (d * h * (1 + k) + 4 * E + 12 * k + (4 * k + 4 if k > 1 else 0)) + 4 * B * E
    if cfg.dispatch == "allgather":  # the gather's index and rows; the scatter's index, every rank's kept choices
        indexed = rows * (8 + d * h) + kept * 8
    else:  # per kept choice: the gather's index, scatter_choices' index and rows
        indexed = kept * (16 + d * h)
    return dense + L * router + indexed + rows * mlp + ends


def traffic_per_rank(config, cfg, world, sent=None, received=None):
    """Bytes a rank sends per step: the MoE layers' exchange_bytes, the replicated
    gradients' all-reduce 2(N-1)/N·4Ψ_replicated (everything but the experts) and the
    gradient norm's one float (these two on average over the ranks: a ring's chunks are
    uneven by an element, a tree's load is uneven)."""
    replicated = M.param_count(config) - config.n_layer * config.n_expert * M.mlp_params(config, 0)  # all but experts
    norm = 4 if cfg.grad_clip else 0
    return exchange_bytes(config, cfg, world, sent, received) + 2 * (world - 1) / world * (4 * replicated + norm)


if __name__ == "__main__":
    M.main_guard(main)
