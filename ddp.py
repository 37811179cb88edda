"""
Data parallel training: every rank holds the whole model, takes its slice of the
global batch, and the gradients are averaged before the optimizer step.

    python ddp.py                                 # one process: the reference run
    torchrun --nproc_per_node=2 ddp.py            # two ranks (CPU processes over gloo, or GPUs over NCCL)
    torchrun --nproc_per_node=8 ddp.py --model=gpt2 --batch_size=64 --grad_accum=4

What it sends: one all-reduce of the gradients per optimizer step. A ring
all-reduce of S bytes makes every rank send 2(N-1)/N·S, so the traffic per rank
is about twice the model's gradient bytes whatever N is; what N changes is how
long it takes, and whether backward can hide it. --mode picks one of the three
stages of DDP, so the difference can be measured:

  naive     after backward, one all-reduce per parameter: many small messages,
            each paying the latency α, and none of them overlapping compute
  bucketed  gradients live in flat buckets of --bucket_mb, in reverse parameter
            order; after backward, one all-reduce per bucket: few large messages
  overlap   (default) each bucket's all-reduce starts asynchronously the moment
            its last gradient is ready, while backward goes on computing the
            gradients of earlier layers; the step waits for them at the end
"""
import torch

import collectives as C
import model as M

DEFAULTS = dict(M.TRAIN_DEFAULTS, mode="overlap", bucket_mb=25.0, grad_accum=1)


def traffic_per_rank(config, cfg, world):
    """Bytes a rank sends per optimizer step: one ring all-reduce of every gradient,
    2(N-1)/N of the gradient bytes (on average over ranks when chunks are uneven),
    whatever --grad_accum is, since the micro-steps before the last don't communicate."""
    return 2 * (world - 1) / world * 4 * M.param_count(config)


class GradBuckets:
    """The gradients of all parameters, packed into flat buffers ("buckets").

    Each parameter's .grad is a view into its bucket, so backward writes straight
    into the buffer that is all-reduced: no copy in, no copy out (PyTorch DDP's
    gradient_as_bucket_view). Parameters go into buckets in reverse order of
    registration, which is roughly the order backward produces their gradients,
    so the first bucket fills first and can be sent while backward still runs.
    """

    def __init__(self, params, bucket_mb, mode, world):
        self.mode = mode if world > 1 else "alone"  # one process: nothing to average, nothing to launch
        params = [p for p in params if p.requires_grad][::-1]
        cap = int(bucket_mb * 2**20)
        groups, size = [[]], 0
        for p in params:
            if groups[-1] and (mode == "naive" or size + p.numel() * p.element_size() > cap):
                groups.append([])  # naive: a "bucket" per parameter, so the same code runs all modes
                size = 0
            groups[-1].append(p)
            size += p.numel() * p.element_size()
        self.buffers, self.bucket_of = [], {}
        for b, group in enumerate(groups):
            flat = torch.zeros(sum(p.numel() for p in group), dtype=params[0].dtype, device=params[0].device)
            offset = 0
            for p in group:
                p.grad = flat[offset:offset + p.numel()].view_as(p)
                self.bucket_of[p] = b
                offset += p.numel()
            self.buffers.append(flat)
        self.sizes = [len(g) for g in groups]
        self.sync = True  # False on the micro-steps of gradient accumulation that don't communicate
        self.handles = []
        if mode == "overlap":
            for p in params:
                # fires once per backward, after p's gradient has been accumulated:
                # a tied weight used twice fires once, with both uses summed
                p.register_post_accumulate_grad_hook(self._ready)

    def zero(self):
        for flat in self.buffers:
            flat.zero_()
        self.ready = [0] * len(self.buffers)
        self.launched = 0

    def _ready(self, p):
        if not self.sync:
            return
        self.ready[self.bucket_of[p]] += 1
        # launch strictly in bucket order, even if a later bucket fills first: every
        # rank must issue its all-reduces in the same order, or rank 0's bucket 3
        # meets rank 1's bucket 2 and the ring exchanges the wrong data (or hangs)
        while self.launched < len(self.buffers) and self.ready[self.launched] == self.sizes[self.launched]:
            self.handles.append(C.all_reduce(self.buffers[self.launched], op="avg", async_op=True))
            self.launched += 1

    def reduce(self):
        """After backward: average every bucket across ranks. Returns the seconds the
        step waited for communication that backward did not hide."""
        t0 = M.timer(self.buffers[0].device)
        if self.mode == "overlap":
            assert self.launched == len(self.buffers), "a gradient never arrived: is every parameter used?"
            for h in self.handles:
                h.wait()
            self.handles = []
        elif self.mode != "alone":
            for flat in self.buffers:
                C.all_reduce(flat, op="avg")
        return M.timer(self.buffers[0].device) - t0


def main(argv=None):
    cfg = M.parse_args(DEFAULTS, argv, __doc__)
    if cfg.mode not in ("naive", "bucketed", "overlap"):
        M.die(f"--mode takes naive, bucketed or overlap, not {cfg.mode!r}")
    if cfg.grad_accum < 1 or cfg.bucket_mb <= 0:
        M.die("--grad_accum must be at least 1 and --bucket_mb positive")
    rank, world, _, device = C.init_distributed()
    if cfg.batch_size % (world * cfg.grad_accum):
        M.die(f"--batch_size={cfg.batch_size} does not divide into {world} ranks x {cfg.grad_accum} micro-steps")
    config, train_data, val_data, autocast = M.setup_run(cfg, device)
    micro = cfg.batch_size // (world * cfg.grad_accum)  # sequences per rank per micro-step

    # every rank builds the same model from the seed; the broadcast from rank 0
    # makes that true even if a user changes the seed per rank (a common bug)
    model = M.GPT(config, seed=cfg.seed).to(device)
    for t in list({id(p): p for p in model.parameters()}.values()) + list(model.buffers()):
        C.broadcast(t.data, src=0)
    buckets = GradBuckets(model.parameters(), cfg.bucket_mb, cfg.mode, world)
    optimizer = M.make_optimizer(model.named_parameters(), cfg, device)
    step_model = torch.compile(model) if cfg.compile else model

    n_params = M.num_params(model.parameters())
    flops_per_step = M.flops_per_token(config, n_params) * cfg.batch_size * config.block_size
    peak = M.peak_flops(device, cfg.peak_flops)
    log = M.Logger(cfg, rank)
    if rank == 0:
        print(f"ddp: {world} ranks, mode {cfg.mode}, {n_params / 1e6:.2f}M parameters, "
              f"{len(buckets.buffers)} buckets, {micro} x {config.block_size} tokens per rank per micro-step")

    def batch(step, m, data=train_data, split="train"):
        first = (rank * cfg.grad_accum + m) * micro  # this rank's contiguous rows of the global batch
        x, y = M.get_batch(data, cfg.seed, step, cfg.batch_size, config.block_size,
                           rows=slice(first, first + micro), split=split)
        return x.to(device, non_blocking=True), y.to(device, non_blocking=True)

    @torch.no_grad()
    def evaluate():
        model.eval()
        losses = torch.zeros(cfg.eval_iters, cfg.grad_accum, device=device)
        for k in range(cfg.eval_iters):
            for m in range(cfg.grad_accum):  # the same rows as a training step: the whole global batch
                with autocast:
                    losses[k, m] = step_model(*batch(k, m, val_data, "val"))[1]
        model.train()
        with C.untracked():  # bookkeeping, not training traffic
            C.all_reduce(losses, op="avg")
        return losses.mean().item()

    for it in range(cfg.max_iters):
        record = {"iter": it}
        if cfg.eval_interval and (it % cfg.eval_interval == 0 or it == cfg.max_iters - 1):
            record["val_loss"] = evaluate()
        lr = M.get_lr(it, cfg)
        M.set_lr(optimizer, lr)
        C.reset_bytes()
        t0 = M.timer(device)

        buckets.zero()
        loss_sum = torch.zeros((), device=device)
        for m in range(cfg.grad_accum):
            # communicate only after the last micro-step: the earlier ones just
            # accumulate into the buckets, and one all-reduce serves them all
            buckets.sync = m == cfg.grad_accum - 1
            x, y = batch(it, m)
            with autocast:
                _, loss = step_model(x, y)
            (loss / cfg.grad_accum).backward()  # the mean over the global batch
            loss_sum += loss.detach() / cfg.grad_accum
        exposed = buckets.reduce()
        # after the all-reduce every rank holds the same gradients, so the local norm is the global norm
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip) if cfg.grad_clip else 0.0
        optimizer.step()

        dt = M.timer(device) - t0
        sent = C.bytes_sent()
        state = M.tensor_bytes(model.parameters()) + M.tensor_bytes(buckets.buffers) + M.optimizer_state_bytes(optimizer)
        peak_mem = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
        rows = C.gather_stats([loss_sum.item(), sent, state, peak_mem, exposed])  # one row per rank, on rank 0
        if rank == 0:
            tokens_per_s = cfg.batch_size * config.block_size / dt
            record.update(loss=sum(r[0] for r in rows) / world, lr=lr, grad_norm=float(norm), dt_ms=1000 * dt,
                          tokens_per_s=tokens_per_s, mfu=flops_per_step / dt / (world * peak) if peak else None,
                          comm_bytes=[int(r[1]) for r in rows], state_bytes=[int(r[2]) for r in rows],
                          exposed_comm_ms=[1000 * r[4] for r in rows])
            if device.type == "cuda":
                record["peak_bytes"] = [int(r[3]) for r in rows]
        log(record)

    if cfg.save_path and rank == 0:
        torch.save({k: v.detach().cpu().clone() for k, v in model.state_dict().items()}, cfg.save_path)
    C.shutdown()
    return log.records


if __name__ == "__main__":
    main()
