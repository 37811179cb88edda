"""bench/trace_replay.py: the replay on small hand-made traces whose answer is known by hand (a
collective waits for its last member, an async op runs beside compute, a message arrives after
its sender posted it, ranks sharing a core share its time), a trace that lacks what the replay
needs refused in one line, and one real trace of two strategies (one launch of 2 ranks): its
counted FLOPs are the model's formula, and every message it holds finds its partner."""
import json
import os
import sys

import pytest

from harness import ROOT, spawn

sys.path[:0] = [ROOT, os.path.join(ROOT, "bench")]
import trace_replay as R  # noqa: E402

CL = dict(flops=1e9, mem_bw=1e9, op_s=0.0, call_s=0.0, alpha=1e-3, beta=1e6, alpha_x=1e-3, beta_x=1e6, per_node=1 << 30,
          cores=None, quantum=4e-3, speed=1.0, peak=None)  # a FLOP a ns, a message 1 ms + a byte a us


def trace(ranks, world=None, step=2):
    """ranks: per rank, a list of ("compute", flops[, bytes]) | ("sync"|"post", op, group, {peer: bytes}) |
    ("wait", index of the post it waits for); -> a trace in --trace's format (times are not read)."""
    events = []
    for r, items in enumerate(ranks):
        seq, flops, nbytes, posts = 0, 0, 0, []
        for item in items:
            if item[0] == "compute":
                flops += item[1]
                nbytes += item[2] if len(item) > 2 else 0
                continue
            seq += 1
            if item[0] == "wait":
                events.append(dict(name="wait", cat="wait", ph="X", ts=0, dur=0, pid=r, tid=0,
                                   args=dict(step=step, at=[seq, flops, 0, nbytes], upto=[seq + 1, flops, 0, nbytes],
                                             of=posts[item[1]], op="all_reduce", group=[], peers=[], bytes=0)))
                seq += 1
                continue
            kind, op, group, peers = item
            sent = {str(p): [1, b] for p, b in peers.items()}
            args = dict(step=step, op=op, group=group, peers=sorted(peers), bytes=sum(peers.values()), to=sent,
                        frm=sent if op != "send" else {}, at=[seq, flops, 0, nbytes])
            if op == "recv":
                args["to"] = {}
            if kind == "sync":
                args["upto"] = [seq + 1, flops, 0, nbytes]
                seq += 1
            else:
                posts.append(seq)
            events.append(dict(name=op, cat="comm", ph="X", ts=0, dur=0, pid=r, tid=0 if kind == "sync" else 1,
                               args=args))
        seq += 1
        events.append(dict(name=f"step {step}", cat="step", ph="X", ts=0, dur=1, pid=r, tid=0,
                           args=dict(step=step, at=[0, 0, 0, 0], upto=[seq, flops, 0, nbytes])))
    return dict(traceEvents=events, otherData=dict(strategy="ddp", world=world or len(ranks)))


def step_of(t, **cl):
    return R.summary(R.replay(R.programs(t)[1], dict(CL, **cl)))


@pytest.mark.quick
def test_a_collective_waits_for_its_last_member():
    """Rank 0 computes 1 s, rank 1 3 s; their all-reduce (two messages of 1000 bytes each way) then
    takes 2 x 1 ms + 2000 bytes / 1 MB/s: the step is 3 + 0.004 s, and rank 0 waited 2 s of it."""
    ar = ("sync", "all_reduce", [0, 1])
    t = trace([[("compute", 1e9), ar + ({1: 2000},)], [("compute", 3e9), ar + ({0: 2000},)]])
    for e in t["traceEvents"]:
        if e["cat"] == "comm":
            e["args"]["to"] = {k: [2, v[1]] for k, v in e["args"]["to"].items()}
    row = step_of(t)
    assert row["step_s"] == pytest.approx(3.004)
    assert row["exposed_s"][0] == pytest.approx(2.004) and row["exposed_s"][1] == pytest.approx(0.004)
    assert row["busy_s"] == pytest.approx([1.0, 3.0])


def test_the_late_member_of_a_blocking_collective_stays_late():
    """lag_s (measured here: gloo's late member leaves after the others): equal ranks, three all-reduces
    of 1000 bytes (2 ms each): the highest rank leaves each 1 ms late, so it is late at the next too."""
    ar = ("sync", "all_reduce", [0, 1])
    t = trace([[("compute", 1e6), ar + ({1 - r: 1000},)] * 3 for r in range(2)])
    row = step_of(t, lag_s=1e-3)
    assert row["step_s"] == pytest.approx(3 * (1e-3 + 2e-3) + 3e-3)
    assert row["exposed_s"] == pytest.approx([3 * 2e-3 + 2e-3, 3 * 2e-3 + 3e-3])


@pytest.mark.quick
def test_an_async_op_runs_beside_the_compute_it_overlaps():
    """Post a 1 s all-reduce, compute 2 s, wait: hidden (2 s); compute 0.5 s instead: 1 s, 0.5 of it exposed."""
    for work, step, exposed in ((2e9, 2.0, 0.0), (0.5e9, 1.001, 0.501)):
        ranks = [[("post", "all_reduce", [0, 1], {1 - r: 1e6}), ("compute", work), ("wait", 0)] for r in range(2)]
        row = step_of(trace(ranks))
        assert row["step_s"] == pytest.approx(step) and row["exposed_s"][0] == pytest.approx(exposed)
    # drawn as trace_timeline.py draws a measured trace: the op on each rank's second (async) row
    out = R.replay(R.programs(trace(ranks))[1], CL)
    rows, _ = R.timeline.lanes(R.as_trace(out, {})["traceEvents"])
    assert {(r, row) for r in (0, 1) for row in (0, 1)} <= set(rows) and rows[(0, 1)][0][2] == "comm"


@pytest.mark.quick
def test_on_shared_cores_an_async_op_takes_a_share():
    """Two ranks on two cores, each computing 1 s beside its own 1 s all-reduce: while the two ops'
    threads run, four jobs share the two cores, so half the compute is done by 1.001 s and the rest
    alone after: 1.5 s, where a core each for the ranks and their threads (a GPU's copy engines)
    hides the op: 1.001 s."""
    ranks = [[("post", "all_reduce", [0, 1], {1 - r: 1e6}), ("compute", 1e9), ("wait", 0)] for r in range(2)]
    assert step_of(trace(ranks))["step_s"] == pytest.approx(1.001)
    assert step_of(trace(ranks), cores=2)["step_s"] == pytest.approx(1.5005)


@pytest.mark.quick
def test_a_message_arrives_after_its_sender_posted_it():
    """The pipeline's hand-over: rank 0 computes 1 s and sends 1000 bytes; rank 1, waiting in its
    receive from the start, gets them at 1 + 0.001 + 0.001 s and computes 1 s more."""
    t = trace([[("compute", 1e9), ("sync", "send", [0, 1], {1: 1000})],
               [("sync", "recv", [0, 1], {0: 1000}), ("compute", 1e9)]])
    row = step_of(t)
    assert row["step_s"] == pytest.approx(2.002) and row["idle_s"][1] == pytest.approx(1.002)


@pytest.mark.quick
def test_ranks_sharing_cores_share_their_time():
    """Two ranks computing 1 s each: 1 s on a core each, 2 s on one core; rank 1 working 2 s beside
    rank 0's 1 s on one core: both at half speed for 2 s, then rank 1 alone for its last 1 s."""
    both = trace([[("compute", 1e9)], [("compute", 1e9)]])
    assert step_of(both)["step_s"] == pytest.approx(1.0)
    assert step_of(both, cores=1)["step_s"] == pytest.approx(2.0)
    uneven = trace([[("compute", 1e9)], [("compute", 2e9)]])
    assert step_of(uneven, cores=1)["step_s"] == pytest.approx(3.0)


@pytest.mark.quick
def test_a_rank_whose_message_is_in_waits_for_a_core():
    """Two ranks on one core: rank 0 waits for the message rank 1 posts after 1 s of work, and rank 1
    works 1 s more. In slices of 10 s rank 1 keeps the core, so rank 0 waits until 2.001 s, its
    message in at 1.002; in slices of 0.1 s it gets on at once. A core at half its speed (two ranks
    switching on it) doubles every stretch; on two cores, a core each: no wait, no loss."""
    t = trace([[("sync", "recv", [0, 1], {1: 1000}), ("compute", 1e9)],
               [("compute", 1e9), ("post", "send", [0, 1], {0: 1000}), ("compute", 1e9), ("wait", 0)]])
    assert step_of(t, cores=1, quantum=10.0)["exposed_s"][0] == pytest.approx(2.001)
    assert step_of(t, cores=1, quantum=0.1)["exposed_s"][0] == pytest.approx(1.002)
    assert step_of(t, cores=1, quantum=10.0, speed=0.5)["step_s"] == pytest.approx(6.001)
    assert step_of(t, cores=2, quantum=10.0, speed=0.5)["step_s"] == pytest.approx(2.002)


@pytest.mark.quick
def test_the_cores_speed_and_slices_are_fitted_on_the_other_runs():
    """Four ranks on 2 cores, in pairs that compute and all-reduce five times: runs measured as the
    replay plays them with the cores at 0.75 of their speed and slices of 4 ms give those values
    back, each run's from the other runs alone (an outlier run, measured twice as slow, moves none)."""
    truth = dict(speed=0.75, quantum=4e-3)
    traces = {}
    for name, work in (("a", 1e7), ("b", 2e7), ("c", 3e7), ("odd", 2e7)):
        pair = [[0, 1], [0, 1], [2, 3], [2, 3]]
        ranks = [[item for _ in range(5) for item in (("compute", work * (1 + r // 2)),
                                                      ("sync", "all_reduce", pair[r], {r ^ 1: 1000}))] for r in range(4)]
        t = trace(ranks)
        row = R.summary(R.replay(R.programs(t)[1], dict(CL, cores=2, **truth)))
        for e in t["traceEvents"]:  # measured: the replay's step, and each rank's waits shared out evenly
            e["dur"] = 1e6 * row["step_s"] * (2 if name == "odd" else 1) if e["cat"] == "step" else \
                1e6 * row["exposed_s"][e["pid"]] / 5
        traces[(name, 4)] = t
    got = {k: R.programs(t)[1:] for k, t in traces.items()}
    fitted = R.time_slices(got, traces, dict(CL, cores=2), n=2)
    for key in got:
        assert fitted[key]["speed"] == pytest.approx(truth["speed"]), key
        assert fitted[key]["quantum"] == pytest.approx(truth["quantum"]), key


@pytest.mark.quick
def test_the_bytes_an_op_moves_cost_time_as_its_flops_do():
    """1 GFLOP that also reads and writes 2 GB: 1 s at 1 GFLOP/s, plus 2 s at 1 GB/s of memory (the
    softmax over a block of scores: few FLOPs, many bytes)."""
    assert step_of(trace([[("compute", 1e9, 2e9)], [("compute", 1e9)]]))["step_s"] == pytest.approx(3.0)


@pytest.mark.quick
def test_a_trace_lacking_what_the_replay_needs_is_refused_in_one_line(tmp_path, capsys):
    ar = ("sync", "all_reduce", [0, 1])
    good = trace([[("compute", 1e9), ar + ({1: 10},)], [("compute", 1e9), ar + ({0: 10},)]])
    old = json.loads(json.dumps(good))
    for e in old["traceEvents"]:
        for k in ("at", "upto", "to", "frm"):
            e["args"].pop(k, None)
    short = dict(good, traceEvents=[e for e in good["traceEvents"] if e["pid"] == 0])
    no_bytes = json.loads(json.dumps(good))
    for e in no_bytes["traceEvents"]:
        for k in ("at", "upto"):
            if k in e["args"]:
                e["args"][k] = e["args"][k][:3]
    lone = trace([[("compute", 1e9), ar + ({1: 10},)], [("compute", 1e9)]])
    cases = {"old": (old, "no work counts"), "no_bytes": (no_bytes, "counts no bytes"),
             "short": (short, "cut short: rank 1 has no step 2"),
             "lone": (lone, "has no partner on rank(s) [1]")}
    for name, (t, says) in cases.items():
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(t))
        with pytest.raises(SystemExit) as e:
            R.main([str(path)])
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(err) == 1 and says in err[0], (name, err)
    with pytest.raises(R.TraceError, match="the trace has 2 ranks and the cluster 8"):  # main's --cluster h100 check
        R.programs(good, world=8)
    with pytest.raises(R.TraceError, match="layers"):  # --what_if scales the width only, never the depth
        R.scale(dict(otherData=dict(model=dict(n_layer=4), batch_size=8, world=2, strategy="ddp")),
                dict(n_layer=12), 1)


def _traced(rank, world, args, out):
    import ddp
    import pipeline_parallel
    steps = ["--max_iters=3", "--eval_interval=0", "--trace_steps=1-2"]
    ddp.main(args + steps + ["--bucket_mb=0.25", f"--trace={out}/ddp.json"])
    pipeline_parallel.main(args + steps + ["--schedule=zb", "--n_micro=4", f"--trace={out}/zb.json"])


def test_a_real_trace_counts_the_models_flops_and_matches_every_message(train_args, tmp_path):
    import model as M
    spawn(_traced, 2, train_args, str(tmp_path), timeout=300)
    config = M.make_config("tiny", vocab_size=192, block_size=32)
    tokens = 24 * 32  # --batch_size x --block_size of the tests' run, both ranks together
    for name in ("ddp", "zb"):
        t = R.load(tmp_path / f"{name}.json")
        step, progs, measured = R.programs(t, world=2)
        counted = sum(item[1] for prog in progs for item in prog if item[0] == "compute")
        # torch's count of the matmuls and attention: the formula's 6N + 12·L·H·Q·T a token
        assert counted == pytest.approx(M.flops_per_token(config) * tokens, rel=0.03), name
        # the bytes: at least AdamW's reads of every parameter, its gradient and two moments (a rank's
        # stage of them in the pipeline: over half the model, the embedding's stage)
        moved = sum(item[4] for prog in progs for item in prog if item[0] == "compute")
        assert moved > 2 * 4 * 4 * M.param_count(config) / 2, name
        fit = R.calibrate([R.samples(t)])  # the link and the compute rate from this trace itself
        row = R.summary(R.replay(progs, R.cluster("here", **fit)))
        assert 0 < row["step_s"] and len(row["busy_s"]) == 2, name
