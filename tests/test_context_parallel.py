"""context_parallel.py: ring and Ulysses attention against scaled_dot_product_attention, the
training run against the one-process run (losses, parameters), the bytes of the formula, the
activations each rank keeps, resume exactness, Ulysses on parallel_nd.py's mesh, and bad input.

Process start-up is the costly part on two cores, so one spawn per world size runs
everything that needs ranks (the attention checks and every training run), and the
tests read its results."""
import functools
import os

import pytest
import torch
import torch.nn.functional as F

import model as M
from harness import (spawn, check_at_two_ranks, refuse, refusals, one_thread, assert_refused, assert_logs_match,
                     assert_states_match)
from conftest import BF16_ARGS, SHORT_STEPS, VOCAB

LAYOUTS = ("contiguous", "zigzag")
# the one 20-step run (warm-up and decay; its checkpoint at RESUME_AT is resumed), the others SHORT_STEPS
FULL, RESUME_AT = (2, "zigzag"), 15
DTYPES = {torch.float32: 1e-5, torch.bfloat16: 5e-2}  # float32 rounding; bfloat16's 8-bit mantissa
# (batch, heads, sequence, head size): odd heads and head size, zigzag chunks of 7 and 3 positions;
# Ulysses splits the heads, so 4 of them
SHAPES = {2: (2, 3, 28, 5), 4: (3, 3, 24, 5)}
ULYSSES_SHAPES = {n: (b, 4, s, d) for n, (b, h, s, d) in SHAPES.items()}
# --attention=ulysses, SHORT_STEPS each (bf16: conftest's run), every recompute mode and both layouts;
# at 2 ranks the first also writes a checkpoint at step 2 that a run resumes
ULYSSES = {2: {"zigzag": [], "contiguous, full": ["--layout=contiguous", "--recompute=full"], "bf16": BF16_ARGS},
           4: {"zigzag, gelu": ["--recompute=gelu"], "contiguous": ["--layout=contiguous"]}}
# parallel_nd.py's mesh at 4 ranks, SHORT_STEPS of --attention=ulysses: the heads split by tp, then by cp
MESHES = {"tp x cp": ["--tp=2", "--cp=2"], "dp_shard x cp": ["--dp_shard=2", "--cp=2", "--layout=contiguous"]}


def _attention_errors(world, method="ring"):
    """This rank's ring (or Ulysses) attention, forward and backward, next to SDPA on the
    whole sequence: -> {(layout, dtype): (max errors of out, dq, dk, dv; bytes sent; dtypes
    right; attention and wait ms)}."""
    import collectives as C
    import context_parallel as CP
    B, H, S, D = (ULYSSES_SHAPES if method == "ulysses" else SHAPES)[world]
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
            out = CP.ATTENTION[method](*mine, ring, clock)
            out.backward(dout[:, :, pos].to(dtype))
            sent = C.bytes_sent()
            errors = [(out.float() - out_ref[:, :, pos]).abs().max().item()]
            errors += [(a.grad.float() - b.grad[:, :, pos]).abs().max().item() for a, b in zip(mine, ref)]
            typed = out.dtype == dtype and all(t.grad.dtype == dtype for t in mine)
            results[(layout, str(dtype))] = (errors, sent, typed, clock.take_ms())
        # scores of +-500 (q x 200): a merge or a softmax that does not subtract the running max
        # overflows there; errors relative to the largest element of each reference
        big = [(200 * q).requires_grad_(), k.clone().requires_grad_(), v.clone().requires_grad_()]
        out_big = F.scaled_dot_product_attention(*big, is_causal=True)
        out_big.backward(dout)
        ring = CP.Ring(None, layout)
        pos = CP.positions(S, ring.me, ring.n, layout)
        mine = [t.detach()[:, :, pos].clone().requires_grad_() for t in big]
        out = CP.ATTENTION[method](*mine, ring, CP.Clock())
        out.backward(dout[:, :, pos])
        pairs = [(out, out_big[:, :, pos])] + [(a.grad, b.grad[:, :, pos]) for a, b in zip(mine, big)]
        results[(layout, "large")] = [((a - b).abs().max() / b.abs().max()).item() for a, b in pairs]
    return results


def _train_all(rank, world, train_args, out):
    """Every multi-rank check of one world size in one process start."""
    import context_parallel as CP
    results = {(method, "attention"): _attention_errors(world, method) for method in ("ring", "ulysses")}
    for layout in LAYOUTS:
        path = os.path.join(out, f"cp_{world}_{layout}.pt")
        extra = [] if (world, layout) == FULL else [f"--max_iters={SHORT_STEPS}"]
        if (world, layout) == FULL:  # this run also writes the checkpoint the resume starts from
            extra = [f"--out_dir={os.path.join(out, 'ckpt')}", f"--ckpt_interval={RESUME_AT}"]
        results[layout] = (CP.main(train_args + [f"--layout={layout}", f"--save_path={path}"] + extra), path)
    if world == 2:
        results["resumed"] = CP.main(train_args + [f"--resume={os.path.join(out, 'ckpt', f'step_{RESUME_AT:06d}')}"])
    short = [f"--max_iters={SHORT_STEPS}", "--attention=ulysses"]
    for i, (name, flags) in enumerate(ULYSSES[world].items()):
        path = os.path.join(out, f"ulysses_{i}.pt")
        ckpt = [f"--out_dir={os.path.join(out, 'ckpt_u')}", "--ckpt_interval=2"] if world == 2 and i == 0 else []
        results["ulysses", name] = (CP.main(train_args + short + flags + ckpt + [f"--save_path={path}"]), path)
    if world == 2:
        resume = os.path.join(out, "ckpt_u", "step_000002")
        results["ulysses resumed"] = CP.main(train_args + short + [f"--resume={resume}"])
    if world == 4:
        import parallel_nd as P
        for name, flags in MESHES.items():
            path = os.path.join(out, f"mesh_{len(results)}.pt")
            results["mesh", name] = (P.main(train_args + [f"--max_iters={SHORT_STEPS}", "--attention=ulysses"] + flags
                                            + [f"--save_path={path}"]), path)
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


@pytest.mark.parametrize("method", ["ring", "ulysses"])
def test_attention_matches_sdpa(runs, method):
    world, results, _ = runs
    B, H, S, D = (ULYSSES_SHAPES if method == "ulysses" else SHAPES)[world]
    for layout in LAYOUTS:
        for dtype, tol in DTYPES.items():
            errors, sent, typed, ms = results[method, "attention"][(layout, str(dtype))]
            where = f"{method}, {layout}, {dtype}, {world} ranks"
            assert max(errors) <= tol, f"{where}: out, dq, dk, dv differ from SDPA by {errors}"
            assert typed, f"{where}: the output or a gradient came back in another dtype"
            a = torch.finfo(dtype).bits // 8
            if method == "ring":  # forward: K/V N-1 hops; backward: K/V again, and dK/dV in float32, N-1 hops
                assert sent == (world - 1) * 2 * B * H * (S // world) * D * (2 * a + 4), where
            else:  # q, k, v and the output, forward and backward: to each other rank its heads of my positions
                assert sent == 8 * (world - 1) * B * (S // world) * (H // world) * D * a, where
            assert ms["attn"] > 0 and ms["wait"] > 0, where
        # the gradients of a near one-hot softmax amplify rounding (Ulysses, SDPA on each rank: up to 2e-3);
        # a merge that overflows is inf or nan
        errors = results[method, "attention"][(layout, "large")]
        assert errors[0] <= 1e-4 and all(e <= 2e-2 for e in errors), \
            f"{method}, {layout}, scores to +-500: out, dq, dk, dv off by {errors} (relative)"


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


def test_ulysses_parity_traffic_and_resume(runs, train_args, reference_short, reference_bf16):
    """--attention=ulysses: the one-process losses and parameters in every recompute mode and both
    layouts (bf16: within bf16 rounding); exactly the formula's bytes and the ring's
    activations; and at 2 ranks a resume that continues the same losses."""
    import context_parallel as CP
    world, results, _ = runs
    config = M.make_config("tiny", VOCAB, block_size=32)
    for name, flags in ULYSSES[world].items():
        where = f"ulysses, {name}, {world} ranks"
        records, path = results["ulysses", name]
        cfg = M.parse_args(CP.DEFAULTS, train_args + [f"--max_iters={SHORT_STEPS}", "--attention=ulysses"] + flags)
        if cfg.dtype == "bfloat16":
            assert_logs_match(records, reference_bf16, 3e-4)
        else:
            assert_logs_match(records, reference_short[0], 1e-4)
            assert_states_match(torch.load(path), reference_short[1], 1e-5)
        for r in records:
            assert r["comm_bytes"] == [CP.traffic_per_rank(config, cfg, world)] * world, where
            # attention keeps what the ring's does: q, k, v (head-split), its output and log-sum-exp,
            # and c_proj's input in the other order. bf16: activation_per_rank is not what autocast
            # keeps, for the ring either (one process, 8 x 32 tokens: 14.4 MB kept, 10.5 counted)
            want = CP.activation_per_rank(config, cfg, world)
            assert cfg.dtype == "bfloat16" or r["act_bytes"] == [want] * world, where
            assert min(r["attn_ms"]) > 0 and min(r["attn_wait_ms"]) > 0, where
    if world == 2:
        first, resumed = results["ulysses", "zigzag"][0], results["ulysses resumed"]
        assert [r["iter"] for r in resumed] == [2] and resumed[0]["loss"] == first[2]["loss"]


@pytest.mark.parametrize("runs", [4], indirect=True, ids=["world4"])
def test_ulysses_on_the_mesh(runs, reference_short):
    """parallel_nd.py --attention=ulysses with tp (12 heads: 6 a tp rank, 3 a cp rank) and with
    a data axis: the one-process losses and parameters, and every axis' bytes its formula's."""
    world, results, _ = runs
    for name in MESHES:
        records, path = results["mesh", name]
        assert_logs_match(records, reference_short[0], 1e-4)
        assert_states_match(torch.load(path), reference_short[1], 1e-5)
        for r in records:
            axes = [k[len("formula_bytes_"):] for k in r if k.startswith("formula_bytes_")]
            assert r["comm_bytes_cp"] == pytest.approx(r["formula_bytes_cp"]), name  # every cp rank the same
            for a in axes:
                assert sum(r[f"comm_bytes_{a}"]) == pytest.approx(sum(r[f"formula_bytes_{a}"])), (name, a)


def _three_ranks(rank, world, train_args):
    """Ulysses at 3 ranks (the tiny preset's 12 heads, 4 a rank; 24 positions, zigzag chunks of 4),
    and the small preset's 4 heads refused, by context_parallel.py and on parallel_nd.py's cp axis."""
    import context_parallel as CP
    small = train_args + ["--model=small", "--block_size=24"]
    return (CP.main(train_args + ["--attention=ulysses", "--block_size=24", f"--max_iters={SHORT_STEPS}"]),
            refuse("context_parallel", small + ["--attention=ulysses"]),
            refuse("parallel_nd", small + ["--cp=3", "--attention=ulysses"]))


def test_ulysses_at_three_ranks_and_heads_that_do_not_split(train_args):
    import ddp
    results = spawn(_three_ranks, 3, train_args, timeout=600)
    with one_thread():
        reference = ddp.main(train_args + ["--block_size=24", f"--max_iters={SHORT_STEPS}"])
    assert_logs_match(results[0][0], reference, 1e-4)
    assert_refused([r[1] for r in results], "--attention=ulysses splits the 4 heads over the ranks: 3 ranks do not "
                   "divide them")
    assert_refused([r[2] for r in results], "--attention=ulysses needs --tp x --cp = 3 to divide the 4 heads")


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
    # Ulysses: 12 layers x 1 other rank x (q, k, v, out: 4 x 24 rows x 16 positions x 48 of the width)
    # x forward and backward (full: forward twice) x 2 bytes + 4Ψ
    cfg.attention = "ulysses"
    assert CP.traffic_per_rank(config, cfg, 2) == 12 * 4 * 18432 * 2 * 2 + 4 * M.param_count(config)
    cfg.dtype, cfg.recompute = "float32", "full"
    assert CP.traffic_per_rank(config, cfg, 2) == 12 * 4 * 18432 * 3 * 4 + 4 * M.param_count(config)


def test_bad_flags_are_one_line(train_args, capsys):
    import context_parallel as CP
    for args, message in ((["--dropout=0.1"], "error: context_parallel.py needs --dropout=0"),
                          (["--layout=striped"], "error: --layout takes contiguous or zigzag, not 'striped'"),
                          (["--attention=tree"], "error: --attention takes ring or ulysses, not 'tree'")):
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
