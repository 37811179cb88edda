"""pipeline_parallel.py: the schedules on paper, then real runs against the one-process reference.

On paper (no model): for p = 1..8 and many m, every rank's action list is complete, each
compute is fed by the exchange before it (ZB-V: by one before it) and its output leaves in an
exchange after it, to the right neighbour; the simulated run ends without deadlock, and its
bubble is each schedule's formula exactly; 1F1B holds at most p-r micro-batches, ZB-H1
min(p, m), ZB-V min(2p, m+1+r, 2m) half-stage chunks, GPipe m; and the executor hands every
exchange to C.sendrecv with the peers' global ranks. In one process: ZB's B leaves the block
linears' weight gradients to W, whose store holds the formula's bytes.
Real runs: one spawn per world size runs the schedules at several m (1F1B with one
micro-batch is GPipe's plan, so it runs once; the extra runs go 3 steps, one run per
schedule and world 20) and checks loss, parameters, traffic, memory and the peak
micro-batches held, and act_bytes against activation_per_rank; at 2 stages also an exact
resume of a ZB-V run (whose checkpoint 1F1B loads at 3 stages), ZB-H1 with --recompute=full
and a bf16 run; at 4, two pipelines side by side on sub-groups of non-neighbouring global ranks.
"""
import argparse
import contextlib
import gc
import io
import math
import os
import sys
import weakref

import pytest
import torch

import collectives as C
import model as M
import pipeline_parallel as PP
from harness import spawn, check_at_two_ranks, refuse, refusals, assert_refused, one_thread, read_log, assert_logs_match, assert_states_match
from conftest import BF16_ARGS, SHORT_STEPS, VOCAB

# the bubble bench's step timer runs on the pool's ranks, which find it by its module's name: on
# the path before the pool's server starts (collection time)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))

# (schedule, m, steps). With one micro-batch GPipe and 1F1B are the same list of actions
# (checked on paper below), so 1F1B's m=1 run would repeat GPipe's. Every run costs steps on
# shared cores: one goes the whole 20 steps (1F1B at 2 stages, where a step costs half what
# it does on 4 ranks: the warm-up and the decay), the others SHORT_STEPS; the parameters
# at the end are checked on all of them. At 4 stages ZB-H1 and interleaved run m = p only:
# their m > p steady states run at 2 stages (zb 4, interleaved 4), and on paper for every p, m
S = SHORT_STEPS
CONFIGS_AT = {2: [("gpipe", 1, S), ("gpipe", 4, S), ("gpipe", 8, S), ("1f1b", 4, 20), ("1f1b", 8, S),
                  ("zb", 2, S), ("zb", 4, S), ("interleaved", 2, S), ("interleaved", 4, S), ("zbv", 4, S)],
              3: [("gpipe", 1, S), ("gpipe", 8, S), ("1f1b", 8, S)],
              4: [("gpipe", 4, S), ("1f1b", 4, S), ("1f1b", 8, S), ("zb", 4, S), ("interleaved", 4, S), ("zbv", 8, S)]}
V = 2  # --virtual_stages of the interleaved runs (the default)
TIMELINES = (("1f1b", 8), ("zb", 4), ("interleaved", 4), ("zbv", 4))  # the runs that print --timeline
AT = 2  # the step the checkpoints below are written at: the short runs' last step is resumed
RESUMED = ("zbv", 4, S)  # at 2 stages: checkpointed at step AT and resumed, and (rank 0 holding both
CROSS = RESUMED  # ends of the tie) loaded into 1F1B at 3 stages
BATCH, BLOCK = 24, 32  # of conftest.TRAIN_ARGS
# at 2 stages: ZB-H1 with each block rerun in backward, once, for B and W together
FULL_RECOMPUTE = ["--schedule=zb", "--n_micro=4", "--recompute=full", f"--max_iters={S}"]
# bf16 on a CPU is slow (no bf16 matmul units): a short run of small batches
# measured: the pipeline drifts from the one-process bf16 run by up to 1.5e-4 in these 4
# steps (1.8e-4 in 20 steps of the full batch); a bug (a gradient missing, a wrong
# micro-batch scale) moves the loss by 1e-3 or more
BF16_TOL = 5e-4


def expected_held(schedule, p, m, stage, v=2):
    """(chunk, micro-batch) activations a stage holds at most: GPipe all m; 1F1B the p-1-r of
    its warm-up and one more; ZB-H1 also its r deferred W's: min(p, m) on every stage;
    interleaved its warm-up and one more, each 1/v of a stage's (all v·m when m == p); ZB-V
    2p half-stage chunks once m >= 2p-1-r (1F1B's first stage's p stages' worth), fewer
    with fewer micro-batches: m+1+r, at most all 2m."""
    if schedule == "zbv":
        return min(2 * p, m + 1 + stage, 2 * m)
    if schedule == "interleaved":
        return v * m if m == p else min(v * m, 2 * (p - stage - 1) + (v - 1) * p + 1)
    return m if schedule == "gpipe" else min(p - stage, m) if schedule == "1f1b" else min(p, m)


def cases(schedule):
    """(p, m, v) on paper: p = 1..8, and every m each schedule allows up to 16 (interleaved:
    the multiples of p, with v = 1..4)."""
    for p in range(1, 9):
        for m in range(1, 17):
            for v in ((1, 2, 3, 4) if schedule == "interleaved" else (2,) if schedule == "zbv" else (1,)):
                if schedule != "interleaved" or m % p == 0:
                    yield p, m, v

# ----------------------------------------------------------------------------- on paper


@pytest.mark.quick
@pytest.mark.parametrize("schedule", PP.SCHEDULES)
def test_schedules_on_paper(schedule):
    kinds = "FBW" if schedule in ("zb", "zbv") else "FB"
    n_actions = 0
    for p, m, v in cases(schedule):
        where = f"{schedule}, {p} stages, {m} micro-batches, {v} chunks a stage"
        for s in range(p):
            order = PP.schedule(schedule, p, m, s, v)
            chunks, holder = sorted(PP.chunks_of(schedule, p, s, v)), lambda c: PP.owner(schedule, p, c)
            # complete: each F, B (and W) once per chunk and micro-batch, F(k) before B(k) before W(k)
            for kind in kinds:
                assert sorted(a for a in order if a.kind == kind) == [PP.Compute(kind, c, k) for c in chunks
                                                                      for k in range(m)], where
            where_is = {a: i for i, a in enumerate(order)}
            for c in chunks:
                for k in range(m):
                    at = [where_is[PP.Compute(kind, c, k)] for kind in kinds]
                    assert at == sorted(at), where
            assert PP.max_held(order) == expected_held(schedule, p, m, s, v), where
            # the messages: each compute is fed by the exchange before it (only computes between
            # them; ZB-V: by one before it, plan() says why), from the rank that holds the chunk
            # before (after) it; what it produces leaves in the next exchange that sends
            actions = PP.plan(schedule, p, m, s, v)
            n_actions += len(actions)
            assert [a for a in actions if isinstance(a, PP.Compute)] == order, where
            received, unsent = set(), set()
            for a in actions:
                if isinstance(a, PP.Exchange):
                    assert not unsent or {x for x, _ in a.sends} == unsent or not a.sends, where
                    for msg, dst in a.sends:
                        assert msg.chunk in chunks and dst == holder(msg.chunk + (1 if msg.kind == "act" else -1)) != s
                        unsent.discard(msg)
                    assert not unsent or not a.sends, where  # all of them, in the first exchange that sends
                    early = received if schedule == "zbv" else set()
                    received = early | {x for x, src in a.recvs if holder(x.chunk) == src != s}
                    assert len(received) == len(early) + len(a.recvs), where
                    continue
                c = a.chunk - 1 if a.kind == "F" else a.chunk + 1
                if a.kind != "W" and 0 <= c < p * v and holder(c) != s:
                    need = PP.Message("act" if a.kind == "F" else "grad", c, a.micro)
                    assert need in received, where
                    received.discard(need)
                c = a.chunk + 1 if a.kind == "F" else a.chunk - 1
                if a.kind != "W" and 0 <= c < p * v and holder(c) != s:
                    unsent.add(PP.Message("act" if a.kind == "F" else "grad", a.chunk, a.micro))
            assert not unsent and not received, where
        # all stages together: every message meets its partner in order, nobody deadlocks
        # (the evaluation's forwards too), and every stage idles exactly the formula's bubble
        timelines = PP.simulate(schedule, p, m, v)
        PP.simulate(schedule, p, m, v, train=False)
        if m == 1 and schedule == "1f1b":
            assert [PP.plan("1f1b", p, 1, s) for s in range(p)] == [PP.plan("gpipe", p, 1, s) for s in range(p)]
        assert [len(t) for t in timelines] == [len(kinds) * m * v] * p, where
        for idle in PP.idle_fractions(timelines):
            assert abs(idle - PP.bubble(schedule, p, m, v)) < 1e-12, where
    assert n_actions > 0
    # the formulas, as the papers state them (ZB-H1 for m >= p: (p-1)(F+B-W) idle per stage)
    assert PP.bubble("1f1b", 4, 8) == PP.bubble("gpipe", 4, 8) == 3 / 11 and PP.bubble("interleaved", 4, 8, 2) == 3 / 19
    assert PP.bubble("zb", 4, 8) == 3 / 27 and PP.bubble("zb", 4, 2) == 5 / 11
    # ZB-V at unit costs of a chunk (half a stage): p-1 idle in 6m, half ZB-H1's in time
    assert PP.bubble("zbv", 4, 8) == 3 / 51 and PP.bubble("zbv", 2, 4) == 1 / 25


def test_exchanges_post_every_message_at_once(monkeypatch):
    """The executor hands each exchange to one call: C.sendrecv for one send and one receive
    at most, C.batch_sendrecv for interleaved's steady state; the messages the plan names, to
    and from the global ranks of the plan's peers, on the pipeline's group."""
    calls = []
    monkeypatch.setattr(C, "sendrecv", lambda out, dst, buf, src, group=None: calls.append(
        ([(out, dst)] if out is not None else [], [(buf, src)] if buf is not None else [], group)))
    monkeypatch.setattr(C, "batch_sendrecv", lambda sends, recvs, group=None: calls.append((sends, recvs, group)))
    ranks = [5, 2, 7, 3, 9]  # the pipeline's global ranks, in stage order: not 0..p-1, not even sorted
    executor = PP.Executor.__new__(PP.Executor)
    executor.act_shape, executor.device, executor.group, executor.ranks = (1,), "cpu", "the group", ranks
    batched = 0
    for schedule in PP.SCHEDULES:
        for s in range(5):
            for a in PP.plan(schedule, 5, 10, s, 2):
                if isinstance(a, PP.Exchange):
                    tensors = [torch.full((1,), float(i)) for i in range(len(a.sends))]
                    executor.mail, before = dict(zip((m for m, _ in a.sends), tensors)), len(calls)
                    executor.exchange(a)
                    assert len(calls) == before + 1
                    sends, recvs, group = calls[-1]
                    batched += len(sends) > 1 or len(recvs) > 1
                    assert group == "the group" and [t for t, _ in sends] == tensors
                    assert [d for _, d in sends] == [ranks[d] for _, d in a.sends]
                    assert [r for _, r in recvs] == [ranks[r] for _, r in a.recvs]
                    assert all(executor.mail[m] is buf for (m, _), (buf, _) in zip(a.recvs, recvs))
    assert batched > 0


def test_simulator_catches_deadlock_and_mismatch(monkeypatch):
    plan, schedule = PP.plan, PP.schedule

    def send_then_receive(*args):
        """The naive ordering: send, wait until it is received, then receive."""
        return [x for a in plan(*args) for x in ([PP.Exchange(a.sends, ()), PP.Exchange((), a.recvs)]
                                                 if isinstance(a, PP.Exchange) else [a])]

    # in 1F1B's steady state two neighbours both send first, and each waits for the other forever
    monkeypatch.setattr(PP, "plan", send_then_receive)
    with pytest.raises(RuntimeError, match="deadlock"):
        PP.simulate("1f1b", 2, 4)
    PP.simulate("gpipe", 2, 4)  # GPipe never has two neighbours sending to each other at once
    monkeypatch.setattr(PP, "plan", plan)

    steps = PP.steps

    def last_stage_backwards_reversed(name, p, m, s, v=1):
        order = steps(name, p, m, s, v)
        return order[:m] + order[m:][::-1] if s == p - 1 else order

    # the gradients then reach the stage before it in another order than it receives them
    monkeypatch.setattr(PP, "steps", last_stage_backwards_reversed)
    with pytest.raises(RuntimeError, match="met"):
        PP.simulate("gpipe", 2, 3)


def test_stage_layers_split_evenly():
    for n_layer in range(1, 14):
        for p in range(1, n_layer + 1):
            parts = [PP.stage_layers(n_layer, p, s) for s in range(p)]
            assert [i for r in parts for i in r] == list(range(n_layer))
            assert max(map(len, parts)) - min(map(len, parts)) <= 1 and min(map(len, parts)) >= 1


def test_checkpoint_entries_cover_the_model_once():
    config = M.make_config("tiny", VOCAB, block_size=BLOCK)
    names = set(M.global_shapes(config))  # the global names, from the shapes alone
    for p in (1, 2, 3):
        entries = [e for s in range(p) for e in PP.checkpoint_entries(PP.Stage(config, s, p, 0))]
        assert sorted(n for n, _, _, write in entries if write) == sorted(names)  # each written once, whole
        assert all(index is None for _, _, index, _ in entries)
        loaded_only = [(n, param.shape) for n, param, _, write in entries if not write]
        assert loaded_only == ([] if p == 1 else [("transformer.wte.weight", (config.vocab_size, config.n_embd))])


def test_b_leaves_the_weights_gradients_to_w(monkeypatch):
    """ZB's B computes the input's gradient and the norms', biases' and ends' (one backward,
    walked once), and leaves each block linear's weight gradient to W: at the first W none
    of those has a gradient yet, and the micro-batch's store holds 4 linears a block, their
    inputs and output gradients (16h numbers a token a layer). After W, every gradient is
    1F1B's (the full backward's). A deferred weight's gradient hooks (data parallelism's
    buckets count on them) run in W (one autograd engine run for all its linears), once a
    micro-batch, never in B: were the weight an input
    of B's graph, autograd would run them there with no gradient, and the mesh's buckets sent
    the weights' gradients before W had computed them (the bug this caught, on zb with
    --dp_replicate or --dp_shard, from 2e-3 off the one-process loss at the second step)."""
    config = M.make_config("tiny", VOCAB, block_size=BLOCK)
    stage, m, b = PP.Stage(config, 0, 1, 0), 2, 3
    rows = torch.randint(0, VOCAB, (m * b, BLOCK + 1), generator=torch.Generator().manual_seed(0))
    batch = lambda k: (rows[k * b:(k + 1) * b, :-1], rows[k * b:(k + 1) * b, 1:])  # noqa: E731
    PP.Executor(stage, (b, BLOCK, config.n_embd), m).run(PP.plan("1f1b", 1, m, 0), batch)
    full = {n: p.grad.clone() for n, p in stage.named_parameters()}
    stage.zero_grad(set_to_none=True)
    at_w, weight_grads = [], PP.weight_grads

    def first_w(store):
        at_w.append(({n for n, p in stage.named_parameters() if p.grad is None}, store_bytes(store), len(store)))
        kept.extend(weakref.ref(t) for _, x, dy in store for t in (x, dy))
        runs.clear()
        weight_grads(store)
        engine_runs.append(len(runs))
    kept, runs, engine_runs, engine = [], [], [], torch.autograd.backward
    store_bytes = PP.store_bytes
    monkeypatch.setattr(PP, "weight_grads", first_w)
    monkeypatch.setattr(torch.autograd, "backward", lambda *a, **k: runs.append(1) or engine(*a, **k))
    executor = PP.Executor(stage, (b, BLOCK, config.n_embd), m)
    fired, kind = [], []  # (parameter's name, the action it fired in)
    for n, p in stage.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, n=n: fired.append((n, kind[-1])))
    for name in ("backward", "weight_grad"):
        run = getattr(executor, name)
        setattr(executor, name, lambda a, *args, run=run: kind.append(a.kind) or run(a, *args))
    executor.run(PP.plan("zb", 1, m, 0), batch)
    deferred = {n for n, p in stage.transformer["h"].named_parameters(prefix="transformer.h") if p.dim() == 2}
    assert len(at_w) == m and at_w[0][0] == deferred and len(deferred) == 4 * config.n_layer
    assert engine_runs == [1] * m  # one autograd engine run a W, not one a linear
    assert sorted(fired) == sorted((n, "W" if n in deferred else "B") for n, _ in stage.named_parameters()
                                   for _ in range(m))
    # after the step nothing holds a store's tensors: the store must not be reachable from the
    # graph it came from (x's grad_fn -> the node -> its store), a cycle through autograd's C++
    # graph that Python's collector cannot free: every step's stores leaked (16h numbers a token a layer)
    gc.collect()
    assert kept and all(ref() is None for ref in kept)
    assert at_w[0][1:] == (PP.w_store_bytes(config, b * BLOCK, config.n_layer), 4 * config.n_layer)
    for n, p in stage.named_parameters():
        assert torch.allclose(p.grad, full[n], rtol=1e-5, atol=1e-7), n


def test_bad_input_in_process(train_args, capsys):
    for flags, message in ((["--schedule=dualpipev"],
                            "error: --schedule takes gpipe, 1f1b, interleaved, zb, zbv, not 'dualpipev'"),
                           (["--n_micro=5"], "error: --batch_size=24 does not divide into --n_micro=5 micro-batches"),
                           (["--n_micro=0"], "error: --n_micro must be at least 1")):
        with pytest.raises(SystemExit) as e:
            PP.main(train_args + flags)
        assert e.value.code != 0 and message in capsys.readouterr().err

# ----------------------------------------------------------------------------- real runs


def _quiet(fn, *args):
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        return fn(*args), printed.getvalue()


def _run_all(rank, world, train_args, out, cross=None):
    results = {}
    for schedule, m, steps in CONFIGS_AT[world]:
        path = os.path.join(out, f"pp_{world}_{schedule}_{m}.pt")
        flags = [f"--schedule={schedule}", f"--n_micro={m}", f"--save_path={path}", f"--max_iters={steps}",
                 f"--timeline={(schedule, m) in TIMELINES}"]
        if world == 2 and (schedule, m, steps) == RESUMED:  # the run that a resume must continue exactly
            flags += [f"--out_dir={out}/ckpt", f"--ckpt_interval={AT}"]
        records, printed = _quiet(PP.main, train_args + flags)
        results[(schedule, m)] = (records, path, printed)
    if world == 2:
        results["resumed"] = _quiet(PP.main, train_args + [f"--schedule={RESUMED[0]}", f"--n_micro={RESUMED[1]}",
                                                           f"--max_iters={RESUMED[2]}",
                                                           f"--resume={out}/ckpt/step_{AT:06d}"])[0]
        for m in (1, 4):
            results[("bf16", m)] = _quiet(PP.main, train_args + BF16_ARGS + [f"--n_micro={m}"])[0]
        results[("bf16 zbv", 4)] = _quiet(PP.main, train_args + BF16_ARGS + ["--n_micro=4", "--schedule=zbv"])[0]
        results["zb_full"] = _quiet(PP.main, train_args + FULL_RECOMPUTE)[0]
    if world == 3:  # 1F1B on 3 stages from the checkpoint of interleaved on 2 x 2 chunks
        path = os.path.join(out, "pp_cross.pt")
        results["cross"] = (_quiet(PP.main, train_args + ["--n_micro=4", f"--resume={cross}", f"--max_iters={CROSS[2]}",
                                                          f"--save_path={path}"])[0], path)
        # more stages than blocks: every rank must stop before any message
        M.PRESETS["two_blocks"] = dict(n_layer=2, n_head=2, n_embd=32, block_size=32)
        results["too_many_stages"] = refuse("pipeline_parallel", train_args + ["--model=two_blocks"])
        # an uneven split: the 4 blocks of "small" over 3 stages, [2, 1, 1]
        path = os.path.join(out, "pp_uneven.pt")
        results["uneven"] = (_quiet(PP.main, train_args + ["--model=small", f"--max_iters={S}", "--n_micro=4",
                                                           f"--save_path={path}"])[0], path)
    if world == 4:
        results["sub_pipelines"] = _sub_pipelines(train_args)
    return results


def _sub_pipelines(train_args):
    """Two 2-stage pipelines side by side, on the sub-groups of global ranks [0, 2] and
    [1, 3] (so a stage's neighbour is never the next global rank), each running one
    training step of the pieces a 3-D mesh would use. -> on rank 0, {"loss": [by rank: the
    step's loss on a last stage, nan on a first], "norm": [by rank]}."""
    cfg = M.parse_args(PP.DEFAULTS, train_args + ["--n_micro=2"])
    run = M.start(cfg, "pipeline")
    groups = [C.new_group([0, 2]), C.new_group([1, 3])]  # every rank creates both, in the same order
    group = groups[run.rank % 2]
    s = C.get_rank(group)
    stage = PP.Stage(run.config, s, 2, cfg.seed)
    executor = PP.Executor(stage, (BATCH // 2, BLOCK, run.config.n_embd), 2, group=group)
    losses = executor.run(PP.plan("1f1b", 2, 2, s), lambda m: M.batch(run, 0, "train", m, 2))
    PP.sum_tied_grads(stage, group)
    norm = PP.clip_global_norm(stage, cfg.grad_clip, group)
    return C.gather_stats(dict(loss=torch.stack(losses).mean() if stage.last else math.nan, norm=norm))


def stage_params(config, p, s, v=1, schedule="1f1b"):
    """Parameters stage s holds, counted from model.py's units (the tied copy included;
    ZB-V: rank 0 holds both ends, one matrix)."""
    count = lambda unit: sum(t.numel() for t in M.build_unit(config, unit, 0).parameters())  # noqa: E731
    chunks = PP.chunks_of(schedule, p, s, v)
    n = sum(count(i) for c in chunks for i in PP.stage_layers(config.n_layer, p * v, c))
    n += count("embed") if 0 in chunks else 0
    n += count("ln_f") + (config.vocab_size * config.n_embd if 0 not in chunks else 0) if p * v - 1 in chunks else 0
    return n


@pytest.fixture(scope="module")
def runs(train_args, tmp_path_factory):
    """world -> rank 0's results of _run_all, each world spawned once for the tests that share it."""
    done = {}

    folders = {}

    def at(world):
        if world not in done:
            cross = os.path.join(folders[2], "ckpt", f"step_{AT:06d}") if world == 3 and at(2) else None
            folders[world] = str(tmp_path_factory.mktemp(f"pp{world}"))
            done[world] = spawn(_run_all, world, train_args, folders[world], cross, timeout=600)[0]
        return done[world]
    return at


def check_traffic(r, config, cfg, world, where):
    """Each boundary carries m activations forward and m gradients back, float32 (B·s·h
    numbers each way in all); first and last stage each send the V·h tied gradient;
    plus the one-float norm all-reduce, 2(p-1)·4 bytes in all. Interleaved: each of a
    stage's v chunks sends its activations on (but the last chunk of all) and its input's
    gradients back (but the first): p·v-1 boundaries instead of p-1."""
    act = 4 * cfg.batch_size * cfg.block_size * config.n_embd
    v = PP.virtual_stages(cfg)
    boundary = [act * ((v - (s == world - 1)) + (v - (s == 0))) + 4 * config.vocab_size * config.n_embd *
                (s in (0, world - 1)) for s in range(world)]
    if cfg.schedule == "zbv":  # each rank's two chunks send both ways, but across the V's bottom; no tie
        boundary = [act * 2 * ((s > 0) + (s < world - 1)) for s in range(world)]
    stated = PP.traffic_per_rank(config, cfg, world)  # the file's own formula
    assert sum(r["comm_bytes"]) == sum(boundary) + 2 * (world - 1) * 4 == stated * world, where
    for sent, want in zip(r["comm_bytes"], boundary):
        assert 0 <= sent - want <= 4 * (1 + math.ceil(math.log2(world))), where


@pytest.mark.quick
def test_quick_at_2_ranks(train_args, reference_short):
    """pipeline_parallel.py's quick check: two stages in 1F1B, 4 micro-batches, 3 steps, against the
    one-process run."""
    argv = train_args + [f"--max_iters={SHORT_STEPS}", "--schedule=1f1b", "--n_micro=4"]
    check_at_two_ranks("pipeline_parallel", argv, reference_short[0], VOCAB)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_parity_traffic_memory(world, train_args, reference, reference_short, runs, tmp_path):
    ref_records, ref_state = reference
    results = runs(world)
    config = M.make_config("tiny", VOCAB, block_size=BLOCK)
    for schedule, m, steps in CONFIGS_AT[world]:
        cfg = M.parse_args(PP.DEFAULTS, train_args + [f"--schedule={schedule}", f"--n_micro={m}"])
        records, path, printed = results[(schedule, m)]
        where = f"{schedule}, {m} micro-batches, {world} stages"
        assert len(records) == steps, where
        assert_logs_match(records, ref_records[:steps], 1e-4)
        ref_val = {r["iter"]: r["val_loss"] for r in ref_records if "val_loss" in r}  # a short run adds its last
        assert all(abs(r["val_loss"] - ref_val[r["iter"]]) <= 1e-4 for r in records if r["iter"] in ref_val), where
        assert sum(r["iter"] in ref_val and "val_loss" in r for r in records) == sum(i < steps for i in ref_val)
        # the same parameters at the end
        assert_states_match(torch.load(path), (ref_state if steps == len(ref_records) else reference_short[1]), 1e-5)
        for r in records:
            check_traffic(r, config, cfg, world, where)
            # memory: each stage holds only its own parameters (16 bytes each: param,
            # grad, Adam's m and v), and the micro-batches its schedule allows
            v = V if schedule == "interleaved" else PP.virtual_stages(cfg)
            assert r["state_bytes"] == [16 * stage_params(config, world, s, v, schedule) for s in range(world)], where
            assert r["peak_micro"] == [expected_held(schedule, world, m, s, V) for s in range(world)], where
            # the bytes held for backward (and between B and W, the W store's), as the formula counts them
            assert r["act_bytes"] == PP.activation_per_rank(config, cfg, world), where
            assert len(r["idle_frac"]) == world and all(0 <= f < 1 for f in r["idle_frac"]), where
            assert r["bubble_theory"] == PP.bubble(schedule, world, m, V)
    # activation bytes: 1F1B holds min(p-s, m) micro-batches' worth where GPipe holds m, ZB-H1 at most min(p, m)
    for m in (4, 8):
        if ("gpipe", m) not in results or ("1f1b", m) not in results:
            continue
        gpipe, onefoneb = results[("gpipe", m)][0][-1]["act_bytes"], results[("1f1b", m)][0][-1]["act_bytes"]
        for s in range(world):
            assert onefoneb[s] * m == gpipe[s] * min(world - s, m), f"stage {s}, {m} micro-batches"
            assert onefoneb[s] < gpipe[s] or world - s >= m
            if ("zb", m) in results:  # min(p, m) micro-batches, those past B down to their W store
                assert results[("zb", m)][0][-1]["act_bytes"][s] * m <= gpipe[s] * min(world, m)
    # the printed timeline: the schedule, on paper, and measured, one line per stage
    printed = results[("1f1b", 8)][2]
    assert PP.draw(PP.simulate("1f1b", world, 8), 3 * (8 + world - 1)) in printed
    assert PP.paper_width("1f1b", world, 8) == 3 * (8 + world - 1)
    assert printed.split("measured")[1].count("idle") == world
    assert " ".join(PP.show(a) for a in PP.plan("1f1b", world, 8, world - 1)) in printed
    if ("zb", 4) in results:  # ZB-H1's W's, on paper and measured
        printed = results[("zb", 4)][2]
        assert PP.draw(PP.simulate("zb", world, 4), PP.paper_width("zb", world, 4)) in printed
        assert "W" in printed.split("measured")[1]
    if ("interleaved", 4) in results:  # the chunks' actions, named by chunk
        printed = results[("interleaved", 4)][2]
        assert PP.draw(PP.simulate("interleaved", world, 4, V), PP.paper_width("interleaved", world, 4, V)) in printed
        assert " ".join(PP.show(a, V) for a in PP.plan("interleaved", world, 4, 0, V)) in printed
    assert all("on paper" not in results[c[:2]][2] for c in CONFIGS_AT[world] if c[:2] not in TIMELINES)
    if world == 3:  # the interleaved checkpoint continues as 1F1B: the reference's steps AT.., its parameters
        records, path = results["cross"]
        assert [r["iter"] for r in records] == list(range(AT, CROSS[2]))
        assert_logs_match(records, reference_short[0][AT:], 1e-4)
        assert_states_match(torch.load(path), reference_short[1], 1e-5)
        code, err = results["too_many_stages"]
        assert code != 0 and "error: 3 stages but the model has 2 blocks" in err
        records, path = results["uneven"]
        uneven_reference(train_args, records, torch.load(path), tmp_path)
    if world == 4:  # two pipelines on sub-groups: each computes the reference's first step
        got, want = results["sub_pipelines"], ref_records[0]
        assert [math.isnan(x) for x in got["loss"]] == [True, True, False, False], got
        assert all(abs(x - want["loss"]) <= 1e-5 for x in got["loss"][2:]), (got, want["loss"])
        assert all(abs(x - want["grad_norm"]) <= 1e-5 * want["grad_norm"] for x in got["norm"]), (got, want)


def uneven_reference(train_args, records, state, tmp_path):
    import ddp
    path = str(tmp_path / "ddp_small.pt")
    with contextlib.redirect_stdout(io.StringIO()):
        ref = ddp.main(train_args + ["--model=small", f"--max_iters={S}", f"--save_path={path}"])
    assert_logs_match(records, ref, 1e-4)
    assert_states_match(state, torch.load(path), 1e-5)


def test_zb_with_full_recompute(runs, train_args, reference_short):
    """--recompute=full under ZB-H1: B reruns each block's forward once and W needs no rerun
    (it reads the store): the reference's losses, and act_bytes the formula's, in which the
    store (16h a token a layer) outweighs what the blocks keep (h)."""
    records = runs(2)["zb_full"]
    assert_logs_match(records, reference_short[0], 1e-4)
    config, cfg = M.make_config("tiny", VOCAB, block_size=BLOCK), M.parse_args(PP.DEFAULTS, train_args + FULL_RECOMPUTE)
    assert all(r["act_bytes"] == PP.activation_per_rank(config, cfg, 2) for r in records)


def test_resume_is_exact(runs):
    """Saved at step AT (a ZB-H1 run) and resumed: the iterations after it log the same
    losses, to the bit. Both copies of the tied matrix (and their Adam moments) come back from one tensor."""
    results = runs(2)
    first, resumed = results[RESUMED[:2]][0], results["resumed"]
    assert [r["iter"] for r in resumed] == list(range(AT, RESUMED[2]))
    assert [r["loss"] for r in resumed] == [r["loss"] for r in first[AT:]]
    assert [r["val_loss"] for r in resumed if "val_loss" in r] == [r["val_loss"] for r in first[AT:] if "val_loss" in r]
    assert any("val_loss" in r for r in resumed)  # the last step's validation, compared too


def test_bf16_sends_float32_and_follows_the_reference(runs, train_args, reference_bf16):
    """--dtype=bfloat16: the boundaries still carry float32 (the residual stream is float32
    under autocast), so the bytes are the formula's, and the loss follows the one-process
    bf16 run of ddp.py within bf16's rounding. With one micro-batch the first step computes
    exactly what the one-process run does; a bf16 boundary would halve the bytes and move
    that loss by 1.4e-5 (measured). ZB-V too: its linears' B and W go through deferred_linear,
    which casts as autocast casts F.linear's inputs, so W's dW is autocast's."""
    ref = reference_bf16
    config = M.make_config("tiny", VOCAB, block_size=BLOCK)
    for key in (("bf16", 1), ("bf16", 4), ("bf16 zbv", 4)):
        flags = ["--schedule=zbv"] if key[0] == "bf16 zbv" else []
        cfg = M.parse_args(PP.DEFAULTS, train_args + BF16_ARGS + [f"--n_micro={key[1]}"] + flags)
        records = runs(2)[key]
        for r in records:
            check_traffic(r, config, cfg, 2, f"{key[0]}, {key[1]} micro-batches")
        assert_logs_match(records, ref, BF16_TOL)
    assert abs(runs(2)[("bf16", 1)][0]["loss"] - ref[0]["loss"]) <= 1e-6  # 0 measured; 2 float32 steps at 5


def test_one_process_reproduces_reference(train_args, reference_short, tmp_path):
    """pipeline_parallel.py on one process (its main() here: no process group), one stage
    that is first and last."""
    path, log = tmp_path / "one.pt", tmp_path / "one.jsonl"
    with one_thread():
        _quiet(PP.main, train_args + ["--n_micro=4", f"--max_iters={SHORT_STEPS}", f"--save_path={path}",
                                      f"--log_file={log}"])
    records = read_log(log)
    assert_logs_match(records, reference_short[0], 1e-4)
    assert_states_match(torch.load(path), reference_short[1], 1e-5)
    assert all(r["comm_bytes"] == [0] and r["peak_micro"] == [1] for r in records)


def test_bubble_bench_pairs_each_step_with_1f1bs_in_its_cycle():
    """bench/pipeline_parallel_bubble.py's ms/step: every schedule gets one step a cycle on the same ranks, and
    the ratio printed is the median of the cycles' ratios to 1F1B's step of the same cycle, not the best run's."""
    import pipeline_parallel_bubble as bench
    args = argparse.Namespace(model="tiny", block_size=32, batch_size=8, schedules=["1f1b", "zb", "zbv"],
                              virtual_stages=2, cycles=2)
    times = spawn(bench.alternating, 2, args, 4)[0]
    assert sorted(times) == ["1f1b", "zb", "zbv"] and all(len(t) == 2 and min(t) > 0 for t in times.values())
    assert bench.paired(times, "1f1b")[1:] == (1.0, (1.0, 1.0))
    made_up = {"1f1b": [1.0, 2.0, 1.0, 1.0, 1.0], "zb": [0.9, 1.6, 1.2, 0.8, 0.85]}  # ratios .9 .8 1.2 .8 .85
    ms, ratio, middle = bench.paired(made_up, "zb")
    assert ms == pytest.approx(900) and ratio == pytest.approx(0.85) and middle == pytest.approx((0.8, 0.9))
    assert bench.paired({"zb": [0.5]}, "zb") == (500, None, None)  # no 1F1B to pair with
    # its prediction at unit costs is the formulas': 1F1B 15 units at p = 2, m = 4, ZB-H1 13, ZB-V 12.5
    assert bench.on_paper(2, 4, 1, 2, 1, 1) == pytest.approx({"zb": 13 / 15, "zbv": 12.5 / 15})


@pytest.mark.quick
def test_bad_batch_fails_on_every_rank(train_args):
    assert_refused(refusals("pipeline_parallel", 2, train_args + ["--n_micro=5"]),
                   "--batch_size=24 does not divide into --n_micro=5 micro-batches")
