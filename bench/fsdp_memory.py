"""
Benchmark fsdp.py: time per step with and without prefetch, and the state each rank
holds under ZeRO-1, 2 and 3 next to DDP's, for the same model at 2 and 4 ranks.

    python bench/fsdp_memory.py                        # small preset on data/shakespeare, 2 and 4 CPU ranks
    python bench/fsdp_memory.py --worlds=2 --iters=20 --model=tiny

Every run is a real `torchrun` launch with a deadline; the numbers come from the JSON
log (rank 0 writes one record per iteration). Time is the median over the iterations
after --warmup. Sent is what one rank sends per step (the most of any rank), next to
the figure of the strategy's own formula, traffic_per_rank() (ZeRO-3: 3(N-1)/N·4Ψ, DDP
and ZeRO-1/2: 2(N-1)/N·4Ψ, Ψ = parameters, padded for the ZeRO runs; an average over
ranks, which differ by a few bytes of the norm's all-reduce). "gathered" is the most
units whose full weights existed at once (ZeRO-3: 1 + prefetch; ZeRO-1/2 keep all).
State is what a rank keeps (the most of any rank), next to fsdp.state_per_rank() (fp32:
ZeRO-1 8Ψ + 8Ψ/N, ZeRO-2 4Ψ + 12Ψ/N, ZeRO-3 16Ψ/N, with padding; DDP keeps 16Ψ).
On CPU ranks over gloo the collectives run on a background thread that
competes with the compute for the same cores, so what prefetch buys here is small next
to what it buys on GPUs, where the copy engines and NVLink work beside the SMs.
"""
import argparse
import importlib
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

RUNS = [  # (label, script, flags)
    ("DDP", "ddp.py", []),
    ("ZeRO-1", "fsdp.py", ["--zero_stage=1"]),
    ("ZeRO-2", "fsdp.py", ["--zero_stage=2"]),
    ("ZeRO-3, no prefetch", "fsdp.py", ["--prefetch=0"]),
    ("ZeRO-3, prefetch 1", "fsdp.py", ["--prefetch=1"]),
]


def launch(script, world, args, log, timeout):
    from tests.harness import free_port
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world), "--master_addr",
           "127.0.0.1", "--master_port", str(free_port()), script, *args, f"--log_file={log}"]
    try:
        p = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True,
                           text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        sys.exit(f"error: timeout after {timeout}s: {' '.join(cmd)}")
    if p.returncode != 0:
        sys.exit(f"error: {' '.join(cmd)} failed:\n{p.stderr[-3000:]}")
    with open(log) as f:
        return [json.loads(line) for line in f if line.strip()]


def formulas(script, flags, world):
    """The strategy's own closed forms: the bytes a rank sends per step, and (fsdp.py) the most
    state any rank keeps; None where the strategy has no such formula."""
    import model as M
    module = importlib.import_module(script[:-3])
    cfg = M.parse_args(module.DEFAULTS, flags)
    _, _, vocab = M.load_data(cfg.data_dir)
    config = M.make_config(cfg.model, vocab, cfg.block_size)
    state = max(module.state_per_rank(config, cfg, world)) if hasattr(module, "state_per_rank") else None
    return module.traffic_per_rank(config, cfg, world), state


def main():
    ap = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    ap.add_argument("--worlds", default="2,4")
    ap.add_argument("--model", default="small")
    ap.add_argument("--batch_size", type=int, default=16)
    ap.add_argument("--block_size", type=int, default=0)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--data_dir", default=os.path.join(ROOT, "data", "shakespeare"))
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--timeout", type=int, default=600)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        data_dir = a.data_dir
        if not os.path.exists(os.path.join(data_dir, "train.bin")):
            from tests.conftest import make_dataset
            data_dir = make_dataset(os.path.join(tmp, "data"))
        common = [f"--model={a.model}", f"--data_dir={data_dir}", f"--batch_size={a.batch_size}",
                  f"--block_size={a.block_size}", f"--max_iters={a.iters}", "--eval_interval=0",
                  f"--dtype={a.dtype}", "--log_interval=0"]
        print(f"{a.model} preset, batch {a.batch_size}, {a.iters} steps (median after {a.warmup}), "
              f"{a.dtype}, CPU ranks over gloo, data {os.path.relpath(data_dir, ROOT)}")
        header = (f"{'ranks':>5}  {'run':<20}{'ms/step':>9}{'tokens/s':>10}{'sent MB/rank':>14}{'formula MB':>12}"
                  f"{'state MB/rank':>15}{'formula MB':>12}{'vs DDP':>8}{'gathered':>10}")
        print(header + "\n" + "-" * len(header), flush=True)
        for world in map(int, a.worlds.split(",")):
            ddp_state = None
            for label, script, flags in RUNS:
                recs = launch(script, world, common + flags, os.path.join(tmp, "log.jsonl"), a.timeout)
                timed = recs[a.warmup:] or recs
                ms = statistics.median(r["dt_ms"] for r in timed)
                tok = statistics.median(r["tokens_per_s"] for r in timed)
                sent, state = max(recs[-1]["comm_bytes"]), max(recs[-1]["state_bytes"])
                ddp_state = ddp_state or state
                formula, state_formula = formulas(script, common + flags, world)
                state_formula = "-" if state_formula is None else f"{state_formula / 1e6:.2f}"
                gathered = recs[-1].get("max_gathered_units", [None])[0]
                gathered = "-" if gathered is None else f"{gathered:g}"
                print(f"{world:>5}  {label:<20}{ms:>9.0f}{tok:>10,.0f}{sent / 1e6:>14.2f}{formula / 1e6:>12.2f}"
                      f"{state / 1e6:>15.2f}{state_formula:>12}{state / ddp_state:>8.2f}{gathered:>10}", flush=True)


if __name__ == "__main__":
    main()
