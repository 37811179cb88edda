"""exercises/: every stub fails (no launch needed), the project's own code passes its grade, and
plausible wrong answers fail for the right reason while a correct one written differently passes.

Cost: the stubs are graded by reading the workspace (grade.py launches nothing for a function
still raising NotImplementedError). The project's code is graded once per family at 2 ranks (the
collectives at 2 and 3): ddp_naive's and zero1_step's runs are ddp.py --bucket_mb=0 --overlap=False and fsdp.py
--zero_stage=1, whose parity and bytes tests/test_ddp.py and tests/test_fsdp.py prove at 2-4
ranks; the three tensor parallel exercises grade the same run. The wrong answers: one hang (5 s
of timeout), the schedule on paper, and a few short runs at 2 ranks.
"""
import ast
import os

import pytest

from conftest import ROOT

from exercises import grade as G
from exercises import start as S
from exercises.table import BY_NAME, EXERCISES


def _solve(folder, name, bodies):
    """A workspace of `name` whose functions get these bodies ({qualname: source})."""
    S.start(name, str(folder))
    path = os.path.join(str(folder), BY_NAME[name].file)
    with open(path) as f:
        source = f.read()
    with open(path, "w") as f:
        f.write(S.replace_bodies(source, bodies))
    return str(folder)


def _real(name, qualname):
    """The project's own body of a function an exercise names, after its docstring, unindented."""
    import textwrap
    with open(os.path.join(ROOT, BY_NAME[name].file)) as f:
        source = f.read()
    fn = S.find_def(ast.parse(source), qualname)
    first = fn.body[1] if ast.get_docstring(fn) is not None else fn.body[0]
    return textwrap.dedent("".join(source.splitlines(keepends=True)[first.lineno - 1:fn.end_lineno]))


def _lines(lines, where):
    return "\n".join(("PASS " if ok else "FAIL ") + line for ok, line in lines) + f"\n({where})"


@pytest.mark.quick
def test_every_stub_fails_without_a_launch(tmp_path, capsys):
    """Each exercise names functions that exist; its workspace keeps their signature and
    docstring, raises NotImplementedError in their place, and grades FAIL on every check, naming
    them. The list is in order and long enough to be a course."""
    assert S.main(["--list"]) == 0
    listing = capsys.readouterr().out
    assert len(EXERCISES) >= 12 and all(f" {e.name} " in listing for e in EXERCISES)
    assert len({e.name for e in EXERCISES}) == len(EXERCISES)
    for ex in EXERCISES:
        folder = S.start(ex.name, str(tmp_path / ex.name))
        assert sorted(os.listdir(folder)) == sorted(S.project_imports(ex.file))
        with open(os.path.join(ROOT, ex.file)) as f:
            real = ast.parse(f.read())
        with open(os.path.join(folder, ex.file)) as f:
            mine = ast.parse(f.read())
        for q in ex.functions:
            a, b = S.find_def(real, q), S.find_def(mine, q)
            assert a is not None, f"{ex.name}: {q} is not in {ex.file}: retarget it in exercises/table.py"
            assert S.is_stub(b) and not S.is_stub(a), (ex.name, q)
            assert ast.dump(a.args) == ast.dump(b.args) and ast.get_docstring(a) == ast.get_docstring(b), (ex.name, q)
        lines = G.grade(ex.name, folder)
        assert lines and not any(ok for ok, _ in lines), _lines(lines, ex.name)
        assert all("not written yet (NotImplementedError)" in line and ex.functions[0] in line for _, line in lines)
        assert len(lines) == len(G.check_names(ex, ex.worlds))
    # the stub raises where it stood, with its name (a student who runs the file sees that first)
    with G.workspace(str(tmp_path / "ring_all_gather")):
        import collectives as C
        with pytest.raises(NotImplementedError, match="_ring_all_gather: not written yet"):
            C.all_gather(__import__("torch").zeros(2), __import__("torch").zeros(2))
    # and an existing workspace is someone's work: start refuses to overwrite it
    with pytest.raises(SystemExit, match="exists"):
        S.start("ring_all_gather", str(tmp_path / "ring_all_gather"))


@pytest.fixture(scope="module")
def refs(data_dir, reference_short):
    """The suite's one-process run is the grader's reference: no second run of it."""
    G.REFERENCES[("dense", data_dir)] = reference_short[0]
    return data_dir


# one exercise per family whose checks run the family's code; the collectives all, at 2 and 3
PROJECT = [("tree_broadcast", None), ("ring_reduce_scatter", None), ("ring_all_gather", None),
           ("pairwise_all_to_all", None), ("ddp_buckets", (2,)), ("fsdp_unit", (2,)), ("tp_column_row", (2,)),
           ("pp_1f1b", (2,)), ("moe_dispatch_combine", (2,)), ("ring_attention_merge", (2,)),
           ("ulysses_exchange", (2,)), ("quorum", None)]


def test_project_code_passes(refs):
    for name, worlds in PROJECT:
        lines = G.grade(name, ROOT, worlds, data_dir=refs)
        assert lines and all(ok for ok, _ in lines), _lines(lines, name)


# --------------------------------------------------------------------------- wrong answers, and a right one


RING_OTHER_WAY = """
steps = [([(chunks[(me + s) % n], left)], [(chunks[(me + s + 1) % n], right)], None) for s in range(n - 1)]
return steps, 1
"""
RING_WRONG_NEIGHBOUR = """
steps = [([(chunks[(me - s) % n], left)], [(chunks[(me - s - 1) % n], left)], None) for s in range(n - 1)]
return steps, 1
"""


def test_ring_written_differently_passes_and_wrong_neighbour_hangs_at_3(tmp_path):
    """The ring the other way round (send left, receive from the right, no segments) is right.
    Sending to the neighbour you receive from is right at 2 ranks, where left is right, and
    hangs at 3: the grade names the op and who waits for whom."""
    other = _solve(tmp_path / "other", "ring_all_gather", {"_ring_all_gather": RING_OTHER_WAY})
    lines = G.grade("ring_all_gather", other)
    assert all(ok for ok, _ in lines), _lines(lines, "ring the other way")
    wrong = _solve(tmp_path / "wrong", "ring_all_gather", {"_ring_all_gather": RING_WRONG_NEIGHBOUR})
    lines = G.grade("ring_all_gather", wrong, (2, 3))
    at2, at3 = [x for x in lines if ", 2 ranks" in x[1]], [x for x in lines if ", 3 ranks" in x[1]]
    assert at2 and all(ok for ok, _ in at2), _lines(lines, "wrong neighbour")
    first = at3[0][1]
    assert not at3[0][0] and "hung: " in first and "timed out waiting for rank" in first, first
    assert "do not pair up" in first and "on ranks [0, 1, 2]" in first, first  # gloo's path cut, not the ranks


# the most likely wrong answers of the two ring exercises: a chunk index off by one (sending the chunk
# just received, not yet added to), and the all-gather that never forwards what arrived. On odd sizes a
# send and its receive then disagree by an element, and gloo aborts the receiving rank in C++
RING_CHUNK_OFF_BY_ONE = ("ring_reduce_scatter", "_ring_reduce_scatter",
                         "c_send, c_recv = (me - s - 1) % n, (me - s - 2) % n",
                         "c_send, c_recv = (me - s) % n, (me - s - 2) % n")
RING_NOT_FORWARDED = ("ring_all_gather", "_ring_all_gather", "chunks[(me - s) % n], chunks[(me - s - 1) % n]",
                      "chunks[me], chunks[(me - s - 1) % n]")


def _planted(folder, bug):
    name, fn, right, wrong = bug
    body = _real(name, fn)
    assert right in body
    return _solve(folder, name, {fn: body.replace(right, wrong)})


@pytest.mark.parametrize("bug", [RING_CHUNK_OFF_BY_ONE, RING_NOT_FORWARDED], ids=["chunk", "forward"])
def test_ring_that_crashes_a_rank_is_one_line_in_seconds(tmp_path, bug):
    """A rank that gloo aborts ends the check at once (the harness sees the process gone), with one
    line naming the rank and the size mismatch in elements: not a hang until the launch's deadline."""
    import time
    t0 = time.monotonic()
    lines = G.grade(bug[0], _planted(tmp_path, bug), (3,))
    took = time.monotonic() - t0
    [(ok, line)] = lines
    assert not ok and "rank " in line and "crashed: a send and its receive disagree on the size, 6671 elements " \
        "sent to it where it posted a receive of 6670" in line, line
    assert took < 30, f"{took:.0f} s: {line}"


def test_function_that_never_returns_is_one_line(tmp_path, monkeypatch):
    """An endless loop in the student's function: one line for the whole exercise, saying where the
    ranks were (the stacks SIGUSR1 makes them write), not one "deadlock?" per check and world."""
    monkeypatch.setattr(G, "COLLECTIVE_LAUNCH_S", 3)
    loop = _solve(tmp_path, "ring_all_gather", {"_ring_all_gather": "while True:\n    pass\n"})
    [(ok, line)] = G.grade("ring_all_gather", loop, (2, 3))
    assert not ok and line.startswith("all_gather, all_reduce, 2 ranks: never returned after 3 s (ranks [0, 1])"), line
    assert "rank 0 at collectives.py:" in line and "in _ring_all_gather" in line and "deadlock" not in line, line


def _abort_on_rank_1(rank, world):
    if rank == 1:
        os.abort()
    import time
    time.sleep(60)  # rank 0 waits, as for a message from the rank that died


def test_harness_notices_a_rank_that_died():
    """spawn() does not wait out its deadline for a rank that is gone: it says which, and how."""
    import time
    from harness import RankDied, spawn
    t0 = time.monotonic()
    with pytest.raises(RankDied) as e:
        spawn(_abort_on_rank_1, 2, timeout=120)
    assert e.value.rank == 1 and e.value.how == "signal SIGABRT" and time.monotonic() - t0 < 20, str(e.value)


def test_schedule_that_deadlocks_fails_on_paper():
    """1F1B's warm-up counted from the wrong end (rank r warms up r forwards, not p-1-r): rank 0
    waits for a gradient while the last rank waits for an activation. Caught by simulate(),
    before any launch; as is a schedule without warm-up, which is correct but slow."""
    reversed_warmup = """
F, B = (partial(Compute, kind) for kind in "FB")
warmup = min(r, m)
order = [F(r, k) for k in range(warmup)]
for k in range(m - warmup):
    order += [F(r, warmup + k), B(r, k)]
return [[a] for a in order + [B(r, k) for k in range(m - warmup, m)]]
"""
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        folder = _solve(d, "pp_1f1b", {"steps": reversed_warmup})
        (ok, line), = G.check_schedule(folder, "1f1b")
        assert not ok and "deadlock: ranks stuck at" in line, line
        folder = _solve(os.path.join(d, "serial"), "pp_1f1b", {"steps": reversed_warmup.replace("min(r, m)", "0")})
        (ok, line), = G.check_schedule(folder, "1f1b")
        assert not ok and "the step takes" in line, line


def test_gradient_scale_and_eager_buckets_fail_a_flat_all_reduce_passes(refs, tmp_path):
    """DDP: a gradient averaged twice trains nearly as well (AdamW and clipping hide the scale)
    but its norm is half: the gradient norm line says so. Buckets that ignore .sync are
    all-reduced after the first micro-step of accumulation and never after the last. A correct
    answer written differently (every gradient in one flat all-reduce) passes, bytes included."""
    twice = _solve(tmp_path / "twice", "ddp_naive", {"all_reduce_each": """
for p in params:
    C.all_reduce(p.grad, op="avg", group=group)
    p.grad.div_(C.get_world_size(group))
"""})
    lines = dict((line.split(": ")[1], (ok, line)) for ok, line in G.check_train(twice, "ddp", ["--bucket_mb=0", "--overlap=False"], (2,),
                                                                                     refs))
    ok, line = lines["gradient norm before clipping"]
    assert not ok and "first differs at step 0" in line, line
    # and where, from the bisector (bench/strategies_compare.py --bisect): the first tensor, half its size
    assert "; first difference: transformer.wte.weight's gradient" in line and "norm 0.500x" in line, line
    flat = _solve(tmp_path / "flat", "ddp_naive", {"all_reduce_each": """
grads = [p.grad for p in params]
flat = torch.cat([g.reshape(-1) for g in grads])
C.all_reduce(flat, op="avg", group=group)
for g, part in zip(grads, flat.split([g.numel() for g in grads])):
    g.copy_(part.view_as(g))
"""})
    lines = G.check_train(flat, "ddp", ["--bucket_mb=0", "--overlap=False"], (2,), refs)
    assert all(ok for ok, _ in lines), _lines(lines, "one flat all-reduce")
    # buckets that ignore .sync: under gradient accumulation they fill, and go, on the first
    # micro-step; the counts then overshoot and the last micro-step's gradients never leave
    eager = _solve(tmp_path / "eager", "ddp_buckets", {"GradBuckets._ready": """
self.ready[self.bucket_of[p]] += 1
while self.launched < len(self.buffers) and self.ready[self.launched] == self.sizes[self.launched]:
    self.handles.append(C.all_reduce(self.buffers[self.launched], op="avg", group=self.group, async_op=True))
    self.launched += 1
""", "GradBuckets.reduce": """
for h in self.handles:
    h.wait()
self.handles = []
if not self.overlap:
    for flat in self.buffers:
        C.all_reduce(flat, op="avg", group=self.group)
"""})
    ok, line = G.check_train(eager, "ddp", ["--bucket_mb=0.25", "--n_micro=2"], (2,), refs)[1]
    assert not ok and "gradient norm before clipping: first differs at step 0" in line, line


def test_tensor_parallel_f_without_its_all_reduce_fails(refs, tmp_path):
    """f that forgets the all-reduce of its backward: each rank's input gradient is a partial
    sum, the weights before it train on it, and the loss parts from the one-process run's."""
    folder = _solve(tmp_path / "f", "tp_f_and_g", {
        "_CopyToParallelRegion.forward": "ctx.group = group\nreturn x",
        "_CopyToParallelRegion.backward": "return grad, None",
        "_ReduceFromParallelRegion.forward": "C.all_reduce(x, group=group)\nctx.mark_dirty(x)\nreturn x",
        "_ReduceFromParallelRegion.backward": "return grad, None"})
    lines = G.check_train(folder, "tensor_parallel", [], (2,), refs)
    assert not lines[0][0] and "first differs at step" in lines[0][1], _lines(lines, "f without all-reduce")
    assert not lines[2][0] and "bytes: step 0" in lines[2][1], _lines(lines, "f without all-reduce")


def test_fsdp_gradient_summed_and_experts_rows_unsorted_fail(refs, tmp_path):
    """FSDP whose reduce-scatter sums the gradient instead of averaging it: the norm is N times
    the one-process run's. Expert parallelism that runs the experts on the rows as they
    arrived (by source rank, not by expert): the wrong expert on most rows, the loss departs."""
    summed = _real("fsdp_unit", "Unit.reduce_scatter")
    assert 'op="avg"' in summed
    folder = _solve(tmp_path / "summed", "fsdp_unit", {
        "Unit.reduce_scatter": summed.replace('op="avg"', 'op="sum"'),
        **{f: _real("fsdp_unit", f) for f in ("Unit.gather", "Unit.free", "add_reduced")}})
    ok, line = G.check_train(folder, "fsdp", ["--zero_stage=3"], (2,), refs)[1]
    assert not ok and "gradient norm before clipping: first differs at step 0" in line, line
    assert "norm 2.000x the one-process run's" in line, line
    folder = _solve(tmp_path / "unsorted", "moe_dispatch_combine", {
        "ExpertParallelMoE.by_all_to_all": _real("moe_dispatch_combine", "ExpertParallelMoE.by_all_to_all"),
        "transpose_blocks": "return x"})
    ok, line = G.check_train(folder, "expert_parallel", BY_NAME["moe_dispatch_combine"].checks[0][2], (2,), refs)[0]
    assert not ok and "loss: first differs at step 0" in line, line
    assert "; first difference: the forward, at transformer.h.0's output (its input agrees" in line, line


def test_merge_that_forgets_the_weights_fails():
    """Ring attention's merge that adds the two parts' outputs as if each had half the mass."""
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        folder = _solve(d, "ring_attention_merge", {"merge": """
new = torch.logaddexp(lse, l)
out.add_(o).mul_(0.5)
lse.copy_(new)
"""})
        (ok, line), = G.check_merge(folder)
        assert not ok and "differ from attention over all the keys" in line, line


def test_ulysses_without_the_reorder_fails(refs, tmp_path):
    """Ulysses' exchange that concatenates what arrives in the ranks' order and forgets that the
    zigzag layout's positions are not contiguous: attention runs on a shuffled sequence, so its
    causal mask is wrong and the loss departs at the first step."""
    zigzag = 'ring.layout == "zigzag"'
    real = {f: _real("ulysses_exchange", f) for f in ("seq_to_heads", "heads_to_seq")}
    assert all(zigzag in body for body in real.values())
    folder = _solve(tmp_path / "unordered", "ulysses_exchange", {f: body.replace(zigzag, "False")
                                                                  for f, body in real.items()})
    ok, line = G.check_train(folder, "context_parallel", BY_NAME["ulysses_exchange"].checks[0][2], (2,), refs)[0]
    assert not ok and "loss: first differs at step 0" in line, line
