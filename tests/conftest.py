"""Shared fixtures: a small synthetic dataset and the one-process reference run.

The parity tests use a dataset with a 192-token vocabulary (a multiple of 64 that
2, 3 and 4 divide, so the tensor parallel vocabulary splits at every test world
size) drawn from a fixed random Markov chain: it has structure to learn, so the
loss falls, and the tiny model trains on it in well under a second per step.
"""
import json
import os
import sys

# The suite runs on CPU processes over gloo on every machine, GPUs or not: hidden before
# torch is imported here, and in every rank the harness starts (they inherit it). Without
# this, one GPU breaks every 2-rank test (both ranks pick cuda:0, NCCL refuses) and several
# hand CUDA tensors to gloo.
os.environ["CUDA_VISIBLE_DEVICES"] = ""

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

VOCAB = 192
# the tiny preset over 20 steps: the run every strategy must reproduce
TRAIN_ARGS = ["--model=tiny", "--batch_size=24", "--block_size=32", "--max_iters=20", "--lr=1e-3",
              "--min_lr=1e-4", "--warmup_iters=4", "--eval_interval=10", "--eval_iters=1",
              "--dtype=float32", "--seed=7", "--log_interval=0"]


def make_dataset(folder, n_train=60_000, n_val=8_000, vocab=VOCAB, seed=0):
    rng = np.random.default_rng(seed)
    successors = rng.integers(0, vocab, size=(vocab, 4))  # each token has 4 likely successors
    tokens = np.empty(n_train + n_val, dtype=np.uint16)
    tokens[0] = 0
    choice = rng.integers(0, 4, size=len(tokens))
    noise = rng.random(len(tokens)) < 0.1
    rand = rng.integers(0, vocab, size=len(tokens))
    for i in range(1, len(tokens)):
        tokens[i] = rand[i] if noise[i] else successors[tokens[i - 1], choice[i]]
    os.makedirs(folder, exist_ok=True)
    tokens[:n_train].tofile(os.path.join(folder, "train.bin"))
    tokens[n_train:].tofile(os.path.join(folder, "val.bin"))
    with open(os.path.join(folder, "meta.json"), "w") as f:
        json.dump({"vocab_size": vocab, "source": "synthetic markov chain (tests)"}, f)
    return folder


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory):
    return make_dataset(str(tmp_path_factory.mktemp("data")))


@pytest.fixture(scope="session")
def train_args(data_dir):
    return TRAIN_ARGS + [f"--data_dir={data_dir}"]


# Parity over the whole 20-step schedule (warm-up, then the cosine decay) is proven once
# per strategy; the other runs of a world size go SHORT_STEPS against this shorter run
# of the same flags, validated at steps 0 and 2 (the last). Three steps catch what six
# did: a wrong slice or a missing sum moves the first loss or the first update, and
# Adam's moments have moved twice by the last; each step a launch skips saves 0.2-0.6 s
# on 2 cores, and the suite runs some sixty of these.
SHORT_STEPS = 3


@pytest.fixture(scope="session")
def reference_short(train_args, tmp_path_factory):
    """The one-process run of ddp.py for SHORT_STEPS: (records, final state_dict)."""
    import torch
    import ddp
    torch.set_num_threads(1)
    path = str(tmp_path_factory.mktemp("reference_short") / "state.pt")
    records = ddp.main(train_args + [f"--max_iters={SHORT_STEPS}", f"--save_path={path}"])
    return records, torch.load(path)


# bf16 autocast on a CPU without bf16 units costs ~10 float32 matmuls: every file's bf16 runs
# are short and small, and share this one-process run as their reference
BF16_ARGS = ["--dtype=bfloat16", "--batch_size=8", "--max_iters=4", "--eval_interval=0"]


def moe_preset():
    """The mixture-of-experts runs' model: the tiny preset with 4 blocks, not 12 (`--model=tiny_moe`).
    Each block's expert exchanges are a few messages that cost milliseconds on 2 shared cores
    whatever their size, so 12 blocks paid three times the latency to prove what 4 prove (a
    pipeline of 2 still gets 2 blocks a stage, interleaved 1 a chunk). Registered where it is
    used, in the ranks and in this process (as the pipeline's tests register theirs), not at
    import, so that no other test sees it among the presets."""
    import model as M
    M.PRESETS.setdefault("tiny_moe", dict(M.PRESETS["tiny"], n_layer=4))


@pytest.fixture(scope="session")
def reference_bf16(train_args):
    """The one-process bf16 autocast run of ddp.py (TRAIN_ARGS, then BF16_ARGS): its records."""
    import torch
    import ddp
    torch.set_num_threads(1)
    return ddp.main(train_args + BF16_ARGS)


@pytest.fixture(scope="session")
def reference(train_args, tmp_path_factory):
    """The one-process run of ddp.py: (per-iteration log records, final state_dict)."""
    import torch
    import ddp
    torch.set_num_threads(1)  # as every spawned rank runs (harness.py): on 2 shared cores more only thrash
    out = tmp_path_factory.mktemp("reference")
    path = str(out / "state.pt")
    records = ddp.main(train_args + [f"--save_path={path}", f"--log_file={out / 'log.jsonl'}"])
    return records, torch.load(path)
