"""
Single-device training speed of model.py: tokens/s and MFU of the one-process
ddp.py run (the whole training step: forward, backward, clipping, fused AdamW).

    python bench/model_speed.py                    # GPU: gpt2 (124M), 16 x 1024, bf16, compiled
    python bench/model_speed.py --model=small      # any ddp.py flag can follow and overrides these

The figures are this run's alone. What they are worth is judged against a plain
training loop of the same model measured in the same run: bench/gpu_check.py's speed
part (`--only=speed`) passes ddp.py at one rank only at 0.95 or more of that loop's
tokens/s. On a CPU it runs a few iterations of a short sequence, just to show the numbers.
"""
import os
import statistics
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import ddp  # noqa: E402


def main():
    if any(a in ("-h", "--help") for a in sys.argv[1:]):
        print(__doc__.strip() + "\n\nEvery other flag is ddp.py's (python ddp.py --help).")
        return
    if torch.cuda.is_available():
        args = ["--model=gpt2", "--batch_size=16", "--block_size=1024", "--max_iters=40", "--compile=True",
                "--dtype=bfloat16"]
    else:
        args = ["--model=gpt2", "--batch_size=1", "--block_size=256", "--max_iters=4", "--dtype=float32"]
    args += ["--eval_interval=0", "--log_interval=10", "--overlap=True"]
    records = ddp.main(args + sys.argv[1:])
    steady = records[len(records) // 2:]  # past compilation and warm-up
    tps = statistics.median(r["tokens_per_s"] for r in steady)
    mfu = [r["mfu"] for r in steady if r["mfu"] is not None]
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(f"{device}: {tps:,.0f} tokens/s" + (f", MFU {100 * statistics.median(mfu):.1f}%" if mfu else
                                               " (no MFU: peak FLOP/s unknown for this device; see --peak_flops)"))


if __name__ == "__main__":
    main()
