"""parallel_3d.py: data x tensor x pipeline on one mesh, against the one-process run.

Two spawns. At 4 ranks: (dp, tp, pp) = (2, 2, 1), (2, 1, 2), (1, 2, 2), 20 steps each,
GPipe and 1F1B (interleaved and ZB-H1 for 6 steps) (on one stage with one micro-batch they are the same plan, checked on
paper, so (2, 2, 1) runs once), sequence parallelism on the 1F1B run of (1, 2, 2); the
1F1B run of (2, 1, 2) also checkpoints and is resumed, its GPipe run all-reduces after the
pipeline drains instead of during the last backward; and bad input. At 8 ranks:
(2, 2, 2) for 20 steps under both schedules, then every factorization of 8 for 2 steps
on a model that each of them can split. Every run's bytes per axis are held to
axis_bytes (the formula bench/plan_3d.py plans with), per group and in all, and its
state to the parameters the plan counts per stage.
"""
import contextlib
import io
import os
import sys
from types import SimpleNamespace

import pytest
import torch

import model as M
import parallel_3d as P3
import pipeline_parallel as PP
from harness import spawn, assert_logs_match, assert_states_match
from conftest import ROOT, SHORT_STEPS, VOCAB

sys.path.insert(0, os.path.join(ROOT, "bench"))
import plan_3d  # noqa: E402

BATCH, BLOCK = 24, 32  # conftest.TRAIN_ARGS
# (dp, tp, pp), schedule, micro-batches, sequence parallel: the parity runs; the 20-step
# ones (a layout of every pair of axes, and the whole mesh), the rest 6 (conftest.SHORT_STEPS)
PARITY = {4: [((2, 2, 1), "1f1b", 1, False), ((2, 1, 2), "gpipe", 3, False), ((2, 1, 2), "1f1b", 3, False),
              ((1, 2, 2), "gpipe", 2, False), ((1, 2, 2), "1f1b", 2, True)],
          8: [((2, 2, 2), "gpipe", 2, False), ((2, 2, 2), "1f1b", 2, True)]}
LONG = {((2, 2, 1), "1f1b", 1, False), ((2, 1, 2), "1f1b", 3, False), ((1, 2, 2), "1f1b", 2, True),
        ((2, 2, 2), "1f1b", 2, True)}
# the newer schedules, 6 steps each (their 20-step parity is pipeline_parallel's test's)
SHORT = [((1, 2, 2), "interleaved", 2, False), ((2, 1, 2), "zb", 2, False)]
RESUMED = ((2, 1, 2), "1f1b", 3, False)  # the dp replicas and both tied copies load (tp slices: --save_path)
NO_OVERLAP = ((2, 1, 2), "gpipe", 3, False)  # the dp all-reduce after the pipeline drains, not during it
# a model every factorization of 8 can split: 8 heads, 8 blocks; 2 steps each
MESH8 = dict(n_layer=8, n_head=8, n_embd=32, block_size=BLOCK)
MESH8_ARGS = ["--model=mesh8", "--max_iters=2", "--eval_interval=0"]


def flags(layout, schedule, m, sp):
    dp, tp, pp = layout
    return [f"--dp={dp}", f"--tp={tp}", f"--pp={pp}", f"--schedule={schedule}", f"--n_micro={m}",
            f"--sequence_parallel={sp}"]


def _quiet(fn, argv):
    with contextlib.redirect_stdout(io.StringIO()) as out:
        return fn(argv), out.getvalue()


def _run_all(rank, world, train_args, out):
    """Every run of one world size, in one process start. -> rank 0's {key: result}."""
    M.PRESETS["mesh8"] = MESH8
    results = {}
    for i, run in enumerate(PARITY[world]):
        path = os.path.join(out, f"state{i}.pt")
        extra = [f"--out_dir={out}/ckpt", "--ckpt_interval=10"] if run == RESUMED else []
        extra += ["--overlap=False"] if run == NO_OVERLAP else []
        steps = [] if run in LONG else [f"--max_iters={SHORT_STEPS}"]
        results[run] = _quiet(P3.main, train_args + flags(*run) + steps + [f"--save_path={path}"] + extra) + (path,)
    if world == 4:
        for run in SHORT:
            results[run] = _quiet(P3.main, train_args + flags(*run) + ["--max_iters=6"])[0]
        results["resumed"] = _quiet(P3.main, train_args + flags(*RESUMED) + [f"--resume={out}/ckpt/step_000010"])[0]
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            try:
                P3.main(train_args + ["--dp=3", "--tp=1", "--pp=1"])
                code = 0
            except SystemExit as e:
                code = e.code
        results["bad"] = (code, err.getvalue())
    if world == 8:
        for i, layout in enumerate(plan_3d.factorizations(8)):
            # sequence parallelism's bytes are checked in the 20-step runs too: here once, as
            # is bfloat16's (the compute dtype's 2 bytes inside the tensor parallel regions)
            schedule, sp = ("gpipe", "1f1b")[i % 2], layout == (2, 4, 1)
            dtype = "bfloat16" if layout == (1, 4, 2) else "float32"
            argv = train_args + MESH8_ARGS + flags(layout, schedule, 3, sp) + [f"--dtype={dtype}"]
            results[("mesh8", layout)] = (_quiet(P3.main, argv)[0], argv)
    return results if rank == 0 else None


@pytest.fixture(scope="module")
def runs(train_args, tmp_path_factory):
    done = {}

    def at(world):
        if world not in done:
            done[world] = spawn(_run_all, world, train_args, str(tmp_path_factory.mktemp(f"p3d{world}")),
                                timeout=600)[0]
        return done[world]
    return at


def check_bytes(records, config, cfg, layout):
    """Measured bytes per axis against axis_bytes: each group's sum, and the world's; and
    nothing sent outside the three axes."""
    dp, tp, pp = layout
    world = P3.axis_bytes(config, cfg, dp, tp, pp)
    for r in records:
        for a in P3.AXES:
            sent = r[f"comm_bytes_{a}"]
            assert sum(sent) == world[a], (layout, a, sum(sent), world[a])
            for ranks in P3.mesh_groups(dp, tp, pp)[a]:
                stage = P3.coords(ranks[0], dp, tp, pp)[0]
                want = P3.axis_bytes(config, cfg, dp, tp, pp, stage=stage)[a]
                assert sum(sent[i] for i in ranks) == want, (layout, a, ranks)
                assert sum(r[f"formula_bytes_{a}"][i] for i in ranks) == pytest.approx(want)
        assert r["comm_bytes"] == [sum(r[f"comm_bytes_{a}"][i] for a in P3.AXES) for i in range(dp * tp * pp)]
    assert all((world[a] > 0) == (n > 1) for a, n in zip(P3.AXES, layout))  # a formula that can fail
    # the state: float32 weight, gradient and Adam's two moments for what the plan counts per stage
    state = [16 * sum(P3.stage_params(config, tp, pp, P3.coords(i, dp, tp, pp)[0])) for i in range(dp * tp * pp)]
    assert records[-1]["state_bytes"] == state, layout


def _cfg(argv):
    return M.parse_args(P3.DEFAULTS, argv)


@pytest.mark.parametrize("world", [4, 8])
def test_parity_and_bytes(world, runs, reference, reference_short, train_args):
    results = runs(world)
    config = M.make_config("tiny", VOCAB, BLOCK)
    for run in PARITY[world]:
        ref_records, ref_state = reference if run in LONG else reference_short
        (records, printed, path) = results[run]
        assert_logs_match(records, ref_records, 1e-4)
        assert_logs_match([r for r in records if "val_loss" in r], [r for r in ref_records if "val_loss" in r],
                          1e-4, key="val_loss")
        assert_states_match(torch.load(path), ref_state)
        check_bytes(records, config, _cfg(train_args + flags(*run)), run[0])
        # rank 0 prints the mesh: every rank's coordinates and groups
        dp, tp, pp = run[0]
        for r in range(world):
            p, d, t = P3.coords(r, dp, tp, pp)
            assert f"rank {r:4d} (pp, dp, tp) = ({p}, {d}, {t})" in printed
            groups = {a: next(g for g in P3.mesh_groups(dp, tp, pp)[a] if r in g) for a in P3.AXES}
            assert f"tp group {groups['tp']}  dp group {groups['dp']}  pp group {groups['pp']}" in printed


def test_every_schedule(runs, reference, train_args):
    """Interleaved (2 chunks a stage) and ZB-H1 on a mesh: the reference's losses, and the
    bytes of axis_bytes (interleaved: 2·(pp·v-1)·m activations across the pipeline)."""
    results = runs(4)
    config = M.make_config("tiny", VOCAB, BLOCK)
    for run in SHORT:
        records = results[run]
        assert_logs_match(records, reference[0][:6], 1e-4)
        check_bytes(records, config, _cfg(train_args + flags(*run) + ["--max_iters=6"]), run[0])


def test_resume_and_bad_input(runs):
    results = runs(4)
    first = results[RESUMED][0]
    resumed = results["resumed"]
    assert [r["iter"] for r in resumed] == list(range(10, 20))
    assert [r["loss"] for r in resumed] == [r["loss"] for r in first[10:]]
    code, err = results["bad"]
    assert code != 0 and err.count("\n") == 1 and err.startswith("error:")
    assert "--dp=3 x --tp=1 x --pp=1 = 3 ranks, but the world has 4" in err, err


def test_plan_traffic_is_measured_for_every_factorization_of_8(runs, train_args):
    """bench/plan_3d.py's traffic model (parallel_3d.axis_bytes) against the bytes every
    factorization of 8 sends, exactly, with and without sequence parallelism, in float32
    and (one) bfloat16."""
    assert plan_3d.axis_bytes is P3.axis_bytes and plan_3d.axis_messages is P3.axis_messages
    results = runs(8)
    config = M.GPTConfig(**MESH8, vocab_size=VOCAB)
    layouts = plan_3d.factorizations(8)
    assert len(layouts) == 10 and all(dp * tp * pp == 8 for dp, tp, pp in layouts)
    for layout in layouts:
        records, argv = results[("mesh8", layout)]
        assert len(records) == 2
        check_bytes(records, config, _cfg(argv), layout)


def test_mesh_and_formulas_on_paper():
    """The layout rank = pp·(dp·tp) + dp·tp + tp_rank, groups that partition the ranks;
    one schedule plan on one stage with one micro-batch; and the 3-D byte count reduces to
    each strategy's own formula when the other two axes are 1."""
    dp, tp, pp = 2, 3, 4
    for r in range(24):
        p, d, t = P3.coords(r, dp, tp, pp)
        assert r == p * dp * tp + d * tp + t == P3.rank_of(p, d, t, dp, tp)
    for a, n in zip(P3.AXES, (dp, tp, pp)):
        groups = P3.mesh_groups(dp, tp, pp)[a]
        assert sorted(r for g in groups for r in g) == list(range(24)) and all(len(g) == n for g in groups)
    assert P3.mesh_groups(dp, tp, pp)["tp"][0] == [0, 1, 2]  # neighbours: one node
    assert PP.plan("gpipe", 1, 1, 0) == PP.plan("1f1b", 1, 1, 0)
    import ddp
    import tensor_parallel as TP
    config = M.make_config("tiny", VOCAB, BLOCK)
    for n in (2, 4):
        cfg = SimpleNamespace(batch_size=BATCH, n_micro=1, dtype="float32", grad_clip=1.0, sequence_parallel=False,
                              dp=0, tp=1, pp=1)
        assert P3.traffic_per_rank(config, cfg, n) == pytest.approx(ddp.traffic_per_rank(config, cfg, n))
        for sp in (False, True):
            cfg.tp, cfg.sequence_parallel = n, sp
            assert P3.traffic_per_rank(config, cfg, n) == pytest.approx(TP.traffic_per_rank(config, cfg, n))
        cfg.tp, cfg.pp, cfg.sequence_parallel, cfg.n_micro = 1, n, False, 4
        assert P3.traffic_per_rank(config, cfg, n) == pytest.approx(PP.traffic_per_rank(config, cfg, n))
