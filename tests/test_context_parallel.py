"""context_parallel.py: ring attention against scaled_dot_product_attention, the training
run against the one-process run (losses, parameters), the bytes of the formula, the
activations each rank keeps, resume exactness, and bad input.

Process start-up is the costly part on two cores, so one spawn per world size runs
everything that needs ranks (the attention checks and every training run), and the
tests read its results."""
import functools
import os

import pytest
import torch
import torch.nn.functional as F

import model as M
from harness import spawn, check_at_two_ranks, refusals, assert_refused, assert_logs_match, assert_states_match
from conftest import SHORT_STEPS, VOCAB

LAYOUTS = ("contiguous", "zigzag")
# the one 20-step run (warm-up and decay; its checkpoint at RESUME_AT is resumed), the others SHORT_STEPS
FULL, RESUME_AT = (2, "zigzag"), 15
DTYPES = {torch.float32: 1e-5, torch.bfloat16: 5e-2}  # float32 rounding; bfloat16's 8-bit mantissa
# (batch, heads, sequence, head size): odd heads and head size, zigzag chunks of 7 and 3 positions
SHAPES = {2: (2, 3, 28, 5), 4: (3, 3, 24, 5)}


def _ring_attention_errors(world):
    """This rank's ring attention, forward and backward, next to SDPA on the whole
    sequence: -> {(layout, dtype): (max errors of out, dq, dk, dv; bytes sent; dtypes
    right; attention and wait ms)}."""
    import collectives as C
    import context_parallel as CP
    B, H, S, D = SHAPES[world]
    g = torch.Generator().manual_seed(123)  # every rank draws the same whole-sequence tensors
    q, k, v, dout = (torch.randn(B, H, S, D, generator=g) for _ in range(4))
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    out_ref = F.scaled_dot_product_attention(*ref, is_causal=True)
    out_ref.backward(dout)
    results = {}
    for layout in LAYOUTS:
        for dtype in DTYPES:
            ring, clock = CP.Ring(None, layout), CP.Clock()
            pos = CP.positions(S, ring.me, ring.n, layout)
            mine = [t[:, :, pos].to(dtype).requires_grad_() for t in (q, k, v)]
            C.reset_bytes()
            out = CP.ring_attention(*mine, ring, clock)
            out.backward(dout[:, :, pos].to(dtype))
            sent = C.bytes_sent()
            errors = [(out.float() - out_ref[:, :, pos]).abs().max().item()]
            errors += [(a.grad.float() - b.grad[:, :, pos]).abs().max().item() for a, b in zip(mine, ref)]
            typed = out.dtype == dtype and all(t.grad.dtype == dtype for t in mine)
            results[(layout, str(dtype))] = (errors, sent, typed, clock.take_ms())
    return results


def _train_all(rank, world, train_args, out):
    """Every multi-rank check of one world size in one process start."""
    import context_parallel as CP
    results = {"attention": _ring_attention_errors(world)}
    for layout in LAYOUTS:
        path = os.path.join(out, f"cp_{world}_{layout}.pt")
        extra = [] if (world, layout) == FULL else [f"--max_iters={SHORT_STEPS}"]
        if (world, layout) == FULL:  # this run also writes the checkpoint the resume starts from
            extra = [f"--out_dir={os.path.join(out, 'ckpt')}", f"--ckpt_interval={RESUME_AT}"]
        results[layout] = (CP.main(train_args + [f"--layout={layout}", f"--save_path={path}"] + extra), path)
    if world == 2:
        results["resumed"] = CP.main(train_args + [f"--resume={os.path.join(out, 'ckpt', f'step_{RESUME_AT:06d}')}"])
    return results


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"world{n}")
def runs(request, train_args, tmp_path_factory):
    """(world, rank 0's results of _train_all, its folder): one spawn per world size."""
    world, out = request.param, str(tmp_path_factory.mktemp(f"cp{request.param}"))
    return world, spawn(_train_all, world, train_args, out, timeout=900)[0], out


@pytest.mark.quick
def test_quick_at_2_ranks(train_args, reference_short):
    """context_parallel.py's quick check: the zigzag ring (the default) at 2 ranks, 3 steps, against
    the one-process run."""
    check_at_two_ranks("context_parallel", train_args + [f"--max_iters={SHORT_STEPS}"], reference_short[0], VOCAB)


def test_ring_attention_matches_sdpa(runs):
    world, results, _ = runs
    B, H, S, D = SHAPES[world]
    block = 2 * B * H * (S // world) * D  # K and V of one rank's positions
    for layout in LAYOUTS:
        for dtype, tol in DTYPES.items():
            errors, sent, typed, ms = results["attention"][(layout, str(dtype))]
            where = f"{layout}, {dtype}, {world} ranks"
            assert max(errors) <= tol, f"{where}: out, dq, dk, dv differ from SDPA by {errors}"
            assert typed, f"{where}: the output or a gradient came back in another dtype"
            # forward: K/V N-1 hops; backward: K/V again, and dK/dV in float32, N-1 hops
            a = torch.finfo(dtype).bits // 8
            assert sent == (world - 1) * block * (2 * a + 4), where
            assert ms["attn"] > 0 and ms["wait"] > 0, where


@functools.lru_cache
def _saved_bytes_one_process(rows, tokens):
    """What autograd keeps for backward in one process for `rows` sequences of `tokens`
    positions of the tiny model."""
    import context_parallel as CP
    model = M.GPT(M.make_config("tiny", VOCAB, block_size=32), seed=7)
    x, y = torch.zeros(rows, tokens, dtype=torch.long), torch.ones(rows, tokens, dtype=torch.long)
    CP.use_ring(model, CP.Ring(None, "contiguous"))
    counting, saved = M.saved_bytes(list(model.parameters()))
    with counting:
        CP.forward(model, x, y, torch.arange(tokens))
    return sum(saved.values())


def test_parity_traffic_and_activations(runs, train_args, reference, reference_short):
    import context_parallel as CP
    world, results, _ = runs
    config = M.make_config("tiny", VOCAB, block_size=32)
    cfg = M.parse_args(CP.DEFAULTS, train_args)
    n_params = M.param_count(config)
    assert n_params % world == 0  # so the all-reduce's chunks are equal and every rank sends the same
    act_bytes = _saved_bytes_one_process(24, 32 // world)
    assert 0.9 * world * act_bytes < _saved_bytes_one_process(24, 32) < 1.1 * world * act_bytes
    for layout in LAYOUTS:
        where = f"{layout}, {world} ranks"
        records, path = results[layout]
        ref_records, ref_state = reference if (world, layout) == FULL else reference_short
        assert_logs_match(records, ref_records, 1e-4)
        assert_logs_match([r for r in records if "val_loss" in r], [r for r in ref_records if "val_loss" in r],
                          1e-4, key="val_loss")
        assert_states_match(torch.load(path), ref_state, 1e-5)
        for r in records:
            assert r["comm_bytes"] == [CP.traffic_per_rank(config, cfg, world)] * world, where
            assert r["state_bytes"] == [16 * n_params] * world, where  # replicated: param, grad, Adam m and v
            # every activation is per position and attention keeps no s x s matrix: a rank keeps
            # exactly what one process keeps for sequences of s/N positions, about 1/N of the whole
            assert r["act_bytes"] == [act_bytes] * world, where
            assert len(r["attn_ms"]) == len(r["attn_wait_ms"]) == world and min(r["attn_ms"]) > 0, where


@pytest.mark.parametrize("runs", [2], indirect=True, ids=["world2"])
def test_resume_is_exact(runs):
    world, results, out = runs
    first, resumed = results["zigzag"][0], results["resumed"]
    assert [r["iter"] for r in resumed] == list(range(RESUME_AT, 20))
    assert [r["loss"] for r in resumed] == [r["loss"] for r in first[RESUME_AT:]]
    assert os.path.exists(os.path.join(out, "ckpt", "step_000020", "manifest.json"))


def test_layouts_balance_the_causal_work():
    """The blocks the causal mask leaves, counted in score elements: contiguous gives the
    last rank N times the first's work, zigzag the same to every rank; and the blocks of
    each layout together cover the causal triangle exactly once."""
    import context_parallel as CP
    S = 24
    for n in (2, 3, 4):
        for layout in LAYOUTS:
            work, cover = [], torch.zeros(S, S, dtype=torch.int64)
            for me in range(n):
                pos_q = CP.positions(S, me, n, layout)
                assert len(pos_q) == S // n and bool((pos_q[1:] > pos_q[:-1]).all())
                total = 0
                for owner in range(n):
                    plan = CP.block_plan(me, owner, n, layout, S // n)
                    pos_k = CP.positions(S, owner, n, layout)
                    visible = pos_q[:, None] >= pos_k[None, :]
                    if plan is None:
                        assert not visible.any(), f"{layout}: a skipped block holds visible keys"
                        continue
                    rows, cols, causal = plan
                    sub = visible[rows][:, cols]
                    # outside the plan nothing is visible; inside, all of it, or the lower triangle
                    assert visible.sum() == sub.sum()
                    assert torch.equal(sub, torch.ones_like(sub).tril()) if causal else bool(sub.all())
                    cover[pos_q[rows][:, None], pos_k[cols][None, :]] += sub.long()
                    total += sub.numel()
                work.append(total)
            assert torch.equal(cover, torch.ones(S, S, dtype=torch.int64).tril()), layout
            if layout == "contiguous":
                assert work[-1] == n * work[0], work
            else:
                assert len(set(work)) == 1, work


def test_traffic_formula_by_hand():
    import context_parallel as CP
    config = M.make_config("tiny", VOCAB, block_size=32)
    cfg = M.parse_args(CP.DEFAULTS, ["--batch_size=24", "--dtype=float32"])
    # 12 layers x 1 hop x (K, V: 2 x 24 rows x 16 positions x 96) x (4 + 4 + 4 bytes) + 4Ψ
    assert CP.traffic_per_rank(config, cfg, 2) == 12 * 73728 * 12 + 4 * M.param_count(config)
    cfg.dtype = "bfloat16"
    assert CP.traffic_per_rank(config, cfg, 2) == 12 * 73728 * (2 + 2 + 4) + 4 * M.param_count(config)
    assert CP.traffic_per_rank(config, cfg, 1) == 0


def test_bad_flags_are_one_line(train_args, capsys):
    import context_parallel as CP
    for args, message in ((["--dropout=0.1"], "error: context_parallel.py needs --dropout=0"),
                          (["--layout=striped"], "error: --layout takes contiguous or zigzag, not 'striped'")):
        with pytest.raises(SystemExit) as e:
            CP.main(train_args + args)
        assert e.value.code != 0
        err = capsys.readouterr().err
        assert err.count("error:") == 1 and err.startswith(message), err


@pytest.mark.quick
def test_block_size_that_does_not_divide_fails_on_every_rank(train_args):
    # 30 tokens: 2 ranks could take 15 each, but zigzag cuts the sequence into 4 equal chunks
    assert_refused(refusals("context_parallel", 2, train_args + ["--block_size=30"]),
                   "--block_size=30 does not divide into 4 equal parts (2 ranks, zigzag layout")
