"""pipeline_parallel.py: the schedules on paper, then real runs against the one-process reference.

On paper (no model): every stage's action list is complete, its messages pair up
and the simulated run ends without deadlock, the simulated bubble is the formula's
(p-1)/(m+p-1), 1F1B holds at most p micro-batches where GPipe holds m, and every
exchange is the named message that goes to the right neighbour.
Real runs: one spawn per world size runs both schedules x {1, 4, 8} micro-batches
(1F1B with one micro-batch is GPipe's plan, so it runs once) and checks loss,
parameters, traffic, memory and the peak micro-batches held; at 2 stages also an
exact resume from a checkpoint and a bf16 run; at 4, two pipelines side by side on
sub-groups of non-neighbouring global ranks.
"""
import contextlib
import io
import math
import os

import pytest
import torch

import collectives as C
import model as M
import pipeline_parallel as PP
from harness import spawn, torchrun, python, read_log, assert_logs_match, assert_states_match
from conftest import VOCAB

# with one micro-batch both schedules are the same list of actions (checked on paper
# below), so 1F1B's m=1 run would repeat GPipe's: the parity runs skip it
CONFIGS = [("gpipe", 1), ("gpipe", 4), ("gpipe", 8), ("1f1b", 4), ("1f1b", 8)]
# every run costs 20 steps on shared cores: all of them at 2 stages; at 3 and 4, the two
# schedules side by side at one m (their activation memory compared), and the other m once
CONFIGS_AT = {2: CONFIGS, 3: [("gpipe", 1), ("gpipe", 8), ("1f1b", 8)], 4: [("gpipe", 4), ("1f1b", 4), ("1f1b", 8)]}
BATCH, BLOCK = 24, 32  # of conftest.TRAIN_ARGS
# bf16 on a CPU is slow (no bf16 matmul units): a short run of small batches
BF16_ARGS = ["--dtype=bfloat16", "--batch_size=8", "--max_iters=4", "--eval_interval=0"]
# measured: the pipeline drifts from the one-process bf16 run by up to 1.5e-4 in these 4
# steps (1.8e-4 in 20 steps of the full batch); a bug (a gradient missing, a wrong
# micro-batch scale) moves the loss by 1e-3 or more
BF16_TOL = 5e-4


def max_held(actions):
    """Most micro-batches whose forward has run and backward not yet, along a schedule."""
    held = peak = 0
    for kind, _ in actions:
        held += 1 if kind == "F" else -1
        peak = max(peak, held)
    return peak


def expected_held(schedule, p, m, stage):
    return m if schedule == "gpipe" else min(p - stage, m)

# ----------------------------------------------------------------------------- on paper


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_schedules_on_paper(schedule):
    for p in range(1, 6):
        for m in (1, 2, 3, 4, 5, 8, 16):
            where = f"{schedule}, {p} stages, {m} micro-batches"
            for s in range(p):
                order = PP.schedule(schedule, p, m, s)
                # complete: each forward and each backward once, in micro-batch order, F(k) before B(k)
                assert [a for a in order if a[0] == "F"] == [("F", k) for k in range(m)], where
                assert [a for a in order if a[0] == "B"] == [("B", k) for k in range(m)], where
                assert all(order.index(("F", k)) < order.index(("B", k)) for k in range(m)), where
                assert max_held(order) == expected_held(schedule, p, m, s), where
                # the messages: each compute is fed by the exchange just before it, and
                # its output leaves in the exchange just after it, in schedule order
                actions = PP.plan(schedule, p, m, s)
                assert [a for a in actions if a[0] != "X"] == order, where
                for i, (kind, k, *_) in enumerate(actions):
                    if kind == "F" and s > 0 or kind == "B" and s < p - 1:
                        assert actions[i - 1][0] == "X" and actions[i - 1][2] == ("act" if kind == "F" else "grad", k)
                    if kind == "F" and s < p - 1 or kind == "B" and s > 0:
                        assert actions[i + 1][0] == "X" and actions[i + 1][1] == ("act" if kind == "F" else "grad", k)
                sends = [a[1] for a in actions if a[0] == "X" and a[1]]
                recvs = [a[2] for a in actions if a[0] == "X" and a[2]]
                acts, grads = [("act", k) for k in range(m)], [("grad", k) for k in range(m)]
                assert [x for x in sends if x[0] == "act"] == (acts if s < p - 1 else []), where
                assert [x for x in sends if x[0] == "grad"] == (grads if s > 0 else []), where
                assert [x for x in recvs if x[0] == "act"] == (acts if s > 0 else []), where
                assert [x for x in recvs if x[0] == "grad"] == (grads if s < p - 1 else []), where
            # all stages together: every message meets its partner in order, nobody
            # deadlocks, and every stage idles exactly the bubble of the formula
            timelines = PP.simulate(schedule, p, m)
            if m == 1:
                assert [PP.plan(schedule, p, 1, s) for s in range(p)] == [PP.plan("gpipe", p, 1, s) for s in range(p)]
            assert [len(t) for t in timelines] == [2 * m] * p, where
            for idle in PP.idle_fractions(timelines):
                assert abs(idle - (p - 1) / (m + p - 1)) < 1e-12, where


def test_named_messages_reach_the_right_neighbour(monkeypatch):
    """Every exchange of every plan is one named message (send_forward_recv_backward...),
    one C.sendrecv to the peers the simulator assumes, with the pipeline's group."""
    calls = []
    monkeypatch.setattr(C, "sendrecv", lambda out, dst, buf, src, group=None: calls.append((out, dst, buf, src, group)))
    ranks = [5, 2, 7, 3, 9]  # the pipeline's global ranks, in stage order: not 0..p-1, not even sorted
    used = set()
    for schedule in ("gpipe", "1f1b"):
        for p in range(2, 6):
            for s in range(p):
                nb = PP.Neighbours(ranks[s - 1] if s else None, ranks[s + 1] if s < p - 1 else None)
                for action in PP.plan(schedule, p, 6, s):
                    if action[0] != "X":
                        continue
                    _, send, recv = action
                    message = PP.MESSAGES[send and send[0], recv and recv[0]]
                    used.add(message.__name__)
                    args = (["out"] if send else []) + (["buf"] if recv else [])
                    calls.clear()
                    message(*args, nb, "the group")
                    dst, src = PP.peers(s, send, recv)
                    assert calls == [("out" if send else None, None if dst is None else ranks[dst],
                                      "buf" if recv else None, None if src is None else ranks[src], "the group")]
    assert used == {f.__name__ for f in PP.MESSAGES.values()}  # all eight occur, and nothing else


def test_simulator_catches_deadlock_and_mismatch(monkeypatch):
    plan, schedule = PP.plan, PP.schedule

    def send_then_receive(*args):
        """The naive ordering: send, wait until it is received, then receive."""
        return [x for a in plan(*args) for x in ([("X", a[1], None), ("X", None, a[2])] if a[0] == "X" else [a])]

    # in 1F1B's steady state two neighbours both send first, and each waits for the other forever
    monkeypatch.setattr(PP, "plan", send_then_receive)
    with pytest.raises(RuntimeError, match="deadlock"):
        PP.simulate("1f1b", 2, 4)
    PP.simulate("gpipe", 2, 4)  # GPipe never has two neighbours sending to each other at once
    monkeypatch.setattr(PP, "plan", plan)

    def last_stage_backwards_reversed(name, p, m, s):
        order = schedule(name, p, m, s)
        return order[:m] + order[m:][::-1] if s == p - 1 else order

    # the gradients then reach the stage before it in another order than it receives them
    monkeypatch.setattr(PP, "schedule", last_stage_backwards_reversed)
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


def test_bad_input_in_process(train_args, capsys):
    for flags, message in ((["--schedule=zb"], "error: --schedule takes gpipe or 1f1b, not 'zb'"),
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


def _run_all(rank, world, train_args, out):
    results = {}
    for schedule, m in CONFIGS_AT[world]:
        path = os.path.join(out, f"pp_{world}_{schedule}_{m}.pt")
        flags = [f"--schedule={schedule}", f"--n_micro={m}", f"--save_path={path}",
                 f"--timeline={schedule == '1f1b' and m == 8}"]
        if world == 2 and (schedule, m) == ("1f1b", 4):  # the run that a resume must continue exactly
            flags += [f"--out_dir={out}/ckpt", "--ckpt_interval=10"]
        records, printed = _quiet(PP.main, train_args + flags)
        results[(schedule, m)] = (records, path, printed)
    if world == 2:
        results["resumed"] = _quiet(PP.main, train_args + ["--schedule=1f1b", "--n_micro=4",
                                                           f"--resume={out}/ckpt/step_000010"])[0]
        for m in (1, 4):
            results[("bf16", m)] = _quiet(PP.main, train_args + BF16_ARGS + [f"--n_micro={m}"])[0]
    if world == 3:
        # more stages than blocks: every rank must stop before any message
        M.PRESETS["two_blocks"] = dict(n_layer=2, n_head=2, n_embd=32, block_size=32)
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            try:
                PP.main(train_args + ["--model=two_blocks"])
                code = 0
            except SystemExit as e:
                code = e.code
        results["too_many_stages"] = (code, err.getvalue())
        # an uneven split: the 4 blocks of "small" over 3 stages, [2, 1, 1]
        path = os.path.join(out, "pp_uneven.pt")
        results["uneven"] = (_quiet(PP.main, train_args + ["--model=small", "--max_iters=4", "--n_micro=4",
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


def stage_params(config, p, s):
    """Parameters stage s holds, counted from model.py's units (the tied copy included)."""
    count = lambda unit: sum(t.numel() for t in M.build_unit(config, unit, 0).parameters())  # noqa: E731
    n = sum(count(i) for i in PP.stage_layers(config.n_layer, p, s))
    n += count("embed") if s == 0 else 0
    n += count("ln_f") + (config.vocab_size * config.n_embd if p > 1 else 0) if s == p - 1 else 0
    return n


@pytest.fixture(scope="module")
def runs(train_args, tmp_path_factory):
    """world -> rank 0's results of _run_all, each world spawned once for the tests that share it."""
    done = {}

    def at(world):
        if world not in done:
            done[world] = spawn(_run_all, world, train_args, str(tmp_path_factory.mktemp(f"pp{world}")),
                                timeout=400)[0]
        return done[world]
    return at


def check_traffic(r, config, cfg, world, where):
    """Each boundary carries m activations forward and m gradients back, float32 (B·s·h
    numbers each way in all); first and last stage each send the V·h tied gradient;
    plus the one-float norm all-reduce, 2(p-1)·4 bytes in all."""
    act = 4 * cfg.batch_size * cfg.block_size * config.n_embd
    boundary = [act * ((s < world - 1) + (s > 0)) + 4 * config.vocab_size * config.n_embd * (s in (0, world - 1))
                for s in range(world)]
    stated = PP.traffic_per_rank(config, cfg, world)  # the file's own formula
    assert sum(r["comm_bytes"]) == sum(boundary) + 2 * (world - 1) * 4 == stated * world, where
    for sent, want in zip(r["comm_bytes"], boundary):
        assert 0 <= sent - want <= 4 * (1 + math.ceil(math.log2(world))), where


@pytest.mark.parametrize("world", [2, 3, 4])
def test_parity_traffic_memory(world, train_args, reference, runs, tmp_path):
    ref_records, ref_state = reference
    results = runs(world)
    config = M.make_config("tiny", VOCAB, block_size=BLOCK)
    cfg = M.parse_args(PP.DEFAULTS, train_args)
    for schedule, m in CONFIGS_AT[world]:
        records, path, printed = results[(schedule, m)]
        where = f"{schedule}, {m} micro-batches, {world} stages"
        assert_logs_match(records, ref_records, 1e-4)
        assert_logs_match([r for r in records if "val_loss" in r], [r for r in ref_records if "val_loss" in r],
                          1e-4, key="val_loss")
        assert_states_match(torch.load(path), ref_state, 1e-5)
        for r in records:
            check_traffic(r, config, cfg, world, where)
            # memory: each stage holds only its own parameters (16 bytes each: param,
            # grad, Adam's m and v), and the micro-batches its schedule allows
            assert r["state_bytes"] == [16 * stage_params(config, world, s) for s in range(world)], where
            assert r["peak_micro"] == [expected_held(schedule, world, m, s) for s in range(world)], where
            assert len(r["idle_frac"]) == world and all(0 <= f < 1 for f in r["idle_frac"]), where
            assert r["bubble_theory"] == (world - 1) / (m + world - 1)
    # activation bytes: 1F1B holds min(p-s, m) micro-batches' worth where GPipe holds m
    for m in (4, 8):
        if ("gpipe", m) not in results or ("1f1b", m) not in results:
            continue
        gpipe, onefoneb = results[("gpipe", m)][0][-1]["act_bytes"], results[("1f1b", m)][0][-1]["act_bytes"]
        for s in range(world):
            assert onefoneb[s] * m == gpipe[s] * min(world - s, m), f"stage {s}, {m} micro-batches"
            assert onefoneb[s] < gpipe[s] or world - s >= m
    # the printed timeline: the schedule, on paper, and measured, one line per stage
    printed = results[("1f1b", 8)][2]
    assert PP.draw(PP.simulate("1f1b", world, 8), 3 * (8 + world - 1)) in printed
    assert printed.split("measured")[1].count("idle") == world
    assert " ".join(PP.show(a) for a in PP.plan("1f1b", world, 8, world - 1)) in printed
    assert all("on paper" not in results[c][2] for c in CONFIGS_AT[world] if c != ("1f1b", 8))
    if world == 3:
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
        ref = ddp.main(train_args + ["--model=small", "--max_iters=4", f"--save_path={path}"])
    assert_logs_match(records, ref, 1e-4)
    assert_states_match(state, torch.load(path), 1e-5)


def test_resume_is_exact(runs):
    """Saved at step 10 of 20 and resumed: iterations 10..19 log the same losses, to the bit.
    Both copies of the tied matrix (and their Adam moments) come back from one tensor."""
    results = runs(2)
    first, resumed = results[("1f1b", 4)][0], results["resumed"]
    assert [r["iter"] for r in resumed] == list(range(10, 20))
    assert [r["loss"] for r in resumed] == [r["loss"] for r in first[10:]]
    assert [r["val_loss"] for r in resumed if "val_loss" in r] == [r["val_loss"] for r in first[10:] if "val_loss" in r]


def test_bf16_sends_float32_and_follows_the_reference(runs, train_args):
    """--dtype=bfloat16: the boundaries still carry float32 (the residual stream is float32
    under autocast), so the bytes are the formula's, and the loss follows the one-process
    bf16 run of ddp.py within bf16's rounding. With one micro-batch the first step computes
    exactly what the one-process run does; a bf16 boundary would halve the bytes and move
    that loss by 1.4e-5 (measured)."""
    import ddp
    with contextlib.redirect_stdout(io.StringIO()):
        ref = ddp.main(train_args + BF16_ARGS)
    config, cfg = M.make_config("tiny", VOCAB, block_size=BLOCK), M.parse_args(PP.DEFAULTS, train_args + BF16_ARGS)
    for m in (1, 4):
        records = runs(2)[("bf16", m)]
        for r in records:
            check_traffic(r, config, cfg, 2, f"bf16, {m} micro-batches")
        assert_logs_match(records, ref, BF16_TOL)
    assert abs(runs(2)[("bf16", 1)][0]["loss"] - ref[0]["loss"]) <= 1e-6  # 0 measured; 2 float32 steps at 5


def test_one_process_reproduces_reference(train_args, reference, tmp_path):
    """`python pipeline_parallel.py`: no process group, one stage that is first and last."""
    path, log = tmp_path / "one.pt", tmp_path / "one.jsonl"
    r = python("pipeline_parallel.py", train_args + ["--n_micro=4", f"--save_path={path}", f"--log_file={log}"],
               timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    records = read_log(log)
    assert_logs_match(records, reference[0], 1e-4)
    assert_states_match(torch.load(path), reference[1], 1e-5)
    assert all(r["comm_bytes"] == [0] and r["peak_micro"] == [1] for r in records)


def test_torchrun_bad_batch_fails_cleanly(train_args):
    r = torchrun("pipeline_parallel.py", 2, train_args + ["--n_micro=5"], timeout=120)
    assert r.returncode != 0
    # one line, from rank 0 only; torchrun prints a traceback of its own when a child
    # fails, but none may come from our code
    assert r.stderr.count("error: --batch_size=24 does not divide into --n_micro=5 micro-batches") == 1
    assert not any(f'{name}.py", line' in r.stderr for name in ("pipeline_parallel", "model", "collectives"))
