"""--trace: every strategy at 2 ranks writes one Chrome trace that parses, has both ranks'
rows, names its spans as the code does, and whose communication adds up to the log's
comm_bytes, byte for byte; ddp.py's exposed_comm_ms is a span of the trace, which starts after
backward and holds every wait; and the overlapped messages (DDP's buckets, FSDP's prefetched
all-gathers, the ring's K/V hops, the mesh's dp_shard gathers and reduce-scatters) have compute
between their issue and their wait. All in one launch of two ranks, 4 steps each, 2 traced."""
import importlib
import json
import os
import sys
import time

import pytest

from harness import ROOT, spawn

STEPS = ["--max_iters=4", "--eval_interval=0", "--trace_steps=2-3"]  # step 0 and 1 warm up
# (name, module, flags, names that must appear on both ranks: each a prefix of some span)
RUNS = [("ddp overlap", "ddp", ["--bucket_mb=0.25"], ["forward", "backward", "optimizer", "all_reduce bucket 0 (",
                                                      "wait all_reduce bucket 0 ("]),
        ("fsdp zero3", "fsdp", [], ["forward block 0", "backward block 1", "all_gather h.0", "reduce_scatter h.1",
                                    "optimizer"]),
        ("tensor sequence parallel", "tensor_parallel", ["--sequence_parallel=True"],
         ["forward", "all_gather f (forward)", "reduce_scatter g (forward)", "reduce_scatter f (backward)"]),
        ("tensor parallel", "tensor_parallel", [], ["all_reduce g (forward)", "all_reduce f (backward)"]),
        ("pipeline 1f1b", "pipeline_parallel", ["--schedule=1f1b", "--n_micro=4"],
         ["forward mb 0", "backward mb 3", "optimizer"]),
        ("context zigzag", "context_parallel", ["--layout=zigzag"],
         ["ring step 0 k/v (", "ring step 1 dk/dv (", "wait ring step 0 k/v"]),
        ("experts", "expert_parallel", ["--n_expert=4", "--top_k=2"],
         ["all_to_all dispatch", "all_to_all combine", "all_to_all dispatch (backward)"]),
        ("mesh tp", "parallel_nd", ["--dp_replicate=1", "--tp=2"],  # the pieces' spans, on the mesh's groups
         ["forward mb 0", "backward mb 0", "all_reduce g (forward)", "all_reduce f (backward)"]),
        ("mesh dp_shard", "parallel_nd", ["--dp_replicate=1", "--dp_shard=2"],
         ["forward mb 0", "all_gather 1", "reduce_scatter 1"])]
# the pipeline's messages differ by stage: rank 0 sends forward, rank 1 sends backward
PER_RANK = {"pipeline 1f1b": (["send_forward mb 0"], ["send_backward mb 0"])}


# Overlap is the lesson of these messages, and every other check is of results, bytes and counts:
# a message waited for as soon as it is issued passes them all. So the traced steps also record
# when the rank computed: each run of tensor ops on the issuing thread between two communication
# events becomes one span named OPS. A message overlaps if such a span lies between its issue
# (posted_us) and the start of its wait: an order of events on one thread, whatever the load.
OPS = "ops (test)"
# (run, the messages' name prefix, how many of a step's messages of that name may not overlap)
OVERLAPS = [("ddp overlap", "all_reduce bucket", 1),  # the last, the embedding's, at backward's end
            ("fsdp zero3", "all_gather", 1),  # the first is taken at once: nothing to hide it
            ("context zigzag", "ring step 0 k/v", 0),  # at 2 ranks one K/V hop each way
            ("mesh dp_shard", "all_gather", 3),  # the first, and the head's and the first backward unit's
            ("mesh dp_shard", "reduce_scatter", 1)]  # the ends' (tied): sent after backward


def _marking_ops():
    """A dispatch mode that appends OPS spans to the trace while a step is traced (see OPS)."""
    import collectives as C
    import model as M
    from torch.utils._python_dispatch import TorchDispatchMode
    bookkeeping = {"empty", "empty_like", "empty_strided", "zeros", "zeros_like", "new_zeros", "new_empty", "clone",
                   "copy_", "detach", "_to_copy", "resize_", "set_", "lift_fresh", "alias", "_local_scalar_dense"}

    class Marks(TorchDispatchMode):
        last = None  # (the span being extended, len(C._spans) when it began)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = func.overloadpacket.__name__
            view = any(r.alias_info is not None for r in func._schema.returns)
            if M._tracer is not None and not view and name not in bookkeeping:
                t, n = time.perf_counter(), len(C._spans)
                if self.last is not None and self.last[1] == n and self.last[0] is M._tracer[0][-1]:
                    self.last[0]["t1"] = t
                else:
                    span = dict(name=OPS, cat="compute", row="main", t0=t, t1=t, bytes=0)
                    M._tracer[0].append(span)
                    self.last = (span, n)
            return out
    return Marks()


def overlapped(events, prefix):
    """-> for each async message whose name starts with prefix, in issue order: whether an OPS span
    lies between its issue and its wait. Messages and waits are paired by name, in order."""
    out = []
    posts = sorted((e for e in events if e["cat"] == "comm" and e["name"].startswith(prefix)
                    and "posted_us" in e["args"]), key=lambda e: e["args"]["posted_us"])
    waits = sorted((e for e in events if e["cat"] == "wait" and e["name"].startswith("wait " + prefix)),
                   key=lambda e: e["ts"])
    ops = [e for e in events if e["name"] == OPS]
    for post in posts:
        wait = next(w for w in waits if w["name"] == "wait " + post["name"] and w["ts"] >= post["args"]["posted_us"])
        waits.remove(wait)
        out.append(any(post["args"]["posted_us"] <= e["ts"] and e["ts"] + e["dur"] <= wait["ts"] for e in ops))
    return out


def _run_all(rank, world, args, out):
    import collectives as C
    import model as M
    logs = {}
    begin, end, marks = M.trace_begin, M.trace_end, _marking_ops()

    def traced_begin(run, **kw):
        begin(run, **kw)
        marks.__enter__()

    def traced_end(run, it):
        marks.__exit__(None, None, None)
        end(run, it)
    M.trace_begin, M.trace_end = traced_begin, traced_end  # a pooled rank: put back below
    try:
        for name, module, flags, _ in RUNS:
            path = os.path.join(out, name.replace(" ", "_"))
            logs[name] = importlib.import_module(module).main(
                args + STEPS + flags + [f"--trace={path}.json", f"--log_file={path}.jsonl"])
    finally:
        M.trace_begin, M.trace_end = begin, end
    # off, nothing is timed: no clock read, no span kept
    stamp, C._stamp = C._stamp, None  # a call would raise
    try:
        importlib.import_module("ddp").main(args + ["--max_iters=2", "--eval_interval=0", "--bucket_mb=0.25"])
    finally:
        C._stamp = stamp
    return logs, C._spans == [] and not C._tracing and M._tracer is None


def test_every_strategy_traces(train_args, tmp_path):
    logs, quiet = spawn(_run_all, 2, train_args, str(tmp_path), timeout=600)[0]
    assert quiet, "a run without --trace recorded something"
    for name, _, _, names in RUNS:
        path = tmp_path / name.replace(" ", "_")
        trace = json.loads((path.with_suffix(".json")).read_text())
        records = [json.loads(line) for line in path.with_suffix(".jsonl").read_text().splitlines()]
        spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
        assert {e["pid"] for e in spans} == {0, 1}, name
        assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in spans), name
        meta = {(e["pid"], e["name"]) for e in trace["traceEvents"] if e["ph"] == "M"}
        assert {(r, "process_name") for r in (0, 1)} <= meta, name
        for r in (0, 1):
            mine = [e for e in spans if e["pid"] == r]
            assert sorted(e["args"]["step"] for e in mine if e["cat"] == "step") == [2, 3], name
            for want in names + PER_RANK.get(name, ([], []))[r]:
                assert any(e["name"].startswith(want) for e in mine), f"{name}: no span {want!r} on rank {r}"
            for step in (2, 3):
                comm = [e for e in mine if e["cat"] == "comm" and e["args"]["step"] == step]
                assert all({"op", "group", "peers", "bytes"} <= set(e["args"]) for e in comm), name
                # the trace agrees with the log, to the byte
                assert sum(e["args"]["bytes"] for e in comm) == records[step]["comm_bytes"][r], (name, r, step)
        if name == "ddp overlap":  # async buckets: on the second row, each with its wait on the first
            assert any(e["tid"] == 1 and e["cat"] == "comm" for e in spans) and any(e["cat"] == "wait" for e in spans)
    for name, prefix, spare in OVERLAPS:
        spans = json.loads((tmp_path / name.replace(" ", "_")).with_suffix(".json").read_text())["traceEvents"]
        for r in (0, 1):
            for step in (2, 3):
                seen = overlapped([e for e in spans if e["ph"] == "X" and e["pid"] == r and e["args"]["step"] == step],
                                  prefix)
                assert seen and seen.count(False) <= spare, \
                    f"{name}, rank {r}, step {step}: {prefix} messages overlapped with compute: {seen} (want all but {spare})"
    # ddp's exposed communication: the log's interval is a span of the trace (the same two clock
    # reads), and it runs from after the end of backward to after the end of the last wait; an
    # interval from backward's start, or one without the last wait, fails the order below
    for name in ("ddp overlap",):
        path = tmp_path / name.replace(" ", "_")
        spans = [e for e in json.loads(path.with_suffix(".json").read_text())["traceEvents"] if e["ph"] == "X"]
        records = [json.loads(line) for line in path.with_suffix(".jsonl").read_text().splitlines()]
        for r in (0, 1):
            for step in (2, 3):
                mine = [e for e in spans if e["pid"] == r and e["args"]["step"] == step]
                [exposed] = [e for e in mine if e["name"] == "exposed communication"]
                assert abs(exposed["dur"] / 1000 - records[step]["exposed_comm_ms"][r]) < 1e-3, (name, r, step)
                start, end = exposed["ts"], exposed["ts"] + exposed["dur"]
                end_backward = max(e["ts"] + e["dur"] for e in mine if e["name"] == "backward")
                waits = [e for e in mine if e["tid"] == 0 and e["cat"] in ("wait", "comm")]
                assert waits and start >= end_backward - 0.01, (name, r, step, start, end_backward)
                assert all(start - 0.01 <= e["ts"] and e["ts"] + e["dur"] <= end + 0.01 for e in waits), (name, r, step)


@pytest.mark.quick
def test_trace_steps_flag(capsys):
    import model as M
    assert list(M.trace_range("2-4")) == [2, 3, 4] and list(M.trace_range("7")) == [7]
    for bad in ("4-2", "x", "-1", "2-"):
        with pytest.raises(SystemExit) as e:
            M.trace_range(bad)
        assert e.value.code == 2
        assert capsys.readouterr().err.strip() == \
            f"error: --trace_steps takes A-B (inclusive, A <= B) or one iteration, not {bad!r}"


TINY_TRACE = {"traceEvents": [
    {"name": "step 2", "cat": "step", "ph": "X", "ts": 0, "dur": 900, "pid": r, "tid": 0, "args": {"step": 2}}
    for r in (0, 1)] + [
    {"name": "backward", "cat": "compute", "ph": "X", "ts": 0, "dur": 600, "pid": r, "tid": 0, "args": {"step": 2}}
    for r in (0, 1)] + [
    {"name": "all_reduce bucket 0 (1.0 MB)", "cat": "comm", "ph": "X", "ts": 300, "dur": 400, "pid": r, "tid": 1,
     "args": {"step": 2, "op": "all_reduce", "group": [0, 1], "peers": [1 - r], "bytes": 1000000}} for r in (0, 1)],
    "otherData": {"strategy": "ddp", "world": 2}}


@pytest.mark.quick
def test_timeline(tmp_path, monkeypatch, capsys):
    """bench/trace_timeline.py draws a trace (when matplotlib is there), and says in one line that it needs it."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import trace_timeline as timeline
    path = tmp_path / "t.json"
    path.write_text(json.dumps(TINY_TRACE))
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    with pytest.raises(SystemExit) as e:
        timeline.main([str(path), "--png", str(tmp_path / "t.png")])
    assert e.value.code == 1 and len(capsys.readouterr().err.strip().splitlines()) == 1
    monkeypatch.delitem(sys.modules, "matplotlib")
    pytest.importorskip("matplotlib")
    timeline.main([str(path), str(path), "--png", str(tmp_path / "t.png"), "--step=2"])
    assert (tmp_path / "t.png").stat().st_size > 1000


@pytest.mark.quick
def test_timeline_median_step():
    """--step=median draws the step of median length, the slowest rank's length counting."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import trace_timeline as timeline
    lengths = {2: (900, 100), 3: (300, 500), 4: (700, 650), 5: (100, 1000), 6: (200, 600)}  # maxima 900 500 700 1000 600
    events = [{"name": f"step {s}", "cat": "step", "ph": "X", "ts": 0, "dur": d, "pid": r, "tid": 0, "args": {"step": s}}
              for s, ds in lengths.items() for r, d in enumerate(ds)]
    assert timeline.median_step(events) == 4
    assert timeline.median_step(events[:4]) == 3  # steps 2 (900) and 3 (500): the shorter of the two middle ones


@pytest.mark.quick
def test_timeline_short_labels():
    """A bar too narrow for its name gets the short form, a pipeline rank's later chunk in lower case, as
    --timeline writes them (ZB-V on 2 ranks: chunks 0 and 1 go down, 2 and 3 come back up)."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import trace_timeline as timeline
    assert timeline.fitting("forward mb 3", "compute", 1000) == "forward mb 3"
    assert timeline.fitting("forward mb 3", "compute", 20) == "F3"
    assert timeline.fitting("weight_grad mb 1 chunk 1", "compute", 20, world=2) == "W1"
    assert timeline.fitting("backward mb 2 chunk 3", "compute", 20, world=2) == "b2"
    assert timeline.fitting("backward mb 2 chunk 3", "compute", 20) == "B2"  # a trace that does not say its world
    assert timeline.fitting("all_reduce bucket 0", "comm", 20) == ""
