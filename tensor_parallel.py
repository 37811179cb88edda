"""
Tensor parallel training (Megatron-LM, Shoeybi et al. 2019): every matrix multiply is
split across the ranks. Each rank holds 1/N of every weight matrix, computes 1/N of
every matmul, and all ranks work on the whole global batch together.

    python tensor_parallel.py                                 # one process (world size 1)
    torchrun --nproc_per_node=2 tensor_parallel.py            # two ranks (CPU processes over gloo, or GPUs over NCCL)
    torchrun --nproc_per_node=4 tensor_parallel.py --model=gpt2 --sequence_parallel=True

What it splits. Attention: c_attn (q, k and v in one matrix) by output columns, so each
rank owns whole heads (n_head/N) and runs attention on them alone; c_proj by input rows.
MLP: c_fc by columns (GELU is elementwise: it stays local), its c_proj by rows. A
column-parallel layer feeding a row-parallel one sends nothing in between: each rank's
output of the second is a partial sum, added up once. The token embedding is split by
vocabulary, and the tied head gives each rank its slice's logits, which the cross-entropy
never gathers. LayerNorms, row-parallel biases and the position embedding are replicated.

What it sends, and when (Megatron's f and g): f, in front of each column-parallel layer, is
the identity forward and all-reduces the input's gradient backward; g, after each
row-parallel layer (and the embedding), all-reduces the partial sums forward and is the
identity backward: per block 2 all-reduces of b·s·h activations forward and 2 backward,
and the loss's 3 of b·s numbers. --sequence_parallel=True (Korthikanti et al. 2022) keeps
s/N positions a rank between the regions, where LayerNorm, dropout and the residual adds
treat each token alone: g becomes a reduce-scatter and f an all-gather (backward, each is
the other), the same bytes and N times smaller LayerNorm and dropout activations.

The lesson is everything above main(); below the fence after it, the byte formulas the
tests hold the log to (activation_per_rank, traffic_per_rank).
"""
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F

import collectives as C
import model as M

DEFAULTS = dict(
    M.TRAIN_DEFAULTS,
    sequence_parallel=False,  # keep s/N positions a rank between the regions (f an all-gather, g a reduce-scatter)
)

# ----------------------------------------------------------------------------- f and g: a parallel region's two ends
#
# Each takes its group and does nothing on a group of one. Every f stands in front of a
# matmul and casts its input to the matmul's dtype first (bf16 under autocast, as the
# matmul would): the numbers are the one-process run's, and f moves bf16, not float32.

class _CopyToParallelRegion(torch.autograd.Function):
    """f. Entering a region, every rank needs the whole input X, and has it: nothing to
    do. But each rank computes dL/dX through its own slice of the weights only, so the
    true gradient is the sum over the ranks: an all-reduce in backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        # in place, as Megatron does: grad is the dX that the matmul behind f (c_attn,
        # c_fc, the head) has just made, and nothing else holds it
        with M.span("all_reduce f (backward)", comm=True):
            C.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromParallelRegion(torch.autograd.Function):
    """g. Leaving a region, each rank holds a partial sum of the output (a row-parallel
    matmul sums over the inner dimension, of which each rank has 1/N): add them up.
    The result, and so its gradient, is then the same on every rank: backward passes
    the gradient through."""

    @staticmethod
    def forward(ctx, x, group):
        with M.span("all_reduce g (forward)", comm=True):
            C.all_reduce(x, group=group)  # in place: x is the matmul's fresh output
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


# torch.compile runs these eagerly (a graph break) and compiles the math in between
@torch.compiler.disable
def copy_to_parallel_region(x, group=None):
    """f: x in the matmul's dtype; its gradient all-reduced over the group."""
    x = as_matmul_input(x)
    return x if C.get_world_size(group) == 1 else _CopyToParallelRegion.apply(x, group)


@torch.compiler.disable
def reduce_from_parallel_region(x, group=None):
    """g: the partial sums x all-reduced over the group; the gradient as it is."""
    return x if C.get_world_size(group) == 1 else _ReduceFromParallelRegion.apply(x, group)


@torch.compiler.disable
def gather_from_sequence_parallel_region(x, group=None):
    """f with sequence parallelism: (s/N, b, h) in the matmul's dtype, all-gathered to
    (s, b, h); backward, the gradient (partial on each rank, as in f) reduce-scattered."""
    return C.all_gather_rows(as_matmul_input(x), group, name="f")


def reduce_scatter_to_sequence_parallel_region(x, group=None):
    """g with sequence parallelism: (s, b, h) partial sums reduce-scattered to (s/N, b, h);
    backward, the gradient all-gathered: every rank needs the whole sequence's."""
    return C.reduce_scatter_rows(x, group, name="g")


def region_ops(sp):
    """(f, g): the plain pair, or sequence parallelism's."""
    return ((gather_from_sequence_parallel_region, reduce_scatter_to_sequence_parallel_region) if sp
            else (copy_to_parallel_region, reduce_from_parallel_region))


def as_matmul_input(x):
    """x as autocast hands it to a matmul: in its dtype (bf16) under autocast, else as it is."""
    dev = x.device.type
    return x.to(torch.get_autocast_dtype(dev)) if torch.is_autocast_enabled(dev) else x

# ----------------------------------------------------------------------------- the parallel layers, cut from full units
#
# Megatron's names come from Y = X A with A = W^T (nn.Linear stores W as (out, in)):
# "column-parallel" splits the output features (W's dim 0), "row-parallel" the input
# features (W's dim 1). Every sharded parameter carries `tp_index`, its part of the
# global tensor in the checkpoint's terms: (dim, start, stop), or for c_attn a list of
# three (this rank's q, k and v rows).

class ColumnParallelLinear(nn.Module):
    """Y_i = f(X) A_i (+ b_i): this rank's output features of an nn.Linear (weight rows and
    bias) on the whole input. parts=3 for c_attn (q, k and v stacked). (Under sequence
    parallelism Megatron also drops f's all-gathered input after forward and gathers it
    again in backward; here the matmul keeps it, for simplicity.)"""

    def __init__(self, linear, group=None, sp=False, parts=1):
        super().__init__()
        self.weight = sharded_param(linear.weight, 0, group, parts)
        self.bias = sharded_param(linear.bias, 0, group, parts) if linear.bias is not None else None
        self.group, self.f = group, region_ops(sp)[0]

    def forward(self, x):
        return F.linear(self.f(x, self.group), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """Y = g(X_i A_i) + b: the weight split by input features, the input arriving
    already split the same way (the output of a column-parallel layer). The bias is
    replicated and added after the sum, so that it is added once."""

    def __init__(self, linear, group=None, sp=False):
        super().__init__()
        self.weight = sharded_param(linear.weight, 1, group)
        self.bias = nn.Parameter(linear.bias.detach().clone()) if linear.bias is not None else None
        self.group, self.g = group, region_ops(sp)[1]

    def forward(self, x):
        y = self.g(F.linear(x, self.weight), self.group)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Rows [lo, lo + V/N) of the token embedding. A token outside them gets zeros here, and
    g's sum puts every token's row in place on every rank (exactly: its owner adds the row,
    the others zeros; float32, as the one-process run's residual stream). Pass the ids as
    (s, b): the output is in the (s, b, h) layout sequence parallelism cuts along dim 0. The
    tied head is the same matrix: its gradient collects both uses locally, no message."""

    def __init__(self, embedding, group=None, sp=False):
        super().__init__()
        self.weight = sharded_param(embedding.weight, 0, group)
        self.lo = self.weight.tp_index[1]
        self.group, self.g = group, region_ops(sp)[1]

    def forward(self, idx):
        local = idx - self.lo
        outside = (local < 0) | (local >= self.weight.shape[0])
        x = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill(outside[..., None], 0.0)
        return self.g(x, self.group)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """The cross-entropy of logits split by vocabulary, (n, V/N) on each rank, without
    gathering them. loss = log sum_v exp(z_v - m) - (z_target - m) needs three numbers
    per token from the whole vocabulary, each one all-reduce of n values instead of
    n·V logits: the max m, the target's logit (only its owner has it, the others add
    0) and the sum of exps. The largest tensor is this rank's (n, V/N)."""

    @staticmethod
    def forward(ctx, logits, target, lo, group):
        m = logits.max(dim=-1).values
        C.all_reduce(m, op="max", group=group)
        z = logits - m[:, None]  # the one (n, V/N) tensor: exp and softmax below are in place
        local = target - lo
        outside = (local < 0) | (local >= z.shape[1])
        local = local.masked_fill(outside, 0)
        z_target = z.gather(1, local[:, None]).squeeze(1).masked_fill(outside, 0.0)
        C.all_reduce(z_target, group=group)
        probs = z.exp_()
        sum_exp = probs.sum(dim=-1)
        C.all_reduce(sum_exp, group=group)
        loss = sum_exp.log() - z_target
        probs.div_(sum_exp[:, None])  # softmax over the whole vocabulary, this rank's columns
        ctx.save_for_backward(probs, local, outside)
        return loss

    @staticmethod
    def backward(ctx, grad):
        # d loss / d z = softmax - onehot(target): local to each rank, nothing to send
        probs, local, outside = ctx.saved_tensors
        dz = probs * grad[:, None]
        dz.scatter_add_(1, local[:, None], -grad.masked_fill(outside, 0.0)[:, None])
        return dz, None, None, None


@torch.compiler.disable
def vocab_parallel_cross_entropy(logits, targets, lo, group=None):
    """Mean cross-entropy over all tokens, in float32, from this rank's (..., V/N) logits
    of the vocabulary rows [lo, lo + V/N)."""
    flat = logits.float().reshape(-1, logits.shape[-1])
    return _VocabParallelCrossEntropy.apply(flat, targets.reshape(-1), lo, group).mean()


def shard_index(size, dim, rank, world, parts=1):
    """This rank's part of a global dimension of `size`: (dim, start, stop). parts=3
    for c_attn, whose rows are q, k and v stacked: the rank takes its slice of each,
    so its local c_attn is [q_local; k_local; v_local] and owns whole heads of all three."""
    part = size // parts
    n = part // world
    slices = [(dim, j * part + rank * n, j * part + (rank + 1) * n) for j in range(parts)]
    return slices if parts > 1 else slices[0]


def take(full, index):
    """The part `index` (from shard_index) of the full tensor, as a new tensor."""
    slices = index if isinstance(index, list) else [index]
    return torch.cat([full.narrow(d, a, b - a) for d, a, b in slices], slices[0][0])


def sharded_param(full, dim, group, parts=1):
    index = shard_index(full.shape[dim], dim, C.get_rank(group), C.get_world_size(group), parts)
    p = nn.Parameter(take(full.detach(), index))
    p.tp_index = index
    return p

# ----------------------------------------------------------------------------- the model: each rank's slice of model.GPT
#
# Each rank holds 1/N of the parameters, gradients and Adam state, and 1/N of the
# activations inside the regions (docs/memory.md). The residual stream is (s, b, h),
# sequence first, as in Megatron: a rank's sequence-parallel positions are one block of
# rows, so the all-gathers and reduce-scatters need no copies and no transposes.
# Dropout (0 by default): every rank draws from one seed, so the replicated regions'
# masks agree, but inside a region the ranks' heads draw the same masks (Megatron forks
# a per-rank generator there).

def parallel_block(block, group=None, sp=False, moe=None):
    """A model.Block cut down to this rank's heads and MLP columns (in place). A mixture of
    experts' block (parallel_nd.py) keeps its MLP's place for moe(block.mlp), the layer that
    replaces model.MoE there (expert_parallel.ExpertParallelMoE), not tp-split."""
    block.attn.c_attn = ColumnParallelLinear(block.attn.c_attn, group, sp, parts=3)
    block.attn.c_proj = RowParallelLinear(block.attn.c_proj, group, sp)
    if moe is not None:
        block.mlp = moe(block.mlp)
        return block
    block.mlp.c_fc = ColumnParallelLinear(block.mlp.c_fc, group, sp)
    block.mlp.c_proj = RowParallelLinear(block.mlp.c_proj, group, sp)
    return block


def build_model(config, seed, group=None, sp=False):
    """Every unit is built whole from the seed, exactly as model.py builds it, and cut
    down to this rank's part of the group: the same init as the one-process run,
    whatever N. Parameter names are model.GPT's."""
    emb = M.build_unit(config, "embed", seed)
    return nn.ModuleDict(dict(transformer=nn.ModuleDict(dict(
        wte=VocabParallelEmbedding(emb.wte, group, sp),
        wpe=emb.wpe,
        h=nn.ModuleList(parallel_block(M.build_unit(config, i, seed), group, sp) for i in range(config.n_layer)),
        ln_f=M.build_unit(config, "ln_f", seed)))))


def split_params(model):
    """(sharded, replicated): the parameters this rank holds a slice of, and those every rank holds whole."""
    params = list(model.parameters())
    return [p for p in params if hasattr(p, "tp_index")], [p for p in params if not hasattr(p, "tp_index")]


def attention(attn, x):
    """model.CausalSelfAttention.forward in the (s, b, h) layout, on this rank's heads
    (counted from c_attn's size): f inside c_attn, g inside c_proj."""
    qkv = attn.c_attn(x)  # (s, b, 3h/N): under sequence parallelism f in c_attn gathers the whole sequence
    T, B, _ = qkv.shape
    q, k, v = qkv.chunk(3, dim=2)  # (s, b, h/N) each: this rank's heads
    q, k, v = (t.view(T, B, -1, attn.head_dim).permute(1, 2, 0, 3) for t in (q, k, v))  # (b, nh/N, s, hs), views
    y = attn.attend(q, k, v)  # model.py's SDPA, or a mesh's context parallel ring (parallel_nd.py)
    # a view when SDPA writes y in q's (s, b, ...) memory order (the CPU kernels do), else
    # the layout's one copy, of this rank's b·s·h/N (the mirror image of model.py's transpose)
    y = y.permute(2, 0, 1, 3).reshape(T, B, -1)
    return F.dropout(attn.c_proj(y), attn.dropout, attn.training)


def embed_forward(wte, wpe, idx, group=None, sp=False, dropout=0.0, training=False):
    """(b, s) token ids -> the residual stream (s, b, h), or with sequence parallelism
    this rank's positions (s/N, b, h). g is inside wte."""
    s = idx.shape[1] // C.get_world_size(group) if sp else idx.shape[1]
    first = C.get_rank(group) * s if sp else 0
    pos = torch.arange(first, first + s, device=idx.device)
    return F.dropout(wte(idx.t()) + wpe(pos)[:, None], dropout, training)


def block_forward(block, x):
    """model.Block.forward in the (s, b, h) layout; its parallel layers hold their f and g."""
    x = x + attention(block.attn, block.ln_1(x))
    return x + block.mlp(block.ln_2(x))


def head_forward(ln_f, wte, x, targets, group=None, sp=False):
    """The final norm, f (the head is column-parallel over the vocabulary), this rank's
    (s, b, V/N) logits through the tied matrix, and the mean loss over every token."""
    f = region_ops(sp)[0]
    logits = F.linear(f(ln_f(x), group), wte.weight)
    return vocab_parallel_cross_entropy(logits, targets.t(), wte.lo, group)


def forward(model, idx, targets, group=None, sp=False, dropout=0.0, recompute="none"):
    """The mean loss over every token of the (b, s) batch, the same on every rank of the group.
    recompute="full" reruns each block's forward in backward, its f's and g's included."""
    t = model.transformer
    x = embed_forward(t.wte, t.wpe, idx, group, sp, dropout, model.training)
    for block in t.h:
        x = M.recompute_block(partial(block_forward, block), x, recompute)
    return head_forward(t.ln_f, t.wte, x, targets, group, sp)


def checkpoint_entries(model, group=None):
    """What this rank saves and loads (model.py, "checkpoints"): each shard with its part
    of the global tensor; each replica whole, written by the group's first rank only."""
    first = C.get_rank(group) == 0
    return [(name, p, getattr(p, "tp_index", None), hasattr(p, "tp_index") or first)
            for name, p in model.named_parameters()]

# ----------------------------------------------------------------------------- the gradient: replicas and the global norm

def grad_sq_norm(sharded, replicated, group=None):
    """This rank's share of the squared norm of the whole model's gradient: its shards,
    and the replicas on the group's first rank only (every rank holds the same replica
    gradient: counted once). Summed over the group, it is the full model's."""
    sq = [p.grad.float().pow(2).sum() for p in sharded]
    if C.get_rank(group) == 0:
        sq += [p.grad.float().pow(2).sum() for p in replicated]
    return torch.stack(sq).sum()


def clip_global_norm(sharded, replicated, max_norm, group=None):
    """The global gradient norm (one all-reduce of one float32 number), and clipping by
    it as torch.nn.utils.clip_grad_norm_ does: no host sync, the coefficient stays a tensor."""
    return M.clip_by_global_norm(grad_sq_norm(sharded, replicated, group),
                                 [p.grad for p in sharded + replicated], max_norm, [group])


def main(argv=None):
    cfg = M.parse_args(DEFAULTS, argv, __doc__)
    run = M.start(cfg, "tensor_parallel")
    rank, world, device, config = run.rank, run.world, run.device, run.config
    sp = cfg.sequence_parallel
    # every rank checks the same things before any communication, so every rank stops
    if config.n_head % world:
        M.die(f"--model={cfg.model} has {config.n_head} heads, which do not split over {world} rank{'s' * (world > 1)} "
              f"(tensor parallelism gives each rank whole heads)")
    if config.vocab_size % world:
        M.die(f"the padded vocabulary ({config.vocab_size} tokens) does not split over {world} rank{'s' * (world > 1)}")
    if sp and config.block_size % world:
        M.die(f"--sequence_parallel needs --block_size ({config.block_size}) divisible by {world} rank{'s' * (world > 1)}")
    group = None  # the whole world; parallel_nd.py runs the same pieces on a sub-group

    model = build_model(config, cfg.seed, group, sp).to(device)
    params = list(model.parameters())
    sharded, replicated = split_params(model)
    # AdamW is elementwise, so AdamW on a shard is the full model's AdamW on that slice
    optimizer = M.make_optimizer(model.named_parameters(), cfg, device)
    run.layout = dict(tensor_parallel=world, sequence_parallel=sp)
    M.restore(run, checkpoint_entries(model, group), optimizer)
    step_forward = torch.compile(forward) if cfg.compile else forward
    if rank == 0:
        n_params = sum(p.numel() for p in sharded) * world + sum(p.numel() for p in replicated)
        print(f"tensor_parallel: {world} rank{'s' * (world > 1)}{', sequence parallel' if sp else ''}, {n_params / 1e6:.2f}M parameters, "
              f"{sum(p.numel() for p in params) / 1e6:.2f}M per rank, {config.n_head // world} heads and "
              f"{config.vocab_size // world} vocabulary rows per rank, {cfg.batch_size} x {config.block_size} tokens")

    @torch.no_grad()
    def evaluate():
        model.eval()
        losses = []
        with C.untracked():  # the forward's collectives: evaluation, not training traffic
            for k in range(cfg.eval_iters):
                with run.autocast:
                    losses.append(step_forward(model, *M.batch(run, k, "val"), group, sp, config.dropout))
        model.train()
        return torch.stack(losses).mean().item()  # the same on every rank: nothing to average

    for it in range(run.start_iter, cfg.max_iters):
        M.begin_iter(run, it, evaluate)
        # ---------------------------------------------------------------- the training step
        optimizer.zero_grad(set_to_none=True)
        x, y = M.batch(run, it)  # the whole global batch on every rank: the ranks split the model, not the data
        counting, saved = M.saved_bytes(params, on=not cfg.compile)
        with M.span("forward"), run.autocast, counting:
            loss = step_forward(model, x, y, group, sp, config.dropout, cfg.recompute)
        with M.span("backward"):
            loss.backward()
        # Without sequence parallelism the replicas need nothing: their inputs are
        # replicated (outputs of g) and so are the gradients that reach them (f's
        # all-reduce hands every rank the same sum), so every rank computes the same
        # gradient, takes the same AdamW step, and the copies never drift apart.
        with M.span("optimizer"):
            if sp:  # a replica met only this rank's positions: its gradient is a partial sum
                C.all_reduce_flat([p.grad for p in replicated], op="sum", group=group)
            norm = clip_global_norm(sharded, replicated, cfg.grad_clip, group) if cfg.grad_clip else 0.0
            optimizer.step()
        # ---------------------------------------------------------------- end of the training step
        state = M.tensor_bytes(params) + M.tensor_bytes(p.grad for p in params) + M.optimizer_state_bytes(optimizer)
        run.record["sequence_parallel"] = sp
        M.end_iter(run, loss=loss.item(), grad_norm=norm, state_bytes=state, act_bytes=sum(saved.values()))
    return M.finish(run)

# ----------------------------------------------------------------------------- the bytes

def activation_per_rank(config, cfg, world):
    """The bytes autograd keeps between forward and backward on a rank (the log's act_bytes):
    the blocks' (model.activation_bytes, split by the heads and MLP columns, and with
    sequence parallelism by the positions), plus the ends'."""
    dtype = M.auto_dtype() if cfg.dtype == "auto" else cfg.dtype
    d, h, n, s = (2 if dtype == "bfloat16" else 4), config.n_embd, cfg.batch_size * config.block_size, config.block_size
    sp, t = cfg.sequence_parallel, world
    blocks = M.activation_bytes(config, n, getattr(cfg, "recompute", "none"), t, sp, dtype_bytes=d)
    cut = t if sp else 1  # the positions' share outside the regions
    embed = n * (8 + 1) + 8 * s // cut  # the local ids (int64) and their outside mask (bool); the positions
    # ln_f's input and statistics (1/N under sequence parallelism), the matmul's input (after f:
    # every position), the loss's (b·s, V/N) float32 softmax, the local target ids and their mask
    head = n * (d * h + 8) // cut + n * d * h + n * (4 * config.vocab_size // t + 8 + 1)
    return blocks + embed + head


def traffic_per_rank(config, cfg, world):
    """Bytes a rank sends per step, on average over the ranks (docs/tensor_parallel.md, "The
    bytes", derives it): 2(N-1)/N · b·s·h · ((4L + 1)·d + 4) + 3 · 2(N-1)/N · 4·b·s + 2(N-1)/N · 4.
    --recompute=full: 5L instead of 4L, 5.5L with sequence parallelism (the attention's
    all-gather and reduce-scatter and the MLP's all-gather again). --sequence_parallel adds the
    replicas' float32 all-reduce, 2(N-1)/N · (6Lh + 2h + s·h) · 4 (2Lh + h + s·h without biases).
    collectives.py's tree for small messages sends the ring's total, unevenly."""
    dtype = M.auto_dtype() if cfg.dtype == "auto" else cfg.dtype
    d = 2 if dtype == "bfloat16" else 4
    ar = 2 * (world - 1) / world  # an all-reduce, or a reduce-scatter plus an all-gather
    L, h, bs = config.n_layer, config.n_embd, cfg.batch_size * config.block_size
    rerun = (1.5 if cfg.sequence_parallel else 1) if getattr(cfg, "recompute", "none") == "full" else 0
    per_block = 4 + rerun
    total = ar * bs * h * ((per_block * L + 1) * d + 4) + 3 * ar * bs * 4 + ar * 4
    if cfg.sequence_parallel:  # LayerNorms (and their biases), row-parallel biases, ln_f, wpe
        per_block, final = (6 * h, 2 * h) if config.bias else (2 * h, h)
        total += ar * (L * per_block + final + config.block_size * h) * 4
    return total


if __name__ == "__main__":
    M.main_guard(main)
