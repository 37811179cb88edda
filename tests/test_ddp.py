"""ddp.py against the one-process run: same losses, same parameters, the traffic of the formula."""
import os

import pytest
import torch

import model as M
from harness import (spawn, torchrun, refusals, assert_refused, read_log, assert_logs_match, assert_states_match,
                     assert_sent_the_formula)
from conftest import SHORT_STEPS, VOCAB

# process start-up and 4 ranks on 2 cores make every run costly: at each world size every
# mode, and both accumulation settings at least once
MODES = {2: [("naive", 1), ("bucketed", 2), ("overlap", 1), ("overlap", 2)],
         3: [("naive", 2), ("bucketed", 1), ("overlap", 2)],
         4: [("naive", 1), ("bucketed", 2), ("overlap", 1)]}
# one run goes the whole 20 steps (overlap with accumulation: the one mode whose launch order
# depends on backward, over the warm-up and the decay); the others SHORT_STEPS, which catch a
# wrong slice, a missing reduction or a bad scale as surely, at a fraction of the cost
FULL = (2, "overlap", 2)
# the three stages of DDP as ddp.py's flags
MODE_FLAGS = {"naive": ["--bucket_mb=0", "--overlap=False"], "bucketed": ["--bucket_mb=0.5", "--overlap=False"],
              "overlap": ["--bucket_mb=0.5", "--overlap=True"]}


def _train_all(rank, world, train_args, out):
    import ddp
    results = {}
    for mode, accum in MODES[world]:
        path = os.path.join(out, f"ddp_{world}_{mode}_{accum}.pt")
        # small buckets, so that overlap has several all-reduces to launch during backward
        steps = [] if (world, mode, accum) == FULL else [f"--max_iters={SHORT_STEPS}"]
        records = ddp.main(train_args + steps + MODE_FLAGS[mode] + [f"--n_micro={accum}",
                                                 f"--save_path={path}"])
        results[(mode, accum)] = (records, path)
    if world == 2:  # every rank's model from a seed of its own (a common bug): rank 0's broadcast must undo it
        gpt = M.GPT
        M.GPT = lambda config, seed: gpt(config, seed=seed + rank)
        try:
            results["per-rank seed"] = ddp.main(train_args + [f"--max_iters={SHORT_STEPS}"])
        finally:
            M.GPT = gpt  # a pooled rank: later jobs see the real class
    return results


@pytest.mark.parametrize("world", [2, 3, 4])
def test_parity_and_traffic(world, train_args, reference, reference_short, tmp_path):
    results = spawn(_train_all, world, train_args, str(tmp_path), timeout=400)[0]
    n_params = M.num_params(M.GPT(M.make_config("tiny", VOCAB, block_size=32)).parameters())
    grad_bytes = 4 * n_params
    if world == 2:
        assert_logs_match(results.pop("per-rank seed"), reference_short[0], 1e-4)
    for (mode, accum), (records, path) in results.items():
        ref_records, ref_state = reference if (world, mode, accum) == FULL else reference_short
        where = f"{mode}, n_micro={accum}, {world} ranks"
        assert_logs_match(records, ref_records, 1e-4)
        assert_logs_match([r for r in records if "val_loss" in r], [r for r in ref_records if "val_loss" in r],
                          1e-4, key="val_loss")
        assert_states_match(torch.load(path), ref_state, 1e-5)
        for r in records:
            # a ring passes every chunk through N-1 hops, twice: 2(N-1)·S in all, exactly,
            # whatever the chunking (small messages take the tree, which sends the same total)
            assert sum(r["comm_bytes"]) == 2 * (world - 1) * grad_bytes, where
            assert len(r["comm_bytes"]) == len(r["state_bytes"]) == world
            # every rank holds everything: 16 bytes a parameter (param, grad, Adam m and v)
            assert r["state_bytes"] == [16 * n_params] * world, where
        if mode != "naive":
            # per rank 2(N-1)/N·S, up to the rounding of uneven chunks (an element per chunk and step)
            n_buckets = -(-grad_bytes // int(0.5 * 2**20)) + 1
            for sent in records[-1]["comm_bytes"]:
                assert abs(sent - 2 * (world - 1) / world * grad_bytes) <= 2 * world * 4 * n_buckets, where


@pytest.mark.quick
def test_torchrun_end_to_end(train_args, reference_short, tmp_path):
    """ddp.py's quick check, as a user runs it: torchrun, 2 ranks (overlapped buckets, the default
    mode), 3 steps against the one-process run: the losses, and the bytes of the formula."""
    log = tmp_path / "log.jsonl"
    argv = train_args + [f"--max_iters={SHORT_STEPS}", "--bucket_mb=0.25"]
    r = torchrun("ddp.py", 2, argv + [f"--log_file={log}", "--log_interval=4"], timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("iter ") == 2  # rank 0 alone prints: iteration 0, and the last (for its validation)
    assert_logs_match(read_log(log), reference_short[0], 1e-4)
    assert_logs_match([r for r in read_log(log) if "val_loss" in r], [r for r in reference_short[0] if "val_loss" in r],
                      1e-4, key="val_loss")
    assert_sent_the_formula("ddp", argv, read_log(log), VOCAB)


def test_batch_that_does_not_divide_fails_on_every_rank(train_args):
    # 24 rows, 3 ranks x 3 micro-steps: every rank stops, rank 0 alone says why
    assert_refused(refusals("ddp", 3, train_args + ["--n_micro=3"]),
                   "--batch_size=24 does not divide into 3 ranks x 3 micro-steps")


@pytest.mark.quick
def test_one_process_launches_no_collective(train_args, monkeypatch):
    """The reference every parity test compares with: no broadcast, no all-reduce, no
    async handle left behind (it once raced its own no-op all-reduce against clipping)."""
    import collectives as C
    import ddp
    launched = []
    real = C._launch
    monkeypatch.setattr(C, "_launch", lambda name, *a, **k: launched.append(name) or real(name, *a, **k))
    for mode in ("naive", "bucketed", "overlap"):
        ddp.main(train_args + ["--max_iters=2", "--eval_interval=1", *MODE_FLAGS[mode]])
    assert launched == [], launched
    assert not C._workers  # no worker was ever started


def _compiled_nodes(loss):
    """The autograd nodes of compiled graphs that loss's backward passes through."""
    found, seen, todo = 0, set(), [loss.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        found += "CompiledFunction" in type(node).__name__
        todo.extend(next_fn for next_fn, _ in node.next_functions)
    return found


def test_compile_splits_backward_by_block():
    """--compile compiles block by block: backward has one node per block (and one for the
    head with its loss, compiled too), so DDP's buckets launch while it runs. Compiled whole
    (the old way), backward is one node and every gradient appears at its end: that is
    checked too, so the count can tell them apart."""
    import dataclasses
    import ddp
    torch._dynamo.reset()
    config = dataclasses.replace(M.make_config("tiny", VOCAB, block_size=16), n_layer=3)
    x = torch.randint(0, VOCAB, (2, 16))
    per_block = ddp.compile_blocks(M.GPT(config), backend="aot_eager")
    assert _compiled_nodes(per_block(x, x)[1]) == config.n_layer + 1
    whole = torch.compile(M.GPT(config), backend="aot_eager")
    assert _compiled_nodes(whole(x, x)[1]) == 1


def _toy(seed=0):
    """A model as a user forks one: two layers, a frozen one before them, and one never called."""
    torch.manual_seed(seed)
    # buckets in reverse order (0.5 kB): [b.bias] [b.weight] [unused, a.bias] [a.weight], so the hooks launch
    # two, and the unused parameter holds back its bucket and the full one after it, until reduce()
    model = torch.nn.ModuleDict(dict(frozen=torch.nn.Linear(8, 8), a=torch.nn.Linear(8, 32),
                                     unused=torch.nn.Linear(8, 8), b=torch.nn.Linear(32, 8)))
    model.frozen.requires_grad_(False)
    return model


def _toy_loss(model, x, y):
    return torch.nn.functional.mse_loss(model.b(torch.tanh(model.a(model.frozen(x)))), y)


def _forked_loop(rank, world, steps=3):
    """The loop a user writes around GradBuckets (or all_reduce_each): optimizer.zero_grad()
    as torch's default has it (set_to_none=True) and the other way, forward on this rank's
    rows, backward, reduce, step. -> for each case, the largest difference of any weight
    from the one-process run of the same loop on the whole batch."""
    import ddp
    g = torch.Generator().manual_seed(1)
    xs, ys = torch.randn(steps, 12, 8, generator=g), torch.randn(steps, 12, 8, generator=g)
    rows = slice(rank * 12 // world, (rank + 1) * 12 // world)  # 12 rows: 2 and 3 ranks both divide them

    def train(mode, set_to_none, world):
        model = _toy()
        # weight decay 0: a parameter no rank used gets a zero gradient from the buckets, None in one process,
        # and AdamW would decay the one and skip the other (docs/data_parallel.md)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
        buckets = ddp.GradBuckets(model.parameters(), 0.0005, mode == "overlap") \
            if world > 1 and mode != "naive" else None
        for k in range(steps):
            optimizer.zero_grad(set_to_none=set_to_none)
            part = rows if world > 1 else slice(None)
            _toy_loss(model, xs[k, part], ys[k, part]).backward()
            if buckets:
                buckets.reduce()
            elif world > 1:
                ddp.all_reduce_each(model.parameters())
            optimizer.step()
        return model.state_dict(), buckets

    ref, _ = train("naive", True, 1)
    out = {}
    for mode in ("naive", "bucketed", "overlap"):
        for set_to_none in (True, False):
            state, buckets = train(mode, set_to_none, world)
            assert buckets is None or len(buckets.buffers) == 4
            out[(mode, set_to_none)] = max((state[k] - ref[k]).abs().max().item() for k in ref)
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_forked_loop_with_zero_grad_frozen_and_unused(world):
    """A user's loop (zero_grad to None or to zeros, a frozen and an unused parameter) trains
    as the one-process run: the hooks copy a gradient autograd wrote outside its bucket back
    into it, the unused parameter's bucket still goes, in order, with zeros."""
    for case, diff in spawn(_forked_loop, world, timeout=120)[0].items():
        assert diff <= 1e-6, (case, diff)


def _with_zero_grad(rank, world, runs):
    """Each strategy's main, as a user forks it: optimizer.zero_grad() (torch's default,
    set_to_none=True) at the top of every step, besides the file's own zeroing. -> the
    records of each run."""
    import importlib
    real_begin, real_make, made = M.begin_iter, M.make_optimizer, []

    def make_optimizer(*args, **kwargs):  # the optimizer main steps, whatever it keeps in run
        made.append(real_make(*args, **kwargs))
        return made[-1]

    def begin_iter(run, it, evaluate):
        real_begin(run, it, evaluate)
        made[-1].zero_grad(set_to_none=True)
    M.begin_iter, M.make_optimizer = begin_iter, make_optimizer
    out = {}
    try:
        for name, (module, argv) in runs.items():
            try:
                out[name] = importlib.import_module(module).main(argv)
            except AttributeError as e:  # every rank alike: a .grad of None met where a tensor was expected
                out[name] = f"{type(e).__name__}: {e}"
        return out
    finally:
        M.begin_iter, M.make_optimizer = real_begin, real_make


def test_main_with_zero_grad(train_args, reference_short):
    """ddp.py with optimizer.zero_grad() added to its step trains as before: each hook
    copies the gradient autograd wrote anew back into its bucket."""
    three = train_args + [f"--max_iters={SHORT_STEPS}"]
    runs = {mode: ("ddp", three + MODE_FLAGS[mode]) for mode in ("overlap", "bucketed")}
    for name, records in spawn(_with_zero_grad, 2, runs)[0].items():
        assert not isinstance(records, str), records
        assert_logs_match(records, reference_short[0], 1e-4)


def test_sharded_with_zero_grad(train_args, reference_short):
    """The same for the other flat gradient buffers: fsdp.py's units, parallel_nd.py's data
    axes. A gradient shard the optimizer no longer sees (its .grad set to None) must not
    leave the weights where they were."""
    three = train_args + [f"--max_iters={SHORT_STEPS}"]
    runs = {f"fsdp ZeRO-{z}": ("fsdp", three + [f"--zero_stage={z}"]) for z in (1, 3)}  # ZeRO-2 steps as 3 does
    runs["parallel_nd --dp_shard=2"] = ("parallel_nd", three + ["--dp_shard=2"])  # dp_replicate: ddp's buckets
    failed = {}
    for name, records in spawn(_with_zero_grad, 2, runs)[0].items():
        try:
            assert not isinstance(records, str), records
            assert_logs_match(records, reference_short[0], 1e-4)
        except AssertionError as e:
            failed[name] = str(e).splitlines()[0]
    assert not failed, failed
