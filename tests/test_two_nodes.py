"""Two nodes on one machine: two torchrun agents (each a node of 2 ranks) meet at one c10d
rendezvous endpoint, as two machines would:

    torchrun --nnodes=2 --nproc_per_node=2 --rdzv_backend=c10d --rdzv_endpoint=127.0.0.1:PORT ...

twice. What one agent cannot show: LOCAL_RANK differs from RANK on the second node, a file
error is printed once per node and a flag error once, --resume=latest is agreed by every
node, a checkpoint is written by the ranks of both nodes into one folder, a rank killed on
the second node ends both agents, and parallel_nd.py with tp inside a node and the data axis
across. One launch a case, 3 steps of the tiny preset. What this cannot show (the network,
a disk per node) is said in docs/checkpoints_and_faults.md.

Run as a script (by torchrun, below) this file is a rank: it prints where it runs, then runs
tests/crash_once.py's wrapper of a strategy (the same command line: the strategy, its flags)."""
import json
import os
import re
import runpy
import subprocess
import sys
import time

if __name__ == "__main__":  # a rank under torchrun
    env = os.environ
    # one write (print writes the newline apart): the node's ranks share the agent's stdout
    os.write(1, f"where: rank {env['RANK']} local_rank {env['LOCAL_RANK']} node {env['GROUP_RANK']}\n".encode())
    runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "crash_once.py"), run_name="__main__")
    sys.exit(0)

import shutil  # noqa: E402

from conftest import SHORT_STEPS, make_dataset  # noqa: E402
from harness import ROOT, assert_logs_match, free_port, read_log  # noqa: E402

NO_CRASH = dict(CRASH_AT="-1")


def two_nodes(script, args, env=None, restarts=0, timeout=180):
    """Two torchrun agents of 2 ranks each at one rendezvous: -> (their exit codes, stdout, stderr).
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: on torch 2.13 with gloo a restarted attempt that
    shares the agents' store sometimes cannot reconnect (so every launch here uses it)."""
    port = free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=2",
           "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=two_nodes",
           f"--max_restarts={restarts}", "--monitor_interval=0.1", "tests/test_two_nodes.py", script, *args]
    full_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", CUDA_VISIBLE_DEVICES="",
                    TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", **(env or {}))
    agents = [subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, start_new_session=True) for _ in range(2)]
    deadline, outs = time.monotonic() + timeout, []
    try:
        for a in agents:
            outs.append(a.communicate(timeout=max(1, deadline - time.monotonic())))
    except subprocess.TimeoutExpired:
        for a in agents:  # SIGTERM first: an agent then ends its ranks (sessions of their own)
            if a.poll() is None:
                a.terminate()
        time.sleep(5)
        for a in agents:
            if a.poll() is None:
                os.killpg(a.pid, 9)
        raise AssertionError(f"timeout after {timeout}s: {' '.join(cmd)}")
    return [a.returncode for a in agents], "".join(o for o, _ in outs), "".join(e for _, e in outs)


def errors(stderr):
    return [line for line in stderr.splitlines() if line.startswith("error:")]


def test_mesh_across_nodes_killed_and_resumed(train_args, reference_short, tmp_path):
    """parallel_nd.py, tp=2 inside each node and the ZeRO data axis across them. Rank 3 (the
    second node's local rank 1) is killed at iteration 2, after the checkpoint of step 2:
    its agent restarts its ranks, the other agent restarts its own (a membership change,
    which its restart count does not count: collectives.py's store prefix must not depend
    on it), every node resumes from the one step rank 0 chose, and the losses are the
    one-process run's. The checkpoint folder holds the files of all 4 ranks."""
    out = tmp_path / "ckpt"
    args = train_args + [f"--max_iters={SHORT_STEPS}", "--eval_interval=0", "--tp=2", "--dp_shard=2",
                         "--dp_replicate=1", "--ckpt_interval=2", "--resume=latest", f"--out_dir={out}",
                         f"--log_file={tmp_path}/log.jsonl"]
    env = dict(CRASH_AT="2", CRASH_RANK="3", CRASH_MARK=str(tmp_path / "crashed"))
    codes, stdout, stderr = two_nodes("parallel_nd.py", args, env=env, restarts=1)
    assert codes == [0, 0], stderr[-3000:]
    where = dict(re.findall(r"where: rank (\d) local_rank (\d)", stdout))
    assert where == {"0": "0", "1": "1", "2": "0", "3": "1"}, stdout  # both attempts' lines agree
    assert "resumed from" in stdout and "step_000002 (step 2" in stdout, stdout[-2000:]
    assert_logs_match(read_log(f"{tmp_path}/log.jsonl"), reference_short[0])
    manifest = json.load(open(out / "step_000002" / "manifest.json"))
    # every rank's file in the one folder, both nodes' (here the first shard's ranks hold the pieces)
    assert [f["file"] for f in manifest["files"]] == [f"rank{r:05d}.pt" for r in range(4)]
    assert all((out / "step_000002" / f"rank{r:05d}.pt").exists() for r in range(4))


def test_a_killed_rank_on_the_second_node_ends_both_agents(train_args):
    codes, _, stderr = two_nodes("ddp.py", train_args + [f"--max_iters={SHORT_STEPS}", "--eval_interval=0", "--timeout_s=10"],
                                 env=dict(CRASH_AT="1", CRASH_RANK="3"), timeout=120)
    assert all(c != 0 for c in codes), (codes, stderr[-3000:])
    assert "Signals.SIGKILL" in stderr or "exitcode  : -9" in stderr, stderr[-3000:]


def test_a_file_error_is_said_once_per_node(data_dir, tmp_path):
    """Every rank of a node reads the same files: its local rank 0 says what is wrong, once
    per node, naming its rank when it is not rank 0; a flag error is said once."""
    folder = str(tmp_path / "data")
    shutil.copytree(data_dir, folder)
    with open(os.path.join(folder, "meta.json"), "w") as f:
        f.write("{vocab_size: 192")
    base = ["--model=tiny", "--block_size=32", "--batch_size=4", "--max_iters=2", "--eval_interval=0"]
    codes, _, stderr = two_nodes("ddp.py", base + [f"--data_dir={folder}"], env=NO_CRASH)
    lines = errors(stderr)
    assert all(c != 0 for c in codes) and len(lines) == 2, (codes, stderr[-3000:])
    assert sorted(line.startswith("error: rank 2: ") for line in lines) == [False, True], lines
    assert all("meta.json is not valid JSON" in line for line in lines), lines


def test_a_flag_error_is_said_once(data_dir):
    codes, _, stderr = two_nodes("ddp.py", ["--model=tiny", f"--data_dir={data_dir}", "--overlap=fast"], env=NO_CRASH)
    lines = errors(stderr)
    assert all(c != 0 for c in codes) and len(lines) == 1 and "--overlap takes" in lines[0], (codes, stderr[-3000:])
