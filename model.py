"""
The one GPT every strategy trains, then the bookkeeping they all share.

The model is everything above the fence ("# ===== the run machinery"): GPT-2 as nanoGPT
writes it (the token embedding tied to the head), its mixture-of-experts layer (--n_expert),
the seeded init one unit at a time (so a sharded strategy never builds the whole model), and
what a block keeps for backward (--recompute). Behind the fence, what makes every strategy's
run the same run: data, optimizer, FLOPs and MFU, the flags, the run skeleton (start,
restore, begin_iter, end_iter, finish) with its log, --trace, checkpoints that any layout
can load, and the memory accounting the strategies log and the tests check.
"""
import glob
import hashlib
import json
import math
import os
import re
import shutil
import sys
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, asdict, field
from types import SimpleNamespace

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint
from torch.utils import flop_counter
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

# -----------------------------------------------------------------------------
# sizes


@dataclass
class GPTConfig:
    block_size: int = 1024
    vocab_size: int = 50304  # GPT-2's 50257 padded up to a multiple of 64 (faster matmuls)
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True
    n_expert: int = 0              # experts of the MLP's shape in each block, in place of its MLP
    top_k: int = 2                 # experts each token is sent to
    capacity_factor: float = 0.0   # an expert takes at most ceil(cf·tokens·top_k/E) a micro-batch; 0: no limit
    aux_loss_coef: float = 0.01    # weight of the load-balancing loss in the training objective


PRESETS = {
    "tiny": dict(n_layer=12, n_head=12, n_embd=96, block_size=64),  # the tests': splits by 2, 3 and 4
    "small": dict(n_layer=4, n_head=4, n_embd=128, block_size=128),  # the CPU demo: loss falls in minutes
    "wide": dict(n_layer=8, n_head=8, n_embd=512, block_size=64),  # the pipeline bench: backward is matmuls
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768, block_size=1024),  # 124M
    "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024, block_size=1024),  # 350M
    "gpt2-large": dict(n_layer=36, n_head=20, n_embd=1280, block_size=1024),  # 774M
    "gpt2-xl": dict(n_layer=48, n_head=25, n_embd=1600, block_size=1024),  # 1558M
}


def pad_vocab(vocab_size):
    return (vocab_size + 63) // 64 * 64


# -----------------------------------------------------------------------------
# the model


class CausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        assert config.n_embd % config.n_head == 0
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)  # q, k, v in one matmul
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.head_dim = config.n_embd // config.n_head
        self.dropout = config.dropout

    def forward(self, x):
        B, T, _ = x.shape
        # heads are counted from the weight's size (-1 below), so a tensor parallel
        # rank that holds only some of the heads runs this same code on its slice
        q, k, v = self.c_attn(x).chunk(3, dim=2)
        q, k, v = (t.view(B, T, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        y = self.attend(q, k, v)
        y = y.transpose(1, 2).reshape(B, T, -1)
        return F.dropout(self.c_proj(y), self.dropout, self.training)

    def attend(self, q, k, v):
        """Causal attention of the T queries on the T keys here, (B, nh, T, hs). The hook
        context_parallel.py sets to its ring, where the keys are the whole sequence's."""
        return F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = config.dropout

    def forward(self, x):
        return F.dropout(self.c_proj(F.gelu(self.c_fc(x), approximate="tanh")), self.dropout, self.training)


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MoE(config) if config.n_expert else MLP(config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """The whole model in one process. Strategies reuse its parts: build_unit()
    makes any one piece with exactly the weights this class would give it."""

    def __init__(self, config, seed=1337):
        super().__init__()
        self.config = config
        emb = build_unit(config, "embed", seed)
        self.transformer = nn.ModuleDict(dict(
            wte=emb.wte,
            wpe=emb.wpe,
            h=nn.ModuleList(build_unit(config, i, seed) for i in range(config.n_layer)),
            ln_f=build_unit(config, "ln_f", seed),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # the tie: one matrix, two uses
        self.recompute = "none"  # --recompute: what each block keeps for backward (recompute_block)
        self.head = head  # the function below; ddp.compile_blocks puts a compiled one here

    def forward(self, idx, targets=None):
        x = embed(self.transformer.wte, self.transformer.wpe, idx, self.config.dropout, self.training)
        for block in self.transformer.h:
            x = recompute_block(block, x, self.recompute)
        return self.head(self.transformer.ln_f, self.lm_head.weight, x, targets)


def embed(wte, wpe, idx, dropout=0.0, training=False):
    pos = torch.arange(idx.shape[1], device=idx.device)
    return F.dropout(wte(idx) + wpe(pos), dropout, training)


def head(ln_f, weight, x, targets=None):
    """Final norm, logits through the tied matrix, and the mean cross-entropy.
    The loss is computed in float32 whatever the autocast dtype."""
    logits = F.linear(ln_f(x), weight)
    if targets is None:
        return logits, None
    loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))
    return logits, loss


# -----------------------------------------------------------------------------
# mixture of experts (--n_expert=E; off by default, and then nothing here runs)
#
# Each block's MLP becomes E experts of its shape and a router sending every token to top_k
# of them, whose outputs the block adds, weighted (sources: docs/expert_parallel.md). The
# router and its softmax run in float32 (Switch: bf16 would flip choices); with top_k = 1
# the weight is the probability itself, or the router would learn from the balance loss
# alone. Capacity counts choices of the GLOBAL micro-batch (every data parallel rank's rows)
# in GShard's order, every first choice before any second, then rank 0's rows, rank 1's...,
# so one process and N ranks drop the same ones. The balance loss is per sequence, averaged:
# the same however the batch is split, and no message. Experts are stacked on dim 0, of
# which an expert parallel rank holds a slice.


class ExpertLinear(nn.Module):
    """n linear maps of one shape, stacked: weight (n, out, in), bias (n, out)."""

    def __init__(self, n, fan_in, fan_out, bias=True):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n, fan_out, fan_in))
        self.bias = nn.Parameter(torch.empty(n, fan_out)) if bias else None

    def forward(self, x, e):
        return F.linear(x, self.weight[e], None if self.bias is None else self.bias[e])


class Experts(nn.Module):
    """n experts, each an MLP of the dense block's shape."""

    def __init__(self, config, n):
        super().__init__()
        self.c_fc = ExpertLinear(n, config.n_embd, 4 * config.n_embd, config.bias)
        self.c_proj = ExpertLinear(n, 4 * config.n_embd, config.n_embd, config.bias)
        self.dropout = config.dropout

    def forward(self, x, sizes):
        """x holds sizes[0] rows for expert 0, then sizes[1] for expert 1, ... Every expert
        runs, even on no rows, so each gets a gradient every step (DDP's hooks wait for it)."""
        out = [self.c_proj(F.gelu(self.c_fc(rows, e), approximate="tanh"), e) for e, rows in enumerate(x.split(sizes))]
        return F.dropout(torch.cat(out), self.dropout, self.training)


def route(router, x, top_k):
    """-> (probs (n, E), weights (n, k), chosen (n, k)): the router's softmax in float32,
    each token's top_k experts and their weights (renormalized when k > 1)."""
    with torch.autocast(x.device.type, enabled=False):
        probs = F.softmax(F.linear(x.float(), router.weight.float()), dim=-1)
    weights, chosen = probs.topk(top_k, dim=-1)
    if top_k > 1:
        weights = weights / weights.sum(-1, keepdim=True)
    return probs, weights, chosen


def balance_loss(probs, chosen):
    """E·Σ_e f_e·P_e per sequence, averaged over the sequences. probs (B, T, E), chosen (B, T, k)."""
    B, T, E = probs.shape
    choices = chosen.reshape(B, -1)
    f = torch.zeros(B, E, device=probs.device).scatter_add_(1, choices, torch.ones(choices.shape, device=probs.device))
    return E * (f / choices.shape[1] * probs.mean(1)).sum(-1).mean()


def choice_counts(chosen, n_expert):
    """(E, k): how many tokens made expert e their s-th choice."""
    return F.one_hot(chosen, n_expert).sum(0).t()


def expert_capacity(config, tokens):
    """The most choices an expert takes from a micro-batch of `tokens` tokens (every data
    parallel rank's rows together); None: no limit."""
    if not config.capacity_factor:
        return None
    return math.ceil(config.capacity_factor * tokens * config.top_k / config.n_expert)


def ahead(table):
    """table (N, E, k): the choices rank i's tokens made, by expert and choice rank. ->
    (N, E, k): how many choices of expert e come before rank i's first (e, s) in the global
    order (all first choices before any second, then rank 0's tokens, rank 1's, ...)."""
    per_rank = table.sum(0)
    return (per_rank.cumsum(1) - per_rank) + (table.cumsum(0) - table)


def kept_counts(table, capacity):
    """(N, E, k): how many of table's choices their experts keep under the capacity."""
    return table if capacity is None else (capacity - ahead(table)).clamp(min=0).minimum(table)


def keep_mask(chosen, ahead_mine, capacity):
    """(n, k) bool, which of this rank's choices are kept, or None (all): those with
    fewer than `capacity` choices of the same expert before them in the global order.
    ahead_mine (E, k) is this rank's row of ahead()."""
    if capacity is None:
        return None
    hot = F.one_hot(chosen, ahead_mine.shape[0])           # (n, k, E)
    earlier = ((hot.cumsum(0) - hot) * hot).sum(-1)        # this rank's earlier tokens, same expert and choice rank
    return earlier + ahead_mine[chosen, torch.arange(chosen.shape[1], device=chosen.device)] < capacity


def by_expert(chosen, keep=None):
    """The kept (token, choice) pairs as indices token·k + choice, grouped by expert and
    in token order within each: the order the experts take their rows in."""
    order = torch.argsort(chosen.reshape(-1), stable=True)
    return order if keep is None else order[keep.reshape(-1)[order]]


def scatter_choices(rows, order, shape):
    """Expert outputs in by_expert order -> (n, k, C), zeros for the dropped choices."""
    n, k = shape
    return rows.new_zeros(n * k, rows.shape[-1]).index_copy(0, order, rows).view(n, k, -1)


class MoE(nn.Module):
    """The MLP's place in a block: the router and the experts. Here one process holds
    every expert; expert_parallel.py's subclass replaces run_experts() with one that
    sends each token to the rank holding its expert."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.router = nn.Linear(config.n_embd, config.n_expert, bias=False)
        self.experts = Experts(config, config.n_expert)
        self.aux = None  # this forward's balance loss, with its graph: moe_loss() adds it to the objective
        self.tally = {}  # the training forwards' statistics, summed until moe_log() reads them

    def forward(self, x):
        B, T, C = x.shape
        tokens = x.reshape(-1, C)
        probs, weights, chosen = route(self.router, tokens, self.config.top_k)
        self.aux = balance_loss(probs.view(B, T, -1), chosen.view(B, T, -1))
        out, stats = self.run_experts(tokens, chosen)  # (n, k, C): each choice's expert output, 0 if dropped
        y = (weights.unsqueeze(-1) * out).sum(1)
        if self.training and not rerunning():  # --recompute=full reruns it in backward: count it once
            for name, v in dict(stats, aux_loss=self.aux.detach(), forwards=1).items():
                self.tally[name] = self.tally.get(name, 0) + v
        return y.view(B, T, C).to(x.dtype)

    def run_experts(self, tokens, chosen):
        """-> (the experts' outputs (n, k, C), stats). One process: every expert is here and
        the micro-batch is all there is, so the global order is this one."""
        table = choice_counts(chosen, self.config.n_expert)[None]  # (1, E, k)
        capacity = expert_capacity(self.config, tokens.shape[0])
        keep = keep_mask(chosen, ahead(table)[0], capacity)
        kept = kept_counts(table, capacity)[0].sum(-1).cpu()  # per expert
        sizes = kept.tolist()
        order = by_expert(chosen, keep)
        out = self.experts(tokens[order // chosen.shape[1]], sizes)
        stats = dict(expert_tokens=kept, dropped_tokens=chosen.numel() - sum(sizes))
        return scatter_choices(out, order, chosen.shape), stats


def moe_layers(model):
    config = getattr(model, "config", None)
    if config is not None and not config.n_expert:  # dense: no walk over every module, twice a step
        return []
    return [m for m in model.modules() if isinstance(m, MoE)]


def moe_loss(model):
    """The objective's balance term: aux_loss_coef × the mean over the MoE layers of this
    forward's balance loss. 0.0 for a dense model (adding it changes nothing)."""
    layers = moe_layers(model)
    if not layers:
        return 0.0
    return layers[0].config.aux_loss_coef * torch.stack([m.aux for m in layers]).mean()


# -----------------------------------------------------------------------------
# init, one unit at a time
#
# The model is cut into units: "embed" (token and position embeddings), blocks
# 0..n_layer-1, and "ln_f". Each draws its weights from its own generator, seeded from
# (seed, unit), so any strategy can build any unit alone and get the numbers the whole
# model's build gives: FSDP builds a block, keeps its shard and drops the rest.


def build_unit(config, unit, seed):
    """One initialized unit on the CPU: a Block, the final LayerNorm, or a ModuleDict
    with wte and wpe."""
    with torch.device("meta"):  # skip PyTorch's default init: we draw our own below
        if unit == "embed":
            m = nn.ModuleDict(dict(wte=nn.Embedding(config.vocab_size, config.n_embd),
                                   wpe=nn.Embedding(config.block_size, config.n_embd)))
        elif unit == "ln_f":
            m = nn.LayerNorm(config.n_embd, bias=config.bias)
        else:
            m = Block(config)
    m = m.to_empty(device="cpu")
    index = {"embed": 0, "ln_f": 1}[unit] if unit in ("embed", "ln_f") else 2 + unit
    g = torch.Generator().manual_seed(seed * 1_000_003 + index)
    for name, p in m.named_parameters():
        with torch.no_grad():
            if "ln" in name or isinstance(m, nn.LayerNorm):
                p.fill_(1.0 if name.endswith("weight") else 0.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                # GPT-2: N(0, 0.02), with the projections that write into the
                # residual stream scaled by 1/sqrt(2 n_layer), since each block adds two
                std = 0.02 / math.sqrt(2 * config.n_layer) if name.endswith("c_proj.weight") else 0.02
                p.normal_(0.0, std, generator=g)
    return m


def make_config(name, vocab_size=50257, block_size=0, dropout=0.0, n_expert=0, top_k=2, capacity_factor=0.0,
                aux_loss_coef=0.01):
    if name not in PRESETS:
        die(f"unknown --model {name!r}; choose one of {', '.join(PRESETS)}")
    cfg = dict(PRESETS[name], vocab_size=pad_vocab(vocab_size), dropout=dropout)
    if block_size:
        cfg["block_size"] = block_size
    if n_expert:  # a dense model keeps the defaults, so its config (and checkpoints) are what they always were
        cfg.update(n_expert=n_expert, top_k=top_k, capacity_factor=capacity_factor, aux_loss_coef=aux_loss_coef)
    return GPTConfig(**cfg)


def num_params(params):
    """Counts each tensor once, so a tied matrix is not counted twice."""
    return sum(p.numel() for p in {id(p): p for p in params}.values())


def param_count(config):
    """The same count from the shapes alone, without building anything (the tied
    matrix once): per block 12·h² weights plus 13·h biases and norms."""
    h = config.n_embd
    per_block = 12 * h * h + (13 * h if config.bias else 2 * h)  # without biases: the two norms' weights
    per_block += mlp_params(config, config.n_expert) - mlp_params(config, 0)  # a mixture of experts' MLPs
    ln_f = 2 * h if config.bias else h
    return (config.vocab_size + config.block_size) * h + config.n_layer * per_block + ln_f


def mlp_params(config, experts):
    """A block's MLP (experts = 0), or `experts` of a mixture's experts and its router."""
    h = config.n_embd
    mlp = 8 * h * h + (5 * h if config.bias else 0)
    return experts * mlp + config.n_expert * h if experts else mlp


def active_params(config):
    """The parameters a token passes through, for the FLOP count: all of them in the
    dense GPT; with a mixture of experts, top_k experts a block and the router."""
    unused = mlp_params(config, config.n_expert) - mlp_params(config, config.top_k) if config.n_expert else 0
    return param_count(config) - config.n_layer * unused


# -----------------------------------------------------------------------------
# activation memory: what autograd keeps for backward, and --recompute
#
# --recompute says what a block keeps between its forward and its backward:
#   none  everything its backward reads (the default)
#   gelu  all but each GELU's output, recomputed in backward from the GELU's input (which
#         the GELU's own backward keeps anyway): 4h numbers a token a layer fewer, for one
#         elementwise op, no matmul, no message, in every strategy
#   full  only the block's input; the whole forward reruns in backward (one more forward
#         a step, ~1/3 more compute), before the block's backward, from that input
# The losses and gradients are the same numbers: a rerun computes the same values.

RECOMPUTE = ("none", "gelu", "full")
_count = None  # while saved_bytes() counts: its pack hook, which _pack_gelu passes the rest to
_rerun = False  # while backward reruns a block's forward (full): MoE's statistics are not counted twice


def rerunning():
    return _rerun


def recompute_block(fn, x, mode="none"):
    """fn(x), a block's forward, keeping for backward what --recompute=mode says. full is
    torch.utils.checkpoint without re-entrance, so the graph stays one graph and
    autograd.grad(inputs=), the pipeline's split backward (B, W) and gradient hooks work as
    without it. The x it keeps is counted here, once by storage."""
    if mode == "full" and torch.is_grad_enabled():
        if _count is not None:
            _count(x)
        calls = []

        def forward(x):  # the first call is forward; any later one, backward's rerun
            global _rerun
            before, _rerun = _rerun, bool(calls)
            calls.append(1)
            try:
                return fn(x)
            finally:
                _rerun = before
        return torch.utils.checkpoint.checkpoint(forward, x, use_reentrant=False)
    if mode == "gelu" and torch.is_grad_enabled():
        with torch.autograd.graph.saved_tensors_hooks(_pack_gelu, _unpack_gelu):
            return fn(x)
    return fn(x)


def _pack_gelu(t):
    """For a GELU's output (or a view of it: the next matmul's weight gradient reads it),
    keep the GELU's input, which the GELU's backward holds anyway, and the view's shape."""
    node = (t if t._base is None else t._base).grad_fn
    if type(node).__name__ == "GeluBackward0":
        return node._saved_self, node._saved_approximate, t.size(), t.stride(), t.storage_offset()
    return t if _count is None else _count(t)


def _unpack_gelu(saved):
    if not isinstance(saved, tuple):
        return saved
    x, approximate, size, stride, offset = saved
    return F.gelu(x, approximate=approximate).as_strided(size, stride, offset)


# ============================================================================= the run machinery
# Above: the model. Below: what every strategy calls around its own training step, so
# that their runs are the same run. Only this part talks to the other ranks.
# =============================================================================

import collectives as C  # noqa: E402  (the model above needs no process group)


# -----------------------------------------------------------------------------
# data: nanoGPT's uint16 token files and the one sampler every strategy uses

GPT2_VOCAB = 50257


def load_data(data_dir):
    """(train tokens, val tokens, vocab size), memory-mapped, after checking the files: whole
    uint16 files, not empty, no id beyond the vocabulary (a strategy that looks one up either
    crashes or, split by vocabulary, silently trains on zeros)."""
    paths = {s: os.path.join(data_dir, f"{s}.bin") for s in ("train", "val")}
    for p in paths.values():
        if not os.path.exists(p):
            die(f"no {p}: run `python data/prepare.py` first (Shakespeare by characters; --tokenizer=gpt2 "
                f"writes data/shakespeare), or pass --data_dir=FOLDER with train.bin and val.bin",
                scope="node")
    meta = read_meta(os.path.join(data_dir, "meta.json"))
    vocab_size = meta.get("vocab_size", GPT2_VOCAB)
    splits = {}
    for s, p in paths.items():
        size = os.path.getsize(p)
        if size == 0 or size % 2:
            die(f"{p} has {size} bytes: not a whole number of uint16 tokens" if size else f"{p} is empty",
                scope="node")
        splits[s] = np.memmap(p, dtype=np.uint16, mode="r")
        # prepare.py records each split's size and largest id; trusted only if the size still matches
        known = meta.get(f"{s}_tokens") == len(splits[s]) and isinstance(meta.get("max_token_id"), int)
        top = meta["max_token_id"] if known else max(int(splits[s][i:i + (1 << 24)].max())  # in bounded chunks
                                                     for i in range(0, len(splits[s]), 1 << 24))
        if top >= vocab_size:
            at = "" if known else f" (first at position {int(np.argmax(np.asarray(splits[s]) >= vocab_size))})"
            given = " given by meta.json" if "vocab_size" in meta else " (GPT-2's; a meta.json with vocab_size says otherwise)"
            die(f"{p} holds token id {top}{at}, beyond the vocabulary of {vocab_size}{given}", scope="node")
    return splits["train"], splits["val"], vocab_size


def read_meta(path):
    """meta.json beside the data, optional: {} without one."""
    if not os.path.exists(path):
        return {}
    try:
        with open(path) as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:
        die(f"{path} is not valid JSON ({e})", scope="node")
    if not isinstance(meta, dict):
        die(f"{path} must hold a JSON object, not {type(meta).__name__}", scope="node")
    v = meta.get("vocab_size", GPT2_VOCAB)
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        die(f"{path}: vocab_size must be a positive integer, not {v!r}", scope="node")
    return meta


def get_batch(data, seed, step, batch_size, block_size, rows=None, split="train"):
    """The global batch of `step`: batch_size windows of block_size + 1 tokens (inputs, and
    targets one later) at starts drawn from (seed, step, split), so every process, whatever
    the strategy or world size, sees the same rows; `rows` (a slice) keeps part of them."""
    rng = np.random.default_rng([seed, step, 0 if split == "train" else 1])
    ix = rng.integers(0, len(data) - block_size, size=batch_size)
    ix = ix[rows] if rows is not None else ix
    x = torch.from_numpy(np.stack([data[i:i + block_size] for i in ix]).astype(np.int64))
    y = torch.from_numpy(np.stack([data[i + 1:i + 1 + block_size] for i in ix]).astype(np.int64))
    return x, y


def batch(run, step, split="train", micro_step=0, n_micro=1, dp_rank=0, dp_size=1):
    """This rank's rows of the global batch of `step`, on its device: the batch cut into
    dp_size contiguous blocks, one per data parallel rank, each cut into n_micro micro-batches."""
    cfg = run.cfg
    micro = cfg.batch_size // (dp_size * n_micro)
    first = (dp_rank * n_micro + micro_step) * micro
    x, y = get_batch(run.val if split == "val" else run.train, cfg.seed, step, cfg.batch_size, cfg.block_size,
                     rows=slice(first, first + micro), split=split)
    if run.device.type == "cuda":  # pinned, so the copy is asynchronous
        return x.pin_memory().to(run.device, non_blocking=True), y.pin_memory().to(run.device, non_blocking=True)
    return x, y


# -----------------------------------------------------------------------------
# the optimizer


def get_lr(it, cfg):
    """Linear warmup, then cosine decay to min_lr at max_iters."""
    if it < cfg.warmup_iters:
        return cfg.lr * (it + 1) / (cfg.warmup_iters + 1)
    if it >= cfg.max_iters:
        return cfg.min_lr
    ratio = (it - cfg.warmup_iters) / max(1, cfg.max_iters - cfg.warmup_iters)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (cfg.lr - cfg.min_lr)


def decays(name, p):
    """nanoGPT's rule: weight matrices and embeddings decay; biases and norms don't
    (a mixture's stacked expert biases are 2-D, hence the name)."""
    return p.dim() >= 2 and not name.endswith("bias")


def make_optimizer(named_params, cfg, device):
    """AdamW over two groups (decay / no decay); fused on a GPU."""
    named = list({id(p): (n, p) for n, p in named_params}.values())  # a tied tensor once
    groups = [dict(params=[p for n, p in named if decays(n, p)], weight_decay=cfg.weight_decay),
              dict(params=[p for n, p in named if not decays(n, p)], weight_decay=0.0)]
    fused = torch.device(device).type == "cuda"
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), fused=fused or None)


def set_lr(optimizer, lr):
    for g in optimizer.param_groups:
        g["lr"] = lr


def clip_coef(total_norm, max_norm):
    """What to scale the gradients by so their global norm is at most max_norm, as
    torch.nn.utils.clip_grad_norm_ computes it: a tensor, on the device (no host sync)."""
    return 1.0 if max_norm <= 0 else torch.clamp(max_norm / (torch.as_tensor(total_norm) + 1e-6), max=1.0)


def clip_by_global_norm(sq, grads, max_norm, groups=()):
    """The clip every strategy ends its step with. sq: this rank's part of the squared norm
    of the gradient (each element counted on one rank), summed over each of `groups` in turn;
    then every gradient in `grads` is scaled by clip_coef. -> the norm, a tensor."""
    for group in groups:
        C.all_reduce(sq, group=group)
    norm = sq.sqrt()
    coef = clip_coef(norm, max_norm)
    for g in grads:
        g.mul_(coef)
    return norm


# -----------------------------------------------------------------------------
# FLOPs and MFU


def flops_per_token(config, n_params=None):
    """6N for the matmuls' forward and backward, plus 12·L·H·Q·T for attention's scores and
    weighted sum (PaLM's appendix B, as nanoGPT counts); N without the position embedding."""
    n_params = param_count(config) if n_params is None else n_params
    N = n_params - config.block_size * config.n_embd
    L, H, Q, T = config.n_layer, config.n_head, config.n_embd // config.n_head, config.block_size
    return 6 * N + 12 * L * H * Q * T


# Dense peaks from the data sheets, FLOP/s: (pattern for torch.cuda.get_device_name, bf16
# tensor cores, float32 as run here: TF32 where the chip has it). The first match wins, so
# the specific names come first ("H200 NVL" before "H200", "L40S" before "L40" before "L4").
PEAK_FLOPS = [
    (r"H[12]00.*NVL", 835e12, 418e12),  # the PCIe NVL cards, H100 NVL and H200 NVL alike (before "H200")
    (r"GH200|H200|H100.*(SXM|HBM3)", 989e12, 494e12),
    (r"H100", 756e12, 378e12),  # the PCIe card; SXM parts name themselves above
    (r"B200", 2250e12, 1100e12),
    (r"A100", 312e12, 156e12),
    (r"L40S", 362e12, 183e12),
    (r"L40\b", 181e12, 90.5e12),
    (r"\bL4\b", 121e12, 60e12),
    (r"A10G", 70e12, 35e12),
    (r"\bA10\b", 125e12, 62.5e12),
    (r"RTX 4090", 165e12, 82.6e12),
    (r"RTX 3090", 71e12, 35.6e12),
    (r"V100", 125e12, 15.7e12),  # fp16 tensor cores; no bf16, no TF32
    (r"\bT4\b", 65e12, 8.1e12),
]


def peak_flops(device, override=0.0, dtype="bfloat16"):
    """The device's peak FLOP/s for this dtype, or the override; None (no MFU) if unknown."""
    if override:
        return override
    if torch.device(device).type != "cuda":
        return None
    return device_peak(torch.cuda.get_device_name(device), dtype)


def device_peak(name, dtype="bfloat16"):
    for pattern, half, single in PEAK_FLOPS:
        if re.search(pattern, name):
            return half if dtype == "bfloat16" else single
    return None


def auto_dtype():
    """bfloat16 where the GPU computes it natively (compute capability 8.0+), else float32:
    torch.cuda.is_bf16_supported() counts emulation too, slower than float32 on a V100."""
    if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 8:
        return "bfloat16"
    return "float32"


# -----------------------------------------------------------------------------
# the command line: the flags every strategy accepts; each adds its own. The comment on a
# flag's line is its --help.

HERE = os.path.dirname(os.path.abspath(__file__))
TRAIN_DEFAULTS = dict(
    model="small",          # size preset: tiny, small, wide, gpt2, gpt2-medium, gpt2-large, gpt2-xl
    data_dir=os.path.join(HERE, "data", "shakespeare_char"),  # train.bin and val.bin (python data/prepare.py)
    batch_size=12,          # sequences per optimizer step, all ranks together
    block_size=0,           # tokens per sequence (the context length); 0: the preset's
    max_iters=1200,         # optimizer steps (two CPU ranks take Shakespeare below val loss 2 in ~3 min)
    lr=2e-3,                # peak learning rate, after warm-up
    min_lr=1e-4,            # learning rate at the end of the cosine decay
    warmup_iters=100,       # steps of linear warm-up
    weight_decay=0.1,       # AdamW's, on weight matrices and embeddings only
    beta1=0.9,              # AdamW's first-moment decay
    beta2=0.95,             # AdamW's second-moment decay
    grad_clip=1.0,          # clip the gradient's global norm to this; 0: no clipping
    eval_interval=200,      # validate every this many steps (and at the last); 0: never
    eval_iters=20,          # validation batches each time
    seed=1337,              # seeds the init and the batches: the same for every layout
    dropout=0.0,            # dropout probability (0: runs compare bit for bit)
    dtype="auto",           # float32 | bfloat16 | auto (bfloat16 on a GPU of compute capability >= 8)
    compile=False,          # torch.compile the blocks
    recompute="none",       # none | gelu | full: what a block keeps for backward
    deterministic=False,    # GPU parity mode: TF32 off, deterministic kernels (CPU runs are so already)
    log_file="",            # write one JSON line per step here (rank 0)
    log_interval=50,        # print every this many steps; 0: never
    out_dir="",             # save checkpoints to out_dir/step_XXXXXX/; empty: none
    ckpt_interval=0,        # save every this many steps; 0: only at the end (with --out_dir)
    keep_ckpts=2,           # how many of the newest checkpoints to keep
    resume="",              # latest (the newest in --out_dir, or start afresh) | a checkpoint folder
    save_path="",           # also write the final model as one torch.save state_dict file here
    timeout_s=300,          # seconds a rank waits for a peer before the run ends, naming it
    collectives="hand",     # hand: collectives.py's, on point-to-point messages | torch: torch.distributed's
    trace="",               # write a Chrome trace of every rank here (open it in ui.perfetto.dev)
    trace_steps="2-4",      # the steps --trace records: A-B (inclusive) or one step
    peak_flops=0.0,         # the device's peak FLOP/s for MFU; 0: from its name
    n_expert=0,             # experts in each block's MLP (mixture of experts); 0: dense
    top_k=2,                # experts each token goes to
    capacity_factor=0.0,    # an expert takes at most ceil(cf·tokens·top_k/E) a micro-batch; 0: no limit
    aux_loss_coef=0.01,     # weight of the load-balancing loss in the objective
)


DIE_WAIT_S = 30  # the longest a silent rank waits for the one that prints (see die)
DIE_WAIT_OTHER_NODE_S = 5  # the same, for a rank on another node than the printer's


def die(msg, scope="all"):
    """Bad input ends the run with one line on stderr and a non-zero exit, never a hang,
    printed by one rank: scope "all" (a flag: rank 0), "node" (a file: each machine's local
    rank 0) or "me". Under torchrun the first rank out ends the job, so the silent ranks wait
    for the printer's exit; on another node only briefly (its agent's exit may take the
    rendezvous store down, but must come after the line)."""
    rank, local = os.environ.get("RANK", "0"), os.environ.get("LOCAL_RANK", "0")
    if (scope == "all" and rank == "0") or (scope == "node" and local == "0") or scope == "me":
        prefix = f"rank {rank}: " if rank != "0" and scope != "all" else ""
        print(f"error: {prefix}{msg}", file=sys.stderr, flush=True)
    elif "TORCHELASTIC_RUN_ID" in os.environ:
        printer_here = scope == "node" or os.environ.get("GROUP_RANK", "0") == "0"  # GROUP_RANK: the node's
        time.sleep(DIE_WAIT_S if printer_here else DIE_WAIT_OTHER_NODE_S)
    sys.exit(2)


def delay_for_tests(where="start"):
    """A test's hook: PARALLEL_GPT_DELAY="RANK:SECONDS[@WHERE]" makes that rank sleep at
    `where`: "start" (the default), "restore" or an iteration's number."""
    spec = os.environ.get("PARALLEL_GPT_DELAY")
    if spec:
        who, _, rest = spec.partition(":")
        seconds, _, at = rest.partition("@")
        if who == os.environ.get("RANK", "0") and (at or "start") == str(where):
            time.sleep(float(seconds))


RENAMED = {  # a flag that was renamed -> what to pass instead
    "grad_accum": "--n_micro",
    "method": "--attention",
    "cp_method": "--attention",
    "mode": "--overlap and --bucket_mb (--mode=naive is --bucket_mb=0 --overlap=False; "
            "--mode=bucketed is --overlap=False)",
}


def parse_args(defaults, argv=None, doc=""):
    """--name=value or --name value for every key of `defaults`, typed like the default."""
    argv = sys.argv[1:] if argv is None else list(argv)
    cfg = dict(defaults)
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("-h", "--help"):
            print(doc.strip() + "\n\nflags (default):\n" + flag_help(defaults))
            sys.exit(0)
        if not arg.startswith("--"):
            die(f"unexpected argument {arg!r}; flags are --name=value")
        key, eq, val = arg[2:].partition("=")
        if key not in cfg:
            die(f"--{key} was renamed: use {RENAMED[key]}" if key in RENAMED else f"unknown flag --{key}; see --help")
        if not eq:
            if i + 1 >= len(argv) or argv[i + 1].startswith("--"):
                die(f"flag --{key} needs a value")
            i += 1
            val = argv[i]
        cfg[key] = _typed(key, val, defaults[key])
        i += 1
    return SimpleNamespace(**cfg)


def flag_help(defaults):
    """--help's lines: --name=default, then the comment on the flag's line in a `DEFAULTS =
    dict(` block (one flag a line, closed by a ")" line), looked up in the running script,
    then in model.py, then in this folder's other files (the mesh reuses the strategies')."""
    main = os.path.abspath(getattr(sys.modules["__main__"], "__file__", None) or __file__)
    notes = {}
    for path in [main, __file__] + sorted(glob.glob(os.path.join(HERE, "*.py"))):
        inside = False
        for line in open(path):
            if re.match(r"\w*DEFAULTS = dict\(", line):
                inside = not line.rstrip().endswith(")")
            elif line.startswith(")"):
                inside = False
            elif inside and (m := re.match(r"\s+(\w+)=.*?#\s*(.*)", line)):
                notes.setdefault(m[1], m[2])
    lines = [(f"  --{k}={v!r}" if isinstance(v, str) and v != "".join(v.split()) else f"  --{k}={v}", notes.get(k, ""))
             for k, v in defaults.items()]
    width = min(32, max(len(flag) for flag, _ in lines) + 2)
    return "\n".join((flag + " " * max(2, width - len(flag)) + note).rstrip() for flag, note in lines)


def _typed(key, val, default):
    if isinstance(default, bool):
        if val.lower() not in ("true", "1", "yes", "false", "0", "no"):
            die(f"--{key} takes True or False, not {val!r}")
        return val.lower() in ("true", "1", "yes")
    try:
        return type(default)(val)
    except ValueError:
        die(f"--{key} takes {({int: 'an integer', float: 'a number'}).get(type(default), 'a string')}, not {val!r}")


def check_flags(cfg):
    """The common flags' values, checked on every rank before anything else happens."""
    if cfg.dtype == "auto":
        cfg.dtype = auto_dtype()
    if cfg.dtype not in ("float32", "bfloat16"):
        die(f"--dtype takes float32, bfloat16 or auto, not {cfg.dtype!r}")
    for k in ("batch_size", "max_iters", "timeout_s"):
        if getattr(cfg, k) <= 0:
            die(f"--{k} must be positive, not {getattr(cfg, k)}")
    for k in ("block_size", "eval_interval", "ckpt_interval", "warmup_iters", "log_interval", "keep_ckpts"):
        if getattr(cfg, k) < 0:
            die(f"--{k} must be at least 0, not {getattr(cfg, k)}")
    if cfg.eval_interval and cfg.eval_iters <= 0:
        die(f"--eval_iters must be positive when --eval_interval is set (or pass --eval_interval=0)")
    if cfg.collectives not in ("hand", "torch"):
        die(f"--collectives takes hand or torch, not {cfg.collectives!r}")
    if cfg.recompute not in RECOMPUTE:
        die(f"--recompute takes {', '.join(RECOMPUTE)}, not {cfg.recompute!r}")
    if cfg.recompute == "gelu" and cfg.compile:  # a compiled graph's saved tensors are not the GELU's
        die("--recompute=gelu runs in eager mode only; with --compile use --recompute=full or none")
    if not 0.0 <= cfg.dropout < 1.0:
        die(f"--dropout must be in [0, 1), not {cfg.dropout}")
    if cfg.resume and cfg.resume != "latest" and not os.path.isdir(cfg.resume):
        die(f"--resume={cfg.resume}: no such checkpoint folder (or pass --resume=latest)")
    if cfg.resume == "latest" and not cfg.out_dir:
        die("--resume=latest needs --out_dir, where the checkpoints are")
    if cfg.ckpt_interval and not cfg.out_dir:
        die("--ckpt_interval needs --out_dir, where the checkpoints go")
    if cfg.trace:
        cfg.trace_range = trace_range(cfg.trace_steps)
    # an output that cannot be written fails now, not after hours of training
    for flag, path, is_dir in (("log_file", cfg.log_file, False), ("save_path", cfg.save_path, False),
                               ("out_dir", cfg.out_dir, True), ("trace", cfg.trace, False)):
        if path:
            folder = path if is_dir else (os.path.dirname(os.path.abspath(path)))
            try:
                os.makedirs(folder, exist_ok=True)
            except OSError as e:
                die(f"--{flag}={path}: cannot create {folder} ({e.strerror})", scope="node")
            if not os.access(folder, os.W_OK) or (not is_dir and os.path.isdir(path)):
                die(f"--{flag}={path}: not writable", scope="node")


def check_moe(cfg, strategy, moe):
    """The mixture-of-experts flags: ranges, and whether this strategy trains one."""
    if cfg.n_expert < 0:
        die(f"--n_expert must be at least 0 (0: the dense model), not {cfg.n_expert}")
    if cfg.capacity_factor < 0 or cfg.aux_loss_coef < 0:
        die(f"--capacity_factor and --aux_loss_coef must be at least 0, not {cfg.capacity_factor} and "
            f"{cfg.aux_loss_coef}")
    if cfg.n_expert and not moe:
        die(f"--n_expert: the {strategy} strategy does not train a mixture of experts; "
            f"use ddp.py (replicated experts) or expert_parallel.py")
    if cfg.n_expert and not 1 <= cfg.top_k <= cfg.n_expert:
        die(f"--top_k must be between 1 and --n_expert={cfg.n_expert}, not {cfg.top_k}")


# -----------------------------------------------------------------------------
# the run: what every strategy file does around its own training step
#
#   run = M.start(cfg, "name")             process group, data, model config, device
#   ... build the model, split it, make the optimizer ...
#   M.restore(run, entries, optimizer)     resume from a checkpoint if --resume says so
#   for it in range(run.start_iter, cfg.max_iters):
#       M.begin_iter(run, it, evaluate)    validation when due, learning rate, clock
#       ... the training step ...
#       M.end_iter(run, loss=..., ...)     per-rank stats by name, the log, a checkpoint when due
#   return M.finish(run)


@dataclass
class Run:
    """What a run carries between the skeleton's calls, made by start(); a strategy sets
    only `layout`."""
    cfg: SimpleNamespace          # the flags, checked
    strategy: str                 # "ddp", "fsdp", ...: written into checkpoints
    rank: int                     # this process in the world
    world: int
    local_rank: int               # this process on its machine (its GPU)
    device: torch.device
    config: GPTConfig             # the model's shape
    vocab_size: int               # the data's, before padding
    tokenizer: dict               # how sample.py reads the ids back: {"tokenizer": "char", "chars": ...} or {}
    train: np.ndarray             # the token splits, memory-mapped
    val: np.ndarray
    autocast: object              # the context every forward runs in (bf16 autocast, or nothing)
    peak: float = None            # the device's peak FLOP/s for MFU (None: unknown, no MFU)
    layout: dict = field(default_factory=dict)  # the strategy's split, for the checkpoint's manifest
    start_iter: int = 0           # restore(): the step a resumed run continues from
    entries: list = None          # restore(): what this rank holds, for save_checkpoint
    optimizer: object = None      # restore()
    log: object = None            # restore(): rank 0's Logger
    record: dict = None           # begin_iter(): this iteration's log record, being filled
    t0: object = None             # begin_iter(): the step's start on the device's clock
    trace: list = field(default_factory=list)  # --trace: this rank's trace events so far


def start(cfg, strategy, moe=False):
    """Check the flags and the data, start the process group, build the model's config,
    seed: every rank checks the same things before any message, so bad input stops them
    all at once. moe: whether the strategy trains a mixture of experts (--n_expert)."""
    delay_for_tests()
    check_flags(cfg)
    check_moe(cfg, strategy, moe)
    train, val, vocab_size = load_data(cfg.data_dir)
    # how to read the ids back into text, for sample.py: kept in every checkpoint's manifest
    tokenizer = {k: v for k, v in read_meta(os.path.join(cfg.data_dir, "meta.json")).items() if k in ("tokenizer", "chars")}
    config = make_config(cfg.model, vocab_size, cfg.block_size, cfg.dropout,
                         cfg.n_expert, cfg.top_k, cfg.capacity_factor, cfg.aux_loss_coef)
    cfg.block_size = config.block_size
    for split, data in (("train", train), ("val", val)):
        if len(data) < config.block_size + 1:
            die(f"{os.path.join(cfg.data_dir, split + '.bin')} has {len(data)} tokens, too few for "
                f"--block_size={config.block_size} (a window needs {config.block_size + 1})", scope="node")
    rank, world, local_rank, device = C.init_distributed(timeout_s=cfg.timeout_s)
    C.use(cfg.collectives)  # the one switch: every C.all_reduce(...) of the strategy files runs on the choice
    torch.manual_seed(cfg.seed)
    # TF32 rounds a float32 run's products to 10 bits of mantissa, and CUDA's embedding and
    # attention backwards add with atomics in any order: --deterministic turns both off, so
    # that float32 runs on a GPU compare as they do on a CPU.
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = not cfg.deterministic
    if cfg.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # read when cuBLAS starts: before any matmul
        torch.backends.cudnn.deterministic = True
        torch.use_deterministic_algorithms(True, warn_only=True)  # an op with no such kernel warns, naming itself
    autocast = nullcontext() if cfg.dtype == "float32" else torch.autocast(device.type, dtype=torch.bfloat16)
    return Run(cfg=cfg, strategy=strategy, rank=rank, world=world, local_rank=local_rank, device=device,
               config=config, vocab_size=vocab_size, tokenizer=tokenizer, train=train, val=val, autocast=autocast,
               peak=peak_flops(device, cfg.peak_flops, cfg.dtype))


def begin_iter(run, it, evaluate):
    """Validation when due (before the step, as nanoGPT does), the learning rate, a fresh
    byte counter, and the clocks: the wall's, and this process's CPU time (cpu_ms: ranks
    whose CPU time fills their cores' wall time are bound by the host)."""
    cfg = run.cfg
    delay_for_tests(it)
    run.record = {"iter": it}
    if cfg.eval_interval and (it % cfg.eval_interval == 0 or it == cfg.max_iters - 1):
        run.record["val_loss"] = evaluate()
    run.record["lr"] = get_lr(it, cfg)
    set_lr(run.optimizer, run.record["lr"])
    C.reset_bytes()
    if cfg.trace and it in cfg.trace_range:
        trace_begin(run, counting=it == cfg.trace_range[0])
    run.cpu0 = time.process_time()  # all of this process's threads, gloo's too
    run.t0 = now(run.device)


def end_iter(run, loss, state_bytes, grad_norm=0.0, loss_ranks=None, axes=None, **per_rank):
    """Stop the clock, save a checkpoint when due, gather every rank's numbers by name to
    rank 0 and log them. loss: this rank's; the logged loss is its mean over loss_ranks
    (default: all; a pipeline passes its last stage). axes: name -> group, to log the bytes
    sent on each. per_rank: any other number, logged as a list by rank."""
    cfg, it = run.cfg, run.record["iter"]
    dt = elapsed(run.t0, now(run.device))
    stats = dict(loss=float(loss), comm_bytes=C.bytes_sent(), state_bytes=state_bytes,
                 cpu_ms=1000 * (time.process_time() - run.cpu0), **per_rank)
    for name, group in (axes or {}).items():
        stats[f"comm_bytes_{name}"] = C.bytes_sent(group)
    if run.device.type == "cuda":
        stats["peak_bytes"] = torch.cuda.max_memory_allocated(run.device)
    if _tracer is not None:
        trace_end(run, it)
    if checkpoint_due(cfg, it + 1):
        stats["ckpt_ms"], stats["ckpt_bytes"] = save_checkpoint(run, it + 1)
    rows = C.gather_stats(stats)  # name -> one value per rank, on rank 0
    if run.rank == 0:
        tokens = cfg.batch_size * cfg.block_size
        losses = [rows["loss"][r] for r in (loss_ranks if loss_ranks is not None else range(run.world))]
        flops = flops_per_token(run.config, active_params(run.config)) * tokens
        run.record.update(loss=sum(losses) / len(losses), grad_norm=float(grad_norm), dt_ms=1000 * dt,
                          tokens_per_s=tokens / dt, mfu=flops / dt / (run.world * run.peak) if run.peak else None)
        for name, values in rows.items():
            if name != "loss":
                run.record[name] = [int(v) if name.endswith("bytes") or float(v).is_integer() else v for v in values]
    run.log(run.record)
    if cfg.trace and it == min(cfg.trace_range[-1], cfg.max_iters - 1):
        write_trace(run)


def finish(run):
    """After the loop: the final state_dict if --save_path asks for it, and the process
    group torn down. -> the log records (rank 0; empty elsewhere)."""
    if run.cfg.save_path:
        save_full_state(run, run.cfg.save_path)
    C.shutdown()
    C.use("hand")  # a process that runs again (the tests' pool) starts from the default
    return run.log.records


def moe_log(run, model, count_experts=True):
    """The step's mixture-of-experts numbers as end_iter keywords ({} for a dense model):
    aux_loss (mean over layers and micro-steps), dropped_tokens (summed over layers) and what
    a strategy's layers count besides; and into rank 0's record expert_tokens, the choices
    each expert took from all ranks (count_experts=False: not this rank's, where another rank
    routed the same tokens). Every rank calls it."""
    total = {}
    for m in moe_layers(model):
        for name, v in m.tally.items():
            total[name] = total.get(name, 0) + v
        m.tally = {}
    if not total:
        return {}
    per_expert, forwards = (total.pop("expert_tokens") * count_experts).tolist(), total.pop("forwards")
    rows = C.gather_stats({f"expert_{e}": n for e, n in enumerate(per_expert)})
    if rows is not None:
        run.record["expert_tokens"] = [int(sum(rows[f"expert_{e}"])) for e in range(len(per_expert))]
    total["aux_loss"] = total["aux_loss"] / forwards
    return {name: float(v) for name, v in total.items()}


now = C._stamp  # now(device): a point on its timeline, a CUDA event (the CPU does not wait) or the CPU's clock


def elapsed(t0, t1):
    """Seconds between two points from now(); on a GPU this waits for t1 to happen."""
    if isinstance(t1, float):
        return t1 - t0
    t1.synchronize()
    return t0.elapsed_time(t1) / 1000


def main_guard(main):
    """A strategy's command-line entry: a communication timeout or Ctrl-C ends the job
    with one line, not a traceback from every rank."""
    rank = int(os.environ.get("RANK", "0"))
    try:
        main()
    except KeyboardInterrupt:
        if rank == 0:
            print("interrupted" + (f"; the last checkpoint is {_last_saved}" if _last_saved else ""),
                  file=sys.stderr, flush=True)
        report_divergence(wait_s=3)  # every rank is stopping: a short wait for the others' records
        os._exit(130)  # now: the other ranks are going too, so no collective may run at exit
    except C.CommError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        report_divergence()
        os._exit(1)


def report_divergence(wait_s=None):
    """The ranks that can still talk compare their last collectives (collectives.diagnose);
    the lowest of them prints the one line saying which rank is behind where."""
    try:
        line, answered = C.diagnose(wait_s)
    except Exception as e:  # the store itself gone: the job is ending anyway
        line, answered = f"(no comparison: {type(e).__name__}: {e})", [C.get_rank()]
    if line and C.get_rank() == min(answered):
        print(f"diagnosis: {line}", file=sys.stderr, flush=True)
    elif line and "TORCHELASTIC_RUN_ID" in os.environ:
        time.sleep(2)  # the first rank out ends the job: let the one that prints get there first (see die)


class Logger:
    """Rank 0's log: a printed line per log_interval steps, as nanoGPT's, and a JSON record
    per step in --log_file. A resumed run keeps the records before the step it resumes from."""

    def __init__(self, cfg, rank, start_iter=0):
        self.active, self.path, self.every = rank == 0, cfg.log_file, cfg.log_interval
        self.records = []
        if self.active and self.path:
            kept = []
            if start_iter and os.path.exists(self.path):
                with open(self.path) as f:
                    kept = [line for line in f if line.strip() and json.loads(line).get("iter", 0) < start_iter]
            with open(self.path, "w") as f:
                f.writelines(kept)

    def __call__(self, r):
        if not self.active:
            return
        self.records.append(r)
        if self.path:
            with open(self.path, "a") as f:
                f.write(json.dumps(r) + "\n")
        if self.every and (r["iter"] % self.every == 0 or "val_loss" in r):  # and the last validation
            print(f"iter {r['iter']}: loss {r['loss']:.4f}" + (f", val {r['val_loss']:.4f}" if "val_loss" in r else "")
                  + f", time {r['dt_ms']:.1f}ms, {r['tokens_per_s']:,.0f} tok/s"
                  + (f", mfu {100 * r['mfu']:.1f}%" if r.get("mfu") is not None else "")
                  + f", sent {max(r['comm_bytes']) / 1e6:.2f} MB/rank"
                  + (f", saved step_{r['iter'] + 1:06d} ({max(r['ckpt_bytes']) / 1e6:.1f} MB/rank, "
                     f"{max(r['ckpt_ms']):.0f} ms)" if "ckpt_ms" in r else ""), flush=True)


# -----------------------------------------------------------------------------
# the trace: --trace=FILE records the steps --trace_steps of every rank as one Chrome trace
# (ui.perfetto.dev): a process per rank, compute and waits on one row, asynchronous
# communication on a second. Strategies mark compute with `with M.span(name):` and name
# messages with span(name, comm=True); collectives.py traces every op. Each compute span
# carries this rank's counts at its ends ("at", "upto": [stamp number, FLOPs, ops, bytes the
# ops read and wrote], counted in the first traced step only): the work bench/trace_replay.py replays.

_tracer = None  # while a traced step runs: (its compute spans, the device, the clock's base, the _Count)

# The CPU's attention kernels are not in torch's FLOP registry: registered as its CUDA ones count
# (q, k, v; the backward's grad first), once however many copies of this file are imported.
for _op, _formula, _n in ((torch.ops.aten._scaled_dot_product_flash_attention_for_cpu, flop_counter.sdpa_flop_count, 3),
                          (torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward,
                           flop_counter.sdpa_backward_flop_count, 4)):
    if _op not in flop_counter.flop_registry:
        flop_counter.register_flop_formula(_op)(lambda *shapes, out_shape=None, f=_formula, n=_n, **kw: f(*shapes[:n]))


class _Count(TorchDispatchMode):
    """The ops this thread dispatches, their FLOPs (as torch's flop counter counts them) and the
    bytes of their tensors; thread-local, so the collectives' workers are not counted. Called: a
    stamp [its number, FLOPs, ops, bytes so far]. Counting costs a Python call an op, so only the
    first traced step counts (its program is every step's); the others stamp [number, None, ...]."""
    def __init__(self, counting):
        super().__init__()
        self.seq = self.flops = self.ops = self.bytes = 0
        self.counting = counting

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.ops += 1
        packet = func._overloadpacket
        if packet in flop_counter.flop_registry:
            self.flops += flop_counter.flop_registry[packet](*args, **kwargs, out_val=out)
        if not func.is_view:  # what it reads and writes: an elementwise op's time follows it, not FLOPs
            self.bytes += sum(t.nbytes for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor))
        return out

    def __call__(self):
        self.seq += 1
        return [self.seq, self.flops, self.ops, self.bytes] if self.counting else [self.seq, None, None, None]


_NO_SPAN = nullcontext()


def span(name, comm=False):
    """with M.span("backward"): a compute span on this rank's row of the trace. comm=True: no
    span of its own; the communication issued inside is traced under `name`."""
    if _tracer is None:
        return _NO_SPAN
    return C.labelled(name) if comm else _compute_span(name)


@contextmanager
def _compute_span(name):
    spans, device, _, count = _tracer
    s = dict(name=name, cat="compute", row="main", t0=now(device), bytes=0, at=count())
    spans.append(s)
    try:
        yield
    finally:
        s["t1"], s["upto"] = now(device), count()


def span_between(name, t0, t1):
    """A span from two stamps already read with now(), for an interval the log reports too."""
    if _tracer is not None:
        _tracer[0].append(dict(name=name, cat="interval", row="main", t0=t0, t1=t1, bytes=0))


def trace_range(text):
    a, dash, b = text.partition("-")
    try:
        steps = range(int(a), int(b if dash else a) + 1)
    except ValueError:
        steps = range(0)
    if not steps or steps[0] < 0:
        die(f"--trace_steps takes A-B (inclusive, A <= B) or one iteration, not {text!r}")
    return steps


def trace_begin(run, counting=True):
    global _tracer
    base = None
    if run.device.type == "cuda":  # one point known on both clocks: the host's now and an event
        torch.cuda.synchronize(run.device)
        base = (time.perf_counter(), now(run.device))
    count = _Count(counting and not run.cfg.compile)  # compiled kernels bypass the dispatcher: no counts
    if count.counting:
        count.__enter__()
    _tracer = ([], run.device, base, count)
    C.trace_on(count)


def trace_end(run, it):
    """The step's spans (compute and communication) -> Chrome trace events in run.trace."""
    global _tracer
    comm = C.trace_off()
    spans, device, base, count = _tracer
    _tracer = None
    if count.counting:
        count.__exit__(None, None, None)
    end = count()
    step_end = now(device)  # before the synchronize, so that every event read below has completed
    if device.type == "cuda":
        torch.cuda.synchronize(device)

    def us(t):  # a stamp from now() -> microseconds on the host's clock
        return 1e6 * (t if isinstance(t, float) else base[0] + base[1].elapsed_time(t) / 1000)

    spans = [dict(name=f"step {it}", cat="step", row="main", t0=run.t0, t1=step_end, bytes=0,
                  at=[0, 0, 0, 0] if count.counting else [0, None, None, None], upto=end)] + spans + comm
    for s in spans:
        ts = us(s["t0"])
        args = dict(step=it)
        if s["cat"] in ("comm", "wait"):
            args.update(op=s["op"], group=s["ranks"], peers=sorted(s["peers"]), bytes=s["bytes"])
            if s.get("posted") is not None:
                args["posted_us"] = round(us(s["posted"]), 3)
            args.update(to=s["to"], frm=s["frm"])  # {peer: [messages, bytes]} each way
            if s.get("of") is not None:
                args["of"] = s["of"]  # a wait: the stamp number of the op it waits for
        if s.get("at") is not None:
            args["at"] = s["at"]
            if s.get("upto") is not None and s["row"] == "main":
                args["upto"] = s["upto"]
                if s["cat"] == "compute" and count.counting:
                    args["flops"] = s["upto"][1] - s["at"][1]
        run.trace.append(dict(name=s["name"], cat=s["cat"], ph="X", ts=round(ts, 3),
                              dur=round(max(0.0, us(s["t1"]) - ts), 3), pid=run.rank,
                              tid=1 if s["row"] == "comm" else 0, args=args))


def write_trace(run):
    """Every rank's events to rank 0 (one gather, padded to the longest), which writes the file."""
    data = json.dumps(run.trace).encode()
    size = torch.tensor([len(data)], device=run.device)
    with C.untracked():
        C.all_reduce(size, op="max")
        mine = torch.zeros(int(size.item()), dtype=torch.uint8, device=run.device)
        mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        every = torch.empty(run.world * mine.numel(), dtype=torch.uint8, device=run.device) if run.rank == 0 else None
        C.gather(every, mine, dst=0)
    run.trace = []
    if run.rank != 0:
        return
    events = []
    for r, row in enumerate(every.view(run.world, -1).cpu()):
        events += json.loads(row.numpy().tobytes().rstrip(b"\0").decode())
        events += [dict(name="process_name", ph="M", pid=r, args=dict(name=f"rank {r}")),
                   dict(name="process_sort_index", ph="M", pid=r, args=dict(sort_index=r)),
                   dict(name="thread_name", ph="M", pid=r, tid=0, args=dict(name="compute and waits")),
                   dict(name="thread_name", ph="M", pid=r, tid=1, args=dict(name="communication (async)"))]
    start = min((e["ts"] for e in events if "ts" in e), default=0.0)
    for e in events:
        if "ts" in e:
            e["ts"] = round(e["ts"] - start, 3)
            if "posted_us" in e["args"]:
                e["args"]["posted_us"] = round(e["args"]["posted_us"] - start, 3)
    tmp = run.cfg.trace + ".tmp"  # written, then renamed: a reader never sees half a trace
    with open(tmp, "w") as f:
        json.dump(dict(traceEvents=events, displayTimeUnit="ms",
                       otherData=dict(strategy=run.strategy, world=run.world, steps=list(run.cfg.trace_range),
                                      model=asdict(run.config), batch_size=run.cfg.batch_size,
                                      dtype=run.cfg.dtype, device=run.device.type)), f)
    os.replace(tmp, run.cfg.trace)
    print(f"trace: {run.cfg.trace} ({len(events)} events, steps {run.cfg.trace_steps}; open it in ui.perfetto.dev)",
          flush=True)


# -----------------------------------------------------------------------------
# checkpoints: every rank saves what it holds, any layout loads any other
#
# A strategy describes what it holds as entries (name, param, index, write): `param` is a
# tensor the optimizer updates, holding the part `index` of the global tensor `name` (a
# name of GPT(config).named_parameters()):
#   None                 the whole tensor
#   (dim, start, stop)   global.narrow(dim, start, stop - start)
#   [(dim, a, b), ...]   those slices of one dim, concatenated (tensor parallel's q|k|v)
#   ("flat", start, stop) global.view(-1)[start:stop], in any shape (FSDP's shards)
# and `write` whether this rank saves it (a replica is saved once); Adam's moments travel
# with their parameter. The folder's format: docs/checkpoints_and_faults.md.

MOMENTS = ("exp_avg", "exp_avg_sq")
_last_saved = ""
CKPT_WAIT_S = 3600  # the checkpoint's barriers wait on disks (writing, hashing), not on the wire


def checkpoint_due(cfg, step):
    return bool(cfg.out_dir) and ((cfg.ckpt_interval and step % cfg.ckpt_interval == 0) or step == cfg.max_iters)


def global_shapes(config):
    with torch.device("meta"):
        return {n: list(p.shape) for n, p in GPT(config).named_parameters()}


def _regions(index, param):
    """[(global index of one piece, function: param-shaped tensor -> that piece's view)]."""
    if isinstance(index, list):
        dim, out, offset = index[0][0], [], 0
        for d, a, b in index:
            out.append(((d, a, b), lambda t, o=offset, n=b - a: t.narrow(dim, o, n)))
            offset += b - a
        return out
    return [(tuple(index) if index is not None else None, lambda t: t)]


def _cut(full, index):
    if index is None:
        return full
    if index[0] == "flat":
        return full.reshape(-1)[index[1]:index[2]]
    dim, a, b = index
    return full.narrow(dim, a, b - a)


def save_checkpoint(run, step, folder=None):
    """Every rank writes its pieces into one folder; rank 0 writes the manifest and renames
    the folder into place. -> (milliseconds, bytes this rank wrote)."""
    global _last_saved
    t0 = time.perf_counter()
    final = folder or os.path.join(run.cfg.out_dir, f"step_{step:06d}")
    tmp = final + ".tmp"
    if run.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # the leftover of a crash
        os.makedirs(tmp)
    C.barrier(timeout_s=max(CKPT_WAIT_S, run.cfg.timeout_s))  # (a barrier is never counted)
    tensors, pieces = {}, []
    for name, param, index, write in run.entries:
        if not write:
            continue
        state = run.optimizer.state.get(param, {})
        for kind, t in [("param", param)] + [(m, state[m]) for m in MOMENTS if m in state]:
            for where, view in _regions(index, param):
                key = f"{kind}/{name}/{len(pieces)}"
                tensors[key] = view(t.detach()).float().cpu().clone()
                pieces.append(dict(key=key, kind=kind, name=name, index=where))
    path = os.path.join(tmp, f"rank{run.rank:05d}.pt")
    torch.save(tensors, path + ".part")
    os.replace(path + ".part", path)
    info = dict(file=os.path.basename(path), bytes=os.path.getsize(path), sha256=sha256(path), pieces=pieces)
    with open(path + ".json", "w") as f:
        json.dump(info, f)
    C.barrier(timeout_s=max(CKPT_WAIT_S, run.cfg.timeout_s))  # every rank's file is complete
    if run.rank == 0:
        files = []
        for r in range(run.world):
            with open(os.path.join(tmp, f"rank{r:05d}.pt.json")) as f:
                files.append(json.load(f))
            os.remove(os.path.join(tmp, f"rank{r:05d}.pt.json"))
        manifest = dict(format=1, strategy=run.strategy, world=run.world, layout=run.layout, step=step,
                        model=asdict(run.config), vocab_size=run.vocab_size, tokenizer=run.tokenizer,
                        shapes=global_shapes(run.config), files=files)
        with open(os.path.join(tmp, "manifest.json"), "w") as f:
            json.dump(manifest, f, indent=1)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        if folder is None:
            done = checkpoints(run.cfg.out_dir)  # the oldest beyond --keep_ckpts go
            for old in done[:max(0, len(done) - max(run.cfg.keep_ckpts, 1))]:
                shutil.rmtree(old, ignore_errors=True)
    _last_saved = final
    return 1000 * (time.perf_counter() - t0), info["bytes"]


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def checkpoints(out_dir):
    """The complete checkpoints in out_dir, oldest first."""
    if not os.path.isdir(out_dir):
        return []
    names = sorted(n for n in os.listdir(out_dir) if re.fullmatch(r"step_\d{6,}", n))
    return [os.path.join(out_dir, n) for n in names if os.path.exists(os.path.join(out_dir, n, "manifest.json"))]


def read_manifest(folder, config=None):
    """The manifest, after checking that it is one, that it was written for this model, and
    that every file it names is there with its size."""
    path = os.path.join(folder, "manifest.json")
    try:
        with open(path) as f:
            manifest = json.load(f)
        files, step, model = manifest["files"], int(manifest["step"]), manifest["model"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        die(f"{folder} is not a complete checkpoint: cannot read {path} ({e})", scope="node")
    if config is not None:
        mine = {k: v for k, v in asdict(config).items() if k != "dropout"}
        defaults = asdict(GPTConfig())  # a field the writer did not have yet took its default then
        theirs = {k: model.get(k, defaults[k]) for k in mine}
        if mine != theirs:
            diff = ", ".join(f"{k}={theirs[k]} (this run: {mine[k]})" for k in mine if mine[k] != theirs[k])
            die(f"{folder} was written for another model: {diff}", scope="node")
    for f in files:
        p = os.path.join(folder, f["file"])
        if not os.path.exists(p) or os.path.getsize(p) != f["bytes"]:
            die(f"{p} is missing or truncated ({os.path.getsize(p) if os.path.exists(p) else 0} bytes, "
                f"the manifest says {f['bytes']})", scope="node")
    return manifest


class CheckpointReader:
    """The global tensors of a checkpoint, read piece by piece from the rank files (memory-
    mapped, each checked against its sha256 when first opened): a stored piece that is
    exactly the slice asked for directly, else the whole tensor assembled (one at a time) and cut."""

    def __init__(self, folder, manifest):
        self.folder, self.manifest, self.opened, self.cached = folder, manifest, {}, (None, None)
        self.where = {}  # (kind, name) -> [(file, key, index)]
        for f in manifest["files"]:
            for p in f["pieces"]:
                index = p["index"] if p["index"] is None else tuple(p["index"])
                self.where.setdefault((p["kind"], p["name"]), []).append((f, p["key"], index))

    def _file(self, f):
        if f["file"] not in self.opened:
            path = os.path.join(self.folder, f["file"])
            if sha256(path) != f["sha256"]:
                die(f"{path} does not match its checksum in manifest.json: the file is corrupt", scope="node")
            try:
                self.opened[f["file"]] = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except Exception as e:  # a corrupt file that still has the right checksum is a bug of ours
                die(f"cannot load {path}: {e}", scope="node")
        return self.opened[f["file"]]

    def has(self, kind, name):
        return (kind, name) in self.where

    def read(self, kind, name, index):
        pieces = self.where.get((kind, name))
        if not pieces:
            die(f"{self.folder} holds no {kind} of {name}", scope="node")
        for f, key, where in pieces:
            if where == index:  # the same layout: the piece as it was saved
                return self._file(f)[key]
        if self.cached[0] != (kind, name):
            full = torch.zeros(self.manifest["shapes"][name])
            covered = 0
            for f, key, where in pieces:
                _cut(full, where).copy_(self._file(f)[key].reshape(_cut(full, where).shape))
                covered += self._file(f)[key].numel()
            if covered < full.numel():
                die(f"{self.folder} holds only {covered} of the {full.numel()} elements of {name}", scope="node")
            self.cached = ((kind, name), full)
        return _cut(self.cached[1], index)


def restore(run, entries, optimizer):
    """Remember what this rank holds (for saving), and load it from the checkpoint --resume
    names, if any: parameters, Adam's moments and step count, and the step to continue from.
    The sampler draws by (seed, step): the resumed run sees the uninterrupted one's batches."""
    cfg = run.cfg
    run.entries, run.optimizer = entries, optimizer
    delay_for_tests("restore")
    folder = latest_checkpoint(run) if cfg.resume == "latest" else cfg.resume
    if folder:
        manifest = read_manifest(folder, run.config)
        reader = CheckpointReader(folder, manifest)
        step = manifest["step"]
        fused = run.device.type == "cuda"
        with torch.no_grad():
            for name, param, index, _ in entries:
                moments = {m: torch.zeros_like(param) for m in MOMENTS if reader.has(m, name)}
                for where, view in _regions(index, param):
                    view(param).copy_(reader.read("param", name, where).reshape(view(param).shape))
                    for m, t in moments.items():
                        view(t).copy_(reader.read(m, name, where).reshape(view(t).shape))
                if len(moments) == len(MOMENTS):  # Adam's state as AdamW itself keeps it after `step` steps
                    step_t = torch.tensor(float(step), device=param.device if fused else "cpu")
                    optimizer.state[param] = dict(step=step_t, **moments)
        run.start_iter = step
        if run.rank == 0:
            print(f"resumed from {folder} (step {step}, written by {manifest['strategy']} on {manifest['world']} "
                  f"ranks)", flush=True)
    run.log = Logger(cfg, run.rank, run.start_iter)


def latest_checkpoint(run):
    """The newest complete checkpoint in --out_dir ("" if none) as rank 0 sees it, broadcast:
    on a shared file system with caching, nodes can briefly list different newest folders."""
    done = checkpoints(run.cfg.out_dir)
    step = torch.tensor([int(os.path.basename(done[-1])[5:]) if done else -1], device=run.device)
    with C.untracked():
        C.broadcast(step, src=0)
    return os.path.join(run.cfg.out_dir, f"step_{int(step.item()):06d}") if step.item() >= 0 else ""


def load_full_state(folder):
    """A checkpoint as one model.GPT state_dict (the tied head included), on the CPU: for
    sample.py, and for --save_path."""
    manifest = read_manifest(folder)
    reader = CheckpointReader(folder, manifest)
    state = {name: reader.read("param", name, None).clone() for name in manifest["shapes"]}
    state["lm_head.weight"] = state["transformer.wte.weight"]
    return state, manifest


def save_full_state(run, path):
    """--save_path: write a checkpoint beside it, and rank 0 turns it into one file."""
    parts = path + ".parts"
    save_checkpoint(run, run.cfg.max_iters, folder=parts)
    if run.rank == 0:
        state, _ = load_full_state(parts)
        torch.save(state, path + ".tmp")
        os.replace(path + ".tmp", path)
        shutil.rmtree(parts, ignore_errors=True)


# -----------------------------------------------------------------------------
# memory accounting: what autograd keeps for backward (counted, and as a formula), and the
# state a rank holds; the strategies log it and the tests hold the formulas to the counts

def saved_bytes(params, skip=None, on=True):
    """-> (a context counting the bytes autograd keeps for backward, {storage: bytes}),
    parameters left out. skip: storages (data_ptr) not to count either, which the caller
    may grow as it goes (ZeRO-3's gathered weights)."""
    if not on:  # --compile (compiled graphs take no saved-tensor hooks), or a pass not counted: a no-op
        return nullcontext(), {}
    skip = set() if skip is None else skip
    skip.update(p.untyped_storage().data_ptr() for p in params)
    seen = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            seen[storage.data_ptr()] = storage.nbytes()
        return t
    return _counting(pack), seen


@contextmanager
def _counting(pack):
    global _count
    before, _count = _count, pack
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield
    finally:
        _count = before


def activation_bytes(config, tokens, mode="none", tp=1, sp=False, ring=False, dtype_bytes=4, layers=None):
    """The bytes autograd keeps for backward in `layers` blocks (default: all) on `tokens`
    tokens, as saved_bytes() counts them; per token per layer (docs/memory.md derives it), with
    h = n_embd, a = n_head, d = dtype_bytes, t = tp: none d·(4h + 12h/t) + 4a/t + 16 (sp:
    d·(2h + 14h/t) + (4a + 16)/t); gelu that - d·4h/t; full d·h (sp: d·h/t). ring: context
    parallel's ring keeps its output in (b, a, s, hs) order too: d·h more (none, gelu)."""
    h, a, d, t, n = config.n_embd, config.n_head, dtype_bytes, tp, tokens
    layers = config.n_layer if layers is None else layers
    if mode == "full":
        return layers * n * d * h // (t if sp else 1)
    split = (12 * h if mode == "none" else 8 * h) + (h if ring else 0)  # what tp splits: heads, MLP columns
    if sp:  # LayerNorms' inputs and statistics split too; c_attn's and c_fc's inputs whole
        return layers * (n * d * 2 * h + (n * d * (split + 2 * h) + n * (4 * a + 16)) // t)
    return layers * (n * d * 4 * h + (n * d * split + n * 4 * a) // t + n * 16)


def ends_bytes(config, tokens, seq, embed=True, head=True, dtype_bytes=4):
    """What autograd keeps for the model's two ends: the embedding its token and `seq`
    position ids (int64); the head ln_f's input and statistics, the matmul's input, the
    log-softmax's float32 output (V numbers a token: in small models the largest term), the
    target ids and the loss's 4-byte total weight."""
    h, d, V = config.n_embd, dtype_bytes, config.vocab_size
    return (8 * tokens + 8 * seq if embed else 0) + (tokens * (2 * d * h + 8 + 4 * V + 8) + 4 if head else 0)


def tensor_bytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors)


def optimizer_state_bytes(optimizer):
    """Adam's two moments (m and v); the per-tensor step counters are bookkeeping."""
    return tensor_bytes(v for s in optimizer.state.values() for k, v in s.items() if k != "step")
