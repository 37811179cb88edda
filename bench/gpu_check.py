"""
The one command to run on a machine with one GPU: it proves the path users take
(NCCL, bf16 autocast, torch.compile, the speed of one GPU) and prints one verdict
line per item, exiting non-zero if any fails. About 5 minutes on one H100/H200.

    python bench/gpu_check.py                  # GPT-2 124M on the GPU
    python bench/gpu_check.py --device=cpu     # the same items on the tiny preset, as a smoke test

Items:
  1. every strategy file at one rank under torchrun (NCCL on a GPU), --model=gpt2,
     bf16, 20 iterations, against ddp.py's losses at every step, uncompiled and
     (--compile=True) compiled: the largest difference and the stated tolerance;
  2. bench/speed.py: tokens/s and MFU for GPT-2 124M (16 x 1024, bf16, compiled),
     next to nanoGPT's figure on one H200 (about 490k tokens/s);
  3. peak GPU memory per strategy, and FSDP's max_gathered_units (must be 1 + prefetch).
Two NCCL ranks cannot share one GPU (NCCL refuses: "invalid usage"), so the
multi-rank paths are proven on CPUs over gloo by the test suite; this proves the
one-rank NCCL path, bf16 and compile on the real device.
The data are synthetic (a fixed random Markov chain over GPT-2's vocabulary), since
the GPU machine may have no network to fetch the Shakespeare corpus.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
from conftest import make_dataset  # noqa: E402

STRATEGIES = [  # (name, script, flags)
    ("ddp", "ddp.py", []),
    ("fsdp", "fsdp.py", ["--prefetch=1"]),
    ("tensor", "tensor_parallel.py", []),
    ("pipeline", "pipeline_parallel.py", ["--n_micro=2"]),
    ("context", "context_parallel.py", []),
    ("expert", "expert_parallel.py", ["--n_expert=4"]),
]
NANOGPT_H200_TOKENS_PER_S = 490e3
results = []


def verdict(ok, item, detail):
    results.append(ok)
    print(f"{'PASS' if ok else 'FAIL'}  {item}: {detail}", flush=True)


def launch(script, flags, log, timeout):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", script, *flags,
           f"--log_file={log}"]
    t0 = time.time()
    try:
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, f"timed out after {timeout}s", time.time() - t0
    if r.returncode:
        errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")] or r.stderr.strip().splitlines()[-3:]
        return None, " | ".join(errors), time.time() - t0
    return [json.loads(line) for line in open(log)], None, time.time() - t0


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--tol", type=float, default=0.0, help="largest loss difference allowed (default: by device)")
    p.add_argument("--skip_speed", action="store_true")
    args = p.parse_args()
    import torch
    gpu = args.device == "cuda"
    if gpu and not torch.cuda.is_available():
        sys.exit("error: no CUDA device here; run with --device=cpu for the smoke test")
    # bf16 over 20 steps of GPT-2 124M: different but equivalent orders of rounding drift by up to
    # ~1e-2 (measured); a wrong slice or a missing gradient moves the loss by 0.1 or more
    tol = args.tol or (0.02 if gpu else 1e-4)
    tmp = tempfile.mkdtemp(prefix="gpu_check_")
    vocab = 50257 if gpu else 192
    data = make_dataset(os.path.join(tmp, "data"), n_train=200_000 if gpu else 60_000, vocab=vocab)
    model = ["--model=gpt2", "--batch_size=8", "--dtype=bfloat16"] if gpu else \
        ["--model=tiny", "--batch_size=8", "--block_size=32", "--dtype=float32"]
    common = model + [f"--data_dir={data}", f"--max_iters={args.iters}", "--eval_interval=0", "--log_interval=0",
                      "--warmup_iters=4", "--seed=7"]
    env_note = f"torch {torch.__version__}" + (f", {torch.cuda.get_device_name()}, NCCL "
                                                f"{'.'.join(map(str, torch.cuda.nccl.version()))}" if gpu else ", CPU")
    print(f"gpu_check: {env_note}; {' '.join(model)}, {args.iters} iterations, tolerance {tol}", flush=True)

    compiled_runs = [False, True] if gpu else [False]
    reference = {}
    for compiled in compiled_runs:
        for name, script, flags in STRATEGIES:
            if not os.path.exists(os.path.join(ROOT, script)):
                verdict(False, f"{name}", f"{script} is missing")
                continue
            extra = flags + (["--compile=True"] if compiled else [])
            log = os.path.join(tmp, f"{name}_{int(compiled)}.jsonl")
            # the expert run trains the mixture-of-experts model, so its reference is ddp.py on that model
            ref_key = ("moe" if name == "expert" else "dense", compiled)
            if ref_key not in reference:
                ref_flags = (["--n_expert=4"] if name == "expert" else []) + (["--compile=True"] if compiled else [])
                rec, err, _ = launch("ddp.py", common + ref_flags, os.path.join(tmp, f"ref_{ref_key[0]}_{compiled}.jsonl"),
                                     900)
                reference[ref_key] = rec
            records, err, secs = launch(script, common + extra, log, 900)
            item = f"{name:<8} 1 rank {'compiled' if compiled else 'eager   '}"
            if err or reference[ref_key] is None:
                verdict(False, item, err or "the ddp.py reference failed")
                continue
            diff = max(abs(a["loss"] - b["loss"]) for a, b in zip(records, reference[ref_key]))
            peak = records[-1].get("peak_bytes", [0])[0] / 2**30
            detail = (f"max |loss - ddp| {diff:.2e} (tol {tol}), loss {records[0]['loss']:.3f} -> "
                      f"{records[-1]['loss']:.3f}, peak {peak:.2f} GiB, "
                      f"{sorted(r['tokens_per_s'] for r in records)[len(records) // 2]:,.0f} tok/s, {secs:.0f}s")
            ok = diff <= tol and len(records) == args.iters
            if name == "fsdp":
                units = records[-1].get("max_gathered_units", [None])[0]
                detail += f", max_gathered_units {units}"
                ok = ok and units == 2
            verdict(ok, item, detail)

    if not args.skip_speed:
        speed = [sys.executable, os.path.join(ROOT, "bench", "speed.py"), f"--data_dir={data}"]
        r = subprocess.run(speed, cwd=ROOT, capture_output=True, text=True, timeout=900)
        m = re.search(r"([\d,]+) tokens/s(?:, MFU ([\d.]+)%)?", r.stdout)
        if r.returncode or not m:
            verdict(False, "speed", (r.stderr.strip().splitlines() or ["no output"])[-1])
        else:
            tps = float(m.group(1).replace(",", ""))
            ratio = tps / NANOGPT_H200_TOKENS_PER_S
            verdict(True, "speed", f"{m.group(0)}; {ratio:.2f}x nanoGPT's 490k tok/s on one H200"
                    + ("" if gpu else " (a CPU: the figure is only a smoke test)"))
    print(f"gpu_check: {sum(results)} passed, {len(results) - sum(results)} failed")
    sys.exit(0 if all(results) else 1)


if __name__ == "__main__":
    main()
