"""
Our strategies against PyTorch's own, on the same model (model.GPT), data
(model.get_batch, each rank its rows), init (the seed), optimizer (model.make_optimizer,
model.get_lr, clipping at the global norm) and precision, in one run: for each pair the
two sides alternate (ours, PyTorch's, ours, ...), and it prints the loss gap at every
step and the ms/step ratio.

    python bench/strategies_vs_torch.py --world=2                      # 2 CPU ranks over gloo (2 GPUs over NCCL)
    python bench/strategies_vs_torch.py --world=2 --pairs=ddp,fsdp --iters=20 --repeats=3
    torchrun --nproc_per_node=2 bench/strategies_vs_torch.py --data_dir=data/shakespeare --model=small

  pair      ours                                PyTorch's
  ddp       ddp.py (--overlap=True)             torch.nn.parallel.DistributedDataParallel
  fsdp      fsdp.py (ZeRO-3, --prefetch=1)      FSDP2: fully_shard on each block, then the root
  tensor    tensor_parallel.py                  DTensor: parallelize_module, Colwise/RowwiseParallel,
                                                the vocabulary split (embedding and tied head) and loss_parallel
  pipeline  pipeline_parallel.py (1f1b)         torch.distributed.pipelining: PipelineStage, Schedule1F1B

Every flag not listed below is passed to both sides as model.py reads it (--model,
--batch_size, --block_size, --dtype, --seed, --lr, ...). Without --data_dir the data are
the tests' synthetic Markov chain (a 192-token vocabulary). The peers live here only:
nothing of them enters the strategy files. The gap is |our loss - PyTorch's| at each
step; the run exits non-zero if a pair's largest gap exceeds --tol.
"""
import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import ddp  # noqa: E402
import fsdp  # noqa: E402
import model as M  # noqa: E402
import pipeline_parallel  # noqa: E402
import tensor_parallel  # noqa: E402

PAIRS = dict(  # name: (our main, our extra flags, PyTorch's side, what it is)
    ddp=(ddp.main, ["--mode=overlap"], "peer_ddp", "DistributedDataParallel"),
    fsdp=(fsdp.main, ["--zero_stage=3", "--prefetch=1"], "peer_fsdp", "FSDP2 fully_shard"),
    tensor=(tensor_parallel.main, [], "peer_tensor", "DTensor parallelize_module"),
    pipeline=(pipeline_parallel.main, ["--schedule=1f1b", "--n_micro=4"], "peer_pipeline", "pipelining Schedule1F1B"),
)


# ----------------------------------------------------------------------------- the common run


def setup(cfg):
    """What model.start does for a strategy, minus the process group (already up)."""
    M.check_flags(cfg)
    train, val, vocab = M.load_data(cfg.data_dir)
    config = M.make_config(cfg.model, vocab, cfg.block_size, cfg.dropout)
    cfg.block_size = config.block_size
    torch.manual_seed(cfg.seed)
    local = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local) if dist.get_backend() == "nccl" else torch.device("cpu")
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if cfg.dtype == "bfloat16" else \
        torch.autocast(device.type, enabled=False)
    return SimpleNamespace(cfg=cfg, config=config, train=train, val=val, device=device, autocast=autocast,
                           rank=dist.get_rank(), world=dist.get_world_size())


def train_loop(run, step, optimizers):
    """The loop every peer shares: each step's learning rate, step(it) -> this rank's loss
    (a tensor), timed from the step's start to its loss on the host, as model.end_iter
    times ours. -> ([loss of each step on this rank], [seconds of each step])."""
    losses, times = [], []
    for it in range(run.cfg.max_iters):
        for opt in optimizers:
            M.set_lr(opt, M.get_lr(it, run.cfg))
        t0 = M.now(run.device)
        losses.append(float(step(it)))
        times.append(M.elapsed(t0, M.now(run.device)))
    return losses, times


def clip(sharded, whole, max_norm, copies=()):
    """Clip at the global norm: the squares of the shards (or stages) summed over the
    ranks, plus those of what every rank holds whole, counted once, as each of ours does;
    copies (a pipeline's second copy of the tied matrix) are scaled, not counted."""
    if not max_norm:
        return
    sq = torch.zeros((), device=(sharded + whole)[0].device)
    for g in sharded:
        sq += g.float().pow(2).sum()
    dist.all_reduce(sq)
    for g in whole:
        sq += g.float().pow(2).sum()
    coef = M.clip_coef(sq.sqrt(), max_norm)
    for g in sharded + whole + list(copies):
        g.mul_(coef)


def mesh(run):
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh(run.device.type, (run.world,))


# ----------------------------------------------------------------------------- PyTorch's side


def data_parallel_step(run, model, params, opt):
    """The step of a data-parallel peer: this rank's rows, backward (the peer's hooks
    communicate), clipping by the global norm, AdamW. -> step(it) -> the loss."""
    params = list(params)

    def step(it):
        opt.zero_grad(set_to_none=True)
        with run.autocast:
            _, loss = model(*M.batch(run, it, dp_rank=run.rank, dp_size=run.world))
        loss.backward()
        if run.cfg.grad_clip:
            torch.nn.utils.clip_grad_norm_(params, run.cfg.grad_clip)
        opt.step()
        return loss.detach()
    return step


def peer_ddp(run):
    """DistributedDataParallel: buckets of 25 MB all-reduced during backward, as ours."""
    from torch.nn.parallel import DistributedDataParallel
    cfg = run.cfg
    model = M.GPT(run.config, seed=cfg.seed).to(run.device)
    wrapped = DistributedDataParallel(model, device_ids=[run.device.index] if run.device.type == "cuda" else None,
                                      bucket_cap_mb=25)
    opt = M.make_optimizer(model.named_parameters(), cfg, run.device)
    return train_loop(run, data_parallel_step(run, wrapped, model.parameters(), opt), [opt]), "mean"


def peer_fsdp(run):
    """FSDP2: each block its own unit, the root (embeddings, final norm, the tied head) one
    more, resharded after forward (ZeRO-3); parameters, gradients and Adam's state are
    DTensors sharded on dim 0."""
    try:
        from torch.distributed.fsdp import fully_shard  # torch >= 2.6
    except ImportError:
        from torch.distributed._composable.fsdp import fully_shard
    cfg = run.cfg
    model = M.GPT(run.config, seed=cfg.seed).to(run.device)
    m = mesh(run)
    for block in model.transformer.h:
        fully_shard(block, mesh=m)
    fully_shard(model, mesh=m)
    opt = M.make_optimizer(model.named_parameters(), cfg, run.device)
    # clip_grad_norm_ over DTensor gradients: each shard's squares, one all-reduce
    return train_loop(run, data_parallel_step(run, model, model.parameters(), opt), [opt]), "mean"


class SplitQKV(nn.Module):
    """model.CausalSelfAttention with q, k and v as three linears (torchtitan's wq, wk,
    wv), the same weights: ColwiseParallel splits a linear's output columns evenly, and
    on the fused c_attn rank 0 would get q and half of k, not its own heads' q, k and v."""

    def __init__(self, attn):
        super().__init__()
        C = attn.c_proj.in_features
        self.q, self.k, self.v = (nn.Linear(C, C, bias=attn.c_attn.bias is not None) for _ in range(3))
        for i, lin in enumerate((self.q, self.k, self.v)):
            lin.weight.data.copy_(attn.c_attn.weight.data[i * C:(i + 1) * C])
            if lin.bias is not None:
                lin.bias.data.copy_(attn.c_attn.bias.data[i * C:(i + 1) * C])
        self.c_proj, self.head_dim, self.dropout = attn.c_proj, attn.head_dim, attn.dropout

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = (lin(x).view(B, T, -1, self.head_dim).transpose(1, 2) for lin in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        return F.dropout(self.c_proj(y.transpose(1, 2).reshape(B, T, -1)), self.dropout, self.training)


def peer_tensor(run):
    """DTensor tensor parallel, Megatron's split as torchtitan writes it: q, k, v and
    c_fc ColwiseParallel, the two c_proj RowwiseParallel (an all-reduce after each), the
    token embedding RowwiseParallel (split by vocabulary, the lookup's partial rows
    all-reduced), the tied head taking the same Shard(0) matrix, so its logits come out
    split by vocabulary, and loss_parallel's cross-entropy on those slices. LayerNorms
    and the position embedding stay plain tensors, replicated."""
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, loss_parallel, parallelize_module
    cfg, config = run.cfg, run.config
    model = M.GPT(config, seed=cfg.seed)
    for block in model.transformer.h:
        block.attn = SplitQKV(block.attn)
    model = model.to(run.device)
    m = mesh(run)
    for block in model.transformer.h:
        parallelize_module(block, m, {"attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(),
                                      "attn.v": ColwiseParallel(), "attn.c_proj": RowwiseParallel(),
                                      "mlp.c_fc": ColwiseParallel(), "mlp.c_proj": RowwiseParallel()})
    parallelize_module(model.transformer.wte, m, RowwiseParallel(input_layouts=Replicate()))
    model.lm_head.weight = model.transformer.wte.weight  # the tie, now to the sharded matrix
    t = model.transformer

    def forward(x, y):
        h = M.embed(t.wte, t.wpe, x)
        for block in t.h:
            h = block(h)
        h = DTensor.from_local(t.ln_f(h), m, [Replicate()])  # its gradient: the all-reduce of the head's partials
        logits = F.linear(h, t.wte.weight)  # (B, T, V/N) per rank: Shard(2)
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.reshape(-1))

    params = list(model.parameters())
    dt = [(n, p) for n, p in model.named_parameters() if isinstance(p, DTensor)]
    plain = [(n, p) for n, p in model.named_parameters() if not isinstance(p, DTensor)]
    # two optimizers, the same AdamW: a fused kernel takes a list of one kind of tensor
    opts = [M.make_optimizer(dt, cfg, run.device), M.make_optimizer(plain, cfg, run.device)]

    def step(it):
        for opt in opts:
            opt.zero_grad(set_to_none=True)
        x, y = M.batch(run, it)  # the whole batch on every rank
        with loss_parallel():
            with run.autocast:
                loss = forward(x, y)
            loss.backward()
        sharded = [p.grad.to_local() for p in params if isinstance(p.grad, DTensor)
                   and not all(pl.is_replicate() for pl in p.grad.placements)]
        whole = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params
                 if not (isinstance(p.grad, DTensor) and not all(pl.is_replicate() for pl in p.grad.placements))]
        clip(sharded, whole, cfg.grad_clip)
        for opt in opts:
            opt.step()
        loss = loss.detach()
        return loss.to_local() if isinstance(loss, DTensor) else loss
    return train_loop(run, step, opts), "rank0"


class PeerStage(nn.Module):
    """This rank's part of model.GPT for torch.distributed.pipelining: the same blocks as
    pipeline_parallel.stage_layers gives ours, the embeddings on the first stage, the final
    norm and a copy of the tied matrix on the last. Returns the activation, or the logits."""

    def __init__(self, full, stage, n_stages):
        super().__init__()
        self.first, self.last = stage == 0, stage == n_stages - 1
        layers = pipeline_parallel.stage_layers(full.config.n_layer, n_stages, stage)
        self.blocks = nn.ModuleList(full.transformer.h[i] for i in layers)
        if self.first:
            self.wte, self.wpe = full.transformer.wte, full.transformer.wpe
        if self.last:
            self.ln_f = full.transformer.ln_f
            self.head = self.wte.weight if self.first else nn.Parameter(full.transformer.wte.weight.detach().clone())

    def tied(self):
        return self.wte.weight if self.first else self.head if self.last else None

    def forward(self, x):
        if self.first:
            x = M.embed(self.wte, self.wpe, x)
        for block in self.blocks:
            x = block(x)
        return F.linear(self.ln_f(x), self.head) if self.last else x


def peer_pipeline(run):
    """torch.distributed.pipelining: one PipelineStage per rank and Schedule1F1B over
    --n_micro micro-batches (the loss of each micro-batch; the gradients scaled by 1/m,
    so the step's gradient is the global mean's, as ours). After the schedule, the two
    ends all-reduce the tied matrix's gradient (ours swap it) and the norm's squares are
    summed over the stages."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B
    cfg, n, me = run.cfg, run.world, run.rank
    stage = PeerStage(M.GPT(run.config, seed=cfg.seed), me, n).to(run.device)
    ends = dist.new_group([0, n - 1]) if n > 2 else None  # every rank creates it, in the same order
    V = run.config.vocab_size

    def loss_fn(logits, y):
        return F.cross_entropy(logits.float().view(-1, V), y.reshape(-1))
    schedule = Schedule1F1B(PipelineStage(stage, me, n, run.device), n_microbatches=cfg.n_micro, loss_fn=loss_fn)
    opt = M.make_optimizer(stage.named_parameters(), cfg, run.device)
    params = list(stage.parameters())

    def step(it):
        opt.zero_grad(set_to_none=True)
        x, y = M.batch(run, it)
        losses = []
        with run.autocast:
            if stage.first and stage.last:
                schedule.step(x, target=y, losses=losses)
            elif stage.first:
                schedule.step(x)
            elif stage.last:
                schedule.step(target=y, losses=losses)
            else:
                schedule.step()
        if n > 1 and stage.tied() is not None:
            dist.all_reduce(stage.tied().grad, group=ends)
        copy = stage.head if stage.last and not stage.first else None
        clip([p.grad for p in params if p is not copy], [], cfg.grad_clip, [copy.grad] if copy is not None else [])
        opt.step()
        return torch.stack(losses).mean().detach() if losses else torch.zeros(())
    return train_loop(run, step, [opt]), "last"


# ----------------------------------------------------------------------------- the comparison


def gaps(ours, theirs):
    """|ours - theirs| at each step; a missing step is an infinite gap."""
    if len(ours) != len(theirs):
        return [float("inf")]
    return [abs(a - b) for a, b in zip(ours, theirs)]


def peer_losses(run, losses, who):
    """The step's loss as our log reports it: the mean over the ranks (data parallel), rank
    0's (tensor parallel: every rank holds the same), or the last stage's (pipeline). On the
    run's device: an NCCL group has no CPU backend, and refuses a CPU tensor."""
    t = torch.tensor(losses, dtype=torch.float64, device=run.device)
    if who == "mean":
        dist.all_reduce(t)
        t /= run.world
    elif who == "last":
        dist.broadcast(t, src=run.world - 1)
    return t.tolist()


def compare(name, argv, repeats):
    ours_main, flags, peer, _ = PAIRS[name]
    ours_ms, theirs_ms, ours_loss, theirs_loss = [], [], None, None
    for _ in range(repeats):  # alternating, so that a busy machine slows both sides alike
        records = ours_main(argv + flags)
        cfg = M.parse_args(dict(M.TRAIN_DEFAULTS, n_micro=4), argv + [f for f in flags if f.startswith("--n_micro")])
        run = setup(cfg)
        (losses, times), who = globals()[peer](run)
        losses = peer_losses(run, losses, who)
        if run.rank == 0:
            ours_loss = [r["loss"] for r in records]
            ours_ms += [r["dt_ms"] for r in records[1:]]  # past the first step's warm-up
            theirs_loss, theirs_ms = losses, theirs_ms + [1000 * s for s in times[1:]]
        dist.barrier()
    if dist.get_rank():
        return None
    return dict(pair=name, gaps=gaps(ours_loss, theirs_loss), ours=ours_loss, theirs=theirs_loss,
                ours_ms=statistics.median(ours_ms), theirs_ms=statistics.median(theirs_ms))


def table(rows, world, tol):
    lines = [f"| pair | PyTorch's | max loss gap (step) | ms/step ours | ms/step PyTorch's | ratio |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['pair']} | {PAIRS[r['pair']][3]} | not run: {r['error']} | | | |")
            continue
        worst = max(range(len(r["gaps"])), key=lambda i: r["gaps"][i])
        lines.append(f"| {r['pair']} | {PAIRS[r['pair']][3]} | {r['gaps'][worst]:.1e} ({worst}) | "
                     f"{r['ours_ms']:.1f} | {r['theirs_ms']:.1f} | {r['ours_ms'] / r['theirs_ms']:.2f} |")
    return "\n".join(lines)


def launch(args, rest):
    """Not under torchrun: make the data if none were given, and start --world ranks."""
    data = []
    if not any(a.startswith("--data_dir") for a in rest):
        sys.path.insert(0, os.path.join(ROOT, "tests"))
        from conftest import make_dataset
        data = [f"--data_dir={make_dataset(tempfile.mkdtemp(prefix='vs_torch_'))}"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.world}",
           os.path.abspath(__file__), *sys.argv[1:], *data]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    try:
        return subprocess.run(cmd, env=env, timeout=args.timeout_s).returncode
    except subprocess.TimeoutExpired:
        print(f"error: strategies_vs_torch did not finish in {args.timeout_s}s", file=sys.stderr)
        return 1


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=2, help="ranks to start (ignored under torchrun)")
    p.add_argument("--pairs", default=",".join(PAIRS), help=f"some of {','.join(PAIRS)}")
    p.add_argument("--iters", type=int, default=6)
    p.add_argument("--repeats", type=int, default=2, help="times each side runs, alternating")
    p.add_argument("--tol", type=float, default=1e-4)
    p.add_argument("--timeout_s", type=int, default=1200)
    args, rest = p.parse_known_args()
    pairs = args.pairs.split(",")
    for name in pairs:
        if name not in PAIRS:
            sys.exit(f"error: --pairs: unknown pair {name!r}; choose from {', '.join(PAIRS)}")
    if "RANK" not in os.environ:
        sys.exit(launch(args, rest))
    argv = ["--model=tiny", "--batch_size=8", "--block_size=32", "--dtype=float32", "--warmup_iters=2",
            "--eval_interval=0", "--log_interval=0", f"--max_iters={args.iters}"] + rest
    cuda = torch.cuda.is_available() and not os.environ.get("VS_TORCH_CPU")
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    else:
        torch.set_num_threads(1)
    dist.init_process_group("nccl" if cuda else "gloo")
    rows = []
    for name in pairs:
        rows.append(compare(name, argv, args.repeats))
    if dist.get_rank() == 0:
        world = dist.get_world_size()
        print(f"strategies_vs_torch: {world} ranks over {dist.get_backend()}, torch {torch.__version__}, {' '.join(argv)}")
        for r in rows:
            print(f"{r['pair']:<8} gap at each step: " + " ".join(f"{g:.1e}" for g in r["gaps"]))
        print(table(rows, world, args.tol))
        bad = [r["pair"] for r in rows if max(r["gaps"]) > args.tol]
        print(f"strategies_vs_torch: {'every pair within' if not bad else 'beyond'} {args.tol} at every step"
              + (f": {', '.join(bad)}" if bad else ""))
    bad = dist.get_rank() == 0 and bool(bad)
    dist.barrier()
    dist.destroy_process_group()
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
