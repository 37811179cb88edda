"""Tensor parallel: every parallel layer against the plain layer, parity with the
one-process run at world sizes 1 to 4 (sequence parallelism at 2 and 4, where the
sequence splits), the traffic formula in float32 and bfloat16, exact resume, the
pieces on two sub-groups at once, the largest tensor the loss creates, and bad input.

One harness.spawn per world size runs everything for that size (start-up dominates
on 2 cores); the tests below read its results.
"""
import copy
import json
import math
import os
import traceback
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import collectives as C
import harness
from harness import check_at_two_ranks
import model as M
import tensor_parallel as TP
from conftest import BF16_ARGS, SHORT_STEPS, VOCAB, make_dataset

MODES = {"tp": [], "sp": ["--sequence_parallel=True"]}
BLOCK, BATCH = 32, 24  # train_args': sequence parallelism needs BLOCK to divide by N, so it runs at 2 and 4
BF16 = BF16_ARGS  # CPU bf16 matmuls are emulated here (~9x float32): a small run, conftest's reference's
BF16_BATCH = 8
FULL = (2, "sp")  # the one 20-step parity run (warm-up and decay), and the one the resume continues
RESUME_FROM = 15
PIECE_STEPS = SHORT_STEPS  # the pieces' own training loop on two sub-groups at once: the short tp run's steps


def steps(world, mode):
    """The FULL run goes 20 steps; the others SHORT_STEPS, which catch a wrong slice or a
    missing sum as surely."""
    return [] if (world, mode) == FULL else [f"--max_iters={SHORT_STEPS}"]


def modes(world):
    return [m for m in MODES if m == "tp" or BLOCK % world == 0]


# ----------------------------------------------------------------------------- inside the ranks

def close(actual, expected, what):
    # atol 1e-5: the (s, b) layout sums a weight's gradient over the rows in another order
    # than the plain layer's (b, s); a wrong slice or a missing sum is off by O(1)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5, msg=lambda m: f"{what}: {m}")


def seq(t, rank, world, sp):
    """(b, s, ...) full -> the (s, b, ...) layout of the tensor parallel residual stream,
    and with sequence parallelism this rank's s/N positions of it."""
    t = t.transpose(0, 1).contiguous()
    return TP.take(t, TP.shard_index(t.shape[0], 0, rank, world)) if sp else t


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
        sharded, replicated = TP.split_params(par)
        assert sharded, f"{what}: nothing is sharded"
        if sp and replicated:
            C.all_reduce_flat([p.grad for p in replicated], op="sum")
        for n, p in par.named_parameters():
            expected = TP.take(grads[n], p.tp_index) if hasattr(p, "tp_index") else grads[n]
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
        par = TP.ColumnParallelLinear(copy.deepcopy(full), None, sp, parts=3)
        cols = TP.shard_index(3 * H, 2, rank, world, parts=3)
        assert par.weight.tp_index == [(0, a, b) for _, a, b in cols]  # the checkpoint's q|k|v slices
        xl = seq(x, rank, world, sp).requires_grad_()
        yl = par(xl)
        close(yl, TP.take(seq(y, 0, 1, False), cols), "column-parallel output" + tag)
        yl.backward(TP.take(seq(gy, 0, 1, False), cols))
        close(xl.grad, seq(gx, rank, world, sp), "column-parallel input grad" + tag)
        compare_params(par, grads, sp, "column-parallel" + tag)

        # row-parallel c_proj: input split by features, output summed (g), bias added once
        full = nn.Linear(4 * H, H)
        x, gy = torch.randn(B, T, 4 * H), torch.randn(B, T, H)
        y, gx, grads = run(full, x, gy)
        par = TP.RowParallelLinear(copy.deepcopy(full), None, sp)
        rows = TP.shard_index(4 * H, 2, rank, world)
        assert par.weight.tp_index == (1, rows[1], rows[2])
        xl = TP.take(seq(x, 0, 1, False), rows).requires_grad_()
        yl = par(xl)
        close(yl, seq(y, rank, world, sp), "row-parallel output" + tag)
        yl.backward(seq(gy, rank, world, sp))
        close(xl.grad, TP.take(seq(gx, 0, 1, False), rows), "row-parallel input grad" + tag)
        compare_params(par, grads, sp, "row-parallel" + tag)

        # vocabulary-parallel embedding, fed (s, b) ids
        full = nn.Embedding(V, H)
        idx, gy = torch.randint(0, V, (B, T)), torch.randn(B, T, H)
        y, _, grads = run(full, idx, gy)
        par = TP.VocabParallelEmbedding(copy.deepcopy(full), None, sp)
        assert par.weight.tp_index == (0, rank * V // world, (rank + 1) * V // world)
        yl = par(idx.t())
        close(yl, seq(y, rank, world, sp), "embedding output" + tag)
        yl.backward(seq(gy, rank, world, sp))
        compare_params(par, grads, sp, "embedding" + tag)

        # a whole block: model.Block against block_forward on the rank's slice
        full = M.build_unit(config, 1, seed=3)
        x, gy = torch.randn(B, T, H), torch.randn(B, T, H)
        y, gx, grads = run(full, x, gy)
        par = TP.parallel_block(copy.deepcopy(full), None, sp)
        xl = seq(x, rank, world, sp).requires_grad_()
        yl = TP.block_forward(par, xl)
        close(yl, seq(y, rank, world, sp), "block output" + tag)
        yl.backward(seq(gy, rank, world, sp))
        close(xl.grad, seq(gx, rank, world, sp), "block input grad" + tag)
        compare_params(par, grads, sp, "block" + tag)

    # vocabulary-parallel cross-entropy against F.cross_entropy; also at logits of +-500, as a bf16 spike or
    # late training reaches: there only the max over the ranks keeps exp(z - m) from underflowing (the
    # tiny model's logits stay near 3, where a sum of the ranks' maxima gives the same log-sum-exp)
    targets = torch.randint(0, V, (B * T,))
    for scale, dtype in ((3, torch.float32), (500, torch.float32), (500, torch.bfloat16)):
        logits = (scale * (2 * torch.rand(B * T, V) - 1)).to(dtype).requires_grad_()
        loss = F.cross_entropy(logits.float(), targets)
        loss.backward()
        vocab = TP.shard_index(V, 1, rank, world)
        local = TP.take(logits.detach(), vocab).requires_grad_()
        loss_l = TP.vocab_parallel_cross_entropy(local, targets, vocab[1])
        tag = f" (logits to +-{scale}, {dtype})"
        close(loss_l, loss.detach(), "cross-entropy" + tag)
        loss_l.backward()
        close(local.grad.float(), TP.take(logits.grad, vocab).float(), "cross-entropy grad" + tag)


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
    hl, wl = h.clone().requires_grad_(), TP.take(w, TP.shard_index(V, 0, rank, world)).requires_grad_()
    with LargestTensor() as parallel:
        logits = F.linear(TP.copy_to_parallel_region(hl), wl)
        TP.vocab_parallel_cross_entropy(logits, targets, rank * V // world).backward()
    hp, wp = h.clone().requires_grad_(), w.clone().requires_grad_()
    with LargestTensor() as plain:
        M.head(nn.Identity(), wp, hp, targets)[1].backward()
    return parallel.numel, plain.numel


def train_pieces(train_args, group, sp, steps):
    """main's training step, rebuilt from the pieces on `group`: this group's losses."""
    cfg = M.parse_args(TP.DEFAULTS, train_args)
    train, _, vocab = M.load_data(cfg.data_dir)
    config = M.make_config(cfg.model, vocab, cfg.block_size)
    model = TP.build_model(config, cfg.seed, group, sp)
    sharded, replicated = TP.split_params(model)
    optimizer = M.make_optimizer(model.named_parameters(), cfg, "cpu")
    losses = []
    for it in range(steps):
        M.set_lr(optimizer, M.get_lr(it, cfg))
        optimizer.zero_grad(set_to_none=True)
        x, y = M.get_batch(train, cfg.seed, it, cfg.batch_size, config.block_size)
        loss = TP.forward(model, x, y, group, sp)
        loss.backward()
        if sp:
            C.all_reduce_flat([p.grad for p in replicated], op="sum", group=group)
        TP.clip_global_norm(sharded, replicated, cfg.grad_clip, group)
        optimizer.step()
        losses.append(loss.item())
    return losses


def two_pairs(rank, world, train_args):
    """Ranks {0, 1} and {2, 3} each train the same model on the same data, at once, every
    piece on its own pair: -> (losses by mode, bytes sent by group, this rank's group)."""
    pairs = [C.new_group([0, 1]), C.new_group([2, 3])]  # every rank creates both, in the same order
    group = pairs[rank // 2]
    C.reset_bytes()
    losses = {mode: train_pieces(train_args, group, mode == "sp", PIECE_STEPS) for mode in MODES}
    return losses, C.bytes_by_group(), tuple(C.group_ranks(group))


def worker(rank, world, train_args, out_dir, small_vocab_dir):
    result = {}
    if world in (2, 3):
        try:
            check_layers(rank, world)
            result["layers"] = "ok"
        except AssertionError:
            result["layers"] = traceback.format_exc()
        result["loss_numel"] = largest_loss_tensors(rank, world)
    if world == 3:  # refused before any communication, on every rank (at 2 ranks the 64 ids divide: it trains)
        result["bad_vocab"] = harness.refuse("tensor_parallel", train_args + [f"--data_dir={small_vocab_dir}"])
        result["bad_sp"] = harness.refuse("tensor_parallel", train_args + ["--sequence_parallel=True",
                                                                         f"--block_size={world * 8 + 1}"])
    ckpt = os.path.join(out_dir, "ckpt")
    for mode in modes(world):
        extra = MODES[mode]
        if (world, mode) == FULL:  # the run that the resume test continues
            extra = extra + [f"--out_dir={ckpt}", f"--ckpt_interval={RESUME_FROM}"]
        path = os.path.join(out_dir, f"{mode}{world}.pt")
        result[mode] = (TP.main(train_args + steps(world, mode) + extra + [f"--save_path={path}"]), path)
    if world == 2:
        result["ckpt"] = os.path.join(ckpt, f"step_{RESUME_FROM:06d}")
        result["resumed"] = TP.main(train_args + MODES["sp"] + [f"--resume={ckpt}/step_{RESUME_FROM:06d}"])
        for mode in MODES:
            result["bf16_" + mode] = TP.main(train_args + BF16 + MODES[mode])
        result["dropout"] = TP.main(train_args + ["--max_iters=1", "--dropout=0.5"])
    if world == 4:
        result["pairs"] = two_pairs(rank, world, train_args)
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
            cache[world] = harness.spawn(worker, world, train_args, out, small_vocab_dir, timeout=600)
        return cache[world]
    return get


# ----------------------------------------------------------------------------- the tests


@pytest.mark.quick
def test_quick_at_2_ranks(train_args, reference_short):
    """tensor_parallel.py's quick check: 2 ranks with sequence parallelism (every f and g as a reduce-scatter
    and an all-gather), 3 steps, against the one-process run."""
    check_at_two_ranks("tensor_parallel", train_args + [f"--max_iters={SHORT_STEPS}", "--sequence_parallel=True"],
                       reference_short[0], VOCAB)


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
def test_parity_with_one_process_run(runs, reference, reference_short, world, mode):
    records, path = runs(world)[0][mode]
    ref_records, ref_state = reference if (world, mode) == FULL else reference_short
    harness.assert_logs_match(records, ref_records, tol=1e-4)
    harness.assert_logs_match([r for r in records if "val_loss" in r], [r for r in ref_records if "val_loss" in r],
                              tol=1e-4, key="val_loss")
    # --save_path is model.py's, from this rank's checkpoint entries: the slices must be right
    harness.assert_states_match(torch.load(path), ref_state)
    assert all(r["sequence_parallel"] is (mode == "sp") for r in records)


def expected_bytes(config, batch, world, rank, sp, d=4):
    """What each rank sends in one training step, counted the way collectives.py sends:
    a ring all-reduce of S bytes makes every rank send 2(N-1)/N·S, a ring reduce-scatter or
    all-gather (N-1)/N·S; an all-reduce under SMALL_ALL_REDUCE_BYTES goes up a binomial
    tree to rank 0 (every other rank sends S once) and back down (a rank sends S to each of
    its children). d: the compute dtype's bytes, which the blocks' and the head's
    activations travel in; the embedding's rows and everything else are float32."""

    def ring(numel, size):  # one ring reduce-scatter or all-gather of numel elements in all
        assert numel % world == 0, "pick sizes the ring splits evenly"
        return (world - 1) * numel * size // world

    def all_reduce(numel, size=4):
        S = numel * size
        if S >= C.SMALL_ALL_REDUCE_BYTES:
            return 2 * ring(numel, size)
        children = sum(1 for k in range(world.bit_length()) if rank < 2**k and rank + 2**k < world)
        return (rank != 0) * S + children * S

    def region(size):  # f or g: an all-reduce, or a reduce-scatter and an all-gather (the same bytes)
        return 2 * ring(bsh, size) if sp else all_reduce(bsh, size)

    bsh = batch * config.block_size * config.n_embd
    total = (4 * config.n_layer + 1) * region(d)       # 4 per block and the head's f: the compute dtype
    total += region(4)                                 # the embedding's g: float32 rows
    total += 3 * all_reduce(batch * config.block_size)  # the loss: max, target logit, sum of exp
    total += all_reduce(1)                             # the squared gradient norm
    if sp:  # the replicas' gradients: LayerNorms 4h and row-parallel biases 2h per block, ln_f, wpe
        total += all_reduce(6 * config.n_layer * config.n_embd + 2 * config.n_embd + config.block_size * config.n_embd)
    return total


def formula(config, batch, world, mode, dtype="float32"):
    cfg = SimpleNamespace(dtype=dtype, batch_size=batch, sequence_parallel=mode == "sp")
    return TP.traffic_per_rank(config, cfg, world)


@pytest.mark.parametrize("world,mode", PARITY)
def test_traffic_is_the_formula(runs, world, mode):
    records, _ = runs(world)[0][mode]
    config = M.make_config("tiny", VOCAB, BLOCK)
    expected = [expected_bytes(config, BATCH, world, rank, mode == "sp") for rank in range(world)]
    assert round(world * formula(config, BATCH, world, mode)) == sum(expected)  # the file's own formula
    for r in records:
        assert r["comm_bytes"] == expected, f"iter {r['iter']}: sent {r['comm_bytes']}, formula {expected}"
    if mode == "tp":
        # the activations (b·s·h = 24·32·96 floats, 288 KiB) take collectives.py's ring (smaller
        # all-reduces go through a tree): (4L + 2)·2(N-1)/N·b·s·h·4 bytes (Shoeybi et al. 2019),
        # and the loss's and the norm's few small trees
        bsh = BATCH * config.block_size * config.n_embd
        assert bsh * 4 >= C.SMALL_ALL_REDUCE_BYTES, "collectives.py's tree threshold moved: raise the test batch"
        ring_part = (4 * config.n_layer + 2) * 2 * (world - 1) * bsh * 4 // world
        assert 0 < expected[0] - ring_part < bsh
    # the state is split: each rank holds well under the whole model's 16 bytes per parameter
    full = 16 * M.num_params(M.GPT(config).parameters())
    assert all(s < full / world * 1.1 for s in records[-1]["state_bytes"]), (records[-1]["state_bytes"], full)


@pytest.mark.parametrize("mode", list(MODES))
def test_bfloat16_bytes_and_loss(runs, reference_bf16, mode):
    """bf16 autocast at 2 ranks: f moves bf16 (its input is cast first, as autocast would
    for the matmul), the embedding float32, and each rank sends exactly the formula's
    bytes; the loss stays within bf16 rounding of the one-process bf16 run (partial sums
    are rounded to bf16 before they are added: measured 1.25e-4 at most, tp and sp alike,
    over conftest's 4 bf16 steps of 8 rows; a wrong gradient moves it by ~1e-2 in as many)."""
    records = runs(2)[0]["bf16_" + mode]
    config = M.make_config("tiny", VOCAB, BLOCK)
    expected = [expected_bytes(config, BF16_BATCH, 2, rank, mode == "sp", d=2) for rank in range(2)]
    assert expected == [formula(config, BF16_BATCH, 2, mode, "bfloat16")] * 2
    assert expected[0] < 0.6 * expected_bytes(config, BF16_BATCH, 2, 0, mode == "sp")  # about half of float32's
    for r in records:
        assert r["comm_bytes"] == expected, f"iter {r['iter']}: sent {r['comm_bytes']}, formula {expected}"
    harness.assert_logs_match(records, reference_bf16, tol=3e-4)


def test_resume_is_exact(runs):
    first, _ = runs(2)[0]["sp"]
    resumed = runs(2)[0]["resumed"]
    assert [r["iter"] for r in resumed] == list(range(RESUME_FROM, len(first)))
    assert [r["loss"] for r in resumed] == [r["loss"] for r in first[RESUME_FROM:]]
    assert "ckpt_bytes" in first[RESUME_FROM - 1]


def test_checkpoint_holds_every_element_once(runs):
    """The entries: shards with their slices (c_attn's q|k|v as three), replicas written by
    one rank; so the pieces of every global tensor add up to it exactly, none twice."""
    with open(os.path.join(runs(2)[0]["ckpt"], "manifest.json")) as f:
        manifest = json.load(f)
    held, files = {}, {}
    for rank_file in manifest["files"]:
        for piece in rank_file["pieces"]:
            if piece["kind"] == "param":
                shape, index = manifest["shapes"][piece["name"]], piece["index"]
                n = math.prod(shape) if index is None else math.prod(shape) // shape[index[0]] * (index[2] - index[1])
                held[piece["name"]] = held.get(piece["name"], 0) + n
                files.setdefault(piece["name"], set()).add(rank_file["file"])
    assert held == {name: math.prod(shape) for name, shape in manifest["shapes"].items()}
    assert len(files["transformer.wpe.weight"]) == 1 and len(files["transformer.h.0.attn.c_attn.weight"]) == 2


def test_pieces_on_two_subgroups_at_once(runs):
    """Two pairs of ranks run tensor parallel's pieces at the same time, each on its own
    group: both reproduce the world-2 run of main, and no byte crosses between the pairs."""
    pairs, world2 = runs(4), runs(2)[0]
    config = M.make_config("tiny", VOCAB, BLOCK)
    for rank, (losses, by_group, ranks) in enumerate(r["pairs"] for r in pairs):
        assert ranks == ((0, 1) if rank < 2 else (2, 3))
        for mode in MODES:
            main_losses = [r["loss"] for r in world2[mode][0][:PIECE_STEPS]]
            assert losses[mode] == pytest.approx(main_losses, abs=1e-5), f"rank {rank}, {mode}"
        sent = PIECE_STEPS * sum(expected_bytes(config, BATCH, 2, rank % 2, mode == "sp") for mode in MODES)
        assert by_group == {ranks: sent}, f"rank {rank} sent {by_group}, expected {sent} on {ranks} alone"


@pytest.mark.parametrize("world", [3])
def test_bad_input_stops_every_rank(runs, world):
    for key, words in (("bad_vocab", "padded vocabulary"), ("bad_sp", "--sequence_parallel")):
        harness.assert_refused([r[key] for r in runs(world)], words)


def test_validation_runs_without_dropout(runs, reference_short):
    """--dropout=0.5: the training losses differ from the one-process run's (other masks), but validation
    runs in eval mode, so at step 0, on the same weights, its loss is the dropout-free reference's.
    Measured at 2 ranks: 4.8e-7 apart; evaluated in train mode instead, 2.9e-5."""
    [record] = runs(2)[0]["dropout"]
    want = reference_short[0][0]["val_loss"]
    assert abs(record["val_loss"] - want) <= 5e-6, f"val_loss {record['val_loss']:.7f} with dropout 0.5, {want:.7f} without"


def test_one_process_reproduces_reference(train_args, reference_short, tmp_path):
    with harness.one_thread():
        records = TP.main(train_args + [f"--max_iters={SHORT_STEPS}", f"--save_path={tmp_path / 'state.pt'}"])
    harness.assert_logs_match(records, reference_short[0], tol=1e-4)
    harness.assert_states_match(torch.load(tmp_path / "state.pt"), reference_short[1])
    assert all(r["comm_bytes"] == [0] for r in records)


def test_heads_that_do_not_divide_stop_every_rank(data_dir):
    # the small preset has 4 heads: 3 ranks cannot each own whole heads
    harness.assert_refused(harness.refusals("tensor_parallel", 3, ["--model=small", f"--data_dir={data_dir}",
                                                                  "--max_iters=2"]),
                           "--model=small has 4 heads, which do not split over 3 ranks")
