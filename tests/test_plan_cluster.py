"""bench/plan_cluster.py, on paper: its formulas against the published ones (ZeRO's Table 1, Megatron's
distributed-optimizer bytes, Korthikanti et al.'s activations, the schedules' bubbles, the ring's
latency per step), --check against the published runs, --json as a script reads it, and bad input.
Its traffic model is held to the bytes parallel_nd.py sends in tests/test_parallel_nd.py."""
import contextlib
import io
import json
import math
import os
import sys

import pytest

from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "bench"))
import plan_cluster as P  # noqa: E402


def _run(argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            P.main(argv)
            code = 0
        except SystemExit as e:
            code = e.code
    return code, out.getvalue(), err.getvalue()


def test_state_bytes_equal_zero_table1_and_megatron():
    """Model state a parameter: ZeRO's Table 1 (fp16, K = 12) to its printed rounding, Megatron's
    distributed optimizer (bf16 weights, float32 main gradients: 18, or 6 + 12/d), and this code's
    float32 Adam (DDP 16, ZeRO-1 8 + 8/N, ZeRO-2 4 + 12/N, ZeRO-3 16/N)."""
    table = json.load(open(P.DATA))["zero_table1"]
    for row in table["rows"]:
        for stage, printed in enumerate(row["gb"]):
            mine = row["params"] * P.state_bytes("zero", stage, row["dp"]) / 1e9
            digits = len(str(printed).split(".")[1]) if "." in str(printed) else 0
            assert abs(mine - printed) <= 0.5 * 10 ** -digits + 1e-9, (row, stage, mine)
    for d in (1, 8, 48):
        assert P.state_bytes("megatron", 0, d) == 18 and P.state_bytes("megatron", 1, d) == pytest.approx(6 + 12 / d)
        assert [P.state_bytes("fp32", z, d) for z in range(4)] == pytest.approx([16, 8 + 8 / d, 4 + 12 / d, 16 / d])


def test_activations_bubbles_and_ring_latency():
    s, b, h, a = 2048, 2, 4096, 32
    for t in (1, 2, 8):  # Korthikanti et al. 2022: tp with sequence parallelism, eq. 6, and its recompute modes
        assert P.layer_activations(s, b, h, a, t, "none") == pytest.approx(s * b * h / t * (34 + 5 * a * s / h))
        assert P.layer_activations(s, b, h, a, t, "selective") == pytest.approx(34 * s * b * h / t)
        assert P.layer_activations(s, b, h, a, t, "none", flash=True) == pytest.approx(34 * s * b * h / t)
        assert P.layer_activations(s, b, h, a, t, "full") == pytest.approx(2 * s * b * h / t)
    for p, m, v in ((4, 8, 1), (8, 64, 2), (35, 280, 3)):
        bubble = lambda sched, v: (P.pipeline_slots(sched, p, m, v) - m) / P.pipeline_slots(sched, p, m, v)  # noqa
        assert bubble("1f1b", 1) == pytest.approx((p - 1) / (m + p - 1))
        assert bubble("interleaved", v) == pytest.approx((p - 1) / (v * m + p - 1))
        assert (P.pipeline_slots("zb", p, m, 1) - m) / m == pytest.approx((p - 1) / (3 * m))
        assert P.held("1f1b", p, m, 1, 0) == min(p, m) and P.held("gpipe", p, m, 1, 0) == m
    # a ring's latency is paid per step and per call, never per segment: 8 ranks on NVLink, one call
    nvl = (1, 450e9)
    S = 100e6
    assert P.coll_time("all_reduce", 8, S, nvl) == pytest.approx(P.LAT_CALL + 14 * P.LAT_NVLINK + 14 / 8 * S / 450e9)
    assert P.coll_time("reduce_scatter", 8, S, nvl) + P.coll_time("all_gather", 8, S, nvl) == \
        pytest.approx(P.coll_time("all_reduce", 8, S, nvl) + P.LAT_CALL)
    # 48 ranks, one a node: 2·47 steps all cross InfiniBand; ten buckets pay the latency ten times
    ib = (48, 50e9)
    one, ten = P.coll_time("all_reduce", 48, S, ib), P.coll_time("all_reduce", 48, S, ib, calls=10)
    assert ten - one == pytest.approx(9 * (P.LAT_CALL + 94 * P.LAT_IB))
    # Megatron's 7.1B run (tp 2, dp 48: 4 ranks of a dp group a node, 12 nodes): its float32 gradients in
    # 40M-element buckets. The latency adds under a tenth to the bandwidth's time (a charge per segment
    # per bucket had nearly doubled it)
    params = 7.1e9 / 2
    bw = 94 / 48 * params * 4 / 50e9
    t = P.coll_time("all_reduce", 48, params * 4, P.span(48, 2, P.SimpleNamespace(gpus_per_node=8, nvlink_bw=450e9,
                                                                                   ib_bw=50e9)),
                    calls=math.ceil(params / 40e6))
    assert P.span(48, 2, P.SimpleNamespace(gpus_per_node=8, nvlink_bw=450e9, ib_bw=50e9)) == (12, 50e9)
    assert bw < t < 1.1 * bw


@pytest.mark.quick
def test_check_reproduces_the_published_tables():
    """--check in seconds: per table the published layout's rank and predicted MFU. These pin what the
    note reports; a change to the model that loses them must say so."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        summary, zero_worst = P.check()
    text = out.getvalue()
    got = {name: (n, exact, within, med) for name, n, exact, within, med, _ in summary}
    # the planner choosing interleaving and micro-batch itself, for the published layouts: as close
    free = {name: med for name, *_, med in summary}
    assert free["mcore_h100"] < 0.16 and free["narayanan2021"] < 0.10, free
    assert set(got) == {"narayanan2021", "korthikanti2022", "mcore_h100"}
    assert got["mcore_h100"][1] >= 8 and got["mcore_h100"][2] >= 8  # published layout first, of 9
    assert got["korthikanti2022"][1] >= 3
    assert all(med < 0.16 for _, _, _, med in got.values()), got
    assert zero_worst < 0.03
    assert "fitted on Narayanan" in text and text.count("source:") == 4
    # the knob plain planning uses is the one --check fits
    tables = {t["name"]: t for t in json.load(open(P.DATA))["tables"]}
    assert P.fit_eff(tables["narayanan2021"]) == pytest.approx(P.EFF, abs=5e-4)


def test_json_describes_any_gpt():
    code, out, err = _run(["--json", "--n_layer=8", "--n_embd=512", "--n_head=8", "--seq=1024", "--vocab=32000",
                           "--gpus=16", "--batch=64", "--gpus_per_node=8", "--mem=24e9", "--peak=312e12",
                           "--cp=2"])
    assert code == 0, err
    doc = json.loads(out)
    assert doc["model"]["n_layer"] == 8 and doc["model"]["vocab_size"] == 32000 and doc["cluster"]["mem"] == 24e9
    rows = doc["layouts"]
    keys = {"dp_replicate", "dp_shard", "zero", "tp", "pp", "cp", "schedule", "recompute", "mem_gb", "step_s", "mfu",
            "fits", "rank"}
    assert rows and all(keys <= set(r) for r in rows)
    assert all(r["dp_replicate"] * r["dp_shard"] * r["tp"] * r["pp"] * r["cp"] == 16 for r in rows)
    fit = [r for r in rows if r["fits"]]
    assert fit and rows[:len(fit)] == fit and [r["rank"] for r in fit] == list(range(1, len(fit) + 1))
    assert [r["step_s"] for r in fit] == sorted(r["step_s"] for r in fit)
    assert any(r["cp"] == 2 for r in rows) and any(r["dp_replicate"] > 1 for r in rows)  # cp and HSDP considered
    assert all(r["mem_gb"] <= 0.9 * 24 for r in fit)


@pytest.mark.parametrize("argv, message", [
    (["--zero=5"], "--zero takes"),
    (["--recompute=some"], "--recompute takes"),
    (["--n_embd=100", "--n_head=3"], "not a multiple of --n_head"),
    (["--check", "--fit_on=nope"], "--fit_on takes"),
])
def test_bad_input(argv, message):
    code, _, err = _run(argv)
    assert code and err.startswith("error:") and message in err, err


def test_state_model_is_what_fsdp_keeps():
    """The planner's fp32 state a parameter, per ZeRO stage, against fsdp.py's own count of
    what it keeps (state_per_rank, which its tests hold to the measured bytes): equal for a
    model whose units divide by N (no padding), at N = 2 and 4; DDP's 16 bytes as ddp.py's."""
    import fsdp
    import model as M
    config = M.make_config("tiny", 192, block_size=32)  # every part a multiple of 96: no padding at 2 or 4
    psi = M.param_count(config)
    for n in (2, 4):
        for stage in (1, 2, 3):
            cfg = M.parse_args(fsdp.DEFAULTS, ["--dtype=float32", f"--zero_stage={stage}"])
            measured = fsdp.state_per_rank(config, cfg, n)
            assert measured == [P.state_bytes("fp32", stage, n) * psi] * n, (n, stage)
    assert P.state_bytes("fp32", 0, 8) * psi == 16 * psi


def test_fp32_activations_equal_the_measured():
    """--precision fp32 plans this code's float32 layer: model.activation_bytes, what autograd keeps
    for a block as counted by saved-tensor hooks, here measured on the tiny model's blocks in one
    process for each recompute mode (tests/test_recompute.py holds the same formula to every
    strategy's log at 2 ranks, tensor parallel with sequence parallelism included)."""
    import torch
    import model as M
    config = M.make_config("tiny", 192, block_size=32)
    gpt = M.GPT(config)
    b, s, L = 2, config.block_size, config.n_layer
    for planner, mode in (("none", "none"), ("selective", "gelu"), ("full", "full")):
        x = torch.randn(b, s, config.n_embd, requires_grad=True)
        counting, saved = M.saved_bytes(list(gpt.parameters()))
        with counting:
            h = x
            for block in gpt.transformer.h:
                h = M.recompute_block(block, h, mode)
        assert sum(saved.values()) == L * P.layer_activations(s, b, config.n_embd, config.n_head, 1, planner,
                                                               precision="fp32"), mode


@pytest.mark.quick
def test_zero_shards_over_dp_shard_as_parallel_nd():
    """The planner shards ZeRO over dp_shard alone, as parallel_nd.py does (its cp ranks hold the
    same parameters and all-reduce their gradients): for layouts with cp > 1, the planner's state on
    each stage's rank, by ZeRO stage, equals parallel_nd.state_per_rank (what the tests of
    parallel_nd.py measure), for a model whose units divide by dp_shard (no padding); and a
    plan's state is it (with pp = 1, the one stage's)."""
    import model as M
    from parallel_nd import DEFAULTS, Mesh, state_per_rank
    config = M.make_config("tiny", 192, block_size=32)
    cl = P.SimpleNamespace(**P.CLUSTERS["H100"])
    run = P.SimpleNamespace(batch=16, precision="fp32", tied=True, bucket_elems=0, eff=P.EFF, flash=False,
                            tp_overlap=False, dp_overlap=True, headroom=0.9)
    for lay in ((2, 1, 1, 2, 2), (2, 2, 2, 2, 2), (4, 1, 3, 2, 2), (4, 2, 1, 2, 2), (8, 1, 1, 4, 4)):
        dp, tp, pp, cp, shard = lay
        for zero in (0, 1, 2, 3):
            if shard < dp and zero != 3:
                continue  # HSDP: a ZeRO-3 layout
            mesh = Mesh(pp, dp // shard, shard, cp, tp) if zero else Mesh(pp, dp, 1, cp, tp)
            cfg = M.parse_args(DEFAULTS, ["--dtype=float32", f"--zero_stage={max(zero, 1)}"])
            for st in P.stage_costs(config, cl, run, lay, 1):
                want = state_per_rank(config, cfg, mesh, st["k"], 0)
                assert P.rank_state(st["params"], "fp32", zero, lay) == want, (lay, zero, st["k"])
            if pp == 1:
                row = P.evaluate(config, cl, run, lay, dict(zero=zero, recompute="none", schedule="1f1b", v=1, b=1))
                assert row["state_gb"] * 1e9 == pytest.approx(want, rel=1e-12), (lay, zero)


@pytest.mark.quick
def test_zero3_is_planned_as_parallel_nd_runs_it():
    """parallel_nd.py sends the same dp_shard messages a step at every ZeRO stage (one all-gather
    of the weights, one reduce-scatter of the gradients: axis_messages), and under ZeRO-3 holds
    each unit's gathered weights from its first use in the step to the step's end: the planner's
    ZeRO-3 row costs ZeRO-2's dp time, and its peak adds the stage's full weights to ZeRO-3's
    sharded state (so on the mesh ZeRO-3 saves memory between steps, not at the peak)."""
    import model as M
    from parallel_nd import DEFAULTS, Mesh, axis_messages
    config = M.make_config("tiny", 192, block_size=32)
    cl = P.SimpleNamespace(**P.CLUSTERS["H100"])
    run = P.SimpleNamespace(batch=16, precision="fp32", tied=True, bucket_elems=0, eff=P.EFF, flash=False,
                            tp_overlap=False, dp_overlap=True, headroom=0.9)
    lay = (4, 1, 2, 1, 4)  # dp 4, all of it dp_shard; pp 2
    by_stage = {}
    for zero in (2, 3):
        cfg = M.parse_args(DEFAULTS, ["--dtype=float32", f"--zero_stage={zero}", "--pp=2", "--n_micro=4"])
        msgs = [m for m in axis_messages(config, cfg, Mesh(2, 1, 4, 1, 1)) if m.axis == "dp_shard"]
        by_stage[zero] = sorted((m.what, m.op, m.nbytes, m.count) for m in msgs)
    assert by_stage[2] == by_stage[3]  # what the planner's equal dp times stand on
    opt = dict(recompute="none", schedule="1f1b", v=1, b=1)
    z2, z3 = (P.evaluate(config, cl, run, lay, dict(opt, zero=z)) for z in (2, 3))
    assert z3["dp_s"] == pytest.approx(z2["dp_s"], rel=1e-12) and z3["step_s"] == pytest.approx(z2["step_s"], rel=1e-12)
    worst = max(P.stage_costs(config, cl, run, lay, 1), key=lambda st: st["params"])  # pp 2: the larger stage
    assert z3["state_gb"] * 1e9 == pytest.approx(P.rank_state(worst["params"], "fp32", 3, lay), rel=1e-12)
    assert z3["mem_gb"] * 1e9 == pytest.approx(z3["state_gb"] * 1e9 + z3["act_gb"] * 1e9, rel=1e-12)
    assert (z3["act_gb"] - z2["act_gb"]) * 1e9 == pytest.approx(4 * worst["params"], rel=1e-9)
