"""
Every strategy side by side: the same GPT on the same data, trained by the one-process
baseline, DDP, FSDP, tensor parallel, both pipeline schedules and context parallel at one
world size; with --moe also the mixture-of-experts model, trained by one process, by DDP
(every expert replicated) and by expert parallelism. One table of what each costs.

    python bench/strategies_compare.py                         # tiny preset, 2 ranks, 20 steps
    python bench/strategies_compare.py --world 4 --moe --csv out.csv --png out.png

    python bench/strategies_compare.py --bisect "tensor_parallel.py --sequence_parallel=True" --dir COPY

Every strategy must end on its baseline's loss (float32, so to about 1e-5), start from
its baseline's gradient norm (the "Δ norm" column, relative, at step 0 where the weights
are the same: a gradient summed over the ranks instead of averaged trains the same losses
under AdamW and clipping, and only the norm shows it), and send the bytes its formula
says: the "formula" column is the closed form each strategy file states as
traffic_per_rank() (docs/formulas.md), or
for expert parallelism the formula of the step's actual routing; "sent" is what
collectives.py counted. A strategy that fails is reported in its row and the others
still run. Data: data/shakespeare if prepared, else a synthetic set.

--bisect "SCRIPT FLAGS" says where a failing configuration differs: it runs one step of it at
--world ranks (the modules of --dir, a copy of the project or an exercise's workspace; default
this project) and of the one-process ddp.py, both without clipping, and stops each at its
optimizer's step. Every rank's gradient pieces are laid against the one-process run's global
gradients by the checkpoints' own map (each rank's entries: name, tensor, index; model.py's
_regions and _cut), and the first line names the tensor furthest off (relative; of those
within 2x of it, the first in the model's order), which ranks hold it and how, and by how much.
A sharded mesh unit's gradient lives in its flat shard, not in its parameters: it is skipped.
"""
import argparse
import csv
import importlib
import io
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
    p.add_argument("--bisect", default="", help='"SCRIPT FLAGS": where its gradients differ from one process\'s')
    p.add_argument("--dir", default="", help="--bisect: the copy of the project whose modules run (default: this one)")
    args = p.parse_args(argv)
    if args.bisect:
        script, *flags = args.bisect.split()
        data_dir = args.data_dir
        if not data_dir:
            sys.path.insert(0, os.path.join(ROOT, "tests"))
            from conftest import make_dataset
            data_dir = make_dataset(tempfile.mkdtemp(prefix="bisect_"))
        common = [f"--model={args.model}", f"--data_dir={data_dir}", f"--batch_size={args.batch_size}",
                  f"--block_size={args.block_size}", "--eval_interval=0", "--log_interval=0", "--dtype=float32"]
        for line in bisect(script[:-3] if script.endswith(".py") else script, common + flags, args.world,
                           args.dir or None):
            print(line)
        return None
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


class _Stepped(Exception):
    """Raised at the optimizer's first step, once the gradients are taken: the run ends there."""


def gradient_pieces(module, args, folder=None, setup=None):
    """module.main(args + one step, no clipping) in this process, stopped at its optimizer's step:
    -> ([(name, index, this rank's gradient piece)] for every entry the checkpoint would hold,
    {(block, "input" or "output"): [sum, sum of squares, tokens] over this rank's tokens}). In the
    modules of `folder` if given (exercises/grade.py's workspace())."""
    import contextlib
    import torch
    from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
    from torch.optim.optimizer import register_optimizer_step_pre_hook
    if folder:
        from exercises.grade import workspace
        scope = workspace(folder)
    else:
        scope = contextlib.nullcontext()
    with scope:
        model = importlib.import_module("model")
        if setup:
            setup(model)  # a preset to register (exercises/grade.py's tiny_moe)
        runs, restore = [], model.restore

        def remember(run, entries, optimizer):
            runs.append(run)
            return restore(run, entries, optimizer)

        def record(block, kind, x):  # sums over this rank's tokens of a block's input or output
            if not runs or not isinstance(block, model.Block) or not isinstance(x, torch.Tensor):
                return
            names = {id(p): n for n, p, _, _ in runs[-1].entries}
            name = names.get(id(next(block.parameters())), "")
            if not name.startswith("transformer.h."):
                return  # a block whose parameters are not the checkpoint's own (a sharded unit's)
            key = (int(name.split(".")[2]), kind)
            x = x.detach().double()
            s = stats.setdefault(key, [0.0, 0.0, 0.0])
            s[0], s[1], s[2] = s[0] + x.sum().item(), s[1] + (x * x).sum().item(), s[2] + x.numel() / x.shape[-1]
        stats = {}
        hooks = [register_module_forward_pre_hook(lambda m, args: record(m, "input", args[0] if args else None)),
                 register_module_forward_hook(lambda m, args, out: record(m, "output", out))]

        def take(optimizer, *_):
            pieces = []
            for name, param, index, _ in runs[-1].entries:
                if param.grad is not None:
                    for where, view in model._regions(index, param):
                        pieces.append((name, where, view(param.grad).detach().float().clone()))
            raise _Stepped(pieces, stats)
        model.restore = remember
        hook = register_optimizer_step_pre_hook(take)
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                importlib.import_module(module).main(list(args) + ["--max_iters=1", "--grad_clip=0"])
        except _Stepped as e:
            return e.args
        finally:
            for h in [hook] + hooks:
                h.remove()
            model.restore = restore
    raise RuntimeError(f"{module} ended without an optimizer step")


def _gradient_job(rank, world, module, args, folder, setup):
    return gradient_pieces(module, args, folder, setup)


def bisect(module, args, world, folder=None, setup=None):
    """-> lines: where `module` at `world` ranks first differs from the one-process ddp.py, by gradient."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from harness import spawn, one_thread
    import ddp
    same = [a for a in args if a.lstrip("-").split("=")[0] in ddp.DEFAULTS]  # the model, data and batch
    with one_thread():
        ref, ref_stats = gradient_pieces("ddp", same, setup=setup)
    ref = {name: t for name, _, t in ref}
    from bench.strategies_compare import _gradient_job  # by a name the ranks can import, whoever runs this
    ranks = spawn(_gradient_job, world, module, args, folder, setup, timeout=300)
    # the forward first: a block's input or output summed over every token, each rank's share weighted
    # so that a token held by several ranks (tensor parallel's replicas) counts once
    for key in sorted(ref_stats, key=lambda k: (k[0], k[1] == "output")):
        s_ref, q_ref, tokens = ref_stats[key]
        held = [st[key] for _, st in ranks if key in st]
        if not held:
            continue
        w = tokens / sum(h[2] for h in held)
        s, q = w * sum(h[0] for h in held), w * sum(h[1] for h in held)
        rel = max(abs(q - q_ref) / q_ref, abs(s - s_ref) / (q_ref * tokens) ** 0.5)
        if rel > 1e-4:
            block, kind = key
            where = f"transformer.h.{block}'s {kind}" + (" (the embedding's output)" if key == (0, "input") else
                                                         f" (its input agrees: inside transformer.h.{block})"
                                                         if kind == "output" else "")
            return [f"first difference: the forward, at {where}: its sum of squares over every token "
                    f"{q / q_ref:.4f}x the one-process run's (relative difference {rel:.1e})"
                    + ("; every earlier block boundary agrees" if key != (0, "input") else "")]
    rows = []  # (name, rank, index, relative max difference, largest difference, norm ratio)
    for rank, (pieces, _) in enumerate(ranks):
        for name, where, g in pieces:
            want = M._cut(ref[name], where).reshape(g.shape)
            diff = (g - want).abs().max().item()
            # relative to the whole tensor's largest gradient: a piece whose true gradient is 0 (the
            # attention key's bias) holds only rounding noise
            rows.append((name, rank, where, diff / max(ref[name].abs().max().item(), 1e-12), diff,
                         g.norm().item() / max(want.norm().item(), 1e-12)))
    order = list(ref)
    held = {n: sorted({r[1] for r in rows if r[0] == n}) for n in order}
    off = [r for r in rows if r[3] > 1e-4]
    if not off:
        return [f"{module} at {world} ranks: every gradient piece of {len(rows)} (of {len(held)} tensors) within "
                f"1e-4 of the one-process run's (relative)"]
    worst = max(r[3] for r in off)
    first = min((r for r in off if r[3] >= worst / 2), key=lambda r: (order.index(r[0]), r[1]))
    name, rank, where, rel, diff, ratio = first
    ranks_off = sorted({r[1] for r in off if r[0] == name})
    how = "whole" if where is None else f"{where[0]}[{where[1]}:{where[2]}]" if where[0] == "flat" else \
        f"dim {where[0]} [{where[1]}:{where[2]}]"
    names_off = sorted({r[0] for r in off}, key=order.index)
    ratios = [r[5] for r in off]
    pattern = ""  # what the tensors that differ have in common, said on the first line (grade.py prints it)
    if max(ratios) - min(ratios) < 1e-3 * max(ratios):  # one factor on every piece: a scale
        axes = [f"--{a}={v}" for a, v in (f.lstrip("-").split("=", 1) for f in args if "=" in f)
                if a in ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep") and v.isdigit()
                and int(v) > 1 and abs(int(v) - max(ratio, 1 / ratio)) < 1e-2]
        pattern = (f"; every piece that differs is {ratio:.3f}x: a sum where an average belongs (or an average "
                   f"twice) over ranks of that many" + (f" ({', '.join(axes)})" if axes else ""))
    whole = [n for n in order if len(held[n]) == world and all(r[2] is None for r in rows if r[0] == n)]
    if names_off == [n for n in whole if n in names_off] and len(names_off) < len(order):
        pattern += (f"; what differs is exactly what every rank holds whole ({len(names_off)} replicas) and the "
                    f"sharded tensors agree: the replicas' gradients are not summed over the ranks")
    lines = [f"first difference: {name}'s gradient, rank {rank}'s piece ({how}): {rel:.1%} off (largest difference "
             f"{diff:.2e}, norm {ratio:.3f}x the one-process run's); held by ranks {held[name]}, off on "
             f"{ranks_off}{pattern}",
             f"{len(names_off)} of {len(order)} tensors differ (relative > 1e-4): "
             + ", ".join(names_off[:8]) + (", ..." if len(names_off) > 8 else "")]
    return lines


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
