"""
Benchmark context_parallel.py on a long sequence, ring attention (both layouts) against
Ulysses (all-to-all) in one run: time per step, the communication a step waits for, the
attention work of the slowest and the fastest rank, the bytes each rank sends (and the
formula's), and the memory each rank keeps, next to the one-process run of the same model.

    python bench/context_parallel_methods.py                     # tiny preset, 1 x 512 and 1 x 1024 tokens, 2 and 4 ranks
    python bench/context_parallel_methods.py --block_sizes=2048  # one longer sequence (minutes a launch on 2 cores)

Every run is a real launch with a deadline (`torchrun` for N ranks, plain `python` for
the one-process run, which is context_parallel.py on a ring of one: the same code, one
s x s block of attention); the numbers come from the JSON log rank 0 writes. Times are
medians over the iterations after --warmup.

"exposed" is the attention's communication that nothing hid, on the rank that waited
most (the log's attn_wait_ms): for the ring the time blocked on a block that had not yet
arrived, for Ulysses every all-to-all, since attention needs all of q, k and v before it
starts. "attn" is the attention compute of a rank in a step (forward and backward,
waiting excluded), for the slowest and the fastest rank: contiguous positions give the
last ring rank N times the first's blocks, zigzag the same work to all, Ulysses whole
sequences of H/N heads to every rank. Both run the same float32 attention math, but
Ulysses' one block a head is the whole s x s, half of it masked, where the ring skips the
blocks wholly in the future: about twice the ring's attention FLOPs here (a flash kernel
skips masked tiles, so on a GPU they are equal). So compare "exposed" for the messages,
and ms/step only with that in mind; the one-process run computes its one block whole
too, so it is no yardstick for speed-up either.

"act" is what autograd keeps for backward on one rank (counted with saved-tensor hooks):
every activation is per position, so it falls as 1/N. "RSS" is the peak resident memory
of the largest process of the launch (weights, optimizer, Python and torch themselves,
and the transient attention scores; the allocator makes it noisy). The synthetic
192-token vocabulary of the tests is the default data, so the blocks, not the embedding,
dominate the model.
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


def launch(world, args, log, timeout):
    """Run the script on `world` ranks; -> (log records, peak RSS in bytes of its largest process)."""
    from tests.harness import free_port
    if world == 1:
        cmd = [sys.executable, "context_parallel.py"]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world), "--master_addr",
               "127.0.0.1", "--master_port", str(free_port()), "context_parallel.py"]
    cmd += [*args, f"--log_file={log}"]
    with tempfile.TemporaryFile("w+") as err:
        p = subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.DEVNULL,
                             stderr=err, start_new_session=True)
        deadline = time.time() + timeout
        # wait4, not wait: its resource usage covers the launcher and every rank it reaped
        while not (done := os.wait4(p.pid, os.WNOHANG))[0]:
            if time.time() > deadline:
                os.killpg(p.pid, 9)
                os.wait4(p.pid, 0)
                p.returncode = -9
                sys.exit(f"error: timeout after {timeout}s: {' '.join(cmd)}")
            time.sleep(0.2)
        p.returncode = os.waitstatus_to_exitcode(done[1])
        if p.returncode:
            err.seek(0)
            sys.exit(f"error: {' '.join(cmd)} failed:\n{err.read()[-3000:]}")
    with open(log) as f:
        return [json.loads(line) for line in f if line.strip()], done[2].ru_maxrss * 1024  # Linux: kilobytes


RUNS = [("ring", "contiguous"), ("ring", "zigzag"), ("ulysses", "contiguous")]  # (method, layout)


def main():
    ap = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    ap.add_argument("--worlds", default="2,4")
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--batch_size", type=int, default=1)
    ap.add_argument("--block_sizes", "--block_size", default="512,1024", help="sequence lengths, comma-separated")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--data_dir", default="", help="default: the tests' synthetic set, made in a temporary folder")
    ap.add_argument("--timeout", type=int, default=1200)
    a = ap.parse_args()
    import context_parallel as CP
    import model as M
    with tempfile.TemporaryDirectory() as tmp:
        data_dir = a.data_dir
        if not data_dir:
            from tests.conftest import make_dataset
            data_dir = make_dataset(os.path.join(tmp, "data"))
        vocab = M.read_meta(os.path.join(data_dir, "meta.json")).get("vocab_size", 50257)
        print(f"{a.model} preset, {a.batch_size} row(s) a step, {a.iters} steps (median after {a.warmup}), float32, "
              f"CPU ranks over gloo, one thread each")
        header = (f"{'tokens':>6}{'ranks':>6}  {'method':<20}{'ms/step':>9}{'exposed ms':>11}{'attn ms max':>12}"
                  f"{'attn ms min':>12}{'sent MB/rank':>13}{'formula MB':>11}{'act MB/rank':>12}{'vs 1 proc':>10}"
                  f"{'RSS MB':>8}")
        print(header + "\n" + "-" * len(header), flush=True)
        for block_size in [int(s) for s in a.block_sizes.split(",")]:
            common = [f"--model={a.model}", f"--data_dir={data_dir}", f"--batch_size={a.batch_size}",
                      f"--block_size={block_size}", f"--max_iters={a.iters}", "--eval_interval=0",
                      "--dtype=float32", "--log_interval=0"]
            config = M.make_config(a.model, vocab, block_size)
            one_act = None
            for world, (method, layout) in [(1, RUNS[0])] + [(int(w), r) for w in a.worlds.split(",") for r in RUNS]:
                args = common + [f"--attention={method}", f"--layout={layout}"]
                recs, rss = launch(world, args, os.path.join(tmp, "log.jsonl"), a.timeout)
                timed = recs[a.warmup:] or recs
                ms = statistics.median(r["dt_ms"] for r in timed)
                exposed = statistics.median(max(r["attn_wait_ms"]) for r in timed)
                slow = statistics.median(max(r["attn_ms"]) for r in timed)
                fast = statistics.median(min(r["attn_ms"]) for r in timed)
                sent, act = max(recs[-1]["comm_bytes"]), max(recs[-1]["act_bytes"])
                one_act = one_act or act
                formula = CP.traffic_per_rank(config, M.parse_args(CP.DEFAULTS, args), world)
                name = f"{method}, {layout}" if world > 1 else "one process"
                print(f"{block_size:>6}{world:>6}  {name:<20}{ms:>9.0f}{exposed:>11.0f}{slow:>12.0f}{fast:>12.0f}"
                      f"{sent / 1e6:>13.2f}{formula / 1e6:>11.2f}{act / 1e6:>12.1f}{act / one_act:>10.2f}"
                      f"{rss / 1e6:>8.0f}", flush=True)


if __name__ == "__main__":
    main()
