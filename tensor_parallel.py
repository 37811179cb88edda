"""
Tensor parallel training (Megatron-LM): every matrix multiply is split across the
ranks. Each rank holds 1/N of every weight matrix, computes 1/N of every matmul,
and all ranks work on the whole global batch together.

    python tensor_parallel.py                                 # one process (world size 1)
    torchrun --nproc_per_node=2 tensor_parallel.py            # two ranks (CPU processes over gloo, or GPUs over NCCL)
    torchrun --nproc_per_node=4 tensor_parallel.py --model=gpt2 --sequence_parallel=True

What it splits. Attention: c_attn (q, k and v in one matrix) by output columns, so
each rank owns whole heads (n_head/N of them) and runs attention on them alone; c_proj
by input rows. MLP: c_fc by columns (GELU works elementwise, so it stays local), its
c_proj by rows. A column-parallel layer feeding a row-parallel one needs nothing
sent in between: each rank's output of the second is a partial sum, added up once at
the end. The token embedding is split by vocabulary, and the output head, tied to it,
gives each rank the logits of its own slice of the vocabulary; the cross-entropy works
on those slices and never gathers the b x s x V logits. LayerNorms, the biases of the
row-parallel layers and the position embedding are small: every rank has a copy.

What it sends, and when. Two conjugate operations mark where a parallel region starts
and where it ends:
    f   identity forward, all-reduce backward   before c_attn, c_fc and the head
    g   all-reduce forward, identity backward   after each c_proj and the embedding
so each block does 2 all-reduces of b·s·h activations forward and 2 backward, plus one
for the embedding (forward) and one for the head (backward), plus the loss's 3
all-reduces of b·s numbers (max, target logit, sum of exp) and one number for the
gradient norm. A ring all-reduce of S bytes makes each rank send 2(N-1)/N·S, so per
rank per step:

    (4L + 2) · 2(N-1)/N · b·s·h·bytes  +  3 all-reduces of b·s floats  +  1 float

(collectives.py all-reduces small messages, under its SMALL_ALL_REDUCE_BYTES, with a
binomial tree instead: fewer steps, but up to log2(N)·S from one rank; the test counts
both exactly). Unlike DDP's, this traffic grows with the batch, not the
model; it sits on the critical path of every layer, forward and backward; and it does
not shrink as N grows: tensor parallelism is for the fast links inside one node. What
it buys: each rank holds 1/N of the parameters, gradients and Adam state (16Ψ/N bytes
in float32, plus the small replicas), and 1/N of the activations inside the regions
(FORMULAS.md: s·b·h(10 + 24/N + 5as/(hN)) bytes per layer instead of s·b·h(34 + 5as/h)).

--sequence_parallel=True (Megatron's sequence parallelism). Between the parallel
regions the LayerNorms, dropouts and residual adds treat each token alone, yet plain
tensor parallelism repeats them on every rank for every token. With it, each rank
keeps s/N positions of the sequence there: g becomes a reduce-scatter (sum, and keep
your positions) and f an all-gather (of the whole sequence), and in backward each is
the other. The bytes are the same (a ring all-reduce IS a reduce-scatter then an
all-gather); the LayerNorm and dropout activations shrink N times. (Megatron also drops
the all-gathered input of c_attn and c_fc after forward and gathers it again in
backward, for (s·b·h/N)(34 + 5as/h) per layer; here the linear keeps it, for
simplicity.) The replicated parameters now see only their rank's positions, so their
gradients are all-reduced once per step: 2(N-1)/N · (6Lh + 2h + block_size·h) · bytes
more.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

import collectives as C
import model as M

DEFAULTS = dict(M.TRAIN_DEFAULTS, sequence_parallel=False)

# -----------------------------------------------------------------------------
# f and g: where a tensor parallel region starts and ends


class Copy(torch.autograd.Function):
    """f. Entering a region, every rank needs the whole input X, and has it: nothing to
    do. But each rank computes dL/dX through its own slice of the weights only, so the
    true gradient is the sum over the ranks: an all-reduce in backward."""

    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        # a copy: autograd may hand this same gradient tensor to the other branch of a sum
        grad = grad.clone(memory_format=torch.contiguous_format)
        C.all_reduce(grad)
        return grad


class Reduce(torch.autograd.Function):
    """g. Leaving a region, each rank holds a partial sum of the output (a row-parallel
    matmul sums over the inner dimension, of which each rank has 1/N): add them up.
    The result, and so its gradient, is then the same on every rank: backward passes
    the gradient through."""

    @staticmethod
    def forward(ctx, x):
        x = x.clone(memory_format=torch.contiguous_format)  # all_reduce works in place; x is autograd's
        C.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad


# The same pair with sequence parallelism. Outside the regions each rank holds
# s/N positions, laid out (s/N, b, h) as in Megatron: sequence first, so that a rank's
# positions are one contiguous block and the collectives need no copies to split them.


class Gather(torch.autograd.Function):
    """f with sequence parallelism: all-gather the sequence (s/N, b, h) -> (s, b, h).
    Backward: the gradient for the whole sequence is partial on each rank (as in f),
    and each rank needs only its positions of the sum: a reduce-scatter."""

    @staticmethod
    def forward(ctx, x):
        out = x.new_empty((C.get_world_size() * x.shape[0], *x.shape[1:]))
        C.all_gather(out, x.contiguous())
        return out

    @staticmethod
    def backward(ctx, grad):
        out = grad.new_empty((grad.shape[0] // C.get_world_size(), *grad.shape[1:]))
        C.reduce_scatter(out, grad.contiguous())
        return out


class ReduceScatter(torch.autograd.Function):
    """g with sequence parallelism: sum the partial outputs and keep this rank's
    positions, (s, b, h) -> (s/N, b, h). Backward: every rank needs the gradient of the
    whole sequence: an all-gather."""

    @staticmethod
    def forward(ctx, x):
        out = x.new_empty((x.shape[0] // C.get_world_size(), *x.shape[1:]))
        C.reduce_scatter(out, x.contiguous())
        return out

    @staticmethod
    def backward(ctx, grad):
        out = grad.new_empty((C.get_world_size() * grad.shape[0], *grad.shape[1:]))
        C.all_gather(out, grad.contiguous())
        return out


# torch.compile runs these eagerly (a graph break) and compiles the math in between
@torch.compiler.disable
def enter(x, sp):
    """Into a region: the whole (b, s, h) input on every rank."""
    return Gather.apply(x).transpose(0, 1) if sp else Copy.apply(x)


@torch.compiler.disable
def leave(x, sp):
    """Out of a region: partial sums (b, s, h) -> summed, (b, s, h) or this rank's (s/N, b, h)."""
    return ReduceScatter.apply(x.transpose(0, 1)) if sp else Reduce.apply(x)

# -----------------------------------------------------------------------------
# the parallel layers, cut from model.py's full units
#
# nn.Linear stores W as (out_features, in_features) and computes x W^T. Megatron's
# names come from Y = X A with A = W^T: "column-parallel" splits A's columns, the
# output features (W's dim 0); "row-parallel" splits A's rows, the input features
# (W's dim 1). Every sharded parameter is tagged with how it was cut (tp_split), so
# the run can tell shards from replicas and reassemble the full model to save it.


def shard(full, dim, rank, world, parts=1):
    """This rank's slice of `full` along dim. parts=3 for c_attn, whose rows are q, k and
    v stacked: the rank takes its slice of each, so its local c_attn is
    [q_local; k_local; v_local] and owns whole heads of all three."""
    return torch.cat([p.chunk(world, dim)[rank] for p in full.chunk(parts, dim)], dim).clone()


def unshard(pieces, dim, parts=1):
    """The inverse of shard: the full tensor from every rank's slice (a list by rank)."""
    return torch.cat([torch.cat([p.chunk(parts, dim)[j] for p in pieces], dim) for j in range(parts)], dim)


def sharded_param(full, dim, rank, world, parts=1):
    p = nn.Parameter(shard(full.detach(), dim, rank, world, parts))
    p.tp_split = (dim, parts)
    return p


def column_parallel(linear, rank, world, parts=1):
    """Keep this rank's output features of an nn.Linear (weight rows and bias): it is
    still a plain nn.Linear, on the whole input, giving this rank's part of the output.
    The f in front of it is in block_forward."""
    linear.weight = sharded_param(linear.weight, 0, rank, world, parts)
    if linear.bias is not None:
        linear.bias = sharded_param(linear.bias, 0, rank, world, parts)
    linear.out_features = linear.weight.shape[0]
    return linear


class RowParallelLinear(nn.Module):
    """y = g(x_local W_local^T) + b: the weight split by input features, the input
    arriving already split the same way (the output of a column-parallel layer). The
    bias is replicated and added after the sum, so that it is added once."""

    def __init__(self, linear, rank, world, sp):
        super().__init__()
        self.weight = sharded_param(linear.weight, 1, rank, world)
        self.bias = nn.Parameter(linear.bias.detach().clone()) if linear.bias is not None else None
        self.sp = sp

    def forward(self, x):
        y = leave(F.linear(x, self.weight), self.sp)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Rows [lo, lo + V/N) of the token embedding. A token outside them gets zeros here;
    the rank that owns it supplies its row, and g's sum puts every token's row in place
    on every rank. The same matrix is the output head (the tie), so its gradient
    collects both uses locally: the tie costs no communication."""

    def __init__(self, embedding, rank, world, sp):
        super().__init__()
        self.weight = sharded_param(embedding.weight, 0, rank, world)
        self.lo, self.sp = rank * self.weight.shape[0], sp

    def forward(self, idx):
        local = idx - self.lo
        outside = (local < 0) | (local >= self.weight.shape[0])
        x = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill(outside[..., None], 0.0)
        return leave(x, self.sp)


class VocabParallelCrossEntropy(torch.autograd.Function):
    """The cross-entropy of logits split by vocabulary, (n, V/N) on each rank, without
    gathering them. loss = log sum_v exp(z_v - m) - (z_target - m) needs three numbers
    per token from the whole vocabulary, each one all-reduce of n values instead of
    n·V logits: the max m, the target's logit (only its owner has it, the others add
    0) and the sum of exps. The largest tensor is this rank's (n, V/N)."""

    @staticmethod
    def forward(ctx, logits, target, lo):
        m = logits.max(dim=-1).values
        C.all_reduce(m, op="max")
        z = logits - m[:, None]  # the one (n, V/N) tensor: exp and softmax below are in place
        local = target - lo
        outside = (local < 0) | (local >= z.shape[1])
        local = local.masked_fill(outside, 0)
        z_target = z.gather(1, local[:, None]).squeeze(1).masked_fill(outside, 0.0)
        C.all_reduce(z_target)
        probs = z.exp_()
        sum_exp = probs.sum(dim=-1)
        C.all_reduce(sum_exp)
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
        return dz, None, None


@torch.compiler.disable
def vocab_parallel_cross_entropy(logits, targets, lo):
    """Mean cross-entropy over all tokens, in float32, from this rank's (..., V/N) logits."""
    return VocabParallelCrossEntropy.apply(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1), lo).mean()

# -----------------------------------------------------------------------------
# the model: each rank's slice of model.GPT(config, seed)


def parallel_block(block, rank, world, sp):
    """A model.Block cut down to this rank's heads and MLP columns (in place)."""
    block.attn.c_attn = column_parallel(block.attn.c_attn, rank, world, parts=3)
    block.attn.c_proj = RowParallelLinear(block.attn.c_proj, rank, world, sp)
    block.mlp.c_fc = column_parallel(block.mlp.c_fc, rank, world)
    block.mlp.c_proj = RowParallelLinear(block.mlp.c_proj, rank, world, sp)
    return block


def build_model(config, seed, rank, world, sp):
    """Every unit is built whole from the seed, exactly as model.py builds it, and cut
    down to this rank's part: the same init as the one-process run, whatever N."""
    emb = M.build_unit(config, "embed", seed)
    return nn.ModuleDict(dict(transformer=nn.ModuleDict(dict(
        wte=VocabParallelEmbedding(emb.wte, rank, world, sp),
        wpe=emb.wpe,
        h=nn.ModuleList(parallel_block(M.build_unit(config, i, seed), rank, world, sp) for i in range(config.n_layer)),
        ln_f=M.build_unit(config, "ln_f", seed)))))


def block_forward(block, x, sp):
    """model.Block.forward with f in view. model.CausalSelfAttention runs unchanged on the
    rank's heads (it counts them from c_attn's size); each c_proj ends its region with g.
    That is 2 all-reduces of b·s·h forward (the g's) and 2 backward (the f's) per block."""
    x = x + block.attn(enter(block.ln_1(x), sp))
    return x + block.mlp(enter(block.ln_2(x), sp))


def forward(model, idx, targets, sp=False, dropout=0.0):
    """The mean loss over every token of the batch, the same on every rank. (Dropout, 0 by
    default: every rank seeds the same generator, so the masks of the replicated regions
    agree and the replicas stay equal; inside a region each rank draws for its own heads.)"""
    t = model.transformer
    if sp:  # this rank's positions of the sequence, (s/N, b, h)
        s = idx.shape[1] // C.get_world_size()
        pos = torch.arange(C.get_rank() * s, (C.get_rank() + 1) * s, device=idx.device)
        x = F.dropout(t.wte(idx) + t.wpe(pos)[:, None], dropout, model.training)
    else:
        x = M.embed(t.wte, t.wpe, idx, dropout, model.training)  # g inside t.wte
    for block in t.h:
        x = block_forward(block, x, sp)
    h = enter(t.ln_f(x), sp)             # f: the head is column-parallel over the vocabulary
    logits = F.linear(h, t.wte.weight)   # (b, s, V/N): this rank's slice, through the tied matrix
    return vocab_parallel_cross_entropy(logits, targets, t.wte.lo)


def full_state_dict(model, world):
    """The whole model on every rank, keys and shapes as model.GPT(config).state_dict():
    replicas as they are, shards all-gathered and put back together."""
    state = {}
    for name, p in model.named_parameters():
        t = p.detach().contiguous()
        if hasattr(p, "tp_split"):
            out = t.new_empty((world, *t.shape))
            C.all_gather(out, t)
            t = unshard(list(out.unbind(0)), *p.tp_split)
        state[name] = t.float().cpu().clone()
    state["lm_head.weight"] = state["transformer.wte.weight"].clone()  # the tie
    return state

# -----------------------------------------------------------------------------
# the gradient: replicas, and the global norm


def sum_replicated_grads(replicated):
    """Sequence parallel only: a replicated parameter (LayerNorm, row-parallel bias,
    position embedding) met only this rank's positions, so its gradient is a partial
    sum: all-reduce them, all packed in one message."""
    flat = torch.cat([p.grad.reshape(-1) for p in replicated])
    C.all_reduce(flat)
    for p, g in zip(replicated, flat.split([p.numel() for p in replicated])):
        p.grad.copy_(g.view_as(p))


def clip_global_norm(sharded, replicated, max_norm):
    """The norm of the whole model's gradient, and clipping by it. Shards: squares summed
    over all ranks (one all-reduce of one number). Replicas: the same gradient on every
    rank, so counted once, locally."""
    sq = torch.stack([p.grad.float().pow(2).sum() for p in sharded]).sum()
    C.all_reduce(sq)
    norm = (sq + sum(p.grad.float().pow(2).sum() for p in replicated)).sqrt()
    coef = M.clip_coef(norm, max_norm)
    if coef < 1.0:
        for p in sharded + replicated:
            p.grad.mul_(coef)
    return norm


def traffic_per_rank(config, cfg, world):
    """The docstring's formula: bytes a rank sends per step, on average over the ranks
    (a ring sends 2(N-1)/N·S from every rank; the tree that small all-reduces take
    sends the same total, unevenly). Activations travel in the compute dtype."""
    act = 2 if cfg.dtype == "bfloat16" else 4
    ar = 2 * (world - 1) / world  # an all-reduce, or a reduce-scatter plus an all-gather
    bs = cfg.batch_size * config.block_size
    total = (4 * config.n_layer + 2) * ar * bs * config.n_embd * act + 3 * ar * bs * 4 + ar * 4
    if cfg.sequence_parallel:
        h = config.n_embd
        total += ar * (6 * config.n_layer * h + 2 * h + config.block_size * h) * 4
    return total


def main(argv=None):
    cfg = M.parse_args(DEFAULTS, argv, __doc__)
    rank, world, _, device = C.init_distributed()
    config, train_data, val_data, autocast = M.setup_run(cfg, device)
    sp = cfg.sequence_parallel
    # every rank checks the same things before any communication, so every rank stops
    if config.n_head % world:
        M.die(f"--model={cfg.model} has {config.n_head} heads, which do not split over {world} ranks "
              f"(tensor parallelism gives each rank whole heads)")
    if config.vocab_size % world:
        M.die(f"the padded vocabulary ({config.vocab_size} tokens) does not split over {world} ranks")
    if sp and config.block_size % world:
        M.die(f"--sequence_parallel needs --block_size ({config.block_size}) divisible by {world} ranks")

    model = build_model(config, cfg.seed, rank, world, sp).to(device)
    params = list(model.parameters())
    sharded = [p for p in params if hasattr(p, "tp_split")]
    replicated = [p for p in params if not hasattr(p, "tp_split")]
    # AdamW is elementwise, so AdamW on a shard is the full model's AdamW on that slice
    optimizer = M.make_optimizer(model.named_parameters(), cfg, device)
    step_forward = torch.compile(forward) if cfg.compile else forward

    n_params = sum(p.numel() for p in sharded) * world + sum(p.numel() for p in replicated)
    flops_per_step = M.flops_per_token(config, n_params) * cfg.batch_size * config.block_size
    peak = M.peak_flops(device, cfg.peak_flops)
    log = M.Logger(cfg, rank)
    if rank == 0:
        print(f"tensor_parallel: {world} ranks{', sequence parallel' if sp else ''}, {n_params / 1e6:.2f}M parameters, "
              f"{sum(p.numel() for p in params) / 1e6:.2f}M per rank, {config.n_head // world} heads and "
              f"{config.vocab_size // world} vocabulary rows per rank, {cfg.batch_size} x {config.block_size} tokens")

    def batch(step, data=train_data, split="train"):
        # the whole global batch on every rank: the ranks split the model, not the data
        x, y = M.get_batch(data, cfg.seed, step, cfg.batch_size, config.block_size, split=split)
        return x.to(device, non_blocking=True), y.to(device, non_blocking=True)

    @torch.no_grad()
    def evaluate():
        model.eval()
        losses = []
        with C.untracked():  # the forward's all-reduces: evaluation, not training traffic
            for k in range(cfg.eval_iters):
                with autocast:
                    losses.append(step_forward(model, *batch(k, val_data, "val"), sp, config.dropout).item())
        model.train()
        return sum(losses) / len(losses)  # the same on every rank: nothing to average

    for it in range(cfg.max_iters):
        record = {"iter": it}
        if cfg.eval_interval and (it % cfg.eval_interval == 0 or it == cfg.max_iters - 1):
            record["val_loss"] = evaluate()
        lr = M.get_lr(it, cfg)
        M.set_lr(optimizer, lr)
        C.reset_bytes()
        t0 = M.timer(device)

        optimizer.zero_grad(set_to_none=True)
        x, y = batch(it)
        with autocast:
            loss = step_forward(model, x, y, sp, config.dropout)
        loss.backward()
        # Without sequence parallelism the replicas need nothing: their inputs are
        # replicated (outputs of g) and so are the gradients that reach them (f's
        # all-reduce hands every rank the same sum), so every rank computes the same
        # gradient, takes the same AdamW step, and the copies never drift apart.
        if sp:
            sum_replicated_grads(replicated)
        norm = clip_global_norm(sharded, replicated, cfg.grad_clip) if cfg.grad_clip else 0.0
        optimizer.step()

        dt = M.timer(device) - t0
        sent = C.bytes_sent()
        state = M.tensor_bytes(params) + M.tensor_bytes(p.grad for p in params) + M.optimizer_state_bytes(optimizer)
        peak_mem = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
        rows = C.gather_stats([loss.item(), sent, state, peak_mem])  # one row per rank, on rank 0
        if rank == 0:
            tokens_per_s = cfg.batch_size * config.block_size / dt
            record.update(loss=rows[0][0], lr=lr, grad_norm=float(norm), dt_ms=1000 * dt,
                          tokens_per_s=tokens_per_s, mfu=flops_per_step / dt / (world * peak) if peak else None,
                          comm_bytes=[int(r[1]) for r in rows], state_bytes=[int(r[2]) for r in rows],
                          sequence_parallel=sp)
            if device.type == "cuda":
                record["peak_bytes"] = [int(r[3]) for r in rows]
        log(record)

    if cfg.save_path:
        state = full_state_dict(model, world)  # a collective: every rank takes part
        if rank == 0:
            torch.save(state, cfg.save_path)
    C.shutdown()
    return log.records


if __name__ == "__main__":
    main()
