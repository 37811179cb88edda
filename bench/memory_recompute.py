"""
Benchmark --recompute on every strategy at 2 ranks: the bytes autograd keeps for backward per
rank (act_bytes, counted with saved-tensor hooks) next to the formula, and the time a step
takes, for none / gelu / full.

    python bench/memory_recompute.py                      # tiny preset, 8 x 64 tokens
    python bench/memory_recompute.py --block_size=256 --iters=4

Every run is a real torchrun launch of 2 CPU ranks over gloo (one thread each) with a
deadline; the numbers come from the JSON log rank 0 writes. ms/step is the median over the
iterations after --warmup: on shared CPU cores it is noisy, and a CPU is not the device the
trade is made for (there the recomputed forward costs ~1/3 more FLOPs, gelu one elementwise
op), so compare the bytes first. act MB is the largest rank's; "formula" says whether every rank's
act_bytes at every step equals model.activation_bytes and each strategy's ends (expert parallel:
expert_parallel.activation_per_rank from the step's routing counts; tests/test_recompute.py holds
them equal).
The synthetic 192-token vocabulary of the tests is the default data, so the blocks dominate.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

RUNS = [("ddp.py", []), ("fsdp.py", ["--zero_stage=3"]), ("fsdp.py", ["--zero_stage=1"]),
        ("tensor_parallel.py", []), ("tensor_parallel.py", ["--sequence_parallel=True"]),
        ("context_parallel.py", []), ("pipeline_parallel.py", ["--schedule=1f1b", "--n_micro=4"]),
        ("expert_parallel.py", ["--n_expert=4"])]


def launch(script, args, log, timeout):
    from tests.harness import free_port
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), script, *args, f"--log_file={log}"]
    p = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES=""),
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=timeout)
    if p.returncode:
        sys.exit(f"error: {' '.join(cmd)} failed:\n{p.stderr[-3000:]}")
    with open(log) as f:
        return [json.loads(line) for line in f if line.strip()]


def formula(script, cfg, config, rec):
    """Each rank's act_bytes from the formulas (as tests/test_recompute.py computes them); expert
    parallel's from the step's routing counts in its log record rec."""
    import model as M
    n, s = cfg.batch_size * config.block_size // 2, config.block_size
    if script == "ddp.py":
        return [M.activation_bytes(config, n, cfg.recompute) + M.ends_bytes(config, n, s)] * 2
    if script == "fsdp.py":
        return [M.activation_bytes(config, n, cfg.recompute) + M.ends_bytes(config, n, s, embed=False)] * 2
    strategy = __import__(script[:-3])
    if script == "expert_parallel.py":  # the rows its experts computed, the choices kept (every rank's: allgather)
        choices = [config.n_layer * n * config.top_k - d for d in rec["dropped_tokens"]]
        kept = [sum(choices)] * 2 if cfg.dispatch == "allgather" else choices
        return [strategy.activation_per_rank(config, cfg, 2, rows, k) for rows, k in zip(rec["expert_load"], kept)]
    got = strategy.activation_per_rank(config, cfg, 2)
    return got if isinstance(got, list) else [got] * 2


def main():
    ap = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--batch_size", type=int, default=8)
    ap.add_argument("--block_size", type=int, default=64)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--data_dir", default="", help="default: the tests' synthetic set, made in a temporary folder")
    ap.add_argument("--timeout", type=int, default=900)
    a = ap.parse_args()
    import model as M
    with tempfile.TemporaryDirectory(prefix="recompute-bench-") as tmp:
        data_dir = a.data_dir
        if not data_dir:
            from tests.conftest import make_dataset
            data_dir = make_dataset(os.path.join(tmp, "data"))
        vocab = M.read_meta(os.path.join(data_dir, "meta.json")).get("vocab_size", 50257)
        common = [f"--model={a.model}", f"--data_dir={data_dir}", f"--batch_size={a.batch_size}",
                  f"--block_size={a.block_size}", f"--max_iters={a.iters}", "--eval_interval=0",
                  "--dtype=float32", "--log_interval=0"]
        print(f"{a.model} preset, {a.batch_size} x {a.block_size} tokens a step, 2 CPU ranks over gloo, one thread "
              f"each, float32, {a.iters} steps (median after {a.warmup})")
        header = f"{'strategy':<46}" + "".join(f"{m + ' MB':>10}{'ms':>7}" for m in M.RECOMPUTE) + f"{'formula':>9}"
        print(header + "\n" + "-" * len(header), flush=True)
        for script, extra in RUNS:
            row, exact = f"{script[:-3] + ' ' + ' '.join(extra):<46}", True
            for mode in M.RECOMPUTE:
                args = common + extra + [f"--recompute={mode}"]
                recs = launch(script, args, os.path.join(tmp, "log.jsonl"), a.timeout)
                strategy = __import__(script[:-3])
                cfg = M.parse_args(strategy.DEFAULTS, args)
                config = M.make_config(a.model, vocab, a.block_size, n_expert=cfg.n_expert, top_k=cfg.top_k)
                act = max(recs[-1]["act_bytes"])
                exact = exact and all(r["act_bytes"] == formula(script, cfg, config, r) for r in recs)
                ms = statistics.median(r["dt_ms"] for r in (recs[a.warmup:] or recs))
                row += f"{act / 2**20:>10.2f}{ms:>7.0f}"
            print(row + f"{'exact' if exact else 'DIFFERS':>9}", flush=True)


if __name__ == "__main__":
    main()
