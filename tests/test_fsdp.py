"""fsdp.py against the one-process run: same losses, same parameters; the traffic and the
per-rank state of the formulas, computed exactly from the config, for every ZeRO stage at 2, 3
and 4 ranks; the ladder DDP > ZeRO-1 > ZeRO-2 > ZeRO-3; the prefetch bound; bf16 mixed
precision; --compile; resuming from a checkpoint."""
import functools
import os

import pytest
import torch

import model as M
from harness import spawn, check_at_two_ranks, refusals, assert_refused, assert_logs_match, assert_states_match
from conftest import BF16_ARGS, SHORT_STEPS, VOCAB

# (world size) -> the runs that share one spawn: (name, extra flags, model)
# "small" at 3 ranks: n_embd=128, so its units do not divide by 3 and the shards are padded
# (every size of the tiny preset is a multiple of n_embd=96, which 2, 3 and 4 divide).
# Prefetch 2, 0 and 1 (the default) at 2, 3 and 4 ranks: max_gathered_units must be 1 + prefetch.
# Every stage at every world size (ZeRO-1/2 at 3 and 4 ranks on the short small runs), so the
# state of each stage is held to its formula at 2, 3 and 4 ranks, padded shards included.
SMALL = ["--model=small", "--block_size=32", f"--max_iters={SHORT_STEPS}", "--eval_interval=2"]
SHORT = [f"--max_iters={SHORT_STEPS}"]  # against the reference's first SHORT_STEPS steps
RUNS = {
    2: [("zero3_prefetch2_accum2", ["--prefetch=2", "--n_micro=2"], "tiny"),  # the 20-step run
        ("zero1_accum2", SHORT + ["--zero_stage=1", "--n_micro=2"], "tiny"),
        ("zero2_accum2", SHORT + ["--zero_stage=2", "--n_micro=2"], "tiny")],
    3: [("zero3_prefetch0", SHORT + ["--prefetch=0"], "tiny"), ("zero3_small_uneven", SMALL, "small"),
        ("zero1_small_uneven", SMALL + ["--zero_stage=1"], "small"),
        ("zero2_small_uneven", SMALL + ["--zero_stage=2"], "small")],
    4: [("zero3", SHORT, "tiny"), ("zero1_small", SMALL + ["--zero_stage=1"], "small"),
        ("zero2_small", SMALL + ["--zero_stage=2"], "small")],
}
# at 2 ranks, checkpointed and resumed: (run, the step it resumes from). Late in the run, so the
# resumed run is short; ZeRO-3 past the schedule's warm-up, ZeRO-1 (which must refresh its full
# weights from the loaded shards) in its short run.
RESUMED = {"zero3_prefetch2_accum2": 15, "zero1_accum2": SHORT_STEPS - 1}
# bf16 at 2 ranks, 4 steps of 8 rows (a bf16 matmul on a CPU without bf16 units costs ~10
# float32 ones), against the one-process bf16 run of ddp.py
BF16_STEPS = BF16_ARGS
BF16_RUNS = [("zero3_bf16", []), ("zero1_accum2_bf16", ["--zero_stage=1", "--n_micro=2"]),
             ("zero2_bf16", ["--zero_stage=2"])]


def flag(extra, name, default):
    return next((type(default)(a.split("=", 1)[1]) for a in extra if a.startswith(f"--{name}=")), default)


def _train_all(rank, world, train_args, out):
    import collectives as C
    import fsdp
    results = {}
    for name, extra, _ in RUNS[world]:
        path, ckpt = os.path.join(out, f"fsdp_{world}_{name}.pt"), os.path.join(out, f"ckpt_{name}")
        at = RESUMED.get(name) if world == 2 else None
        saving = [f"--out_dir={ckpt}", f"--ckpt_interval={at}"] if at else []
        results[name] = (fsdp.main(train_args + extra + saving + [f"--save_path={path}"]), path)
        if at:
            step = os.path.join(ckpt, f"step_{at:06d}")
            results[name + "_resumed"] = (fsdp.main(train_args + extra + [f"--resume={step}"]), None)
    if world == 2:
        args = [a for a in train_args if not a.startswith("--dtype=")] + BF16_STEPS
        for name, extra in BF16_RUNS:
            results[name] = (fsdp.main(args + extra), None)
    # what this rank sends for the gradient norm's all-reduce of one float (a tree: it differs by rank)
    C.reset_bytes()
    C.all_reduce(torch.zeros(()))
    return results, C.bytes_sent()


@pytest.fixture(scope="module")
def runs(train_args, tmp_path_factory):
    """world -> (rank 0's results by run name, the norm's bytes by rank): one spawn per world size."""
    done = {}

    def get(world):
        if world not in done:
            out = str(tmp_path_factory.mktemp(f"fsdp{world}"))
            returned = spawn(_train_all, world, train_args, out, timeout=900)
            done[world] = returned[0][0], [r[1] for r in returned]
        return done[world]
    return get


def parts(config, bf16):
    """Per unit, its parts as (elements, bytes each when gathered): in a bf16 run a block's linear
    layers travel in bf16 and its LayerNorms in fp32; the ends (embeddings, final norm, tied head)
    always in fp32, and everything in fp32 otherwise."""
    units = {}
    for name, p in M.GPT(config).named_parameters():  # the tied matrix once
        unit = name.split(".")[2] if name.startswith("transformer.h.") else "ends"
        linear = bf16 and (".attn." in name or ".mlp." in name)
        units.setdefault(unit, {}).setdefault(2 if linear else 4, 0)
        units[unit][2 if linear else 4] += p.numel()
    return [[(n, b) for b, n in u.items()] for u in units.values()]


def shard_layout(config, world, bf16=False):
    """(per rank: elements with padding, their bytes when gathered; padding in all; real elements by rank)."""
    flat = [(n, b) for unit in parts(config, bf16) for n, b in unit]
    shards = [(-(-n // world), b) for n, b in flat]
    real = [sum(min(max(n - r * s, 0), s) for (n, _), (s, _) in zip(flat, shards)) for r in range(world)]
    return (sum(s for s, _ in shards), sum(s * b for s, b in shards),
            world * sum(s for s, _ in shards) - sum(n for n, _ in flat), real)


def expected_bytes(config, world, stage, accum, bf16=False):
    """What one rank sends per step, norm excluded: a ring all-gather or reduce-scatter sends N-1
    chunks of the shard. Gathers in each part's dtype; reduce-scatters in fp32."""
    S, gathered, _, _ = shard_layout(config, world, bf16)
    gathers, reduces = {3: (2 * accum, accum), 2: (1, accum), 1: (1, 1)}[stage]
    return (world - 1) * (gathers * gathered + reduces * 4 * S)


def expected_state(config, world, stage, bf16=False):
    """What each rank keeps: its fp32 master shard, gradient shard (padded) and Adam's m and v
    (the real elements only). ZeRO-1/2 keep the full weights (W, in their gather dtypes), and
    the fp32 shard is a slice of them: only a bf16 part's master shard is a copy (S_lo); ZeRO-1
    keeps the full fp32 gradient, and the gradient shard is a slice of it."""
    S, gathered, _, real = shard_layout(config, world, bf16)
    W, S_lo = world * gathered, (4 * S - gathered) // 2  # S_lo: the shard's elements gathered in 2 bytes
    kept = {3: 8 * S, 2: W + 4 * S_lo + 4 * S, 1: W + 4 * S_lo + 4 * world * S}[stage]
    return [kept + 8 * x for x in real]


@pytest.mark.quick
def test_quick_at_2_ranks(train_args, reference_short):
    """fsdp.py's quick check: ZeRO-3 (the default) at 2 ranks, 3 steps, against the one-process run."""
    check_at_two_ranks("fsdp", train_args + [f"--max_iters={SHORT_STEPS}"], reference_short[0], VOCAB)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_parity_traffic_memory(world, runs, reference, reference_short, small_reference):
    import fsdp
    results, norm_bytes = runs(world)
    assert {flag(extra, "zero_stage", 3) for _, extra, _ in RUNS[world]} == {1, 2, 3}
    ladder = {}  # stage -> the most any rank keeps, on the tiny preset
    for name, extra, preset in RUNS[world]:
        records, path = results[name]
        ref_records, ref_state = (small_reference if preset == "small" else
                                  reference_short if SHORT[0] in extra else reference)
        where = f"{name}, {world} ranks"
        assert_logs_match(records, ref_records, 1e-4)
        assert_logs_match([r for r in records if "val_loss" in r], [r for r in ref_records if "val_loss" in r],
                          1e-4, key="val_loss")
        assert_states_match(torch.load(path), ref_state, 1e-5)

        stage, accum, prefetch = flag(extra, "zero_stage", 3), flag(extra, "n_micro", 1), flag(extra, "prefetch", 1)
        config = M.make_config(preset, VOCAB, block_size=32)
        S, _, padding, _ = shard_layout(config, world)
        if "uneven" in name:
            assert padding > 0, "this run is meant to have uneven shards"
        cfg = M.parse_args(fsdp.DEFAULTS, ["--dtype=float32"] + extra)
        sent = expected_bytes(config, world, stage, accum)
        full_state = ref_records[0]["state_bytes"][0]  # the one-process DDP run: 16 bytes a parameter
        for r in records:
            assert r["comm_bytes"] == [sent + b for b in norm_bytes], where
            assert sum(r["comm_bytes"]) / world == pytest.approx(fsdp.traffic_per_rank(config, cfg, world)), where
            assert r["state_bytes"] == expected_state(config, world, stage), where
            assert r["state_bytes"] == fsdp.state_per_rank(config, cfg, world), where
            if stage == 3:  # the full model's state / N, plus the padding
                assert max(r["state_bytes"]) <= (full_state + 16 * padding) / world, where
                # the true peak of gathered units alive: 1 + prefetch, the window used in full
                assert r["max_gathered_units"] == [1 + prefetch] * world, where
            else:
                assert r["max_gathered_units"] == [config.n_layer + 1] * world, where
        if preset == "tiny":
            ladder[stage] = max(records[-1]["state_bytes"])
    if world == 2:  # each rung keeps strictly less (the one-process DDP run keeps what DDP keeps on each rank)
        ddp_state = reference[0][0]["state_bytes"][0]
        assert ddp_state > ladder[1] > ladder[2] > ladder[3], (ddp_state, ladder)


@pytest.mark.parametrize("name", RESUMED)
def test_resume_is_exact(name, runs):
    """Saved (every rank writes its shards) and resumed at 2 ranks: the same losses, to the
    bit. ZeRO-1 must refresh its full weights from the loaded shards."""
    results, _ = runs(2)
    first, resumed, at = results[name][0], results[name + "_resumed"][0], RESUMED[name]
    assert [r["iter"] for r in resumed] == list(range(at, len(first)))
    assert [r["loss"] for r in resumed] == [r["loss"] for r in first[at:]]


def test_bf16_matches_autocast_run(runs, reference_bf16):
    """bf16: the same model as the one-process autocast run (linear weights gathered in bf16,
    LayerNorm and the ends in fp32), gradients reduced and accumulated in fp32. Measured at 2
    ranks over these 4 steps of 8 rows: iteration 0 within 7e-7, then within 1.4e-4 (ZeRO-3,
    ZeRO-2) and 1.0e-4 (ZeRO-1, n_micro 2); DDP at 2 ranks drifts as far (1.4e-4 over 8
    steps of 24 rows): a bf16 matmul over half the rows rounds its gradient otherwise.
    Gathering everything in bf16 (the embedding and norms on rounded weights) was off by
    1.6e-5 at step 0, 9e-4 at step 1, 1.2e-2 by step 7 (24 rows). Reducing in bf16, or
    gathering the norms in bf16, stays within the drift: the bytes pin those dtypes."""
    import fsdp
    results, norm_bytes = runs(2)
    config = M.make_config("tiny", VOCAB, block_size=32)
    for name, extra in BF16_RUNS:
        records = results[name][0]
        assert abs(records[0]["loss"] - reference_bf16[0]["loss"]) <= 2e-6, name
        assert_logs_match(records, reference_bf16, 4e-4)
        stage, accum = flag(extra, "zero_stage", 3), flag(extra, "n_micro", 1)
        cfg = M.parse_args(fsdp.DEFAULTS, BF16_STEPS + extra)
        sent = expected_bytes(config, 2, stage, accum, bf16=True)
        assert sent < expected_bytes(config, 2, stage, accum)  # the linear weights travel in half the bytes
        for r in records:
            assert r["comm_bytes"] == [sent + b for b in norm_bytes], name
            assert sum(r["comm_bytes"]) / 2 == pytest.approx(fsdp.traffic_per_rank(config, cfg, 2)), name
            assert r["state_bytes"] == expected_state(config, 2, stage, bf16=True), name
            assert r["state_bytes"] == fsdp.state_per_rank(config, cfg, 2), name


def test_one_process_matches_reference(train_args, reference_short, tmp_path):
    import fsdp
    path = str(tmp_path / "state.pt")
    records = fsdp.main(train_args + SHORT + [f"--save_path={path}"])
    assert_logs_match(records, reference_short[0], 1e-4)
    assert_states_match(torch.load(path), reference_short[1], 1e-5)
    assert all(r["comm_bytes"] == [0] for r in records)  # one rank: nothing to send
    assert all(r["max_gathered_units"] == [2] for r in records)  # prefetch 1


def test_compile_matches_reference(train_args, reference, monkeypatch):
    """--compile: one compiled block function takes each block's weights as arguments, so it
    computes with the right ones. The first 4 iterations (warmup: the learning rate does not
    depend on --max_iters) against the reference. Inductor takes minutes on two CPU cores, so
    the test compiles with aot_eager: dynamo traces the function and AOTAutograd its backward,
    where the weights would go wrong; inductor only generates the kernels."""
    import fsdp
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    records = fsdp.main(train_args + ["--compile=True", "--max_iters=4", "--eval_interval=0"])
    assert_logs_match(records, reference[0][:4], 1e-4)


@pytest.mark.quick
def test_unit_frees_and_gathers_under_the_graph():
    """A unit's parameters are views into its flat buffer: free() releases the memory even while
    autograd's graph still refers to a parameter, gather() fills the same storage again and the
    kept graph runs on it; LiveUnits counts the units that hold memory. And the .grad contract:
    a caller's zero_grad(set_to_none=True) on the optimizer's pieces must not leave a piece
    without the gradient the reduce-scatter wrote (it would not train)."""
    import fsdp
    live = fsdp.LiveUnits()
    a, b = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
    ua, ub = (fsdp.Unit(list(m.named_parameters()), None, 3, "cpu", live=live) for m in (a, b))
    want = a.weight.detach().clone() if a.weight.untyped_storage().nbytes() else None
    assert want is None and live.peak == 0  # ZeRO-3: nothing held until gathered
    ua.gather()
    x = torch.ones(2, 4, requires_grad=True)
    y = a(x).sum()  # the graph keeps a.weight
    ua.free()
    assert a.weight.untyped_storage().nbytes() == 0
    ub.gather()
    assert live.peak == 1
    ua.gather()
    assert live.peak == 2
    gx, gw = torch.autograd.grad(y, [x, a.weight])
    assert torch.equal(gx, a.weight.sum(0).expand(2, 4)) and torch.equal(gw, torch.full((3, 4), 2.0))
    pieces = ua.pieces()
    for _, piece, *_ in pieces:
        piece.grad = None  # optimizer.zero_grad()
    fsdp.add_reduced(ua.reduce_scatter(ua.flat_grads([gw, torch.ones(3)])))
    assert all(piece.grad is not None and piece.grad.abs().sum() > 0 for _, piece, *_ in pieces)


@pytest.mark.quick
def test_bad_input_fails_on_every_rank(train_args):
    assert_refused(refusals("fsdp", 2, train_args + ["--zero_stage=4"]), "--zero_stage takes 1, 2 or 3, not 4")


@pytest.fixture(scope="module")
def small_reference(train_args, tmp_path_factory):
    import ddp
    path = str(tmp_path_factory.mktemp("small") / "state.pt")
    return ddp.main(train_args + SMALL + [f"--save_path={path}"]), torch.load(path)
