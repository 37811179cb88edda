"""The mixture of experts (model.py, --n_expert) and expert_parallel.py.

The model against a naive token-by-token version of itself (routing, renormalized
weights, GShard's capacity rule, the balance loss); the expert parallel layer against
the one-process layer, outputs and gradients, and its bytes against the formula from
routing counts the test works out itself; training against the one-process `ddp.py
--n_expert` run (loss within 1e-4 at each of 20 steps, same parameters; the tiny preset at
4 blocks, conftest.moe_preset) at 2 and 4 ranks, both dispatch modes, top_k 1 and 2, with
and without a capacity limit; resume exactness; and the refusals."""
import importlib
import math
import os

import pytest
import torch
import torch.nn.functional as F

import model as M
from harness import spawn, check_at_two_ranks, one_thread, refuse, assert_logs_match, assert_states_match
from conftest import SHORT_STEPS, VOCAB, moe_preset

# the one-process references (ddp.py); each parallel run below names one. One run goes the
# whole 20 steps (warm-up and decay); the others SHORT_STEPS, which show a wrong route or a lost token as well
SHORT = [f"--max_iters={SHORT_STEPS}"]
TINY_MOE = ["--model=tiny_moe"]  # conftest.moe_preset: the tiny preset at 4 blocks
MOE = {"e4k2": TINY_MOE + ["--n_expert=4", "--top_k=2"],
       "e4k2_short": TINY_MOE + ["--n_expert=4", "--top_k=2"] + SHORT,
       "e8k1cap": TINY_MOE + ["--n_expert=8", "--top_k=1", "--capacity_factor=1.0"] + SHORT}
# (reference, strategy, dispatch): 2 and 4 ranks, E = 4 and 8, top_k 1 and 2, with and without a
# capacity, both modes; the layer checks below add both modes at every world size and the capacity
# with top_k = 2 (the runs are a covering subset: each costs seconds of CPU per rank and step)
RUNS = {2: [("e4k2", "expert_parallel", "alltoall"), ("e8k1cap", "expert_parallel", "allgather"),
            ("e4k2_short", "ddp", None)],
        4: [("e8k1cap", "expert_parallel", "alltoall")]}
RESUME_AT = 15  # the 20-step run and its reference checkpoint here; the resumed runs go 5 steps


def tiny(**kw):
    return M.make_config("tiny", VOCAB, block_size=16, **kw)


# ----------------------------------------------------------------------------- the model, one process

def naive_moe(moe, x):
    """The layer token by token: every expert on every token, then each token's choices
    in GShard's priority order (all first choices, then all second...) against the capacity."""
    cfg, E, k = moe.config, moe.config.n_expert, moe.config.top_k
    tokens = x.reshape(-1, x.shape[-1])
    probs = torch.softmax(tokens @ moe.router.weight.t(), -1)
    top, chosen = probs.topk(k, -1)
    weights = top / top.sum(-1, keepdim=True) if k > 1 else top
    w1, b1, w2, b2 = (t.detach() for t in (moe.experts.c_fc.weight, moe.experts.c_fc.bias,
                                           moe.experts.c_proj.weight, moe.experts.c_proj.bias))
    every = torch.stack([F.gelu(tokens @ w1[e].t() + b1[e], approximate="tanh") @ w2[e].t() + b2[e] for e in range(E)])
    cap = math.ceil(cfg.capacity_factor * tokens.shape[0] * k / E) if cfg.capacity_factor else None
    used, keep = [0] * E, torch.zeros_like(chosen, dtype=torch.bool)
    for s in range(k):
        for t in range(tokens.shape[0]):
            e = int(chosen[t, s])
            if cap is None or used[e] < cap:
                keep[t, s], used[e] = True, used[e] + 1
    y = torch.zeros_like(tokens)
    for t in range(tokens.shape[0]):
        for s in range(k):
            if keep[t, s]:
                y[t] += weights[t, s] * every[chosen[t, s], t]
    B, T = x.shape[:2]
    f = F.one_hot(chosen.view(B, T * k), E).float().mean(1)
    aux = (E * (f * probs.view(B, T, E).mean(1)).sum(-1)).mean()
    return y.view_as(x), keep, chosen, aux


def moe_layer(config, seed=3, router_scale=20.0):
    """A block's MoE layer with the model's init, its router made decisive (and so
    unbalanced), so that a capacity drops some choices."""
    moe = M.build_unit(config, 0, seed).mlp
    with torch.no_grad():
        moe.router.weight.mul_(router_scale)
    return moe


@pytest.mark.parametrize("E, k, cf", [(4, 2, 0.0), (4, 1, 0.0), (8, 2, 1.0), (4, 1, 1.25)])
def test_layer_matches_token_by_token(E, k, cf):
    moe = moe_layer(tiny(n_expert=E, top_k=k, capacity_factor=cf))
    x = torch.randn(3, 16, 96, generator=torch.Generator().manual_seed(1))
    y_ref, keep, chosen, aux = naive_moe(moe, x)
    y = moe(x)
    assert torch.allclose(y, y_ref, atol=1e-6), (y - y_ref).abs().max()
    assert torch.allclose(moe.aux, aux, atol=1e-6)
    dropped = int((~keep).sum())
    assert moe.tally["dropped_tokens"] == dropped and (dropped > 0) == (cf > 0)
    assert moe.tally["expert_tokens"].tolist() == [int(((chosen == e) & keep).sum()) for e in range(E)]


def test_parameters_init_and_flops():
    dense, moe = tiny(), tiny(n_expert=4, top_k=2)
    for c in (dense, moe, tiny(n_expert=8, top_k=1), M.make_config("tiny", VOCAB, block_size=16, n_expert=2,
                                                                       top_k=1)):
        assert M.param_count(c) == M.num_params(M.GPT(c).parameters())
    C, L = 96, 12
    mlp = 8 * C * C + 5 * C
    assert M.active_params(dense) == M.param_count(dense)
    assert M.active_params(moe) == M.param_count(dense) + L * (mlp + 4 * C)  # 2 experts a token, the router
    assert M.param_count(moe) == M.param_count(dense) + L * (3 * mlp + 4 * C)
    # the dense model draws what it always drew: the same names, and the same numbers
    gpt = M.GPT(M.make_config("tiny", VOCAB, block_size=32), seed=7)
    names = [n for n, _ in gpt.named_parameters()]
    assert len(names) == 148 and "transformer.h.0.mlp.c_fc.weight" in names and not any("expert" in n for n in names)
    assert abs(sum(p.double().abs().sum().item() for p in gpt.parameters()) - 16901.773732262) < 1e-5
    assert dense == M.make_config("tiny", VOCAB, block_size=16, top_k=1, capacity_factor=2.0)  # ignored when dense
    # an expert's weights are N(0, 0.02) (c_proj scaled as the MLP's), biases 0 and not decayed
    layer = M.GPT(moe, seed=7).transformer.h[0].mlp
    assert layer.experts.c_fc.weight.shape == (4, 4 * C, C) and layer.experts.c_proj.bias.shape == (4, C)
    assert abs(layer.experts.c_fc.weight.std().item() - 0.02) < 1e-3 and not layer.experts.c_fc.bias.any()
    assert not M.decays("mlp.experts.c_fc.bias", layer.experts.c_fc.bias)
    assert M.decays("mlp.experts.c_fc.weight", layer.experts.c_fc.weight)


@pytest.mark.parametrize("args, must_say", [
    (["--n_expert=4", "--top_k=5"], "--top_k must be between 1 and --n_expert=4, not 5"),
    (["--n_expert=4", "--top_k=0"], "--top_k must be between 1 and --n_expert=4, not 0"),
    (["--n_expert=-1"], "--n_expert must be at least 0"),
    (["--n_expert=4", "--capacity_factor=-1"], "--capacity_factor and --aux_loss_coef must be at least 0"),
])
def test_bad_moe_flags(args, must_say, data_dir, capsys):
    for strategy in ("ddp", "expert_parallel"):
        with pytest.raises(SystemExit) as e:
            importlib.import_module(strategy).main([f"--data_dir={data_dir}"] + args)
        lines = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and must_say in lines[0], lines


def test_other_strategies_and_flags_refused(data_dir, capsys):
    cases = [(s, ["--n_expert=4"], f"--n_expert: the {s} strategy does not train a mixture of experts")
             for s in ("fsdp", "tensor_parallel")]
    cases += [("expert_parallel", ["--n_expert=0"], "expert_parallel.py splits a mixture of experts"),
              ("expert_parallel", ["--dispatch=allreduce"], "--dispatch takes alltoall or allgather, not 'allreduce'")]
    for strategy, args, must_say in cases:
        with pytest.raises(SystemExit) as e:
            importlib.import_module(strategy).main([f"--data_dir={data_dir}"] + args)
        lines = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and must_say in lines[0], lines


@pytest.mark.quick
def test_clip_stays_on_the_device(train_args, monkeypatch):
    """The clip never reads a tensor to the host (it once did, `if coef < 1`: a device sync
    every step): clip_global_norm with Tensor.__bool__ raising, alone and inside main's
    steps, gives torch's clip."""
    import expert_parallel as EP

    def refuse(self):
        raise AssertionError("the clip read a tensor to the host")
    clip = EP.clip_global_norm

    def clip_on_device(*args, **kwargs):
        with monkeypatch.context() as m:
            m.setattr(torch.Tensor, "__bool__", refuse)
            return clip(*args, **kwargs)
    g = torch.Generator().manual_seed(0)
    for max_norm in (0.5, 100.0):  # clipped, and not
        params = [torch.nn.Parameter(torch.zeros(5, 3)) for _ in range(4)]
        for p in params:
            p.grad = torch.randn(5, 3, generator=g)
        ref = [torch.nn.Parameter(torch.zeros(5, 3)) for _ in params]
        for r, p in zip(ref, params):
            r.grad = p.grad.clone()
        norm = torch.nn.utils.clip_grad_norm_(ref, max_norm)
        assert torch.allclose(clip_on_device(params[:2], params[2:], max_norm), norm)  # replicas, experts
        assert all(torch.allclose(p.grad, r.grad) for p, r in zip(params, ref)), max_norm
    monkeypatch.setattr(EP, "clip_global_norm", clip_on_device)
    steps = ["--n_expert=2", "--top_k=1", "--max_iters=2", "--eval_interval=0", "--grad_clip=0.01", "--batch_size=4"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # on a busy machine more threads only spin
    try:
        records = EP.main(train_args + steps + ["--dispatch=allgather"])
    finally:
        torch.set_num_threads(threads)
    assert all(r["grad_norm"] > 0.01 for r in records)  # so the clip did scale


def test_dynamo_does_not_trace_the_collectives():
    """torch.compile must run each collective eagerly, behind torch.compiler.disable: traced,
    they reach collectives.py's lock, an unsupported context manager, and break the graph
    into fragments (23 breaks in 4 steps of a 2-layer model before). The routing's own
    reads to the host (the counts) still break it, as in every MoE."""
    import expert_parallel as EP
    config = tiny(n_expert=2, top_k=1)
    x = torch.randn(2, 16, 96, generator=torch.Generator().manual_seed(0))
    for mode in EP.DISPATCH:
        layer = EP.ExpertParallelMoE(M.build_unit(config, 0, 1).mlp, mode)
        torch._dynamo.reset()
        reasons = [str(b.reason) for b in torch._dynamo.explain(layer)(x).break_reasons]
        assert sum("compiler.disable" in r for r in reasons) >= 2, (mode, reasons)
        assert not any("context manager" in r for r in reasons), (mode, reasons)
    torch._dynamo.reset()


# ----------------------------------------------------------------------------- the layer, N ranks

def _layer_checks(rank, world, E):
    """The expert parallel layer against the one-process one, for each dispatch mode,
    with and without a capacity: outputs, gradients, and the bytes each rank sent."""
    import collectives as C
    import expert_parallel as EP
    results = []
    for mode in ("alltoall", "allgather"):
        for cf in (0.0, 1.0):
            config = tiny(n_expert=E, top_k=2, capacity_factor=cf)
            x = torch.randn(2 * world, 16, 96, generator=torch.Generator().manual_seed(5))
            g = torch.randn(2 * world, 16, 96, generator=torch.Generator().manual_seed(6))
            ref = moe_layer(config)
            xr = x.clone().requires_grad_()
            (ref(xr) * g).sum().backward()
            ep = EP.ExpertParallelMoE(moe_layer(config), mode)
            rows = slice(2 * rank, 2 * rank + 2)
            xe = x[rows].clone().requires_grad_()
            C.reset_bytes()
            y = ep(xe)
            (y * g[rows]).sum().backward()
            sent = C.bytes_by_op()
            C.all_reduce(ep.router.weight.grad)  # the replicated router: each rank's part of the gradient, summed
            first, n = ep.first, ep.local
            diffs = dict(y=(y - ref(x)[rows]).abs().max().item(), x=(xe.grad - xr.grad[rows]).abs().max().item(),
                         router=(ep.router.weight.grad - ref.router.weight.grad).abs().max().item(),
                         experts=max((p.grad - q.grad[first:first + n]).abs().max().item() for p, q in
                                     zip(ep.experts.parameters(), ref.experts.parameters())))
            results.append(dict(mode=mode, cf=cf, diffs=diffs, sent=sent, dropped=ep.tally["dropped_tokens"]))
    return results


def expected_bytes(world, E, k, cf, mode, rank):
    """What rank `rank` sends at one layer, worked out from the routing of the whole batch."""
    config = tiny(n_expert=E, top_k=k, capacity_factor=cf)
    x = torch.randn(2 * world, 16, 96, generator=torch.Generator().manual_seed(5))
    _, keep, chosen, _ = naive_moe(moe_layer(config), x)
    n, h = 2 * 16, 96
    if mode == "allgather":  # the tokens and their routing all-gathered, the outputs reduce-scattered; and back
        return {"all_gather": (world - 1) * (n * k * 8 + n * h * 4 + n * k * h * 4),
                "reduce_scatter": (world - 1) * (n * k * h * 4 + n * h * 4)}
    owner = chosen // (E // world)  # the rank holding each choice's expert
    token_rank = torch.arange(world * n).div(n, rounding_mode="floor").unsqueeze(1).expand_as(chosen)
    out = int((keep & (token_rank == rank) & (owner != rank)).sum())
    into = int((keep & (token_rank != rank) & (owner == rank)).sum())
    return {"all_gather": (world - 1) * E * k * 8, "all_to_all": 2 * (out + into) * h * 4}


# ----------------------------------------------------------------------------- training, N ranks

def _train(rank, world, train_args, out, ref_dir):
    import ddp
    import expert_parallel
    moe_preset()
    results = dict(layer=_layer_checks(rank, world, 2 * world), runs={}, refused={})
    for ref, strategy, mode in RUNS[world]:
        path = os.path.join(out, f"{world}_{strategy}_{ref}_{mode}.pt")
        args = train_args + MOE[ref] + [f"--save_path={path}"] + ([f"--dispatch={mode}"] if mode else [])
        if world == 2 and mode == "alltoall":  # also the checkpointed run of the resume test
            args += [f"--out_dir={out}/ckpt", f"--ckpt_interval={RESUME_AT}"]
        module = expert_parallel if strategy == "expert_parallel" else ddp
        results["runs"][(ref, strategy, mode)] = (module.main(args), path)
    if world == 2:
        # resumed from its own step 10, and from the one-process run's (full tensors, sliced on load)
        step = f"step_{RESUME_AT:06d}"
        for name, folder in (("self", f"{out}/ckpt/{step}"), ("ddp", f"{ref_dir}/{step}")):
            results["runs"][("resume", name)] = expert_parallel.main(train_args + MOE["e4k2"] + [f"--resume={folder}"])
        for name, (module, args) in {"indivisible": ("expert_parallel", ["--n_expert=3", "--top_k=1"]),
                                     "ddp capacity": ("ddp", MOE["e8k1cap"])}.items():
            results["refused"][name] = refuse(module, train_args + args)
    return results


@pytest.fixture(scope="module")
def moe_reference(train_args, tmp_path_factory):
    """The one-process runs of ddp.py --n_expert: name -> (records, final state_dict)."""
    import ddp
    moe_preset()
    out, refs = tmp_path_factory.mktemp("moe_reference"), {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks run: on a busy machine more threads only spin
    try:
        for name, flags in MOE.items():
            path = str(out / f"{name}.pt")
            ckpt = [f"--out_dir={out / name}", f"--ckpt_interval={RESUME_AT}"] if name == "e4k2" else []
            refs[name] = (ddp.main(train_args + flags + ckpt + [f"--save_path={path}"]), torch.load(path))
    finally:
        torch.set_num_threads(threads)
    return refs, str(out / "e4k2")


@pytest.mark.quick
def test_quick_at_2_ranks(train_args):
    """expert_parallel.py's quick check: 4 experts, top 2, routed by all-to-all over 2 ranks,
    3 steps, against the one-process run of the same mixture (ddp.py --n_expert=4)."""
    import ddp
    moe_preset()
    argv = train_args + MOE["e4k2_short"]
    with one_thread():
        reference = ddp.main(argv)
    check_at_two_ranks("expert_parallel", argv, reference, VOCAB, setup=moe_preset)


@pytest.mark.parametrize("world", [2, 4])
def test_parity_traffic_resume(world, train_args, moe_reference, tmp_path):
    refs, ref_dir = moe_reference
    result = spawn(_train, world, train_args, str(tmp_path), ref_dir, timeout=400)
    E = 2 * world
    for c, check in enumerate(result[0]["layer"]):
        where = f"{check['mode']}, capacity {check['cf']}"
        for r, per_rank in enumerate(result):
            mine = per_rank["layer"][c]
            assert max(mine["diffs"].values()) < 1e-5, (where, r, mine["diffs"])
            assert mine["sent"] == expected_bytes(world, E, 2, check["cf"], check["mode"], r), (where, r)
        assert (sum(p["layer"][c]["dropped"] for p in result) > 0) == (check["cf"] > 0), where
    runs = result[0]["runs"]
    config = M.make_config("tiny", VOCAB, block_size=32)
    for (ref, strategy, mode), (records, path) in [(k, v) for k, v in runs.items() if k[0] != "resume"]:
        where = f"{strategy} {mode} {ref}, {world} ranks"
        ref_records, ref_state = refs[ref]
        assert_logs_match(records, ref_records, 1e-4)
        assert_logs_match([r for r in records if "val_loss" in r], [r for r in ref_records if "val_loss" in r],
                          1e-4, key="val_loss")
        assert_states_match(torch.load(path), ref_state, 1e-5)
        for rec, q in zip(records, ref_records):
            assert abs(sum(rec["aux_loss"]) / world - q["aux_loss"][0]) < 1e-5, where
            assert sum(rec["dropped_tokens"]) == q["dropped_tokens"][0], where  # the same choices dropped
            assert rec["expert_tokens"] == q["expert_tokens"], where
        if strategy == "ddp":
            continue
        assert (sum(records[-1]["dropped_tokens"]) > 0) == ("cap" in ref), where
        cfg = M.parse_args(dict(M.TRAIN_DEFAULTS, dispatch=mode), MOE[ref] + ["--batch_size=24", "--dtype=float32"])
        moe_config = M.make_config("tiny_moe", VOCAB, 32, 0.0, cfg.n_expert, cfg.top_k, cfg.capacity_factor)
        import expert_parallel as EP
        local = cfg.n_expert // world
        for rec in records:
            assert rec["expert_load"] == [sum(rec["expert_tokens"][i * local:(i + 1) * local]) for i in range(world)]
            # the formula's bytes from the step's routing counts: exactly, per rank, for the token
            # exchange; in sum over the ranks with the all-reduces (their chunks are uneven by an element)
            counts = [(rec["sent_tokens"][i], rec["received_tokens"][i]) if mode == "alltoall" else (None, None)
                      for i in range(world)]
            for i in range(world):
                assert rec["dispatch_bytes"][i] == EP.exchange_bytes(moe_config, cfg, world, *counts[i]), where
            if mode == "alltoall":
                assert sum(rec["sent_tokens"]) == sum(rec["received_tokens"]) > 0, where
            total = sum(EP.traffic_per_rank(moe_config, cfg, world, *counts[i]) for i in range(world))
            assert abs(sum(rec["comm_bytes"]) - total) < 1e-3, where
    if world == 2:
        first = runs[("e4k2", "expert_parallel", "alltoall")][0]
        resumed = runs[("resume", "self")]
        assert [r["iter"] for r in resumed] == list(range(RESUME_AT, 20))
        assert [r["loss"] for r in resumed] == [r["loss"] for r in first[RESUME_AT:]]  # exactly
        assert_logs_match(runs[("resume", "ddp")], refs["e4k2"][0][RESUME_AT:], 1e-4)
        refused = result[0]["refused"]
        assert refused["indivisible"][0] == 2 and refused["indivisible"][1].strip() == \
            "error: --n_expert=3 experts do not divide among 2 ranks"
        assert refused["ddp capacity"][0] == 2 and refused["ddp capacity"][1].strip().startswith(
            "error: --capacity_factor needs the whole micro-batch's routing")
        assert len(refused["ddp capacity"][1].strip().splitlines()) == 1
