"""
The command to run on a machine with one GPU. It prints one PASS/FAIL line per item
and exits non-zero if any fails, a part that times out included.

    python bench/gpu_check.py                        # command 1: device, parity, speed (~4.5 min on one H100)
    python bench/gpu_check.py --only=compile         # command 2: compile (~3 min on one H100)
    python bench/gpu_check.py --device=cpu           # the same items on the tiny preset: a smoke test
    python bench/gpu_check.py --list                 # each part's estimate, how it is derived, its timeout

Two commands, each estimated at 5 minutes or less on one H100 and each part cut off by its own
timeout (--list), so that each fits one 10-minute device command with room to rerun it.

Parts, each one process at one rank (as torchrun starts it), each under its own timeout:
  device   the GPU is real (a matmul on it matches the CPU's), its name, compute
           capability, native bf16, NCCL's version, and the peak FLOP/s MFU is counted against
  parity   every strategy file at one rank against the plain loop (model.GPT, the same
           data, init and optimizer, no strategy code): float32 in the deterministic
           parity mode (TF32 off, deterministic algorithms; tolerance 1e-4), then bf16
           autocast (5e-3; GPU only); peak memory per strategy; FSDP's max_gathered_units
           = 1 + prefetch
  compile  every strategy with --compile=True, float32 parity mode, against the plain eager
           loop (1e-3: Inductor's fused kernels sum in other orders), on GPT-2's width with 2
           blocks (what compiles is one block's code, whatever the depth; 12 blocks in one
           stage's graph would compile six times as long)
  speed    a plain single-GPU training loop (nanoGPT's recipe: torch.compile, fused AdamW,
           bf16 autocast, TF32, 16 x 1024 tokens of GPT-2 124M) and ddp.py at one rank with the
           same settings, in one process one after the other: ddp.py passes at T/(T + H) of the
           plain loop's tokens/s or more (T the plain loop's step, H ddp.py's bookkeeping a step,
           HOST_STEP_MS); both MFUs against the device's peak; their losses (5e-3)

What one rank proves, and what it does not. A one-rank collective sends nothing (there
is no peer), so no NCCL communication happens here: the NCCL group is created (with
device_id, as every strategy creates it) and torn down, nothing more. The multi-rank
algorithms are proven on CPU ranks over gloo by the tests. What this proves on the real
device: the CUDA path (device placement, pinned copies, CUDA-event timing), bf16
autocast, torch.compile, and collectives.py's side stream: at one rank FSDP's prefetched
all-gathers and reduce-scatters still run on it (their copies, ordered by events), so a
missing event or a tensor freed too early shows up as a wrong loss.

The data are synthetic (a fixed random Markov chain over GPT-2's vocabulary), since
the GPU machine may have no network to fetch the Shakespeare corpus.
"""
import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext
from types import SimpleNamespace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

STRATEGIES = [  # (name, script, flags); expert_parallel.py trains the mixture of experts (--n_expert=4)
    ("ddp", "ddp.py", []),
    ("fsdp", "fsdp.py", ["--prefetch=1"]),
    ("tensor", "tensor_parallel.py", []),
    # ZB-H1: at one rank its W store (a custom autograd.Function and a custom operator) is what the
    # plain loop does not run, under bf16 autocast and torch.compile alike
    ("pipeline", "pipeline_parallel.py", ["--n_micro=2", "--schedule=zb"]),
    ("context", "context_parallel.py", []),
    ("expert", "expert_parallel.py", ["--n_expert=4"]),
]
# Each part's time on one H100, estimated (no GPU has been lent to measure it; each part prints
# its own time), from: a child's start, 15 s (importing torch and the strategies took 14 s on the
# 2-core CPU machine under load, 2026-12-06; CUDA's and NCCL's start added); building GPT-2 124M,
# 2.5 s a run (measured there, one thread); a step's FLOPs (model.flops_per_token) at 10% of the
# H100's peak (docs/formulas.md: 989 TFLOP/s bf16; float32 with TF32 off, the parity mode, at
# 67, the data sheet's fp32) for these small batches; and a compile, 60 s for the whole GPT-2
# and 20 s for a 2-block model, assumed (Inductor's time on a GPU host has not been measured here).
PARTS = {  # name: (what, estimated seconds on one H100, how, the part's timeout)
    "device": ("the GPU is real, bf16, NCCL, the peak FLOP/s, the host's cost per op", 20,
               "a child's start, a matmul, 5 x 90 dry ops", 60),
    "parity": ("6 strategies x (float32 parity mode, bf16) against the plain loop", 90,
               "a start + 16 runs x (2.5 s build + 10 steps, 2.4 s in float32, 0.2 s in bf16)", 180),
    "speed": ("ddp.py at one rank against the plain compiled loop, tokens/s and MFU", 150,
              "a start + 2 x (60 s compile + 2.5 s build + 40 steps of 16 x 1024 tokens, 5.7 s)", 240),
    "compile": ("6 strategies compiled (2 blocks) against the plain eager loop", 165,
                "a start + 2 eager runs (5 s) + 6 x (20 s compile + 2.5 s build)", 280),
}
COMMANDS = ["device,parity,speed", "compile"]  # the two device commands: 260 s and 165 s estimated
FP32_TOL, BF16_TOL, COMPILE_TOL = 1e-4, 5e-3, 1e-3
NORM_TOL = {"float32": 1e-4, "bfloat16": 1e-2}  # relative, at step 0 (norm_verdict)
# ddp.py's bookkeeping a step beyond the plain loop's (its log record, per-rank stats, timing),
# at most: measured on the 2-core CPU machine under load (load average 10, 2026-12-06), the
# model a 1-block, 8-wide one so that the difference is the host's: -0.2, 1.5 and 2.4 ms a step
# in 3 runs (each the median of 150 steps; the spread is the load's). A GPU's host does the same
# work; were none of it hidden behind the device's, ddp.py would reach T/(T + H) of the plain
# loop's tokens/s, T its step: below that, ddp.py loses more than all its bookkeeping costs
HOST_STEP_MS = 2.5
MIN_SPEED_CPU = 0.5  # a shared CPU's timings swing by tens of percent: there a smoke test


# ----------------------------------------------------------------------------- the verdicts (pure functions)


def loss_verdict(name, ours, ref, tol, iters):
    """ours, ref: the loss of each step. -> (ok, detail). A missing or extra step fails,
    so does a loss that does not fall (a model that learns nothing matches nothing)."""
    if not ours or not ref:
        return False, "no losses" + ("" if ours else f" from {name}") + ("" if ref else " from the reference")
    if len(ours) != iters or len(ref) != iters:
        return False, f"{len(ours)} steps against the reference's {len(ref)}, {iters} expected"
    diff = max(abs(a - b) for a, b in zip(ours, ref))
    falls = ours[-1] < ours[0]
    ok = diff <= tol and falls
    return ok, (f"max |loss - reference| {diff:.1e} (tol {tol:g}) over {iters} steps, "
                f"loss {ours[0]:.4f} -> {ours[-1]:.4f}" + ("" if falls else " (does not fall)"))


def norm_verdict(ours, ref, tol, detail=""):
    """The gradient norm before clipping, relative to the plain loop's, at step 0 (the same
    weights) within tol: a gradient with a wrong scale trains the same losses under AdamW and
    clipping, and only its norm shows it. -> (ok, detail)."""
    if not ours or not ref:
        return False, f"{detail}, no gradient norms"
    rel = abs(ours[0] - ref[0]) / ref[0]
    return rel <= tol, f"{detail}, gradient norm at step 0 {rel:.1e} from the reference's (tol {tol:g})"


def speed_verdict(ours_tps, plain_tps, peak, flops_per_token, min_ratio):
    """Tokens/s of ddp.py at one rank and of the plain loop, measured in the same run.
    -> (ok, detail); MFU against the device's peak where it is known."""
    if not ours_tps or not plain_tps:
        return False, "no tokens/s measured"
    ratio = ours_tps / plain_tps

    def mfu(tps):
        return f", MFU {100 * tps * flops_per_token / peak:.1f}%" if peak else ""
    return ratio >= min_ratio, (f"ddp.py {ours_tps:,.0f} tok/s{mfu(ours_tps)} = {ratio:.3f} of the plain loop's "
                                f"{plain_tps:,.0f} tok/s{mfu(plain_tps)} (needs >= {min_ratio:.3g})"
                                + ("" if peak else "; MFU: peak FLOP/s unknown for this device"))


def min_speed(tokens_per_step, plain_tps, device):
    """The share of the plain loop's tokens/s ddp.py must reach: T/(T + H), T the plain loop's
    step measured in the same run, H = HOST_STEP_MS (there: how it was measured); on a CPU the
    smoke test's MIN_SPEED_CPU."""
    if device == "cpu" or not tokens_per_step or not plain_tps:
        return MIN_SPEED_CPU
    step = tokens_per_step / plain_tps
    return step / (step + HOST_STEP_MS / 1000)


def device_verdict(facts, want):
    """facts: what the child found (device_check). -> (ok, detail)."""
    if facts.get("error"):
        return False, facts["error"]
    if want == "cpu":
        return True, f"CPU ({facts.get('name', 'cpu')}): the smoke test, no GPU checked"
    ok = facts.get("kind") == "cuda" and facts.get("matmul_err", 1.0) < 1e-2 and facts.get("bf16", False)
    return ok, (f"{facts.get('name')} (compute capability {facts.get('capability')}), tensors on {facts.get('kind')}, "
                f"a matmul within {facts.get('matmul_err', float('nan')):.1e} of the CPU's, native bf16 "
                f"{facts.get('bf16')}, NCCL {facts.get('nccl')}, peak bf16 "
                + (f"{facts['peak'] / 1e12:.0f} TFLOP/s" if facts.get("peak") else "unknown (pass --peak_flops)"))


def units_verdict(units, prefetch=1):
    return units == 1 + prefetch, f"FSDP max_gathered_units {units} (1 + prefetch = {1 + prefetch})"


def checked_dtypes(part, device):
    """-> [(dtype, tolerance)] of a part's loss items. On a CPU, parity is float32 only:
    bf16 there is emulated (minutes a run on a small CPU), and the bf16 items are the GPU's."""
    if part == "parity":
        return [("float32", FP32_TOL)] + ([("bfloat16", BF16_TOL)] if device == "cuda" else [])
    return [("float32", COMPILE_TOL)] if part == "compile" else []


def verdicts(part, result, device):
    """One part's child result -> [(ok, item, detail)]. A part that failed or timed out
    gives a FAIL for it, with its error, instead of a traceback."""
    if result.get("error") and not result.get("runs") and not result.get("facts"):
        return [(False, part, result["error"])]
    out, runs = [], result.get("runs", {})
    iters = result.get("iters", 0)
    if part == "device":
        ok, detail = device_verdict(result.get("facts", {}), device)
        out.append((ok, "device", detail))
    if part == "device" and result.get("host_us"):
        ok, detail = host_verdict(result["host_us"], device)
        out.append((ok, "host cost per op", detail))
    for dtype, tol in checked_dtypes(part, device):
        for name, _, _ in STRATEGIES:
            key = f"{name} {dtype}" + (" compiled" if part == "compile" else "")
            ref = runs.get(f"plain{' moe' if name == 'expert' else ''} {dtype}", {}).get("loss")
            if key not in runs:
                out.append((False, f"{part} {key}", result.get("error") or "did not run"))
                continue
            ok, detail = loss_verdict(name, runs[key].get("loss"), ref, tol, iters)
            plain = runs.get(f"plain{' moe' if name == 'expert' else ''} {dtype}", {})
            if ok and part == "parity":
                ok, detail = norm_verdict(runs[key].get("grad_norm"), plain.get("grad_norm"), NORM_TOL[dtype], detail)
            if runs[key].get("peak_bytes"):
                detail += f", peak {runs[key]['peak_bytes'] / 2**30:.2f} GiB"
            if name == "fsdp":
                u_ok, u_detail = units_verdict(runs[key].get("max_gathered_units"))
                ok, detail = ok and u_ok, f"{detail}, {u_detail}"
            if runs[key].get("error"):
                ok, detail = False, runs[key]["error"]
            out.append((ok, f"{part} {key}", detail))
    if part == "speed":
        plain, ours = runs.get("plain"), runs.get("ddp")
        if not plain or not ours:
            return out + [(False, "speed", result.get("error") or "a run is missing")]
        ok, detail = speed_verdict(ours.get("tokens_per_s"), plain.get("tokens_per_s"), result.get("peak"),
                                   result.get("flops_per_token"),
                                   min_speed(result.get("tokens_per_step"), plain.get("tokens_per_s"), device))
        out.append((ok, "speed", detail))
        ok, detail = loss_verdict("ddp", ours.get("loss"), plain.get("loss"), BF16_TOL, iters)
        out.append((ok, f"speed losses ({'compiled bf16' if device == 'cuda' else 'eager float32'}, ddp.py against "
                        f"the plain loop)", detail))
    if result.get("error") and part != "speed":
        out.append((False, f"{part}", result["error"]))
    return out


# ----------------------------------------------------------------------------- the host's cost per op

HOST_OPS = [("all_reduce", 4 << 10), ("all_reduce", 295 << 10), ("all_reduce", 4 << 20),
            ("reduce_scatter", 295 << 10), ("all_gather", 295 << 10)]
# The host's cost per op on a GPU, at most: what the same dry run took on the 2-core CPU machine
# under load (load average 14, 2026-12-06; `python bench/gpu_check.py --device=cpu --only=device`).
# There it includes the adds and copies, which a GPU's host only launches: a GPU figure above it is
# host work the CUDA path added (a synchronize, a copy through the host, an event too many).
HOST_US_MAX = {"all_reduce 4K": 32, "all_reduce 295K": 657, "all_reduce 4096K": 1896, "reduce_scatter 295K": 381,
               "all_gather 295K": 61}


def host_cost(device):
    """-> {"op size": microseconds} that collectives.py's Python (and its adds, on the device)
    takes to issue one op between two ranks, with no wire: one rank, told its group has two,
    and every message counted and returned at once (the dry run --collectives=torch counts
    bytes with; torch's own posting call, a few us, is left out). Timed on the host: what a
    GPU run pays before NCCL moves a byte."""
    import torch
    import torch.distributed as dist
    import collectives as C
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    if device == "cpu":
        torch.set_num_threads(1)  # as the other parts: OpenMP's spinning threads on a busy CPU time the machine
    link = C._link(None)
    real = (link.n, link.ranks, link.index)
    link.n, link.ranks, link.index = 2, [0, 1], {0: 0, 1: 1}  # a peer that is never asked
    out = {}
    try:
        for op, size in HOST_OPS:
            full, part = torch.zeros(size // 4, device=dev), torch.zeros(size // 8, device=dev)
            call = dict(all_reduce=lambda: C.all_reduce(full), reduce_scatter=lambda: C.reduce_scatter(part, full),
                        all_gather=lambda: C.all_gather(full, part))[op]
            C._running.dry = 0
            best = float("inf")
            for _ in range(3):
                t0 = time.perf_counter()
                for _ in range(30):
                    call()
                best = min(best, (time.perf_counter() - t0) / 30)
            C._running.dry = None
            out[f"{op} {size >> 10}K"] = best * 1e6
    finally:
        C._running.dry = None
        link.n, link.ranks, link.index = real
        dist.destroy_process_group()
    return out


def host_verdict(host_us, device):
    ok = device == "cpu" or all(v <= HOST_US_MAX.get(k, 0) for k, v in host_us.items())
    return ok, "host us per op, 2 ranks, no wire (at most, on a GPU: the CPU's): " + ", ".join(
        f"{k} {v:.0f} ({HOST_US_MAX.get(k)})" for k, v in host_us.items())


def report(lines):
    """Print the verdict lines; -> the exit code (1 if any failed or none ran)."""
    for ok, item, detail in lines:
        print(f"{'PASS' if ok else 'FAIL'}  {item}: {detail}", flush=True)
    passed = sum(ok for ok, _, _ in lines)
    print(f"gpu_check: {passed} passed, {len(lines) - passed} failed")
    return 0 if lines and passed == len(lines) else 1


# ----------------------------------------------------------------------------- the child: one part, one process


def parity_mode():
    """The deterministic parity mode for the float32 items: TF32 off (a TF32 matmul keeps
    10 bits of mantissa, and its rounding drifts past 1e-4 within a few steps) and
    deterministic algorithms (CUDA's embedding and attention backwards add with atomics,
    in any order). warn_only: an op with no deterministic kernel warns instead of stopping
    the check. The cuBLAS workspace setting it needs is set before CUDA starts (launch)."""
    import torch
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.use_deterministic_algorithms(True, warn_only=True)


def plain_loop(argv):
    """nanoGPT's train.py loop on model.py's pieces, and nothing of any strategy: model.GPT
    (compiled with --compile), model.make_optimizer (fused AdamW on a GPU), model.get_lr,
    clip_grad_norm_, the same batches, bf16 autocast with --dtype=bfloat16. Timed as
    model.end_iter times the strategies: from the step's start to its loss on the host.
    -> the records, as a strategy's main returns them."""
    import torch
    import model as M
    cfg = M.parse_args(M.TRAIN_DEFAULTS, argv)
    M.check_flags(cfg)
    train, val, vocab = M.load_data(cfg.data_dir)
    config = M.make_config(cfg.model, vocab, cfg.block_size, cfg.dropout, cfg.n_expert, cfg.top_k,
                           cfg.capacity_factor, cfg.aux_loss_coef)
    cfg.block_size = config.block_size
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    torch.manual_seed(cfg.seed)
    model = M.GPT(config, seed=cfg.seed).to(device)
    optimizer = M.make_optimizer(model.named_parameters(), cfg, device)
    forward = torch.compile(model) if cfg.compile else model
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if cfg.dtype == "bfloat16" else nullcontext()
    run = SimpleNamespace(cfg=cfg, train=train, val=val, device=device)
    records = []
    for it in range(cfg.max_iters):
        M.set_lr(optimizer, M.get_lr(it, cfg))
        t0 = M.now(device)
        x, y = M.batch(run, it)
        with autocast:
            _, loss = forward(x, y)
        (loss + M.moe_loss(model)).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip) if cfg.grad_clip else 0.0
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss = loss.item()
        dt = M.elapsed(t0, M.now(device))
        records.append(dict(iter=it, loss=loss, grad_norm=float(norm), dt_ms=1000 * dt, tokens_per_s=cfg.batch_size * cfg.block_size / dt))
    return records


def device_check():
    """The facts device_verdict judges: a matmul on the device against the CPU's."""
    import torch
    import model as M
    if not torch.cuda.is_available():
        return dict(kind="cpu", name="cpu")
    facts = {}
    try:
        a = torch.randn(512, 512, generator=torch.Generator().manual_seed(0))
        on = torch.randn(1, device="cuda")  # raises if CUDA is faked or broken
        facts.update(kind=on.device.type, name=torch.cuda.get_device_name(),
                     capability=".".join(map(str, torch.cuda.get_device_capability())),
                     bf16=torch.cuda.get_device_capability()[0] >= 8,
                     nccl=".".join(map(str, torch.cuda.nccl.version())), peak=M.device_peak(
                         torch.cuda.get_device_name(), "bfloat16"))
        torch.backends.cuda.matmul.allow_tf32 = False
        facts["matmul_err"] = ((a.cuda() @ a.cuda()).cpu() - a @ a).abs().max().item() / (a @ a).abs().max().item()
    except Exception as e:  # noqa: BLE001 - any failure here is the verdict
        facts["error"] = f"CUDA does not work: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return facts


def child(part, device, data, out, iters):
    """Run one part at one rank in this process (as rank 0 of one), writing what it finds to
    `out` after every run: a part cut off by its timeout keeps the runs it finished."""
    import torch
    import torch.distributed as dist
    import model as M
    import ddp
    import fsdp
    import tensor_parallel
    import pipeline_parallel
    import context_parallel
    import expert_parallel
    mains = dict(ddp=ddp.main, fsdp=fsdp.main, tensor=tensor_parallel.main, pipeline=pipeline_parallel.main,
                 context=context_parallel.main, expert=expert_parallel.main)
    result = dict(part=part, iters=iters, runs={})

    def save():
        with open(out, "w") as f:
            json.dump(result, f)
    if part == "device":  # first: a faked or broken CUDA must give facts, not a traceback
        result["facts"] = device_check()
        if not result["facts"].get("error"):
            result["host_us"] = host_cost(device)
        return save()
    gpu = device == "cuda"
    if gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    else:
        torch.set_num_threads(1)  # on a busy CPU, 2 threads spinning in OpenMP's barriers ran a step 20x slower
    # the NCCL group (gloo on a CPU), created once for every run of the part, as a
    # strategy creates it: the strategies find it and leave it up (the tests' harness does the same)
    dist.init_process_group("nccl" if gpu else "gloo", **({"device_id": torch.device("cuda", torch.cuda.current_device())}
                                                          if gpu else {}))
    M.PRESETS["gpt2_2"] = dict(M.PRESETS["gpt2"], n_layer=2)  # the compile part's: one block's code, twice
    model_flags = [f"--model={'gpt2_2' if part == 'compile' else 'gpt2'}", "--batch_size=8", "--block_size=256"] \
        if gpu else ["--model=tiny", "--batch_size=8", "--block_size=32"]
    common = [f"--data_dir={data}", f"--max_iters={iters}", "--eval_interval=0", "--log_interval=0",
              "--warmup_iters=4", "--seed=7"]
    if part in ("parity", "compile"):
        common += ["--deterministic=True"]  # the strategies' own parity mode (model.start)
        parity_mode()  # and the same for the plain loop, which does not go through model.start
        dtypes = [dtype for dtype, _ in checked_dtypes(part, device)]
        for dtype in dtypes:
            for moe in ([], ["--n_expert=4"]):
                key = f"plain{' moe' if moe else ''} {dtype}"
                records = plain_loop(model_flags + common + moe + [f"--dtype={dtype}"])
                result["runs"][key] = dict(loss=[r["loss"] for r in records],
                                           grad_norm=[r["grad_norm"] for r in records])
                save()
            for name, _, flags in STRATEGIES:
                compiled = ["--compile=True"] if part == "compile" else []
                key = f"{name} {dtype}" + (" compiled" if compiled else "")
                if gpu:  # this run's peak memory, not the one before it
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats()
                try:
                    records = mains[name](model_flags + common + flags + compiled + [f"--dtype={dtype}"])
                    result["runs"][key] = dict(loss=[r["loss"] for r in records],
                                               grad_norm=[r["grad_norm"] for r in records],
                                               peak_bytes=max(records[-1].get("peak_bytes", [0])),
                                               max_gathered_units=records[-1].get("max_gathered_units", [None])[0])
                except SystemExit as e:  # model.die: its error line is on stderr already
                    result["runs"][key] = dict(error=f"{name} exited with {e.code}")
                except Exception as e:  # noqa: BLE001 - reported as this item's FAIL
                    result["runs"][key] = dict(error=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
                save()
    elif part == "speed":
        import statistics as st
        flags = (["--model=gpt2", "--batch_size=16", "--block_size=1024", "--compile=True", "--dtype=bfloat16"]
                 if gpu else ["--model=tiny", "--batch_size=8", "--block_size=64", "--dtype=float32"])
        flags += common
        torch.backends.cuda.matmul.allow_tf32 = True  # as nanoGPT, and as model.start sets it
        torch.backends.cudnn.allow_tf32 = True
        for key, fn in (("plain", plain_loop), ("ddp", lambda a: ddp.main(a + ["--overlap=True"]))):
            records = fn(flags)
            steady = records[len(records) // 2:]  # past compilation and warm-up
            result["runs"][key] = dict(loss=[r["loss"] for r in records],
                                       tokens_per_s=st.median(r["tokens_per_s"] for r in steady))
            if gpu:
                torch.cuda.empty_cache()
            save()
        config = M.make_config(flags[0].split("=")[1], 50257 if gpu else 192, int(flags[2].split("=")[1]))
        result["tokens_per_step"] = int(flags[1].split("=")[1]) * int(flags[2].split("=")[1])
        result["peak"] = M.device_peak(torch.cuda.get_device_name(), "bfloat16") if gpu else None
        result["flops_per_token"] = M.flops_per_token(config)
        save()
    dist.destroy_process_group()


# ----------------------------------------------------------------------------- the parent


def launch(part, device, data, iters, timeout, tmp):
    """One process at one rank for `part`, in the environment torchrun gives a rank (RANK,
    WORLD_SIZE, MASTER_ADDR, ...), set here rather than by torchrun: torchrun starts its
    worker in a session of its own, which a timeout could not kill with it. -> the part's
    result, with error set when it failed or ran out of time (the runs it finished kept)."""
    out = os.path.join(tmp, f"{part}.json")
    cmd = [sys.executable, os.path.abspath(__file__), f"--child={part}", f"--device={device}", f"--data={data}",
           f"--out={out}", f"--iters={iters}"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # cuBLAS reads its workspace setting when it starts: without it, deterministic mode refuses its matmuls
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port), CUBLAS_WORKSPACE_CONFIG=":4096:8", PYTHONUNBUFFERED="1")
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # the smoke test stays on the CPU on a machine with a GPU too
    t0 = time.time()
    p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        _, err = p.communicate(timeout=timeout)
        error = None if p.returncode == 0 else \
            "; ".join([ln for ln in err.splitlines() if ln.startswith("error:")][-2:]
                      or [ln for ln in err.splitlines() if ln.strip()][-1:]) or f"exit code {p.returncode}"
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, 9)
        p.communicate()
        error = f"timed out after {timeout}s"
    result = {}
    if os.path.exists(out):
        with open(out) as f:
            result = json.load(f)
    if error:
        result["error"] = error
    result["seconds"] = time.time() - t0
    return result


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--only", default="", help=f"some of {','.join(PARTS)} (default: {COMMANDS[0]}, command 1)")
    p.add_argument("--list", action="store_true", help="list the parts, their estimated times and timeouts")
    p.add_argument("--iters", type=int, default=0, help="steps of each run (default: 10, speed 40; CPU 6, 8)")
    p.add_argument("--timeout_s", type=int, default=0, help="each part's limit (default: the part's own, --list)")
    p.add_argument("--child", default="", help=argparse.SUPPRESS)
    p.add_argument("--data", default="", help=argparse.SUPPRESS)
    p.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return child(args.child, args.device, args.data, args.out, args.iters)
    if args.list:
        for name, (what, secs, how, limit) in PARTS.items():
            print(f"{name:<8} {what}: about {secs} s on one H100 (estimated: {how}), timeout {limit} s")
        for i, parts in enumerate(COMMANDS):
            est, limit = (sum(PARTS[p][k] for p in parts.split(",")) for k in (1, 3))
            print(f"command {i + 1}: python bench/gpu_check.py --only={parts}  (about {est} s, at most {limit} s "
                  f"and the data's making)")
        return 0
    parts = (args.only or COMMANDS[0]).split(",")
    for name in parts:
        if name not in PARTS:
            print(f"error: --only: unknown part {name!r}; choose from {', '.join(PARTS)}", file=sys.stderr)
            return 2
    import torch
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: no CUDA device here; run with --device=cpu for the smoke test", file=sys.stderr)
        return 2
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from conftest import make_dataset
    tmp = tempfile.mkdtemp(prefix="gpu_check_")
    gpu = args.device == "cuda"
    data = make_dataset(os.path.join(tmp, "data"), n_train=300_000 if gpu else 60_000, vocab=50257 if gpu else 192)
    print(f"gpu_check: torch {torch.__version__}, {args.device}, parts {', '.join(parts)}; one rank: the NCCL group "
          f"is created but no NCCL communication happens (no peer); see --help for what this proves", flush=True)
    lines, t0 = [], time.time()
    for part in parts:
        iters = args.iters or ((40 if gpu else 8) if part == "speed" else (10 if gpu else 6))
        result = launch(part, args.device, data, iters, args.timeout_s or PARTS[part][3], tmp)
        print(f"gpu_check: part {part} took {result['seconds']:.0f}s (estimated {PARTS[part][1]}s on one H100)",
              flush=True)
        lines += verdicts(part, result, args.device)
    print(f"gpu_check: {time.time() - t0:.0f}s in all")
    return report(lines)


if __name__ == "__main__":
    sys.exit(main())
