"""
Expert parallelism: the all-to-all dispatch against the all-gather/reduce-scatter
one, and what the load-balancing loss does to the experts' loads. Each run is
launched with torchrun and read back from its JSON log.

    python bench/expert_parallel_dispatch.py                    # both tables, CPU ranks over gloo
    python bench/expert_parallel_dispatch.py --ranks=2 --steps=6 --balance_steps=50

Table 1, at 2 and 4 ranks, both --dispatch modes: ms/step, and the MB a rank sends a
step, in all and at the MoE layers alone, against expert_parallel.exchange_bytes()
(the uniform-routing expectation for the all-to-all; exact for the other). What to
expect: the all-to-all moves each chosen token once each way, (N-1)/N of n·k rows
per all-to-all, where the all-gather dispatch moves the whole global micro-batch to
every rank and the outputs back, (N-1)·n·(1+k) rows each way: N(1+k)/(2k) times
more, so its share grows with N (1.5x at 2 ranks, 3x at 4, for k = 2).

Table 2, 2 ranks, --balance_steps steps with --aux_loss_coef 0 and 0.01: the
experts' load, max/mean, per layer (averaged over the layers) and of the ranks,
and the balance loss, in windows of steps. Nothing but the balance loss stops the
router from favouring some experts (they get more gradient, so they get better, so
they get chosen more): without it the imbalance grows, with it it shrinks towards
the noise floor that even a uniformly random router shows on a finite batch. The
learning rate is higher than the default so that this shows within 200 steps.
"""
import argparse
import os
import statistics
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
from harness import bench_data, run_logged  # noqa: E402


def dispatch_table(args, common, tmp):
    import expert_parallel as EP
    import model as M
    print(f"\n{args.model} preset, {args.n_expert} experts, top {args.top_k}, global batch {args.batch_size} x "
          f"{args.block_size} tokens, {args.steps} steps (median of all but the first), float32, CPU ranks over gloo")
    header = (f"{'dispatch':<10}{'ranks':>6}{'ms/step':>10}{'sent MB/rank':>14}{'MoE MB/rank':>13}"
              f"{'formula MB':>12}{'vs alltoall':>13}")
    print(header)
    print("-" * len(header))
    for n in (int(r) for r in args.ranks.split(",")):
        moe = {}
        for mode in EP.DISPATCH:
            flags = common + [f"--max_iters={args.steps}", f"--dispatch={mode}"]
            log = os.path.join(tmp, f"{mode}.{n}.jsonl")
            records = run_logged("expert_parallel.py", n, flags, log, args.timeout)[1:]
            cfg = M.parse_args(EP.DEFAULTS, flags)
            config = M.make_config(cfg.model, block_size=cfg.block_size, n_expert=cfg.n_expert, top_k=cfg.top_k)
            ms = statistics.median(r["dt_ms"] for r in records)
            sent = statistics.mean(max(r["comm_bytes"]) for r in records) / 1e6
            moe[mode] = statistics.mean(statistics.mean(r["dispatch_bytes"]) for r in records) / 1e6
            formula = EP.exchange_bytes(config, cfg, n) / 1e6
            print(f"{mode:<10}{n:>6}{ms:>10.1f}{sent:>14.2f}{moe[mode]:>13.2f}{formula:>12.2f}"
                  f"{moe[mode] / moe['alltoall']:>12.2f}x", flush=True)
    print("sent: all a rank sends a step (the largest over the ranks; mean over the steps); MoE: the counts and\n"
          "the token exchange alone (mean over ranks and steps); formula: exchange_bytes(), uniform routing")


def balance_table(args, common, tmp):
    import numpy as np
    steps, windows = args.balance_steps, 4
    span = steps // windows
    tokens = args.balance_batch * args.block_size
    print(f"\nload balance: 2 ranks, {steps} steps of {args.balance_batch} x {args.block_size} tokens, lr "
          f"{args.balance_lr}; max/mean of the experts' loads per layer (mean over the layers), of the ranks' loads, "
          f"and the balance loss (1: balanced), each the mean over a window of steps")
    cols = [f"{w * span}-{(w + 1) * span - 1}" for w in range(windows)]
    header = f"{'aux_loss_coef':<14}{'':<13}" + "".join(f"{c:>10}" for c in cols) + f"{'final loss':>12}"
    print(header)
    print("-" * len(header))
    for coef in ("0", "0.01"):
        flags = [f for f in common if not f.startswith("--batch_size")] + [
            f"--batch_size={args.balance_batch}", f"--max_iters={steps}", f"--aux_loss_coef={coef}",
            f"--lr={args.balance_lr}", f"--warmup_iters={steps // 10}"]
        records = run_logged("expert_parallel.py", 2, flags, os.path.join(tmp, f"balance.{coef}.jsonl"), args.timeout)
        rows = {"experts/layer": [statistics.mean(r["expert_max_over_mean"]) for r in records],
                "ranks": [r["load_max_over_mean"] for r in records],
                "balance loss": [statistics.mean(r["aux_loss"]) for r in records]}
        for name, series in rows.items():
            cells = "".join(f"{statistics.mean(series[w * span:(w + 1) * span]):>10.3f}" for w in range(windows))
            final = f"{records[-1]['loss']:>12.4f}" if name == "experts/layer" else ""
            print(f"{coef:<14}{name:<13}{cells}{final}", flush=True)
    # what a perfectly balanced router scores: every token's k experts drawn uniformly at random
    rng = np.random.default_rng(0)
    floor = statistics.mean(
        (lambda c: c.max() / c.mean())(np.bincount(np.argsort(rng.random((tokens, args.n_expert)), 1)[:, :args.top_k]
                                                   .ravel(), minlength=args.n_expert)) for _ in range(2000))
    print(f"uniformly random choices of {args.top_k} of {args.n_expert} experts for {tokens} tokens score "
          f"{floor:.3f} (experts/layer): the noise floor")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="small")
    ap.add_argument("--n_expert", type=int, default=8)
    ap.add_argument("--top_k", type=int, default=2)
    ap.add_argument("--batch_size", type=int, default=8)
    ap.add_argument("--block_size", type=int, default=64)
    ap.add_argument("--steps", type=int, default=8, help="steps per dispatch run; the first is not timed")
    ap.add_argument("--balance_steps", type=int, default=200)
    ap.add_argument("--balance_batch", type=int, default=16)
    ap.add_argument("--balance_lr", type=float, default=6e-3, help="high enough that the router drifts in 200 steps")
    ap.add_argument("--ranks", default="2,4")
    ap.add_argument("--timeout", type=int, default=1800)
    args = ap.parse_args()
    if 0 < args.balance_steps < 4:
        sys.exit("error: --balance_steps must be 0 (no balance table) or at least 4 (its 4 windows)")
    with tempfile.TemporaryDirectory() as tmp:
        common = [f"--model={args.model}", f"--data_dir={bench_data(tmp)}", f"--batch_size={args.batch_size}",
                  f"--block_size={args.block_size}", f"--n_expert={args.n_expert}", f"--top_k={args.top_k}",
                  "--eval_interval=0", "--dtype=float32", "--log_interval=0"]
        dispatch_table(args, common, tmp)
        if args.balance_steps:
            balance_table(args, common, tmp)


if __name__ == "__main__":
    main()
