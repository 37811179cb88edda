"""
Context parallel training with ring attention: the SEQUENCE is split across the
ranks. Every rank takes all b rows of the global batch but only s/N of each row's
positions, holds the whole model, and the ranks together attend over the whole
sequence by passing keys and values around a ring (Liu, Zaharia & Abbeel, "Ring
Attention with Blockwise Transformers for Near-Infinite Context", 2023).

    python context_parallel.py                                  # one process: a ring of one
    torchrun --nproc_per_node=2 context_parallel.py             # two ranks (CPU processes over gloo, or GPUs over NCCL)
    torchrun --nproc_per_node=4 context_parallel.py --block_size=4096 --layout=contiguous
    torchrun --nproc_per_node=4 context_parallel.py --attention=ulysses  # all-to-all instead of the ring

What it splits. Everything in a block but attention treats each position alone (the
embeddings, with GLOBAL positions, the LayerNorms, the MLP, the residual adds, the head
and the loss), so it runs on the rank's s/N positions, and every activation a rank
keeps for backward is 1/N of the one-process run's: that, not speed, is what context
parallelism buys, a sequence too long for one device's memory. The model is model.py's
own; only its attention's attend() hook is pointed at the ring.

What it sends, and when. Each rank holds the queries of its positions; the key/value
blocks travel. At each of N-1 steps a rank sends the block in hand to the next rank and
receives one from the previous (async, so the transfer overlaps the attention on the
block that already arrived), and merges each block's partial result exactly by the
online softmax's log-sum-exp rule. Backward sends the blocks round again, each block's
gradient following it home. The weights are replicated (16Ψ bytes of weights, gradients
and Adam state per rank, as in DDP), so their gradients are averaged once a step.
--layout=zigzag (the default) balances the causal work over the ranks (see positions()).
--attention=ulysses (DeepSpeed-Ulysses) sends heads instead of keys: an all-to-all before
attention gives each rank every position of H/N heads, one after it gives the positions
back. Fewer bytes than the ring, none of them hidden behind compute, and N must divide the heads.

The lesson is everything above main(); below the fence after it, the instruments: the
clock behind the log's attn_ms and attn_wait_ms, and the byte formulas the tests hold the
log to (docs/context_parallel.md derives them).
"""
import functools
import math
import types
from contextlib import contextmanager, nullcontext

import torch

import collectives as C
import model as M

DEFAULTS = dict(
    M.TRAIN_DEFAULTS,
    layout="zigzag",        # contiguous | zigzag: which positions each rank holds (zigzag balances the causal work)
    attention="ring",       # ring: K and V passed round the ranks | ulysses: two all-to-alls around attention
)
LAYOUTS = ("contiguous", "zigzag")

# ----------------------------------------------------------------------------- the layout: the positions each rank holds
#
# Under the causal mask, with contiguous positions rank 0 attends to one block and rank
# N-1 to N: everyone waits for the last rank. Zigzag gives rank r chunks r and 2N-1-r of
# 2N (an early and a late one): every rank does the diagonal plus half of each other
# block, the same work (the layout of Llama 3's context parallelism, Dubey et al. 2024,
# and of zhuzilin's ring-flash-attention).

def positions(block_size, me, n, layout, device="cpu"):
    """The GLOBAL positions of rank `me` of `n`, ascending: contiguous, one chunk of
    s/N; zigzag, chunks me and 2N-1-me of 2N."""
    if layout == "contiguous":
        c = block_size // n
        return torch.arange(me * c, (me + 1) * c, device=device)
    c = block_size // (2 * n)
    early, late = torch.arange(me * c, (me + 1) * c), torch.arange((2 * n - 1 - me) * c, (2 * n - me) * c)
    return torch.cat([early, late]).to(device)


def block_plan(me, owner, n, layout, length):
    """What the causal mask leaves of (my queries) x (owner's keys):
    (query rows, key columns, causal?) or None when the block is wholly in the future."""
    every = slice(None)
    if owner == me:  # the diagonal: both sides hold the same positions, in the same order
        return every, every, True
    if layout == "contiguous":
        return (every, every, False) if owner < me else None
    half = slice(0, length // 2), slice(length // 2, None)
    if owner < me:  # its early chunk lies before both of mine; its late chunk after both
        return every, half[0], False
    return half[1], every, False  # my late chunk comes after both of its chunks; my early chunk before

# ----------------------------------------------------------------------------- ring attention
#
# The ring's loops; the math of one block (attend, merge, attend_backward) follows them.
# clock(kind) times a span ("attn": compute, "wait": waiting for a block) for the log:
# Clock, after main(), in main; untimed() for everyone else.

class Ring:
    """The ranks that share one sequence, in ring order: whom this rank sends to (next)
    and receives from (prev), GLOBAL ranks of `group`; and the layout. (Ulysses reads
    only the group, the rank, N and the layout.)"""

    def __init__(self, group=None, layout="zigzag"):
        ranks = C.group_ranks(group)
        self.group, self.me, self.n, self.layout = group, C.get_rank(group), len(ranks), layout
        self.next, self.prev = ranks[(self.me + 1) % self.n], ranks[(self.me - 1) % self.n]


def shift(t, ring, name):
    """One hop around the ring, started now: send t to the next rank, receive the
    previous rank's tensor of the same shape. -> (the buffer receiving it, handle).
    name: what the trace calls it, "ring step 1 k/v" (and the MB are added)."""
    incoming = torch.empty_like(t)
    with M.span(f"{name} ({t.numel() * t.element_size() / 1e6:.1f} MB)", comm=True):
        return incoming, C.sendrecv(t, ring.next, incoming, ring.prev, group=ring.group, async_op=True)


def ring_forward(q, k, v, ring, clock):
    """-> (out, lse) of this rank's queries against the whole sequence, float32."""
    scale, length = 1.0 / math.sqrt(q.shape[-1]), q.shape[2]
    q = q.float()
    kv = torch.stack([k, v])  # K and V travel together: one message per hop
    out = lse = None
    for step in range(ring.n):
        owner = (ring.me - step) % ring.n  # whose block is in hand
        if step < ring.n - 1:
            # send_kv to next / recv_kv from prev, behind the attention below
            kv_next, handle = shift(kv, ring, f"ring step {step} k/v")
        plan = block_plan(ring.me, owner, ring.n, ring.layout, length)
        if plan is not None:
            rows, cols, causal = plan
            with clock("attn"):
                o, l = attend(q[:, :, rows], kv[0][:, :, cols].float(), kv[1][:, :, cols].float(), scale, causal)
                if out is None:  # step 0: the diagonal, every row (each query sees at least itself)
                    out, lse = o, l
                else:
                    merge(out[:, :, rows], lse[:, :, rows], o, l)
        if step < ring.n - 1:
            with clock("wait"):
                handle.wait()
            kv = kv_next
    return out, lse


def ring_backward(dout, q, k, v, out, lse, ring, clock):
    """-> (dq, dk, dv) float32. dq is this rank's alone; dK and dV of a block need every
    rank's share: each block's gradient starts at the rank after its owner, gathers one
    share per hop as it follows the block around, and its (N-1)-th hop brings it home."""
    scale, length = 1.0 / math.sqrt(q.shape[-1]), q.shape[2]
    q, dout = q.float(), dout.float()
    delta = (dout * out.float()).sum(-1)
    dq = torch.zeros_like(q)
    kv = torch.stack([k, v])
    own = None
    for step in range(ring.n):
        owner = (ring.me - step) % ring.n
        if step < ring.n - 1:
            # send_kv / recv_kv again: forward kept no blocks but its own
            kv_next, kv_handle = shift(kv, ring, f"ring step {step} k/v (backward)")
        part = torch.zeros((2,) + tuple(k.shape), dtype=torch.float32, device=k.device)  # my share of owner's dK, dV
        plan = block_plan(ring.me, owner, ring.n, ring.layout, length)
        if plan is not None:
            rows, cols, causal = plan
            with clock("attn"):
                dq_b, dk_b, dv_b = attend_backward(q[:, :, rows], kv[0][:, :, cols].float(), kv[1][:, :, cols].float(),
                                                   dout[:, :, rows], lse[:, :, rows], delta[:, :, rows], scale, causal)
                dq[:, :, rows] += dq_b
                part[0][:, :, cols] += dk_b
                part[1][:, :, cols] += dv_b
        if step == 0:
            own = part  # my share of my own block's gradient, added when the rest comes home
        else:
            if step > 1:  # the owner's gradient so far, from the ranks the block has passed
                with clock("wait"):
                    dkv_handle.wait()
                part += dkv_in
            # send_dkv to next / recv_dkv from prev (home at the last step)
            dkv_in, dkv_handle = shift(part, ring, f"ring step {step} dk/dv")
        if step < ring.n - 1:
            with clock("wait"):
                kv_handle.wait()
            kv = kv_next
    if ring.n > 1:
        with clock("wait"):
            dkv_handle.wait()
        own += dkv_in  # every other rank's share of my block's gradient
    return dq, own[0], own[1]


class RingAttention(torch.autograd.Function):
    """Causal attention of this rank's q over the sequence all ranks hold, (B, H, s/N, D)
    each. Saves q, k, v, the output and the log-sum-exp: O(s/N) per row, no attention
    matrix. Computed in float32 whatever the autocast dtype; returns q's dtype."""

    @staticmethod
    def forward(ctx, q, k, v, ring, clock):
        with torch.autocast(q.device.type, enabled=False):
            out, lse = ring_forward(q, k, v, ring, clock)
        out = out.to(q.dtype)
        ctx.ring, ctx.clock = ring, clock
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        with torch.autocast(dout.device.type, enabled=False):
            dq, dk, dv = ring_backward(dout, q, k, v, out, lse, ctx.ring, ctx.clock)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def untimed(kind):
    return nullcontext()


# torch.compile runs the ring eagerly (a graph break) and compiles the math around it
@torch.compiler.disable
def ring_attention(q, k, v, ring, clock=None):
    return RingAttention.apply(q, k, v, ring, clock or untimed)

# ----------------------------------------------------------------------------- one block's attention, forward and backward
#
# This is a teaching implementation: each block's scores come from plain float32
# matmuls. On a GPU one would call a flash-attention kernel that returns the log-sum-exp
# with the output (flash_attn's _flash_attn_forward, or torch's
# _scaled_dot_product_flash_attention) and its backward kernel, and merge the same way.

def attend(q, k, v, scale, causal):
    """Softmax attention of q on one block of keys and values alone.
    -> (out, lse): the output and each row's log-sum-exp of the scores."""
    s = torch.matmul(q, k.transpose(-2, -1)) * scale  # (B, H, Lq, Lk): only this block's, never s x s
    if causal:
        s.masked_fill_(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    return torch.matmul(torch.exp(s - lse.unsqueeze(-1)), v), lse


def merge(out, lse, o, l):
    """In place: (out, lse) becomes the attention over the keys of both parts. Each is a
    softmax-weighted mean, weighted by its share e^lse of the total mass (the online
    softmax, Milakov & Gimelshein 2018; FlashAttention, Dao et al. 2022):
    out = (e^lse1 out1 + e^lse2 out2) / (e^lse1 + e^lse2)."""
    new = torch.logaddexp(lse, l)
    out.mul_(torch.exp(lse - new).unsqueeze(-1)).add_(o * torch.exp(l - new).unsqueeze(-1))
    lse.copy_(new)


def attend_backward(q, k, v, dout, lse, delta, scale, causal):
    """FlashAttention-2's backward for one block (Dao 2023): P recomputed from the scores
    and the final lse (so P is the block's share of the FULL softmax; no attention matrix
    was kept), delta = rowsum(dO * O). -> (dq, dk, dv), this block's parts."""
    s = torch.matmul(q, k.transpose(-2, -1)) * scale
    if causal:
        s.masked_fill_(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    p = torch.exp(s - lse.unsqueeze(-1))
    dv = torch.matmul(p.transpose(-2, -1), dout)
    ds = p * (torch.matmul(dout, v.transpose(-2, -1)) - delta.unsqueeze(-1))  # softmax's Jacobian
    return torch.matmul(ds, k) * scale, torch.matmul(ds.transpose(-2, -1), q) * scale, dv

# ----------------------------------------------------------------------------- Ulysses: the heads travel instead of the keys
#
# DeepSpeed-Ulysses (Jacobs et al. 2023): for the length of attention, swap what is split
# (the module docstring). Backward is autograd's: C.all_to_all_rows sends the gradients back
# the way they came. The attention in between could be any kernel; here it is the ring's own
# math on a ring of one, so that the bench compares the messages.

def seq_to_heads(x, ring):
    """(..., H, s/N, D) at my positions -> (..., H/N, s, D): my heads, every position in order."""
    send = torch.stack(x.chunk(ring.n, dim=-3))  # (N, ..., H/N, s/N, D): part j, heads group j, to rank j
    parts = C.all_to_all_rows(send, group=ring.group, name="to heads").unbind(0)  # part i: rank i's positions
    if ring.layout == "zigzag":  # part i is chunks i and 2N-1-i: the early halves in order, then the late reversed
        halves = [p.chunk(2, dim=-2) for p in parts]
        parts = [h[0] for h in halves] + [h[1] for h in halves[::-1]]
    return torch.cat(parts, dim=-2)


def heads_to_seq(y, ring):
    """seq_to_heads's inverse: (..., H/N, s, D) -> (..., H, s/N, D) at my positions."""
    if ring.layout == "zigzag":  # rank i's positions: chunks i and 2N-1-i of 2N
        c = y.chunk(2 * ring.n, dim=-2)
        parts = [torch.cat([c[i], c[2 * ring.n - 1 - i]], dim=-2) for i in range(ring.n)]
    else:
        parts = y.chunk(ring.n, dim=-2)
    recv = C.all_to_all_rows(torch.stack(parts), group=ring.group, name="to positions")  # part j: rank j's heads
    return torch.cat(recv.unbind(0), dim=-3)


def exchange(x, ring, to_heads, clock):
    """One of the two exchanges, its forward and (clock.backward) its backward timed as
    "wait": nothing overlaps them, all of it is exposed."""
    with clock("wait"):
        y = (seq_to_heads if to_heads else heads_to_seq)(x, ring)
    if y.requires_grad and hasattr(clock, "backward"):
        clock.backward("wait", x, y)
    return y


ALONE = types.SimpleNamespace(me=0, n=1, layout="contiguous")  # a ring of one: one block, no messages


# torch.compile runs the exchanges eagerly (a graph break), as the ring
@torch.compiler.disable
def ulysses_attention(q, k, v, ring, clock=None):
    """Causal attention of this rank's q over the sequence all ranks hold, (B, H, s/N, D)
    each, H divisible by N; returns q's dtype. The same Ring (group, layout) as the ring's."""
    clock = clock or untimed
    qkv = exchange(torch.stack([q, k, v]), ring, True, clock)  # one message for all three
    y = RingAttention.apply(*qkv.unbind(0), ALONE, clock)  # (B, H/N, s, D): whole sequences, causal
    return exchange(y, ring, False, clock)


ATTENTION = dict(ring=ring_attention, ulysses=ulysses_attention)

# ----------------------------------------------------------------------------- the model on a rank's positions

def use_ring(model, ring, clock=None, attention="ring"):
    """Point every block's attention at the ring: model.CausalSelfAttention runs as it is
    (c_attn, the heads, c_proj) and its attend() hook, SDPA in one process, becomes
    ring attention over every rank's keys (attention="ulysses": the all-to-alls around it)."""
    for block in model.transformer.h:
        block.attn.attend = functools.partial(ATTENTION[attention], ring=ring, clock=clock)


def forward(model, idx, targets, pos, recompute="none"):
    """model.GPT's forward on this rank's positions `pos` of every row (its attention on
    the ring). -> the mean loss over this rank's tokens (every rank holds as many: the
    ranks' mean is the batch's)."""
    t = model.transformer
    x = t.wte(idx) + t.wpe(pos)  # the GLOBAL positions
    for block in t.h:
        x = M.recompute_block(block, x, recompute)
    return M.head(t.ln_f, model.lm_head.weight, x, targets)[1]


def main(argv=None):
    cfg = M.parse_args(DEFAULTS, argv, __doc__)
    if cfg.layout not in LAYOUTS:
        M.die(f"--layout takes contiguous or zigzag, not {cfg.layout!r}")
    if cfg.attention not in ATTENTION:
        M.die(f"--attention takes ring or ulysses, not {cfg.attention!r}")
    if cfg.dropout:
        M.die("context_parallel.py needs --dropout=0: the ring's hand-written attention backward recomputes "
              "the attention weights and would need forward's random masks (ulysses keeps to the same model)")
    run = M.start(cfg, "context_parallel")
    rank, world, device, config = run.rank, run.world, run.device, run.config
    if cfg.attention == "ulysses" and config.n_head % world:
        M.die(f"--attention=ulysses splits the {config.n_head} heads over the ranks: {world} ranks do not divide them "
              f"(--attention=ring does not need it)")
    parts = world * (2 if cfg.layout == "zigzag" else 1)
    if config.block_size % parts:
        M.die(f"--block_size={config.block_size} does not divide into {parts} equal parts "
              f"({world} rank{'s' * (world > 1)}, {cfg.layout} layout{', two chunks each' if cfg.layout == 'zigzag' else ''})")
    group = None  # the whole world; the ring takes its group, so a mesh could run it on a sub-group
    ring, clock = Ring(group, cfg.layout), Clock(device)
    pos = positions(config.block_size, ring.me, ring.n, cfg.layout, device)

    # the weights are replicated, as in DDP: the same seed everywhere, made sure by a broadcast
    model = M.GPT(config, seed=cfg.seed).to(device)
    use_ring(model, ring, clock, cfg.attention)
    params = list(model.parameters())  # the tied matrix once
    for t in params + list(model.buffers()):
        C.broadcast(t.data, src=C.group_ranks(group)[0], group=group)
    optimizer = M.make_optimizer(model.named_parameters(), cfg, device)
    M.restore(run, [(n, p, None, rank == 0) for n, p in model.named_parameters()], optimizer)
    step_forward = torch.compile(forward) if cfg.compile else forward
    if rank == 0:
        print(f"context_parallel: {world} rank{'s' * (world > 1)}, {cfg.attention}, {cfg.layout} layout, "
              f"{M.param_count(config) / 1e6:.2f}M parameters, "
              f"{cfg.batch_size} x {config.block_size // world} tokens per rank "
              f"({config.block_size} per sequence)", flush=True)

    @torch.no_grad()
    def evaluate():
        model.eval()
        losses = torch.zeros(cfg.eval_iters, device=device)
        with C.untracked():  # validation, not training traffic
            for k in range(cfg.eval_iters):
                x, y = M.batch(run, k, "val")
                with run.autocast:
                    losses[k] = step_forward(model, x[:, pos], y[:, pos], pos)
            C.all_reduce(losses, op="avg", group=group)
        model.train()
        return losses.mean().item()

    for it in range(run.start_iter, cfg.max_iters):
        M.begin_iter(run, it, evaluate)
        # ---------------------------------------------------------------- the training step
        clock.reset()  # validation's attention is not the step's
        optimizer.zero_grad(set_to_none=True)
        x, y = M.batch(run, it)  # every row of the global batch...
        x, y = x[:, pos], y[:, pos]  # ...at this rank's positions
        counting, saved = M.saved_bytes(params, on=not cfg.compile)
        with M.span("forward"), run.autocast, counting:
            loss = step_forward(model, x, y, pos, cfg.recompute)
        with M.span("backward"):
            loss.backward()  # the ring runs again, backward, inside
        with M.span("optimizer"):
            C.all_reduce_flat([p.grad for p in params], group=group)  # the replicated weights' gradients, once a step
            # after the all-reduce every rank holds the same gradients, so the local norm is the global norm
            norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip) if cfg.grad_clip else 0.0
            optimizer.step()
        # ---------------------------------------------------------------- end of the training step
        ms = clock.take_ms()
        state = M.tensor_bytes(params) + M.tensor_bytes(p.grad for p in params) + M.optimizer_state_bytes(optimizer)
        M.end_iter(run, loss=loss.item(), grad_norm=norm, state_bytes=state, act_bytes=sum(saved.values()),
                   attn_ms=ms["attn"], attn_wait_ms=ms["wait"])
    return M.finish(run)

# ----------------------------------------------------------------------------- the clock and the bytes

class Clock:
    """clock(kind) times the spans of one kind ("attn", "wait") on the device's timeline
    (CUDA events on a GPU: the CPU does not wait); take_ms() adds them up per step."""

    def __init__(self, device="cpu"):
        self.device = torch.device(device)
        self.spans = dict(attn=[], wait=[])

    @contextmanager
    def __call__(self, kind):
        t0 = M.now(self.device)
        yield
        self.spans[kind].append((t0, M.now(self.device)))

    def backward(self, kind, x, y):
        """Times autograd's way back from y to x as `kind`: from y's gradient to x's."""
        start = []
        y.register_hook(lambda grad: start.append(M.now(self.device)))
        x.register_hook(lambda grad: self.spans[kind].append((start.pop(), M.now(self.device))))

    def reset(self):
        for spans in self.spans.values():
            spans.clear()

    def take_ms(self):
        """Milliseconds spent per kind since the last reset (on a GPU, reads the events)."""
        ms = {k: 1000 * sum(M.elapsed(t0, t1) for t0, t1 in v) for k, v in self.spans.items()}
        self.reset()
        return ms


def activation_per_rank(config, cfg, world):
    """The bytes autograd keeps between forward and backward on a rank (the log's act_bytes;
    docs/memory.md): every activation is per position, so what one process keeps for s/N
    positions. --attention=ulysses keeps the same (the ring's math, on H/N heads of s positions)."""
    d = 2 if cfg.dtype == "bfloat16" else 4
    n, s = cfg.batch_size * config.block_size // world, config.block_size // world
    return (M.activation_bytes(config, n, getattr(cfg, "recompute", "none"), ring=True, dtype_bytes=d)
            + M.ends_bytes(config, n, s, dtype_bytes=d))


def traffic_per_rank(config, cfg, world):
    """Bytes a rank sends per optimizer step (docs/context_parallel.md, "What each sends", derives
    it): ring L·(N-1)·2·b·(s/N)·h·(2a + 4), ulysses 8(N-1)/N²·L·b·s·h·a (each plus the forward's
    share again under --recompute=full), and 2(N-1)/N·4Ψ for the gradients' ring all-reduce (the
    mean over ranks when N does not divide Ψ), with a = 4 bytes in float32 or 2 in bfloat16."""
    if world == 1:
        return 0
    b, s, h, L = cfg.batch_size, config.block_size, config.n_embd, config.n_layer
    a = 2 if cfg.dtype == "bfloat16" else 4
    passes = 2 if getattr(cfg, "recompute", "none") == "full" else 1  # full: backward reruns forward
    block = 2 * b * (s // world) * h  # K and V, every row and head, of one rank's positions
    if getattr(cfg, "attention", "ring") == "ulysses":
        piece = b * (s // world) * (h // world)  # one tensor's share for one other rank: my positions, its heads
        attention = L * (world - 1) * 4 * piece * a * (passes + 1)
    else:
        attention = L * (world - 1) * block * a * passes + L * (world - 1) * block * (a + 4)
    weights = 2 * (world - 1) / world * 4 * M.param_count(config)
    return attention + weights


if __name__ == "__main__":
    M.main_guard(main)
