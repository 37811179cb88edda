"""
The one GPT that every strategy trains, and everything the strategies must share
for their runs to be comparable: the size presets, the seeded init (one unit at a
time, so a sharded strategy never has to build the whole model), the batch
sampler, the learning-rate schedule, the optimizer's decay groups, the FLOP count
and MFU, the command line and the log.

The model is GPT-2 as nanoGPT writes it: pre-LayerNorm blocks, GELU MLP, causal
self-attention through scaled_dot_product_attention (flash attention on a GPU),
learned positions, and the token embedding tied to the output head.
"""
import json
import math
import os
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, asdict
from types import SimpleNamespace

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

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


PRESETS = {
    # tests: layers, heads and the test batch divide by 2, 3 and 4, so every
    # strategy can split it at every world size the tests use
    "tiny": dict(n_layer=12, n_head=12, n_embd=96, block_size=64),
    # the CPU demo: small enough that two CPU processes show a falling loss in minutes
    "small": dict(n_layer=4, n_head=4, n_embd=128, block_size=128),
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768, block_size=1024),  # 124M
    "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024, block_size=1024),  # 350M
    "gpt2-large": dict(n_layer=36, n_head=20, n_embd=1280, block_size=1024),  # 774M
    "gpt2-xl": dict(n_layer=48, n_head=25, n_embd=1600, block_size=1024),  # 1558M
}


def pad_vocab(vocab_size, multiple=64):
    return (vocab_size + multiple - 1) // multiple * multiple


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
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        y = y.transpose(1, 2).reshape(B, T, -1)
        return F.dropout(self.c_proj(y), self.dropout, self.training)


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
        self.mlp = MLP(config)

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

    def forward(self, idx, targets=None):
        x = embed(self.transformer.wte, self.transformer.wpe, idx, self.config.dropout, self.training)
        for block in self.transformer.h:
            x = block(x)
        return head(self.transformer.ln_f, self.lm_head.weight, x, targets)


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
# init, one unit at a time
#
# The model is cut into units: "embed" (token and position embeddings), blocks
# 0..n_layer-1, and "ln_f". Each unit draws its weights from its own generator,
# seeded from (seed, unit), so any strategy can build any unit alone and get the
# same numbers the whole-model build gives: FSDP builds one block, keeps its shard,
# and drops the rest, and never holds the whole model.


def unit_generator(seed, unit):
    index = {"embed": 0, "ln_f": 1}.get(unit, None)
    index = index if index is not None else 2 + unit
    return torch.Generator().manual_seed(seed * 1_000_003 + index)


def build_unit(config, unit, seed):
    """One initialized unit on the CPU: an nn.Module (a Block, the final LayerNorm,
    or a ModuleDict with wte and wpe)."""
    with torch.device("meta"):  # skip PyTorch's default init: we draw our own below
        if unit == "embed":
            m = nn.ModuleDict(dict(wte=nn.Embedding(config.vocab_size, config.n_embd),
                                   wpe=nn.Embedding(config.block_size, config.n_embd)))
        elif unit == "ln_f":
            m = nn.LayerNorm(config.n_embd, bias=config.bias)
        else:
            m = Block(config)
    m = m.to_empty(device="cpu")
    g = unit_generator(seed, unit)
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


def make_config(name, vocab_size=50257, block_size=0, dropout=0.0):
    if name not in PRESETS:
        die(f"unknown --model {name!r}; choose one of {', '.join(PRESETS)}")
    cfg = dict(PRESETS[name], vocab_size=pad_vocab(vocab_size), dropout=dropout)
    if block_size:
        cfg["block_size"] = block_size
    return GPTConfig(**cfg)


def num_params(params):
    """Counts each tensor once, so a tied matrix is not counted twice."""
    return sum(p.numel() for p in {id(p): p for p in params}.values())


def param_count(config):
    """The same count from the shapes alone, without building anything (the tied
    matrix once): per block 12·C² weights plus 13·C biases and norms."""
    C = config.n_embd
    per_block = 12 * C * C + (13 * C if config.bias else 2 * C)  # without biases: the two norms' weights
    ln_f = 2 * C if config.bias else C
    return (config.vocab_size + config.block_size) * C + config.n_layer * per_block + ln_f


def tensor_bytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors)


def optimizer_state_bytes(optimizer):
    """Adam's two moments (m and v); the per-tensor step counters are bookkeeping."""
    return tensor_bytes(v for s in optimizer.state.values() for k, v in s.items() if k != "step")


# -----------------------------------------------------------------------------
# data: nanoGPT's uint16 token files and the one sampler every strategy uses


def load_data(data_dir):
    """(train tokens, val tokens, vocab size). The arrays are memory-mapped."""
    paths = [os.path.join(data_dir, f"{s}.bin") for s in ("train", "val")]
    for p in paths:
        if not os.path.exists(p):
            die(f"no {p}: run `python data/prepare.py` first, or pass --data_dir=FOLDER with train.bin and val.bin")
    vocab_size = 50257  # GPT-2's, unless a metadata file says otherwise
    meta = os.path.join(data_dir, "meta.json")
    if os.path.exists(meta):
        with open(meta) as f:
            vocab_size = json.load(f).get("vocab_size", vocab_size)
    train, val = (np.memmap(p, dtype=np.uint16, mode="r") for p in paths)
    return train, val, vocab_size


def get_batch(data, seed, step, batch_size, block_size, rows=None, split="train"):
    """The global batch of `step`: batch_size random windows of the token stream,
    drawn from a generator seeded by (seed, step, split), so every process, whatever
    the strategy or world size, sees the same rows. `rows` (a slice) returns only
    part of it, e.g. a data parallel rank's share."""
    if len(data) <= block_size + 1:
        die(f"the data has {len(data)} tokens, too few for --block_size={block_size}")
    rng = np.random.default_rng([seed, step, 0 if split == "train" else 1])
    ix = rng.integers(0, len(data) - block_size - 1, size=batch_size)
    ix = ix[rows] if rows is not None else ix
    x = torch.from_numpy(np.stack([data[i:i + block_size] for i in ix]).astype(np.int64))
    y = torch.from_numpy(np.stack([data[i + 1:i + 1 + block_size] for i in ix]).astype(np.int64))
    return x, y


# -----------------------------------------------------------------------------
# the optimizer run


def get_lr(it, cfg):
    """Linear warmup, then cosine decay to min_lr at max_iters."""
    if it < cfg.warmup_iters:
        return cfg.lr * (it + 1) / (cfg.warmup_iters + 1)
    if it >= cfg.max_iters:
        return cfg.min_lr
    ratio = (it - cfg.warmup_iters) / max(1, cfg.max_iters - cfg.warmup_iters)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (cfg.lr - cfg.min_lr)


def decays(name, p):
    """nanoGPT's rule: weight matrices and embeddings decay; biases and norms don't."""
    return p.dim() >= 2


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
    """What to scale the gradients by so their global norm is at most max_norm (as
    torch.nn.utils.clip_grad_norm_ computes it). Each strategy finds the global
    norm its own way (summing squared norms of shards, counting replicas once)."""
    if max_norm <= 0:
        return 1.0
    return min(1.0, max_norm / (float(total_norm) + 1e-6))


# -----------------------------------------------------------------------------
# FLOPs and MFU


def flops_per_token(config, n_params):
    """6N for the matmuls' forward and backward, plus 12·L·H·Q·T for attention's
    scores and weighted sum (the PaLM appendix form nanoGPT uses). N excludes the
    position embedding, which is a lookup, not a matmul."""
    N = n_params - config.block_size * config.n_embd
    L, H, Q, T = config.n_layer, config.n_head, config.n_embd // config.n_head, config.block_size
    return 6 * N + 12 * L * H * Q * T


# dense bf16 peaks from the vendors' data sheets, matched against the device's name
PEAK_FLOPS = [("H200", 989e12), ("H100", 989e12), ("GH200", 989e12), ("B200", 2250e12), ("A100", 312e12),
              ("A10G", 125e12), ("L40S", 362e12), ("L4", 121e12), ("RTX 4090", 165e12),
              ("RTX 3090", 71e12), ("V100", 125e12), ("T4", 65e12)]


def peak_flops(device, override=0.0):
    """The device's peak FLOP/s from its name, or the override; None when unknown
    (a CPU), in which case MFU is not reported."""
    if override:
        return override
    if torch.device(device).type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((f for key, f in PEAK_FLOPS if key in name), None)


# -----------------------------------------------------------------------------
# the command line: the flags every strategy accepts; each adds its own

TRAIN_DEFAULTS = dict(
    model="small",          # size preset, see PRESETS
    data_dir=os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "shakespeare"),
    batch_size=12,          # global sequences per optimizer step, across all ranks
    block_size=0,           # tokens per sequence; 0 takes the preset's
    max_iters=150,
    lr=1e-3,
    min_lr=1e-4,
    warmup_iters=20,
    weight_decay=0.1,
    beta1=0.9,
    beta2=0.95,
    grad_clip=1.0,          # 0 disables clipping
    eval_interval=50,       # 0 disables validation
    eval_iters=10,
    seed=1337,
    dropout=0.0,
    dtype="auto",           # float32 | bfloat16 | auto (bfloat16 on a GPU that has it, else float32)
    compile=False,
    log_file="",            # JSON lines, one per iteration, written by rank 0
    log_interval=1,         # print every this many iterations (the JSON log gets every one)
    save_path="",           # where rank 0 saves the final full state_dict (torch.save), if set
    peak_flops=0.0,         # overrides the device's peak for MFU
)


def die(msg, code=2):
    """Bad input ends the run with one line on stderr and a non-zero exit. Every rank
    checks the same things before any communication, so every rank exits; only
    rank 0 prints, so torchrun shows the line once."""
    if os.environ.get("RANK", "0") == "0":
        print(f"error: {msg}", file=sys.stderr, flush=True)
    sys.exit(code)


def parse_args(defaults, argv=None, doc=""):
    """--name=value or --name value for every key of `defaults`, typed like the default."""
    argv = sys.argv[1:] if argv is None else list(argv)
    cfg = dict(defaults)
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("-h", "--help"):
            print(doc.strip() + "\n\nflags (default):\n" + "\n".join(f"  --{k}={v}" for k, v in defaults.items()))
            sys.exit(0)
        if not arg.startswith("--"):
            die(f"unexpected argument {arg!r}; flags are --name=value")
        key, eq, val = arg[2:].partition("=")
        if not eq:
            if i + 1 >= len(argv) or argv[i + 1].startswith("--"):
                die(f"flag --{key} needs a value")
            i += 1
            val = argv[i]
        if key not in cfg:
            die(f"unknown flag --{key}; see --help")
        cfg[key] = _typed(key, val, defaults[key])
        i += 1
    return SimpleNamespace(**cfg)


def _typed(key, val, default):
    if isinstance(default, bool):
        if val.lower() in ("true", "1", "yes"):
            return True
        if val.lower() in ("false", "0", "no"):
            return False
        die(f"--{key} takes True or False, not {val!r}")
    try:
        return type(default)(val)
    except ValueError:
        die(f"--{key} takes a {type(default).__name__}, not {val!r}")


def setup_run(cfg, device):
    """Validate the common flags, seed, allow TF32, and return (model config,
    train data, val data, autocast context)."""
    if cfg.dtype == "auto":
        cfg.dtype = "bfloat16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "float32"
    if cfg.dtype not in ("float32", "bfloat16"):
        die(f"--dtype takes float32 or bfloat16, not {cfg.dtype!r}")
    for k in ("batch_size", "max_iters"):
        if getattr(cfg, k) <= 0:
            die(f"--{k} must be positive")
    train, val, vocab_size = load_data(cfg.data_dir)
    config = make_config(cfg.model, vocab_size, cfg.block_size, cfg.dropout)
    cfg.block_size = config.block_size
    torch.manual_seed(cfg.seed)
    torch.backends.cuda.matmul.allow_tf32 = True  # TF32 matmuls: ~free speed for float32 on Ampere+
    torch.backends.cudnn.allow_tf32 = True
    device_type = torch.device(device).type
    ctx = nullcontext() if cfg.dtype == "float32" else torch.autocast(device_type, dtype=torch.bfloat16)
    return config, train, val, ctx


class Logger:
    """Rank 0's log: one printed line per iteration in nanoGPT's manner, and one
    JSON record per iteration in --log_file (the file is started afresh)."""

    def __init__(self, cfg, rank):
        self.active, self.path, self.every = rank == 0, cfg.log_file, cfg.log_interval
        self.records = []
        if self.active and self.path:
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
            open(self.path, "w").close()

    def __call__(self, record):
        if not self.active:
            return
        self.records.append(record)
        if self.path:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")
        if self.every and record["iter"] % self.every == 0:
            line = f"iter {record['iter']}: loss {record['loss']:.4f}"
            if "val_loss" in record:
                line += f", val {record['val_loss']:.4f}"
            line += f", time {record['dt_ms']:.1f}ms, {record['tokens_per_s']:,.0f} tok/s"
            if record.get("mfu") is not None:
                line += f", mfu {100 * record['mfu']:.1f}%"
            line += f", sent {max(record['comm_bytes']) / 1e6:.2f} MB/rank"
            print(line, flush=True)


def timer(device):
    """time.time() that first waits for queued GPU work, so a step's time is real."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    return time.time()
