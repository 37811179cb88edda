"""Tensor parallel: every parallel layer against the plain layer, parity with the
one-process run at world sizes 1 to 4 (sequence parallelism at 2 and 4, where the
sequence splits), the traffic formula, the largest tensor the loss creates, and bad input.

One harness.spawn per world size runs everything for that size (start-up dominates
on 2 cores); the tests below read its results.
"""
import contextlib
import copy
import io
import os
import traceback

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import collectives as C
import harness
import model as M
import tensor_parallel as TP
from conftest import make_dataset

MODES = {"tp": [], "sp": ["--sequence_parallel=True"]}
BLOCK = 32  # train_args' --block_size: sequence parallelism needs it to divide by N, so it runs at 2 and 4
# one step with activations of b·s·h = 64·128·128 floats = 4 MiB: big enough that collectives.py
# all-reduces them with its ring (smaller ones go through a tree); the small preset has 4 heads
RING_BATCH, RING_WORLDS = 64, (2, 4)
RING_ARGS = ["--model=small", "--block_size=128", f"--batch_size={RING_BATCH}", "--max_iters=1", "--eval_interval=0"]


def modes(world):
    return [m for m in MODES if m == "tp" or BLOCK % world == 0]


# ----------------------------------------------------------------------------- inside the ranks

def close(actual, expected, what):
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what}: {m}")


def seq_shard(t, rank, world):
    """(b, s, ...) full -> this rank's (s/N, b, ...) sequence shard, as sequence parallelism lays it out."""
    return TP.shard(t.transpose(0, 1), 0, rank, world)


def check_layers(rank, world):
    """Each parallel layer against the plain one: forward output, input gradient and every
    parameter's gradient (a shard against the matching slice of the full gradient)."""
    torch.manual_seed(0)  # the same full layers, inputs and output gradients on every rank
    config = M.GPTConfig(block_size=12, vocab_size=192, n_layer=2, n_head=12, n_embd=96)
    B, T, H, V = 2, 12, config.n_embd, config.vocab_size

    def run(layer, x, gy):  # the plain layer: output, input grad, param grads
        x = x.clone().requires_grad_(x.is_floating_point())
        y = layer(x)
        y.backward(gy)
        return y.detach(), x.grad, {n: p.grad for n, p in layer.named_parameters()}

    def compare_params(par, grads, sp, what):
        replicated = [p for p in par.parameters() if not hasattr(p, "tp_split")]
        if sp and replicated:
            TP.sum_replicated_grads(replicated)
        for n, p in par.named_parameters():
            expected = grads[n]
            if hasattr(p, "tp_split"):
                dim, parts = p.tp_split
                expected = TP.shard(expected, dim, rank, world, parts)
            close(p.grad, expected, f"{what} {n}.grad")
        if not replicated:
            return
        # the replicas' gradients are identical on every rank, bit for bit, so the copies never drift
        flat = torch.cat([p.grad.reshape(-1) for p in replicated])
        every = flat.new_empty(world * flat.numel())
        C.all_gather(every, flat)
        assert all(torch.equal(r, flat) for r in every.view(world, -1)), f"{what}: replicated grads differ across ranks"

    for sp in (False, True):
        tag = " (sequence parallel)" if sp else ""
        # column-parallel c_attn: f, then this rank's q, k, v columns (whole heads)
        full = nn.Linear(H, 3 * H)
        x, gy = torch.randn(B, T, H), torch.randn(B, T, 3 * H)
        y, gx, grads = run(full, x, gy)
        par = TP.column_parallel(copy.deepcopy(full), rank, world, parts=3)
        xl = (seq_shard(x, rank, world) if sp else x.clone()).requires_grad_()
        yl = par(TP.enter(xl, sp))
        close(yl, TP.shard(y, 2, rank, world, 3), "column-parallel output" + tag)
        yl.backward(TP.shard(gy, 2, rank, world, 3))
        close(xl.grad, seq_shard(gx, rank, world) if sp else gx, "column-parallel input grad" + tag)
        compare_params(par, grads, sp, "column-parallel" + tag)

        # row-parallel c_proj: input split by features, output summed (g), bias added once
        full = nn.Linear(4 * H, H)
        x, gy = torch.randn(B, T, 4 * H), torch.randn(B, T, H)
        y, gx, grads = run(full, x, gy)
        par = TP.RowParallelLinear(copy.deepcopy(full), rank, world, sp)
        xl = TP.shard(x, 2, rank, world).requires_grad_()
        yl = par(xl)
        close(yl, seq_shard(y, rank, world) if sp else y, "row-parallel output" + tag)
        yl.backward(seq_shard(gy, rank, world) if sp else gy)
        close(xl.grad, TP.shard(gx, 2, rank, world), "row-parallel input grad" + tag)
        compare_params(par, grads, sp, "row-parallel" + tag)

        # vocabulary-parallel embedding
        full = nn.Embedding(V, H)
        idx, gy = torch.randint(0, V, (B, T)), torch.randn(B, T, H)
        y, _, grads = run(full, idx, gy)
        par = TP.VocabParallelEmbedding(copy.deepcopy(full), rank, world, sp)
        yl = par(idx)
        close(yl, seq_shard(y, rank, world) if sp else y, "embedding output" + tag)
        yl.backward(seq_shard(gy, rank, world) if sp else gy)
        compare_params(par, grads, sp, "embedding" + tag)

        # a whole block: model.Block against block_forward on the rank's slice
        full = M.build_unit(config, 1, seed=3)
        x, gy = torch.randn(B, T, H), torch.randn(B, T, H)
        y, gx, grads = run(full, x, gy)
        par = TP.parallel_block(copy.deepcopy(full), rank, world, sp)
        xl = (seq_shard(x, rank, world) if sp else x.clone()).requires_grad_()
        yl = TP.block_forward(par, xl, sp)
        close(yl, seq_shard(y, rank, world) if sp else y, "block output" + tag)
        yl.backward(seq_shard(gy, rank, world) if sp else gy)
        close(xl.grad, seq_shard(gx, rank, world) if sp else gx, "block input grad" + tag)
        compare_params(par, grads, sp, "block" + tag)

    # vocabulary-parallel cross-entropy against F.cross_entropy
    logits, targets = 3 * torch.randn(B * T, V), torch.randint(0, V, (B * T,))
    logits.requires_grad_()
    loss = F.cross_entropy(logits, targets)
    loss.backward()
    local = TP.shard(logits.detach(), 1, rank, world).requires_grad_()
    loss_l = TP.vocab_parallel_cross_entropy(local, targets, rank * V // world)
    close(loss_l, loss.detach(), "cross-entropy")
    loss_l.backward()
    close(local.grad, TP.shard(logits.grad, 1, rank, world), "cross-entropy grad")


class LargestTensor(TorchDispatchMode):
    """Records the most elements of any tensor an op creates while it is active."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


def largest_loss_tensors(rank, world):
    """(largest tensor of the tensor parallel head + loss, forward and backward; the same
    for the plain head). n_embd is small here so that the logits are the largest thing."""
    torch.manual_seed(0)
    B, T, H, V = 4, 8, 16, 192
    h, w, targets = torch.randn(B, T, H), torch.randn(V, H), torch.randint(0, V, (B, T))
    hl, wl = h.clone().requires_grad_(), TP.shard(w, 0, rank, world).requires_grad_()
    with LargestTensor() as parallel:
        TP.vocab_parallel_cross_entropy(F.linear(TP.enter(hl, False), wl), targets, rank * V // world).backward()
    hp, wp = h.clone().requires_grad_(), w.clone().requires_grad_()
    with LargestTensor() as plain:
        M.head(nn.Identity(), wp, hp, targets)[1].backward()
    return parallel.numel, plain.numel


def bad_input(args):
    """main(args) must stop with SystemExit before any communication: (exit code, stderr)."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            TP.main(args)
        except SystemExit as e:
            return e.code, err.getvalue()
    return 0, err.getvalue()


def worker(rank, world, train_args, out_dir, small_vocab_dir, layers):
    result = {}
    if layers:
        try:
            check_layers(rank, world)
            result["layers"] = "ok"
        except AssertionError:
            result["layers"] = traceback.format_exc()
        result["loss_numel"] = largest_loss_tensors(rank, world)
        result["bad_vocab"] = bad_input(train_args + [f"--data_dir={small_vocab_dir}"])
        result["bad_sp"] = bad_input(train_args + ["--sequence_parallel=True", f"--block_size={world * 8 + 1}"])
    for mode in modes(world):
        extra = MODES[mode]
        path = os.path.join(out_dir, f"{mode}{world}.pt")
        result[mode] = (TP.main(train_args + extra + [f"--save_path={path}"]), path)
    if world in RING_WORLDS:
        result["ring"] = TP.main(train_args + RING_ARGS)
    return result


# ----------------------------------------------------------------------------- the runs

@pytest.fixture(scope="module")
def small_vocab_dir(tmp_path_factory):
    # a 64-token vocabulary pads to 64, which 3 does not divide
    return make_dataset(str(tmp_path_factory.mktemp("vocab64")), n_train=4000, n_val=1000, vocab=64)


@pytest.fixture(scope="module")
def runs(train_args, small_vocab_dir, tmp_path_factory):
    cache = {}

    def get(world):
        if world not in cache:
            out = str(tmp_path_factory.mktemp(f"tp{world}"))
            cache[world] = harness.spawn(worker, world, train_args, out, small_vocab_dir, world in (2, 3),
                                         timeout=600)
        return cache[world]
    return get


# ----------------------------------------------------------------------------- the tests

@pytest.mark.parametrize("world", [2, 3])
def test_parallel_layers_match_plain_layers(runs, world):
    for rank, r in enumerate(runs(world)):
        assert r["layers"] == "ok", f"rank {rank}:\n{r['layers']}"


@pytest.mark.parametrize("world", [2, 3])
def test_loss_never_materializes_full_logits(runs, world):
    B, T, V = 4, 8, 192
    for parallel, plain in (r["loss_numel"] for r in runs(world)):
        assert plain == B * T * V  # the tracker does see the full logits when they exist
        assert parallel == B * T * V // world


PARITY = [(w, m) for w in (2, 3, 4) for m in modes(w)]


@pytest.mark.parametrize("world,mode", PARITY)
def test_parity_with_one_process_run(runs, reference, world, mode):
    records, path = runs(world)[0][mode]
    ref_records, ref_state = reference
    harness.assert_logs_match(records, ref_records, tol=1e-4)
    harness.assert_logs_match([r for r in records if "val_loss" in r], [r for r in ref_records if "val_loss" in r],
                              tol=1e-4, key="val_loss")
    harness.assert_states_match(torch.load(path), ref_state)


def expected_bytes(config, batch, world, rank, sp):
    """What each rank sends in one training step, counted the way collectives.py sends:
    a ring all-reduce of S bytes makes every rank send 2(N-1)/N·S, a ring reduce-scatter or
    all-gather (N-1)/N·S; an all-reduce under SMALL_ALL_REDUCE_BYTES goes up a binomial
    tree to rank 0 (every other rank sends S once) and back down (a rank sends S to each of
    its children)."""
    fp32 = 4

    def ring(numel):  # one ring reduce-scatter or all-gather of numel elements in all
        assert numel % world == 0, "pick sizes the ring splits evenly"
        return (world - 1) * numel * fp32 // world

    def all_reduce(numel):
        S = numel * fp32
        if S >= C.SMALL_ALL_REDUCE_BYTES:
            return 2 * ring(numel)
        children = sum(1 for k in range(world.bit_length()) if rank < 2**k and rank + 2**k < world)
        return (rank != 0) * S + children * S

    bsh = batch * config.block_size * config.n_embd
    # 4 per block, the embedding's g and the head's f: all-reduces, or with sequence
    # parallelism each a reduce-scatter and an all-gather, (N-1)/N·S each, the same bytes
    total = (4 * config.n_layer + 2) * (2 * ring(bsh) if sp else all_reduce(bsh))
    total += 3 * all_reduce(batch * config.block_size)   # the loss: max, target logit, sum of exp
    total += all_reduce(1)                                # the squared gradient norm of the shards
    if sp:  # the replicas' gradients: LayerNorms 4h and row-parallel biases 2h per block, ln_f, wpe
        total += all_reduce(6 * config.n_layer * config.n_embd + 2 * config.n_embd + config.block_size * config.n_embd)
    return total


@pytest.mark.parametrize("world,mode", PARITY)
def test_traffic_is_the_formula(runs, world, mode):
    records, _ = runs(world)[0][mode]
    config = M.make_config("tiny", 192, BLOCK)
    for r in records:
        expected = [expected_bytes(config, 24, world, rank, mode == "sp") for rank in range(world)]
        assert r["comm_bytes"] == expected, f"iter {r['iter']}: sent {r['comm_bytes']}, formula {expected}"
    # the state is split: each rank holds well under the whole model's 16 bytes per parameter
    full = 16 * M.num_params(M.GPT(config).parameters())
    assert all(s < full / world * 1.1 for s in records[-1]["state_bytes"]), (records[-1]["state_bytes"], full)


@pytest.mark.parametrize("world", RING_WORLDS)
def test_traffic_is_the_ring_formula(runs, world):
    """Activations big enough for the ring: (4L + 2)·2(N-1)/N·b·s·h·4 bytes, FORMULAS.md's number."""
    config = M.make_config("small", 192, 128)
    bsh = RING_BATCH * config.block_size * config.n_embd
    assert bsh * 4 >= C.SMALL_ALL_REDUCE_BYTES, "collectives.py's tree threshold moved: raise RING_BATCH"
    [record] = runs(world)[0]["ring"]
    expected = [expected_bytes(config, RING_BATCH, world, rank, False) for rank in range(world)]
    assert record["comm_bytes"] == expected
    ring_part = (4 * config.n_layer + 2) * 2 * (world - 1) * bsh * 4 // world
    assert 0 < expected[0] - ring_part < bsh  # the rest: the loss's and the norm's few small trees


@pytest.mark.parametrize("world", [3])
def test_bad_input_stops_every_rank(runs, world):
    for rank, r in enumerate(runs(world)):
        for key, words in (("bad_vocab", "padded vocabulary"), ("bad_sp", "--sequence_parallel")):
            code, err = r[key]
            assert code != 0, f"rank {rank}: {key} did not stop the run"
            if rank == 0:
                assert err.startswith("error:") and words in err, err


def test_one_process_reproduces_reference(train_args, reference, tmp_path):
    records = TP.main(train_args + [f"--save_path={tmp_path / 'state.pt'}"])
    harness.assert_logs_match(records, reference[0], tol=1e-4)
    harness.assert_states_match(torch.load(tmp_path / "state.pt"), reference[1])
    assert all(r["comm_bytes"] == [0] for r in records)


def test_torchrun_heads_do_not_divide(data_dir):
    # the small preset has 4 heads: 3 ranks cannot each own whole heads
    p = harness.torchrun("tensor_parallel.py", 3, ["--model=small", f"--data_dir={data_dir}", "--max_iters=2"])
    assert p.returncode != 0
    assert p.stderr.count("error: --model=small has 4 heads, which do not split over 3 ranks") == 1, p.stderr[-2000:]
    # torchrun reports a failed rank with a traceback of its own (ChildFailedError): the only one allowed
    assert 'tensor_parallel.py", line' not in p.stderr and 'model.py", line' not in p.stderr, p.stderr[-3000:]
    assert all("ChildFailedError" in t for t in p.stderr.split("Traceback (most recent call last)")[1:]), p.stderr
