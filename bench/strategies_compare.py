"""
Every strategy side by side: the same GPT on the same data, trained by the one-process
baseline, DDP, FSDP, tensor parallel, both pipeline schedules and context parallel at one
world size; with --moe also the mixture-of-experts model, trained by one process, by DDP
(every expert replicated) and by expert parallelism. One table of what each costs.

    python bench/strategies_compare.py                         # tiny preset, 2 ranks, 20 steps
    python bench/strategies_compare.py --world 4 --moe --csv out.csv --png out.png

Every strategy must end on its baseline's loss (float32, so to about 1e-5), start from
its baseline's gradient norm (the "Δ norm" column, relative, at step 0 where the weights
are the same: a gradient summed over the ranks instead of averaged trains the same losses
under AdamW and clipping, and only the norm shows it), and send the bytes its formula
says: the "formula" column is the closed form each strategy file states as
traffic_per_rank() (docs/formulas.md), or
for expert parallelism the formula of the step's actual routing; "sent" is what
collectives.py counted. A strategy that fails is reported in its row and the others
still run. Data: data/shakespeare if prepared, else a synthetic set.
"""
import argparse
import csv
import importlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import model as M  # noqa: E402

STRATEGIES = [  # (name, script, runs at world size N?, extra flags)
    ("baseline", "ddp.py", False, []),
    ("ddp", "ddp.py", True, []),
    ("fsdp", "fsdp.py", True, []),
    ("tensor", "tensor_parallel.py", True, []),
    ("pipe-gpipe", "pipeline_parallel.py", True, ["--schedule=gpipe"]),
    ("pipe-1f1b", "pipeline_parallel.py", True, ["--schedule=1f1b"]),
    ("context", "context_parallel.py", True, ["--layout=zigzag"]),
]
MOE = ["--n_expert=4", "--top_k=2"]
MOE_STRATEGIES = [  # the mixture-of-experts model: its own baseline
    ("moe-baseline", "ddp.py", False, MOE),
    ("moe-ddp", "ddp.py", True, MOE),
    ("moe-expert", "expert_parallel.py", True, MOE),
]


def launch(script, world, flags, log, timeout):
    # a baseline is the one-process run, as a user starts it (`python ddp.py`): no launcher
    run = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}"] if world > 1 else []
    cmd = [sys.executable, *run, script, *flags, f"--log_file={log}"]
    try:
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                           env=dict(os.environ, OMP_NUM_THREADS="1"))
    except subprocess.TimeoutExpired:
        return None, f"timed out after {timeout}s"
    if r.returncode:
        lines = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")] or r.stderr.strip().splitlines()[-1:]
        return None, (lines[0] if lines else f"exit code {r.returncode}")
    return [json.loads(line) for line in open(log)], None


def formula(script, flags, world, records):
    """The strategy's own closed form for the bytes a rank sends per step, on average over
    the ranks; expert parallelism's from each step's actual routing (the rows each rank
    sent and received, which it logs)."""
    module = importlib.import_module(script[:-3])
    cfg = M.parse_args(module.DEFAULTS, flags)
    _, _, vocab = M.load_data(cfg.data_dir)
    config = M.make_config(cfg.model, vocab, cfg.block_size, cfg.dropout, cfg.n_expert, cfg.top_k,
                           cfg.capacity_factor, cfg.aux_loss_coef)
    if "sent_tokens" in records[0]:
        return statistics.mean(statistics.mean(module.traffic_per_rank(config, cfg, world, s, r)
                                               for s, r in zip(rec["sent_tokens"], rec["received_tokens"]))
                               for rec in records)
    return module.traffic_per_rank(config, cfg, world)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--model", default="tiny")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--batch_size", type=int, default=24)
    p.add_argument("--block_size", type=int, default=64)
    p.add_argument("--n_micro", type=int, default=4)
    p.add_argument("--data_dir", default="")
    p.add_argument("--only", nargs="*", help="run only these strategies (names as in the table)")
    p.add_argument("--moe", action="store_true", help="also the mixture-of-experts rows")
    p.add_argument("--keep", action="store_true", help="keep the temporary folder of logs")
    p.add_argument("--csv", default="")
    p.add_argument("--png", default="")
    p.add_argument("--timeout", type=int, default=600)
    args = p.parse_args(argv)
    table = STRATEGIES + (MOE_STRATEGIES if args.moe or any(n.startswith("moe") for n in args.only or []) else [])
    unknown = sorted(set(args.only or []) - {name for name, *_ in STRATEGIES + MOE_STRATEGIES})
    if unknown:
        p.error(f"unknown strategies {unknown}; the table has {[name for name, *_ in STRATEGIES + MOE_STRATEGIES]}")
    data_dir = args.data_dir or os.path.join(ROOT, "data", "shakespeare")
    tmp = tempfile.mkdtemp(prefix="compare_")
    if not os.path.exists(os.path.join(data_dir, "train.bin")):
        sys.path.insert(0, os.path.join(ROOT, "tests"))
        from conftest import make_dataset
        data_dir = make_dataset(os.path.join(tmp, "data"))
    common = [f"--model={args.model}", f"--data_dir={data_dir}", f"--batch_size={args.batch_size}",
              f"--block_size={args.block_size}", f"--max_iters={args.iters}", "--eval_interval=0",
              "--log_interval=0", "--dtype=float32", f"--warmup_iters={max(1, args.iters // 5)}"]

    rows, curves = [], {}
    todo = [s for s in table if not args.only or s[0] in args.only]
    for k, (name, script, parallel, extra) in enumerate(todo):
        world = args.world if parallel else 1
        flags = common + extra + (["--n_micro=%d" % args.n_micro] if script.startswith("pipeline") else [])
        print(f"[{k + 1}/{len(todo)}] {name} on {world} rank{'s' if world > 1 else ''}...", file=sys.stderr, flush=True)
        records, err = launch(script, world, flags, os.path.join(tmp, f"{name}.jsonl"), args.timeout)
        row = dict(strategy=name, ranks=world)
        if err:
            row["error"] = err
        else:
            steady = records[2:] or records
            sent = [statistics.mean(r["comm_bytes"]) for r in steady]
            row.update(final_loss=records[-1]["loss"], ms_per_step=statistics.median(r["dt_ms"] for r in steady),
                       tokens_per_s=statistics.median(r["tokens_per_s"] for r in steady),
                       sent_mb=statistics.mean(sent) / 1e6, formula_mb=formula(script, flags, world, steady) / 1e6,
                       state_mb=max(records[-1]["state_bytes"]) / 1e6,
                       peak_mb=max(records[-1]["peak_bytes"]) / 1e6 if "peak_bytes" in records[-1] else None)
            curves[name] = [r["loss"] for r in records]
        base = next((r for r in rows if r["strategy"] == ("moe-baseline" if name.startswith("moe") else "baseline")),
                    rows[0] if rows else row)
        if "error" not in row:
            row["grad_norm0"] = records[0]["grad_norm"]
            row["norm_rel"] = abs(row["grad_norm0"] - base["grad_norm0"]) / base["grad_norm0"] \
                if "grad_norm0" in base else float("nan")
        rows.append(row)
        print_row(row, base, header=len(rows) == 1)
    if not args.keep:
        shutil.rmtree(tmp, ignore_errors=True)

    if args.csv:
        keys = ["strategy", "ranks", "final_loss", "norm_rel", "ms_per_step", "tokens_per_s", "sent_mb",
                "formula_mb", "state_mb", "peak_mb", "grad_norm0", "error"]
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, keys)
            w.writeheader()
            w.writerows(rows)
    if args.png:
        plot(curves, args.png)
    return rows


def print_row(row, base, header):
    if header:
        print(f"{'strategy':<11} {'ranks':>5} {'final loss':>10} {'Δ baseline':>10} {'Δ norm':>7} {'ms/step':>8} {'tok/s':>7} "
              f"{'sent MB/rank':>12} {'formula MB':>10} {'state MB/rank':>13} {'peak MB':>8}")
    if "error" in row:
        print(f"{row['strategy']:<11} {row['ranks']:>5}  FAILED: {row['error']}", flush=True)
        return
    delta = row["final_loss"] - base["final_loss"] if "final_loss" in base else float("nan")
    peak = f"{row['peak_mb']:.0f}" if row["peak_mb"] is not None else "-"
    print(f"{row['strategy']:<11} {row['ranks']:>5} {row['final_loss']:>10.5f} {delta:>10.1e} {row['norm_rel']:>7.0e} "
          f"{row['ms_per_step']:>8.1f} "
          f"{row['tokens_per_s']:>7.0f} {row['sent_mb']:>12.3f} {row['formula_mb']:>10.3f} {row['state_mb']:>13.2f} "
          f"{peak:>8}", flush=True)


def plot(curves, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    for name, losses in curves.items():
        plt.plot(losses, label=name, linestyle="--" if name != "baseline" else "-")
    plt.xlabel("iteration")
    plt.ylabel("train loss")
    plt.legend()
    plt.title("the same run, split five ways")
    plt.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
