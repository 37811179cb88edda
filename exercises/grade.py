"""
Grade an exercise: the project's own checks, run on the files of your workspace.

    python exercises/grade.py ring_all_gather                 # exercises/work/ring_all_gather/
    python exercises/grade.py ring_all_gather --dir /tmp/mine

One line per check, PASS or FAIL and why: the first element or step that differs, the bytes
against the formula, or, when ranks wait for each other forever, the flight recorder's line
(which rank waits for whom, in which op). Exit status 0 only when every check passes.

What is checked (exercises/table.py says which checks each exercise gets):
  a collective   against torch.distributed's built-in, on odd sizes, at 2 and 3 ranks (a
                 ring's wrong neighbour is invisible at 2), and the bytes it sent against its
                 formula
  a strategy     its main() at 2 (and 3) ranks, against the one-process run of the untouched
                 ddp.py: the loss and the gradient norm before clipping at every step within
                 1e-4 (the loss alone cannot see a gradient summed instead of averaged: AdamW
                 and clipping hide its scale), and the bytes sent against the file's formula
  faults         fault_tolerance.py's launcher, 3 replicas, one killed and back: who trained
                 each step, the loss and gradient norm of the one-process run told who was away
  a schedule     every rank's action list run on paper (pipeline_parallel.simulate): no
                 deadlock, every micro-batch once, as long and holding as much as 1F1B at most
Every launch has a deadline: a wait that times out ends the check, with the ranks' diagnosis.
"""
import argparse
import contextlib
import datetime
import importlib
import io
import os
import re
import shutil
import sys
import tempfile
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for p in (os.path.join(ROOT, "tests"), ROOT):
    if p not in sys.path:
        sys.path.insert(0, p)

from exercises.table import BY_NAME  # noqa: E402

SHORT_STEPS = 3          # as the suite's short parity runs: a wrong slice or sum shows by step 0 or 2
COLLECTIVE_TIMEOUT_S = 5  # a wait in a collective check (milliseconds of work) that lasts this long is a hang
TRAIN_TIMEOUT_S = 30      # a wait in a training run: longer, a peer may be computing a whole stage
LAUNCH_TIMEOUT_S = 240    # the harness's own deadline for a launch, should a rank hang outside any wait
COLLECTIVE_LAUNCH_S = 30  # the same for the collectives' checks (seconds of work, 3 ranks on 2 busy cores)
LOSS_TOL = 1e-4
MOE_FLAGS = ("--n_expert", "--top_k")


def _project_modules():
    return [f[:-3] for f in os.listdir(ROOT) if f.endswith(".py")]


@contextlib.contextmanager
def workspace(folder):
    """Inside: `import collectives` (model, ddp, ...) is the workspace's copy, imported afresh;
    after, this process's own modules are back. (A pooled rank serves later launches too.)"""
    names = _project_modules()
    saved = {n: sys.modules.pop(n) for n in names if n in sys.modules}
    sys.path.insert(0, folder)
    importlib.invalidate_caches()
    try:
        yield
    finally:
        for n in names:
            sys.modules.pop(n, None)
        sys.modules.update(saved)
        sys.path.remove(folder)


def _moe_preset(M):
    """tests/conftest.moe_preset's model, in the given copy of model.py."""
    M.PRESETS.setdefault("tiny_moe", dict(M.PRESETS["tiny"], n_layer=4))


def describe(e):
    """One line for an exception: the function not written yet, or the error and where it arose."""
    if isinstance(e, NotImplementedError):
        return f"{e} (NotImplementedError)"
    if isinstance(e, SystemExit):
        return f"the run stopped with exit code {e.code}"
    frames = traceback.extract_tb(e.__traceback__)
    where = next((f for f in reversed(frames) if not f.filename.startswith(os.path.dirname(os.__file__))), None)
    at = f" (at {os.path.basename(where.filename)}:{where.lineno} in {where.name})" if where else ""
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}{at}"


def _failure(e, C, wait_s):
    """What a rank reports when its part of a check raised: the error, and the flight
    recorder's diagnosis (every rank asks, so the one that raised publishes its record too)."""
    out = {"error": describe(e), "comm": isinstance(e, getattr(C, "CommError", ())) if C else False}
    if C is not None and hasattr(C, "diagnose"):
        try:
            out["hang"] = C.diagnose(wait_s=wait_s)[0]
        except Exception as d:
            out["hang"] = f"(no diagnosis: {describe(d)})"
    return out

# ----------------------------------------------------------------------------- collectives, in each rank


def _data(seed, rank, numel):
    """Small integers as float32: every sum is exact in any order, so comparisons are exact."""
    import torch
    g = torch.Generator().manual_seed(seed * 1009 + rank)
    return torch.randint(-8, 9, (numel,), generator=g).float()


class _Case:
    """One op's results on one rank: the first difference found, the bytes sent and due."""

    def __init__(self, C):
        self.C, self.wrong, self.sent, self.want = C, None, 0, 0

    def run(self, fn, want_bytes):
        before = self.C.bytes_sent()
        fn()
        self.sent += self.C.bytes_sent() - before
        self.want += want_bytes

    def compare(self, what, got, want):
        import torch
        if self.wrong is None and not torch.equal(got, want):
            bad = (got != want).nonzero().flatten()
            self.wrong = (f"{what}: {len(bad)} of {got.numel()} elements differ from the built-in's "
                          f"(the first at index {bad[0].item() if len(bad) else '?'})")

    def result(self):
        return dict(wrong=self.wrong, sent=self.sent, want=self.want)


def _broadcast(C, dist, g, rank, n):
    case = _Case(C)
    for size in (1, 7, 1001, 20011):
        for root in range(n):
            x = _data(size + root, rank, size)
            want = x.clone()
            dist.broadcast(want, root, group=g)
            case.run(lambda: C.broadcast(x, root, group=g), (n - 1) * 4 * size)
            case.compare(f"broadcast of {size} from rank {root}", x, want)
    return case.result()


def _reduce_scatter(C, dist, g, rank, n):
    import torch
    case = _Case(C)
    for size in (1, 7, 1001):
        full = _data(size, rank, n * size)
        kept, want = full.clone(), full.clone()
        dist.all_reduce(want, group=g)
        out = torch.full((size,), 99.0)
        case.run(lambda: C.reduce_scatter(out, full, group=g), (n - 1) * 4 * size * n)
        case.compare(f"reduce_scatter of {n}x{size}", out, want[rank * size:(rank + 1) * size])
        case.compare(f"reduce_scatter of {n}x{size} (its input must be left as it was)", full, kept)
    return case.result()


def _all_gather(C, dist, g, rank, n):
    import torch
    case = _Case(C)
    for size in (1, 7, 1001):
        x = _data(size, rank, size)
        want, out = torch.empty(n * size), torch.full((n * size,), 99.0)
        dist.all_gather_into_tensor(want, x, group=g)
        case.run(lambda: C.all_gather(out, x, group=g), (n - 1) * 4 * size * n)
        case.compare(f"all_gather of {n}x{size}", out, want)
    return case.result()


def _all_reduce(C, dist, g, rank, n):
    case = _Case(C)
    for size in (20011, 7):  # 80 KB takes the ring, 28 bytes the tree: both send 2(N-1)·S in all
        x = _data(size, rank, size)
        want = x.clone()
        dist.all_reduce(want, group=g)
        case.run(lambda: C.all_reduce(x, group=g), 2 * (n - 1) * 4 * size)
        case.compare(f"all_reduce of {size}", x, want)
    return case.result()


def _all_to_all(C, dist, g, rank, n):
    import torch
    case = _Case(C)
    width = 3
    rows = lambda i, j: (i + j) % 3 + 1  # noqa: E731  rows rank i sends rank j: uneven, and symmetric
    for uneven in (True, False):
        ins = [rows(rank, j) if uneven else 2 for j in range(n)]
        outs = [rows(i, rank) if uneven else 2 for i in range(n)]
        x = _data(7 + uneven, rank, sum(ins) * width).view(-1, width)
        want, out = torch.empty(sum(outs), width), torch.full((sum(outs), width), 99.0)
        dist.all_to_all_single(want, x, outs, ins, group=g)
        total = sum((rows(i, j) if uneven else 2) * width * 4 for i in range(n) for j in range(n) if i != j)
        case.run(lambda: C.all_to_all(out, x, outs if uneven else None, ins if uneven else None, group=g), total)
        case.compare(f"all_to_all of {'uneven' if uneven else 'equal'} splits {ins}", out, want)
    return case.result()


COLLECTIVES = {"broadcast": (_broadcast, "(N-1)·S in all"), "reduce_scatter": (_reduce_scatter, "(N-1)·S in all"),
               "all_gather": (_all_gather, "(N-1)·S in all"), "all_reduce": (_all_reduce, "2(N-1)·S in all"),
               "all_to_all": (_all_to_all, "every piece but a rank's own, once")}


def _collective_job(rank, world, folder, ops, timeout_s):
    import warnings
    import torch.distributed as dist
    warnings.filterwarnings("ignore", category=FutureWarning)  # all_gather_into_tensor's new name
    out, C = {}, None
    with workspace(folder):
        try:
            C = importlib.import_module("collectives")
        except Exception as e:
            return {"import": describe(e)}
        g = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=timeout_s))
        for op in ops:
            try:
                out[op] = COLLECTIVES[op][0](C, dist, g, rank, world)
            except Exception as e:
                out[op] = _failure(e, C, timeout_s)
                out["broken"] = True  # messages may still be posted on this group: the ranks go
                break
        if not out.get("broken"):
            C.shutdown()  # its worker threads, if any; the group is the harness's, and stays
            dist.destroy_process_group(g)
    return out

# ----------------------------------------------------------------------------- training runs, in each rank


def _train_job(rank, world, folder, module, args, timeout_s):
    import torch.distributed as dist
    C = None
    with workspace(folder):
        try:
            M = importlib.import_module("model")
            _moe_preset(M)
            C = importlib.import_module("collectives")
            mod = importlib.import_module(module)
        except Exception as e:
            return {"error": "import: " + describe(e), "broken": False}
        # The run uses the whole world (group None), whose waits last 30 minutes: for the run,
        # the world is a group of the same ranks whose waits time out after timeout_s.
        world_pg = dist.distributed_c10d._world
        g = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=timeout_s))
        harness_pg, world_pg.default_pg = world_pg.default_pg, g
        err = io.StringIO()
        try:
            # rank 0's banner and log lines are not the student's; what a refusal prints is
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
                out = {"records": mod.main(args)}
        except BaseException as e:
            out = dict(_failure(e, C, timeout_s), broken=True)
            said = err.getvalue().strip().splitlines()
            if isinstance(e, SystemExit) and said:
                out["error"] += f": {said[-1]}"
        finally:
            world_pg.default_pg = harness_pg
        if not out.get("broken"):
            dist.destroy_process_group(g)
        return out

# ----------------------------------------------------------------------------- launching, and the checks


def _launch(job, world, *args, timeout=LAUNCH_TIMEOUT_S):
    """-> (each rank's result, or None and a line saying why there are none). A rank that dies
    ends the launch at once (harness.RankDied); ranks that never answer, at the deadline, with
    where they were (harness.NeverReturned): no wait timed out, so they are not waiting for a
    message, but running something that never returns."""
    from harness import spawn, _end_pool, _pools, RankDied, NeverReturned
    try:
        results = spawn(job, world, *args, timeout=timeout)
    except RankDied as e:
        return None, died(e)
    except NeverReturned as e:
        where = "; ".join(f"rank {r} at {e.where[r]}" for r in e.ranks if e.where.get(r))
        return None, (f"{NEVER_RETURNED} after {timeout} s (ranks {e.ranks}), and none waits for a message: "
                      f"{where or 'somewhere'} (an endless loop?)")
    except AssertionError as e:
        return None, str(e).strip().splitlines()[0]
    if any(r.get("broken") for r in results) and world in _pools:
        _end_pool(world)  # a failed check may leave messages posted: the next launch gets fresh ranks
    return results, None


NEVER_RETURNED = "never returned"


def died(e):
    """A student's line for harness.RankDied: gloo's size check in words, else the signal."""
    size = re.search(r"op\.preamble\.length <= op\.nbytes\. (\d+) vs (\d+)", e.said)
    if size:
        sent, room = (int(n) // 4 for n in size.groups())
        return (f"rank {e.rank} crashed: a send and its receive disagree on the size, {sent} elements sent to it "
                f"where it posted a receive of {room} (float32; gloo aborts the receiving process)")
    return f"rank {e.rank} crashed ({e.how})" + (f": {e.last}" if e.last else "")


def _hang_or_error(results):
    """The line for ranks that failed: the diagnosis of a hang, else the first error."""
    failed = [r for r in results if r.get("error")]
    comm = [r for r in failed if r.get("comm")]
    first = next((r for r in failed if not r.get("comm")), None)  # what a rank raised beats its peers' timeouts
    if first is not None:
        return first["error"]
    error = re.sub(r"\[[^\]]*[/\\][^\]]*\] ", "", comm[0]["error"])  # gloo's source path, not a rank list
    line = next((r["hang"] for r in comm if r.get("hang")), "")
    return f"hung: {error}; " + (line or "the flight recorder finds every rank in the same op: its messages "
                                          "do not pair up (a wrong peer, or a message one side never posts)")


def check_collective(folder, ops, worlds):
    lines = []
    for world in worlds:
        results, why = _launch(_collective_job, world, folder, ops, COLLECTIVE_TIMEOUT_S, timeout=COLLECTIVE_LAUNCH_S)
        if results is None:  # one line for the launch: each op's would say the same
            lines.append((False, f"{', '.join(ops)}, {world} ranks: {why}"))
            if NEVER_RETURNED in why:
                break  # a larger world would only wait as long again
            continue
        for op in ops:
            name = f"{op}, {world} ranks"
            if any("import" in r for r in results):
                lines.append((False, f"{name}: {results[0].get('import')}"))
                continue
            mine = [r.get(op) for r in results]
            if any(m is None for m in mine):
                lines.append((False, f"{name}: not run (an op before it failed)"))
            elif any("error" in m for m in mine):
                lines.append((False, f"{name}: {_hang_or_error(mine)}"))
            elif any(m["wrong"] for m in mine):
                r = next(i for i, m in enumerate(mine) if m["wrong"])
                lines.append((False, f"{name}: rank {r}: {mine[r]['wrong']}"))
            else:
                sent, want = sum(m["sent"] for m in mine), mine[0]["want"]
                formula = COLLECTIVES[op][1]
                if sent != want:
                    lines.append((False, f"{name}: the results are right, but the ranks sent {sent} bytes in all "
                                         f"where {formula} is {want} ({sent - want:+d})"))
                else:
                    lines.append((True, f"{name}: equal to torch.distributed's, {sent} bytes = {formula}"))
    return lines


def reference(kind, data_dir):
    """The one-process run of the project's own ddp.py (never the workspace's): its records."""
    import ddp
    import model as M
    from harness import one_thread
    key = (kind, data_dir)
    if key not in REFERENCES:
        if kind == "moe":
            _moe_preset(M)
        with one_thread(), contextlib.redirect_stdout(io.StringIO()):  # its banner is not the student's
            REFERENCES[key] = ddp.main(train_args(data_dir) + (list(MOE_REF) if kind == "moe" else []))
    return REFERENCES[key]


REFERENCES = {}  # (kind, data dir) -> records; tests put the suite's own reference here
MOE_REF = ("--model=tiny_moe", "--n_expert=4", "--top_k=2")


def train_args(data_dir):
    from conftest import TRAIN_ARGS
    return TRAIN_ARGS + [f"--data_dir={data_dir}", f"--max_iters={SHORT_STEPS}"]


def formula_bytes(module, args, world, rec):
    """-> (the bytes every rank together should send in the step logged as rec, per the file's
    own traffic_per_rank of the untouched project, the tolerance)."""
    import model as M
    from conftest import VOCAB
    _moe_preset(M)
    mod = importlib.import_module(module)
    cfg = M.parse_args(mod.DEFAULTS, args)
    config = M.make_config(cfg.model, VOCAB, cfg.block_size, 0.0, getattr(cfg, "n_expert", 0),
                           getattr(cfg, "top_k", 2), getattr(cfg, "capacity_factor", 0.0))
    if module == "expert_parallel":  # the token exchange depends on the step's routing
        return sum(mod.traffic_per_rank(config, cfg, world, rec["sent_tokens"][i], rec["received_tokens"][i])
                   for i in range(world)), 1e-3
    total = world * mod.traffic_per_rank(config, cfg, world)
    return total, 1e-6 * total + 1e-3


def check_train(folder, module, flags, worlds, data_dir):
    lines = []
    kind = "moe" if any(f.startswith(MOE_FLAGS) for f in flags) else "dense"
    ref = reference(kind, data_dir)
    args = train_args(data_dir) + list(flags)
    for world in worlds:
        name = f"{module} {' '.join(flags)}".strip() + f", {world} ranks"
        results, why = _launch(_train_job, world, folder, module, args, TRAIN_TIMEOUT_S)
        if results is None:
            lines.append((False, f"{name}: {why}"))
            continue
        if any(r.get("error") for r in results):
            lines.append((False, f"{name}: {_hang_or_error(results)}"))
            continue
        records = results[0]["records"]
        found = [_compare_steps(f"{name}: loss", records, ref, "loss", lambda q: LOSS_TOL),
                 _compare_steps(f"{name}: gradient norm before clipping", records, ref, "grad_norm",
                                lambda q: LOSS_TOL * max(1.0, abs(q)), "relative")]
        bad = next((i for i, (ok, _) in enumerate(found) if not ok), None)
        if bad is not None:  # where: the bisector's first line (bench/strategies_compare.py --bisect)
            found[bad] = (False, f"{found[bad][1]}; {where_it_differs(folder, module, args, world)}")
        lines += found
        bad = None
        for r in records:
            want, tol = formula_bytes(module, args, world, r)
            if abs(sum(r["comm_bytes"]) - want) > tol:
                bad = (f"{name}: bytes: step {r['iter']}: the ranks sent {sum(r['comm_bytes'])} in all, "
                       f"{module}.traffic_per_rank() says {want:.0f} ({sum(r['comm_bytes']) - want:+.0f})")
                break
        lines.append((False, bad) if bad else
                     (True, f"{name}: bytes: {sum(records[-1]['comm_bytes'])} a step in all = "
                            f"{module}.traffic_per_rank()"))
    return lines


def where_it_differs(folder, module, args, world):
    """The first line of bench/strategies_compare.py's bisector on the workspace's run."""
    from bench.strategies_compare import bisect
    try:
        return bisect(module, args, world, folder, _moe_preset)[0]
    except Exception as e:  # the run got through once: a second failure is worth a word, not a crash
        return f"(the bisector could not say where: {describe(e)})"


def _compare_steps(name, records, ref, key, tol, how=""):
    if [r["iter"] for r in records] != [q["iter"] for q in ref]:
        return False, (f"{name}: logged steps {[r['iter'] for r in records]}, the one-process run "
                       f"{[q['iter'] for q in ref]}")
    for r, q in zip(records, ref):
        if not abs(r[key] - q[key]) <= tol(q[key]):
            return False, (f"{name}: first differs at step {r['iter']}: {r[key]:.6f}, the one-process run "
                           f"{q[key]:.6f}")
    how = f" {how}" if how else ""
    return True, f"{name}: within {LOSS_TOL:.0e}{how} of the one-process run at every step ({len(ref)})"


def check_faults(folder, faults, data_dir):
    """The workspace's fault_tolerance.py, 3 replicas with --faults: who trained each step is who
    the kills left, and the loss and gradient norm are the project's one-process reference's,
    told of the same absences; every replica holds the same weights after every step."""
    import subprocess
    import fault_tolerance as F  # the project's own: its reference
    from harness import read_log
    name = f"fault_tolerance --faults={faults}"
    args = train_args(data_dir) + ["--eval_interval=0", "--log_interval=0", "--replicas=3", "--max_iters=6"]
    log = os.path.join(tempfile.mkdtemp(prefix="exercise_faults_"), "log.jsonl")
    try:
        p = subprocess.run([sys.executable, os.path.join(folder, "fault_tolerance.py"), *args, f"--faults={faults}",
                            f"--log_file={log}", f"--timeout_s={TRAIN_TIMEOUT_S}"], capture_output=True, text=True,
                           timeout=LAUNCH_TIMEOUT_S, env=dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES=""))
    except subprocess.TimeoutExpired:
        return [(False, f"{name}: still running after {LAUNCH_TIMEOUT_S} s: a replica waits for a verdict that "
                        "never comes?")]
    finally:
        records = read_log(log) if os.path.exists(log) else []
        shutil.rmtree(os.path.dirname(log), ignore_errors=True)
    if p.returncode:
        return [(False, f"{name}: exit status {p.returncode}: {(p.stderr.strip().splitlines() or [''])[-1]}")]
    away = F.absences(faults, 6)
    with contextlib.redirect_stdout(io.StringIO()):
        ref, _ = F.reference(args, away)
    who = [[r for r in range(3) if it not in away.get(r, ())] for it in range(6)]
    lines = [(False, f"{name}: the replicas of each step were {[r['replicas'] for r in records]}, not {who}")
             if [r["replicas"] for r in records] != who else (True, f"{name}: the replicas of each step: {who}")]
    lines.append(_compare_steps(f"{name}: loss", records, ref, "loss", lambda q: LOSS_TOL))
    lines.append(_compare_steps(f"{name}: gradient norm before clipping", records, ref, "grad_norm",
                                lambda q: LOSS_TOL * max(1.0, abs(q)), "relative"))
    split = [r["iter"] for r in records if len(set(r["weights_hash"])) > 1]
    lines.append((False, f"{name}: the replicas' weights differ after step {split[0]}") if split else
                 (True, f"{name}: every replica holds the same weights after every step"))
    return lines


def check_schedule(folder, name):
    """Every rank's plan on paper, at p = 2..4 ranks and m = 1..2p+1 micro-batches."""
    with workspace(folder):
        try:
            PP = importlib.import_module("pipeline_parallel")
            for p in (2, 3, 4):
                for m in range(1, 2 * p + 2):
                    where = f"schedule {name}, p={p}, m={m}"
                    for r in range(p):
                        order = PP.schedule(name, p, m, r)
                        for kind in "FB":
                            got = sorted(a.micro for a in order if a.kind == kind)
                            if got != list(range(m)):
                                return [(False, f"{where}: rank {r} runs {kind} of micro-batches {got}, "
                                                f"not each of 0..{m - 1} once")]
                        early = [a.micro for i, a in enumerate(order) if a.kind == "B" and
                                 ("F", a.micro) not in [(b.kind, b.micro) for b in order[:i]]]
                        if early:
                            return [(False, f"{where}: rank {r} runs the backward of micro-batch {early[0]} "
                                            f"before its forward")]
                    try:
                        timelines = PP.simulate(name, p, m)
                    except RuntimeError as e:
                        return [(False, f"{where}: {str(e).splitlines()[0]}")]
                    took = max(end for t in timelines for _, _, end in t)
                    if took > 3 * (m + p - 1):
                        return [(False, f"{where}: the step takes {took} time units (F = 1, B = 2); 1F1B takes "
                                        f"(m + p - 1)(F + B) = {3 * (m + p - 1)}")]
                        held, most = PP.max_held(order), min(p - r, m)
                        if held > most:
                            return [(False, f"{where}: rank {r} holds {held} micro-batches at once; 1F1B holds "
                                            f"at most min(p - r, m) = {most}")]
        except Exception as e:
            return [(False, f"schedule {name}: {describe(e)}")]
    return [(True, f"schedule {name}: no deadlock, every micro-batch once, (m + p - 1)(F + B) long, at most "
                   f"min(p - r, m) held (p = 2..4, m = 1..2p+1)")]


def check_merge(folder):
    """merge() of attention over two halves of the keys against attention over all of them."""
    import torch
    with workspace(folder):
        try:
            CP = importlib.import_module("context_parallel")
            g = torch.Generator().manual_seed(0)
            q, k, v = (torch.randn(2, 3, 5, 8, generator=g) for _ in range(3))
            want, want_lse = CP.attend(q, k, v, 0.3, False)
            out, lse = (t.clone() for t in CP.attend(q, k[:, :, :4], v[:, :, :4], 0.3, False))
            o, l = CP.attend(q, k[:, :, 4:], v[:, :, 4:], 0.3, False)
            whole = torch.zeros(2, 3, 7, 8), torch.zeros(2, 3, 7)
            whole[0][:, :, 1:6], whole[1][:, :, 1:6] = out, lse
            CP.merge(whole[0][:, :, 1:6], whole[1][:, :, 1:6], o, l)  # views, as ring_forward passes them
            diff = (whole[0][:, :, 1:6] - want).abs().max().item()
            diff_lse = (whole[1][:, :, 1:6] - want_lse).abs().max().item()
        except Exception as e:
            return [(False, f"merge: {describe(e)}")]
    if diff > 1e-5 or diff_lse > 1e-5:
        return [(False, f"merge: two halves merged differ from attention over all the keys by {diff:.1e} "
                        f"(out) and {diff_lse:.1e} (lse), in the views passed in")]
    return [(True, "merge: two halves merged equal attention over all the keys, in place")]


def not_written(ex, folder):
    """-> the functions of ex that are missing from the workspace or still the stub (read, not run)."""
    import ast
    from exercises.start import find_def, is_stub
    path = os.path.join(folder, ex.file)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        tree = ast.parse(f.read())  # a SyntaxError is the student's to see: grade() says where
    return [q for q in ex.functions if find_def(tree, q) is None or is_stub(find_def(tree, q))]


def check_names(ex, worlds):
    names = []
    for check in ex.checks:
        kind = check[0]
        if kind == "collective":
            names += [f"{op}, {w} ranks" for w in worlds for op in check[1]]
        elif kind == "train":
            names += [f"{check[1]} {' '.join(check[2])}".strip() + f", {w} ranks" for w in worlds]
        else:
            names.append(" ".join(check))
    return names


def grade(name, folder=None, worlds=None, data_dir=None):
    """-> [(passed, line)], one per check."""
    ex = BY_NAME[name]
    folder = os.path.abspath(folder or os.path.join(HERE, "work", name))
    worlds = worlds or ex.worlds
    try:
        todo = not_written(ex, folder)
    except SyntaxError as e:
        return [(False, f"{ex.file} does not parse: {e.msg} (line {e.lineno})")]
    if todo is None:
        return [(False, f"no workspace at {folder}: python exercises/start.py {name}")]
    if todo:  # no launch: every check would fail the same way
        why = ", ".join(todo) + (" is" if len(todo) == 1 else " are") + " not written yet (NotImplementedError)"
        return [(False, f"{c}: {why}") for c in check_names(ex, worlds)]
    lines, made = [], None
    try:
        for check in ex.checks:
            if check[0] == "collective":
                lines += check_collective(folder, check[1], worlds)
            elif check[0] in ("train", "faults"):
                if data_dir is None:
                    from conftest import make_dataset
                    made = data_dir = make_dataset(tempfile.mkdtemp(prefix="exercise_data_"))
                lines += (check_train(folder, check[1], check[2], worlds, data_dir) if check[0] == "train" else
                          check_faults(folder, check[1], data_dir))
            elif check[0] == "schedule":
                lines += check_schedule(folder, check[1])
            elif check[0] == "merge":
                lines += check_merge(folder)
    finally:
        if made:
            shutil.rmtree(made, ignore_errors=True)
    return lines


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("name", help="the exercise (python exercises/start.py --list)")
    ap.add_argument("--dir", help="the workspace (default exercises/work/NAME/)")
    ap.add_argument("--worlds", help="world sizes, comma-separated (default: the exercise's)")
    args = ap.parse_args(argv)
    if args.name not in BY_NAME:
        print(f"error: no exercise {args.name!r}; `python exercises/start.py --list` names them", file=sys.stderr)
        return 2
    try:
        worlds = tuple(int(w) for w in args.worlds.split(",")) if args.worlds else None
        assert worlds is None or min(worlds) >= 2
    except (ValueError, AssertionError):
        print(f"error: --worlds takes world sizes of 2 or more, comma-separated, not {args.worlds!r}", file=sys.stderr)
        return 2
    lines = grade(args.name, args.dir, worlds)
    for ok, line in lines:
        print(("PASS " if ok else "FAIL ") + line, flush=True)
    passed = sum(ok for ok, _ in lines)
    print(f"{passed} of {len(lines)} checks pass" + ("" if passed < len(lines) else f": {args.name} done"))
    return 0 if passed == len(lines) else 1


if __name__ == "__main__":
    # the ranks must find this module's functions by an importable name, not __main__'s
    sys.exit(importlib.import_module("exercises.grade").main())
