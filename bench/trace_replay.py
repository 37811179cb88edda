"""
What this exact program would do on a cluster: replay a --trace of any strategy on a modeled
one. Every rank keeps the order it issued its work in (the trace's stamps); between two stamps
it computes what it dispatched there (the FLOPs, ops and bytes model.py counted) at the
cluster's rates; a collective ends when its slowest member has pushed its messages over the links it
uses, once every member has reached it; a point-to-point message arrives once both ends have
posted it; an async op runs on its group's worker, in the order issued, beside the compute.

    torchrun --nproc_per_node=2 ddp.py --model=tiny --max_iters=5 --trace=ddp.json
    python bench/trace_replay.py ddp.json --cluster here --flops 20e9 --alpha_us 300 --beta_gbs 1   # one replay
    python bench/trace_replay.py ddp16.json --cluster h100 --nodes 2 --png ddp.png  # a 16-rank trace on 2 x 8
    python bench/trace_replay.py --check --json check.json   # predicted against measured here, and the
                                                             # p = 4 zero-bubble rows at a core a stage
    python bench/trace_replay.py --what_if                   # GPT-2 and a 1.7B on 8 and 2 x 8 H100s

Cluster (a rank = a device, or a process sharing `cores` with the others): its compute rate F
(FLOP/s, peak x efficiency), its memory rate M (bytes/s), a host cost per dispatched op and per
call, alpha (a message's latency) and beta (bytes/s) inside a node and across, the ranks a node.
A stretch of work costs FLOPs / F + bytes / M + ops x op_s (bytes: what its ops read and wrote;
an elementwise op over a large tensor takes time for few FLOPs); a collective on a rank costs
call_s + the sum over the peers it sends to (or hears from, whichever is more) of messages x
alpha + bytes / beta of that link, and the member that takes longest decides (docs/formulas.md's
alpha-beta costs, counted from the trace's own messages); in a blocking collective the member
that arrived last leaves lag_s after the others (gloo here: it stays the late one, replay()'s
late()). With `cores` the ranks are processes on a CPU's cores, handed out as an OS does
(schedule()): a rank that waits gives its core up; one that computes, or whose wait has ended,
takes a free core or queues for one, and runs a slice (quantum) before the next in the queue
gets on, so with more ranks than cores a rank whose message is in still waits for a core; and
then a core runs at `speed` of its pace (switching, caches the other ranks filled). An async op
in flight (its thread copies and reduces) takes a share of the cores as a computing rank does.

--check calibrates F, M, op_s (the compute stretches), the link (each collective's and message's
time from its last member's arrival to its end) and lag_s on the 2-rank runs but the one it
predicts (leave one out), and predicts the 4-rank runs from all of them on the 2 cores, with
speed and quantum fitted on the other 4-rank runs' steps and waiting shares (time_slices()).
--what_if traces at a model's depth and a small width, then scales (scale()): each stretch's
FLOPs by the model formula's ratio, DDP's and FSDP's messages by the parameter ratio, the others'
by h x tokens. Calculated figures, never measured ones (docs/planning.md).

What --check runs and prints. It traces every strategy (DDP bucketed and overlapped, FSDP, tensor
parallel with and without sequence parallelism, the ring, the experts, the pipeline's five
schedules at m = 8, the mesh's tp x dp) at 2 and 4 ranks of the tiny preset, five traced steps
each (the first counts the work, the four others keep their time); fits F, M and op_s on the compute
stretches, the link (alpha, beta, a call) on the collectives' times and lag_s on the 2-rank runs,
each stretch and op the median of its four timed steps. Per run: the predicted step beside the
measured one (the median of the timed steps, their range beside it), and the share of the step the
ranks wait in a collective or a wait, predicted and measured (a pipeline's idle fraction with its
message time); then the worst row at 2 and at 4 ranks, and the zero-bubble schedules at p = 4,
m = 8 replayed with a core a stage beside simulate()'s paper figures. --json writes a record per
run (run, strategy, ranks, predicted_ms, measured_ms, the steps, the waiting shares; at 4 ranks the
cores' fitted speed and slice).

What --what_if runs: each strategy traced at 8 and 16 ranks at a model's real depth and a width
of 64 (16 heads, so that every split divides it), replayed on 8 H100s in a node and on 2 x 8 at
plan_cluster.py's figures (989 TFLOP/s x its eff, NVLink 450 GB/s, one 400 Gb/s NIC a GPU,
NCCL's latencies), no host cost an op and no memory term (HBM traffic not charged: the planner
adds it, so these rows are the faster side of its figure), the trace's float32 bytes; for GPT-2
124M (8 sequences of 1,024 a GPU) and a 1.7B at Megatron-Core's shape (24 layers, h = 2,048, 4 x
4,096 tokens a GPU). The scaling is the model's formula, not a trace at the width: a stretch's
FLOPs grow by one ratio whatever it holds, and the ops a stretch dispatches stay the trace's.

A trace that lacks what the replay needs gets one line and exit code 2, never a figure: one
without the work counts (an older trace, or a --compile one), one cut short (a rank without the
step, a wait for an op never issued, a message or a collective with no partner), or one of another
world size than the cluster's ranks.
"""
import argparse
import json
import math
import os
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)
import trace_timeline as timeline  # noqa: E402

P2P = ("send", "recv", "sendrecv")
PARAM_SYNC = ("ddp", "fsdp")  # strategies whose messages carry parameters or gradients (scale())


class TraceError(Exception):
    """A trace the replay cannot read: one line saying what it lacks."""


# ----------------------------------------------------------------------------- reading a trace

def load(path):
    try:
        with open(path) as f:
            trace = json.load(f)
    except (OSError, ValueError) as e:
        raise TraceError(f"cannot read {path} as a trace: {e}")
    if not isinstance(trace, dict) or "traceEvents" not in trace:
        raise TraceError(f"{path} is not a --trace file (no traceEvents)")
    return trace


def counted_step(trace):
    """The traced step that counted its work (model.py counts the first; the others stamp only
    the order), or None."""
    for e in trace["traceEvents"]:
        if e.get("cat") == "step" and e["args"].get("upto", [None, None])[1] is not None:
            return e["args"]["step"]
    return None


def timed_steps(trace):
    """The traced steps whose times the counting did not slow (all of them if only one was traced)."""
    steps = sorted({e["args"]["step"] for e in trace["traceEvents"] if e.get("cat") == "step"})
    return [s for s in steps if s != counted_step(trace)] or steps


def programs(trace, step=None, world=None):
    """-> (step, [per rank: its program], measured) for one traced step (default: the median of the
    uncounted ones), its work as the counted step counted it (the same program every step).
    A program: ("compute", flops, ops, name, bytes) | (kind, op, t0, t1), kind "post", "sync" or "wait",
    op a dict with its group, kind and messages, t0 and t1 the step's times of the item (us).
    measured: per rank (step start, step length, its events)."""
    info = trace.get("otherData", {})
    if "world" not in info:
        raise TraceError("the trace does not say its world size (made before the replay's format): retrace it")
    n = info["world"]
    if world is not None and world != n:
        raise TraceError(f"the trace has {n} ranks and the cluster {world}: trace the program at {world} ranks "
                         f"(or give the cluster {n} with --nodes and --per_node)")
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    counted = counted_step(trace)
    if counted is None:
        raise TraceError("the trace has no work counts (at/upto: an older --trace, or a --compile run): "
                         "retrace it with this code's --trace, without --compile")
    if any(len(e["args"]["at"]) < 4 for e in events if "at" in e["args"]):
        raise TraceError("the trace counts no bytes an op moves (at/upto [number, FLOPs, ops, bytes]: an older "
                         "--trace): retrace it with this code's --trace")
    if step is None:
        timed = set(timed_steps(trace))
        step = timeline.median_step([e for e in events if e["args"].get("step") in timed])
    progs, measured = [], []
    for r in range(n):
        evs, work = ([e for e in events if e["pid"] == r and e["args"].get("step") == s] for s in (step, counted))
        steps, heads = [e for e in evs if e["cat"] == "step"], [e for e in work if e["cat"] == "step"]
        if not steps or not heads:
            raise TraceError(f"the trace is cut short: rank {r} has no step {step if not steps else counted}")
        head, count = steps[0], {e["args"]["at"][0]: e["args"] for e in work if "at" in e["args"]}
        if order(evs) != order(work):
            raise TraceError(f"rank {r} did other work in step {step} than in step {counted}, the counted one")
        points = sorted((e for e in evs if e["cat"] in ("comm", "wait") and "at" in e["args"]),
                        key=lambda e: e["args"]["at"][0])
        compute = sorted((e for e in work if e["cat"] == "compute"), key=lambda e: e["args"]["at"][0])
        prog, cur, ops = [], heads[0]["args"]["at"], {}
        for e in points + [None]:
            a = count[e["args"]["at"][0]] if e is not None else heads[0]["args"]
            at = a["at"] if e is not None else a["upto"]
            if at[2] > cur[2] or at[1] > cur[1]:
                prog.append(("compute", at[1] - cur[1], at[2] - cur[2], label(compute, cur[0], at[0]), at[3] - cur[3]))
            if e is None:
                break
            if e["cat"] == "wait":
                if a.get("of") not in ops:
                    raise TraceError(f"the trace is cut short: rank {r}'s {e['name']!r} waits for an op it never issued")
                prog.append(("wait", ops[a["of"]], e["ts"], e["ts"] + e["dur"]))
                cur = a.get("upto", a["at"])
                continue
            op = dict(rank=r, name=e["name"], op=a["op"], group=tuple(a["group"]),
                      to={int(k): v for k, v in a.get("to", {}).items()},
                      frm={int(k): v for k, v in a.get("frm", {}).items()}, seq=a["at"][0], event=e)
            ops[op["seq"]] = op
            if e["tid"] == 1:
                posted = e["args"].get("posted_us", e["ts"])
                prog.append(("post", op, posted, posted))
                cur = a["at"]
            else:
                prog.append(("sync", op, e["ts"], e["ts"] + e["dur"]))
                cur = a.get("upto", a["at"])
        progs.append(prog)
        measured.append((head["ts"], head["dur"], evs))
    return step, progs, measured


def order(evs):
    """A step's stamped spans in issue order, by name: the same program every step."""
    return [e["name"] for e in sorted((e for e in evs if "at" in e["args"] and e["cat"] != "step"),
                                      key=lambda e: e["args"]["at"][0])]


def label(compute, first, last):
    """The innermost compute span around the stretch between two stamps: its name, for the picture."""
    inside = [e for e in compute if e["args"]["at"][0] <= first and e["args"].get("upto", [math.inf])[0] >= last]
    return inside[-1]["name"] if inside else "compute"


# ----------------------------------------------------------------------------- the cluster

def cluster(name, **over):
    """here: this machine (F, M, op_s, link: --check fits them); h100: 8 H100 a node, plan_cluster.py's
    data-sheet figures (dense bf16 peak x its eff, NVLink and a 400 Gb/s NIC a GPU, NCCL's latencies)."""
    if name == "here":
        base = dict(flops=20e9, mem_bw=5e9, op_s=20e-6, call_s=100e-6, lag_s=0.0, alpha=300e-6, beta=1e9,
                    alpha_x=300e-6, beta_x=1e9, per_node=1 << 30, cores=os.cpu_count(), peak=None)
    elif name == "h100":
        import plan_cluster as PC
        g = PC.CLUSTERS["H100"]
        base = dict(flops=g["peak"] * PC.EFF, op_s=0.0, mem_bw=math.inf, call_s=PC.LAT_CALL, lag_s=0.0,
                    alpha=PC.LAT_NVLINK, beta=g["nvlink_bw"],
                    alpha_x=PC.LAT_IB, beta_x=g["ib_bw"], per_node=g["gpus_per_node"], cores=None, peak=g["peak"])
    else:
        raise TraceError(f"unknown cluster {name!r}: here or h100")
    base.update(quantum=4e-3, speed=1.0)  # shared cores only (--cores): a slice; no loss unless fitted
    base.update({k: v for k, v in over.items() if v is not None})
    return base


def link(cl, a, b):
    inside = a // cl["per_node"] == b // cl["per_node"]
    return (cl["alpha"], cl["beta"]) if inside else (cl["alpha_x"], cl["beta_x"])


def op_cost(cl, op, r, byte_scale=1.0):
    """One member's time on the wire for its part of a collective. Across nodes the group's ranks
    on a node share its NICs (one a GPU: NCCL runs a ring a NIC, so the crossing bytes spread
    over them)."""
    node = r // cl["per_node"]
    nics = sum(1 for g in op["group"] if g // cl["per_node"] == node)
    ways = []
    for tally in (op["to"], op["frm"]):
        t = 0.0
        for peer, (msgs, nbytes) in tally.items():
            alpha, beta = link(cl, r, peer)
            if peer // cl["per_node"] != node:
                beta *= nics
            t += msgs * alpha + nbytes * byte_scale / beta
        ways.append(t)
    return cl["call_s"] + max(ways)


# ----------------------------------------------------------------------------- the replay

def instances(progs):
    """Match the ops across ranks: a collective by its group and its number on that group (every
    member issues a group's collectives in one order); a point-to-point message by its ends and
    its number between them. -> {key: set of member ranks}; each op gets op["keys"]."""
    need, counts = {}, {}
    for r, prog in enumerate(progs):
        for kind, *rest in prog:
            if kind not in ("post", "sync"):
                continue
            op = rest[0]
            keys = []
            if op["op"] in P2P:
                for way, tally in (("to", op["to"]), ("frm", op["frm"])):
                    for peer, (msgs, nbytes) in tally.items():
                        src, dst = (r, peer) if way == "to" else (peer, r)
                        for _ in range(msgs):
                            k = counts[(src, dst, way)] = counts.get((src, dst, way), 0) + 1
                            keys.append(("msg", src, dst, k))
                            need.setdefault(keys[-1], set()).add(r)
            else:
                k = counts[(op["group"], r)] = counts.get((op["group"], r), 0) + 1
                keys.append(("coll", op["group"], k))
                need.setdefault(keys[-1], set()).add(r)
            op["keys"] = keys
    for key, ranks in need.items():
        want = set(key[1]) if key[0] == "coll" else {key[1], key[2]}
        if ranks != want:
            missing = sorted(want - ranks)
            what = f"collective #{key[2]} on ranks {list(key[1])}" if key[0] == "coll" else \
                f"message #{key[3]} from rank {key[1]} to rank {key[2]}"
            raise TraceError(f"the trace is cut short or mismatched: the {what} has no partner on rank(s) {missing}")
    return need


def replay(progs, cl, flop_scale=1.0, byte_scale=1.0):
    """-> per rank dict(end, busy, blocked, spans=[(start, length, cat, name, row)]); times in seconds."""
    n = len(progs)
    need = instances(progs)
    arrive, cost, ends = {k: {} for k in need}, {k: {} for k in need}, {}
    queues = {}  # (rank, group) -> its ops in issue order
    for r, prog in enumerate(progs):
        for kind, *rest in prog:
            if kind in ("post", "sync"):
                op = rest[0]
                op.update(issued=None, ready=None, end=None)
                op["prev"] = queues.get((r, op["group"]))
                queues[(r, op["group"])] = op
    pc, left, now = [0] * n, [None] * n, 0.0
    sharing = bool(cl["cores"])  # ranks on a CPU's cores, handed out in slices (below); else a device each
    oncore, queue = {}, []  # sharing: rank on a core -> when its slice ends; the ranks waiting for one
    out = [dict(end=None, busy=0.0, blocked=0.0, spans=[]) for _ in range(n)]
    started = [None] * n  # when the current compute stretch or block began

    pending = []  # ops issued and not yet ended
    dated = []    # async ops whose start and end are known (they share the cores on a CPU)

    def late(key, r):
        """Measured here (gloo, 2 cores; lag_samples()): in a blocking collective the member that
        arrives last leaves lag_s after the others, so it arrives last again at the next one, and
        every blocking collective of a step costs lag_s (an async op's members, and a message's
        two ends, leave together). Arrivals are never equal on a real machine: a tie goes to the
        highest rank."""
        return max(arrive[key], key=lambda m: (arrive[key][m], m)) == r

    def settle():
        """Date what the issued ops now allow: an op is ready once its group's previous op on the
        rank has ended (the worker's FIFO); a match ends once every member is ready."""
        changed = True
        while changed:
            changed = False
            for op in pending:
                r, prev = op["rank"], op["prev"]
                if op["ready"] is None and (prev is None or prev["end"] is not None):
                    op["ready"] = max(op["issued"], prev["end"] if prev is not None else 0.0)
                    changed = True
                    for key in op["keys"]:
                        arrive[key][r] = op["ready"]
                        if key[0] == "coll":
                            cost[key][r] = op_cost(cl, op, r, byte_scale)
                        else:
                            peer = key[2] if key[1] == r else key[1]
                            msgs, nbytes = (op["to"] if key[1] == r else op["frm"])[peer]
                            alpha, beta = link(cl, key[1], key[2])
                            cost[key][r] = alpha + nbytes / msgs * byte_scale / beta
                        if len(arrive[key]) == len(need[key]):
                            ends[key] = max(arrive[key].values()) + max(cost[key].values())
                if op["ready"] is not None and all(k in ends for k in op["keys"]):
                    op["end"] = max(ends[k] for k in op["keys"]) if op["keys"] else op["ready"] + cl["call_s"]
                    if op["row"] == 0 and op["op"] not in P2P and any(late(k, r) for k in op["keys"]):
                        op["end"] += cl.get("lag_s", 0.0)  # the late member of a blocking collective (late())
                    if op["row"] == 1:
                        dated.append(op)
                    out[r]["spans"].append((op["ready"], op["end"] - op["ready"], "comm", op["name"], op["row"]))
                    changed = True
            pending[:] = [op for op in pending if op["end"] is None]

    def schedule(states):
        """Shared cores as the OS hands them out: a rank that computes, or whose wait has ended, takes
        a free core or queues for one; one whose slice (quantum) is over goes to the back of the
        queue if a rank waits there. So a rank whose message is in still waits until a core frees."""
        for r in [r for r in oncore if states[r] not in ("run", "wake")]:
            del oncore[r]  # it blocks or is done: its core is free
        queue[:] = [r for r in queue if states[r] in ("run", "wake")]
        queue.extend(r for r in range(n) if states[r] in ("run", "wake") and r not in oncore and r not in queue)
        over = sorted((r for r in oncore if oncore[r] <= now + 1e-15), key=lambda r: oncore[r])
        for r in over[:len(queue) - (cl["cores"] - len(oncore))]:  # as many as the queue lacks free cores for
            del oncore[r]
            queue.append(r)
        while queue and len(oncore) < cl["cores"]:
            oncore[queue.pop(0)] = now + cl["quantum"]

    def advance(r):
        """Run rank r's program from now until it computes or blocks."""
        prog = progs[r]
        while pc[r] < len(prog):
            kind, *rest = prog[pc[r]]
            if kind == "compute":
                if left[r] is None:
                    flops, ops, _, nbytes = rest
                    left[r] = flops * flop_scale / cl["flops"] + ops * cl["op_s"] + nbytes / cl["mem_bw"]
                    started[r] = now
                if left[r] > 1e-15:
                    return "run"
                out[r]["spans"].append((started[r], now - started[r], "compute", rest[2], 0))
                left[r] = started[r] = None
            else:
                op = rest[0]
                if kind in ("post", "sync") and op["issued"] is None:
                    op.update(issued=now, row=1 if kind == "post" else 0)
                    pending.append(op)
                    settle()
                if kind in ("sync", "wait"):
                    if op["end"] is None or op["end"] > now + 1e-15:
                        if started[r] is None:
                            started[r] = now
                        return "block"
                    if sharing and r not in oncore:
                        return "wake"  # its op has ended; it returns from the wait once it holds a core
                    if started[r] is not None and now > started[r]:
                        out[r]["blocked"] += now - started[r]
                        if kind == "wait":
                            out[r]["spans"].append((started[r], now - started[r], "wait", "wait " + op["name"], 0))
                    started[r] = None
            pc[r] += 1
        out[r]["end"] = now
        return "done"

    while True:
        states = [advance(r) if out[r]["end"] is None else "done" for r in range(n)]
        if all(s == "done" for s in states):
            break
        # on shared cores an async op's thread (the copies, the reduction) takes a share as compute does
        moving = [op for op in dated if op["ready"] <= now < op["end"]] if sharing else []
        if sharing:
            schedule(states)
            if any(states[r] == "wake" for r in oncore):
                continue  # it returns from its wait now
        running = [r for r in (oncore if sharing else range(n)) if states[r] == "run"]
        rate = 1.0 if not sharing else min(1.0, cl["cores"] / max(1, len(oncore) + len(moving)))
        rate *= cl["speed"] if sharing and n > cl["cores"] else 1.0  # more ranks than cores: switching
        times = [now + left[r] / rate for r in running]
        times += [end for end in oncore.values() if queue and end > now]  # a slice ends, a waiting rank gets on
        times += [t for op in dated for t in (op["ready"], op["end"]) if t > now]
        for r in range(n):
            if states[r] == "block":
                op = progs[r][pc[r]][1]
                if op["end"] is not None:
                    times.append(op["end"])
        if not times:
            stuck = [f"rank {r} at {progs[r][pc[r]][1]['name']!r}" for r in range(n) if states[r] == "block"]
            raise TraceError("the replay deadlocks (a trace cut short, or mismatched ops): " + ", ".join(stuck))
        t = max(min(times), now)
        for r in running:
            left[r] -= (t - now) * rate
            out[r]["busy"] += t - now  # wall time computing, slowed or not by sharing a core
        now = t
        dated[:] = [op for op in dated if op["end"] > now]
    return out


def summary(out, flops_model=None, peak=None):
    step = max(o["end"] for o in out)
    row = dict(step_s=step, busy_s=[o["busy"] for o in out], idle_s=[step - o["busy"] for o in out],
               exposed_s=[o["blocked"] for o in out], waiting=statistics.mean(o["blocked"] / step for o in out))
    if flops_model and peak:
        row["mfu"] = flops_model / (step * len(out) * peak)
    return row


def as_trace(out, info):
    """The replayed timeline as a Chrome trace that trace_timeline.draw() draws."""
    events = [dict(name=name, cat=cat, ph="X", ts=1e6 * t0, dur=1e6 * d, pid=r, tid=row, args=dict(step=0))
              for r, o in enumerate(out) for t0, d, cat, name, row in o["spans"]]
    events += [dict(name="step 0", cat="step", ph="X", ts=0, dur=1e6 * o["end"], pid=r, tid=0, args=dict(step=0))
               for r, o in enumerate(out)]
    return dict(traceEvents=events, otherData=info)


# ----------------------------------------------------------------------------- measured, and calibration

def step_lengths(trace):
    """Each timed step's length (its slowest rank's), seconds."""
    length, timed = {}, set(timed_steps(trace))
    for e in trace["traceEvents"]:
        if e.get("cat") == "step" and e["args"]["step"] in timed:
            length[e["args"]["step"]] = max(length.get(e["args"]["step"], 0), e["dur"] / 1e6)
    return [length[k] for k in sorted(length)]


def measured_step(measured):
    return max(length for _, length, _ in measured) / 1e6


def measured_waiting(measured):
    """Per rank, the share of its step spent blocked in a collective or a wait (main row)."""
    shares = []
    for _, length, evs in measured:
        blocked = sum(e["dur"] for e in evs if e["tid"] == 0 and e["cat"] in ("comm", "wait"))
        shares.append(blocked / length)
    return statistics.mean(shares)


def stretches(progs, measured):
    """(flops, ops, bytes, seconds) of every compute stretch as measured: from the end of the item before
    it (a collective, a wait, a post; or the step's start) to the start of the one after."""
    rows = []
    for prog, (start, length, _) in zip(progs, measured):
        for i, item in enumerate(prog):
            if item[0] == "compute":
                t0 = prog[i - 1][3] if i > 0 else start
                t1 = prog[i + 1][2] if i + 1 < len(prog) else start + length
                if t1 > t0:
                    rows.append((item[1], item[2], item[4], (t1 - t0) / 1e6))
    return rows


def link_samples(progs, measured):
    """(messages, bytes, seconds) of every matched op: from its last member's start to its end."""
    starts = {}
    instances(progs)
    for prog in progs:
        for kind, *rest in prog:
            if kind in ("post", "sync"):
                op = rest[0]
                e = op["event"]
                for key in op["keys"]:
                    s = starts.setdefault(key, dict(t0=[], t1=[], msgs=0, bytes=0))
                    s["t0"].append(e["ts"])
                    s["t1"].append(e["ts"] + e["dur"])
                    for tally in (op["to"], op["frm"]):
                        m = sum(v[0] for v in tally.values())
                        b = sum(v[1] for v in tally.values())
                        if key[0] == "msg" and m:
                            m, b = 1, b / m
                        s["msgs"], s["bytes"] = max(s["msgs"], m), max(s["bytes"], b)
    return [(s["msgs"], s["bytes"], (min(s["t1"]) - max(s["t0"])) / 1e6) for s in starts.values()
            if min(s["t1"]) > max(s["t0"])]


def lag_samples(progs):
    """(seconds,) of every blocking collective whose members did not arrive at once: how much
    later than the first member to leave the last one to arrive left (replay's late())."""
    instances(progs)
    got = {}
    for prog in progs:
        for kind, *rest in prog:
            if kind == "sync" and rest[0]["op"] not in P2P:
                e = rest[0]["event"]
                for key in rest[0]["keys"]:
                    got.setdefault(key, []).append((e["ts"], e["ts"] + e["dur"]))
    return [((max(m)[1] - min(t1 for _, t1 in m)) / 1e6,) for m in got.values()
            if len(m) > 1 and max(m)[0] > min(m)[0]]


def nonneg_fit(rows):
    """Least squares of the last column on the others, no coefficient below zero (drop, refit)."""
    import numpy as np
    X = np.array([r[:-1] for r in rows], dtype=float)
    y = np.array([r[-1] for r in rows], dtype=float)
    keep = list(range(X.shape[1]))
    while True:
        coef = np.zeros(X.shape[1])
        sol = np.linalg.lstsq(X[:, keep], y, rcond=None)[0]
        if (sol >= 0).all():
            coef[keep] = sol
            return coef
        keep = [k for k, c in zip(keep, sol) if c > 0]


def samples(trace):
    """-> (compute stretches, link samples) of a trace, each the median of its traced steps (the same
    program every step, item by item), as the measured step is their median: a rank descheduled by
    other work in one step moves neither."""
    comp, wire, lag = [], [], []
    for step in timed_steps(trace):
        _, progs, meas = programs(trace, step)
        comp.append(stretches(progs, meas))
        wire.append(link_samples(progs, meas))
        lag.append(lag_samples(progs))
    middle = [[(*rows[0][:-1], statistics.median(x[-1] for x in rows)) for rows in zip(*every)]
              for every in (comp, wire) if all(len(rows) == len(every[0]) for rows in every)]
    if len(middle) < 2:  # steps that differ (a run whose program changes): every sample as it is
        middle = [sum(comp, []), sum(wire, [])]
    return middle + [sum(lag, [])]  # which member is late changes from step to step: all of them


def calibrate(runs):
    """F, M and op_s from the compute stretches; call_s, alpha and 1/beta from the ops' times; lag_s,
    the mean lag of a blocking collective's late member. runs: samples() of each trace."""
    inv_f, op_s, inv_mem = nonneg_fit([row for comp, _, _ in runs for row in comp])
    call_s, alpha, inv_beta = nonneg_fit([(1.0, *row) for _, wire, _ in runs for row in wire])
    lags = [row[0] for _, _, lag in runs for row in lag]
    beta = 1 / inv_beta if inv_beta > 0 else 1e12
    return dict(flops=1 / inv_f if inv_f > 0 else 1e15, mem_bw=1 / inv_mem if inv_mem > 0 else math.inf, op_s=op_s,
                call_s=call_s, alpha=alpha, beta=beta,
                lag_s=max(0.0, statistics.mean(lags)) if lags else 0.0,
                alpha_x=alpha, beta_x=beta)


# ----------------------------------------------------------------------------- the check on this machine

RUNS = [  # (label, module, flags or {world: flags}): every strategy, and the pipeline's five schedules
    ("ddp bucketed", "ddp", ["--overlap=False", "--bucket_mb=0.5"]),
    ("ddp overlap", "ddp", ["--overlap=True", "--bucket_mb=0.5"]),
    ("fsdp zero3", "fsdp", []),
    ("tensor", "tensor_parallel", []),
    ("tensor sp", "tensor_parallel", ["--sequence_parallel=True"]),
    ("context ring", "context_parallel", []),
    ("experts", "expert_parallel", ["--n_expert=4", "--top_k=2"]),
    ("pipeline gpipe", "pipeline_parallel", ["--schedule=gpipe", "--n_micro=8"]),
    ("pipeline 1f1b", "pipeline_parallel", ["--schedule=1f1b", "--n_micro=8"]),
    ("pipeline interleaved", "pipeline_parallel", ["--schedule=interleaved", "--n_micro=8"]),
    ("pipeline zb", "pipeline_parallel", ["--schedule=zb", "--n_micro=8"]),
    ("pipeline zbv", "pipeline_parallel", ["--schedule=zbv", "--n_micro=8"]),
    ("mesh tp x dp", "parallel_nd", {2: ["--dp_replicate=1", "--tp=2"], 4: ["--dp_replicate=2", "--tp=2"]}),
]
COMMON = ["--model=tiny", "--batch_size=32", "--block_size=64", "--dtype=float32", "--eval_interval=0",
          "--log_interval=0", "--max_iters=7", "--trace_steps=2-6"]


def traced_all(rank, world, runs, data_dir, out, common=None):
    """On pooled ranks (tests/harness.py): every run's main() with --trace, one after another;
    -> {label: the error line of a run that refused, or None}."""
    import importlib
    import model as M
    M.PRESETS.update(THIN)  # the what-ifs' shapes: a model's depth at a width every split divides
    errors = {}
    for name, module, flags in runs:
        path = os.path.join(out, f"{name}_{world}.json".replace(" ", "_"))
        flags = flags.get(world, []) if isinstance(flags, dict) else flags  # flags by world size
        try:
            importlib.import_module(module).main((common or COMMON) + [f"--data_dir={data_dir}", *flags,
                                                                      f"--trace={path}"])
            errors[name] = None
        except SystemExit as e:
            errors[name] = f"refused (exit {e.code})"
    return errors


def run_traces(runs, worlds, folder, common=None, timeout=600):
    """Trace every run at every world size in pooled ranks, once per world; a trace already in
    `folder` is reused. -> {(label, world): trace}, printing a line for each run that failed."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from conftest import make_dataset
    from harness import spawn
    from trace_replay import traced_all  # the ranks find it by its module's name, not __main__
    data = make_dataset(os.path.join(folder, "data"))
    got = {}
    for world in worlds:
        path = {name: os.path.join(folder, f"{name}_{world}.json".replace(" ", "_")) for name, _, _ in runs}
        todo = [r for r in runs if not os.path.exists(path[r[0]])]
        errors = dict.fromkeys(path)
        errors.update(spawn(traced_all, world, todo, data, folder, common, timeout=timeout)[0] if todo else {})
        for name in path:
            if errors[name]:
                print(f"{name:>21} {world:>5}  {errors[name]}", flush=True)
            else:
                got[(name, world)] = load(path[name])
    return got


def check(args, folder):
    """Predicted against measured on this machine -> (records, {(label, world): (programs, measured)}, fit)."""
    runs = [r for r in RUNS if not args.only or any(o in r[0] for o in args.only)]
    traces = run_traces(runs, args.worlds, folder, timeout=args.timeout)
    got = {key: programs(trace)[1:] for key, trace in traces.items()}
    two = {k: samples(traces[k]) for k in got if k[1] == 2}
    if not two:
        raise TraceError("no run at 2 ranks to calibrate on")
    here_all = calibrate(list(two.values()))
    print(f"calibrated on the {len(two)} runs at 2 ranks (each 2-rank row below on the others only): "
          f"F {here_all['flops'] / 1e9:.1f} GFLOP/s, {1e6 * here_all['op_s']:.1f} us an op, "
          f"memory {here_all['mem_bw'] / 1e9:.1f} GB/s, "
          f"{1e6 * here_all['call_s']:.0f} us a call, a late member {1e6 * here_all['lag_s']:.0f} us, "
          f"alpha {1e6 * here_all['alpha']:.0f} us, "
          f"beta {here_all['beta'] / 1e9:.2f} GB/s; {os.cpu_count()} cores shared, load average "
          f"{os.getloadavg()[0]:.1f} at the end")
    records, slices = [], time_slices(got, traces, here_all)
    print(f"{'run':>21} {'ranks':>5} {'predicted ms':>12} {'measured ms':>11} {'(its steps)':>17} {'ratio':>6} "
          f"{'waiting: predicted':>18} {'measured':>8}")
    for (name, world), (progs, meas) in got.items():
        fit = calibrate([v for k, v in two.items() if k != (name, world)]) if world == 2 and len(two) > 1 else here_all
        row = summary(replay(progs, cluster("here", **fit, **slices.get((name, world), {}))))
        lengths = step_lengths(traces[(name, world)])
        m = statistics.median(lengths)
        rec = dict(run=name, strategy=name.split()[0], ranks=world, predicted_ms=1e3 * row["step_s"],
                   measured_ms=1e3 * m, measured_steps_ms=[round(1e3 * x, 1) for x in lengths],
                   ratio=row["step_s"] / m, waiting_predicted=row["waiting"], waiting_measured=measured_waiting(meas),
                   calibrated_on="the other 2-rank runs" if world == 2 else
                   "every 2-rank run; the cores' speed and slices on the other 4-rank runs",
                   **slices.get((name, world), {}))
        records.append(rec)
        spread = f"{1e3 * min(lengths):.0f}-{1e3 * max(lengths):.0f}"
        print(f"{name:>21} {world:>5} {rec['predicted_ms']:>12.1f} {rec['measured_ms']:>11.1f} {spread:>17} "
              f"{rec['ratio']:>6.2f} {rec['waiting_predicted']:>18.2f} {rec['waiting_measured']:>8.2f}", flush=True)
    for world in args.worlds:
        mine = [r for r in records if r["ranks"] == world]
        if mine:
            worst = max(mine, key=lambda r: abs(r["ratio"] - 1))
            idle = max((r for r in mine if r["strategy"] == "pipeline"),
                       key=lambda r: abs(r["waiting_predicted"] - r["waiting_measured"]), default=None)
            print(f"worst at {world} ranks: {worst['run']}, {100 * (worst['ratio'] - 1):+.0f}%"
                  + (f"; the schedules' waiting share at most {abs(idle['waiting_predicted'] - idle['waiting_measured']):.2f}"
                     f" off ({idle['run']})" if idle else ""))
    return records, got, here_all


def time_slices(got, traces, fit, n=None):
    """Where more ranks than cores run, how the OS hands the cores out: the speed a core keeps
    (switching between ranks, caches the others filled), fitted on the steps, and the slice a rank
    runs before the next one in the queue gets its core (quantum), fitted on the waiting shares (a
    rank whose message is in waits for a core: the longer the slice, the longer the wait). For each
    such run, the values (on grids) at which the *other* runs of its world size are predicted, in
    the median, at what they measured. -> {(label, world): dict(speed=, quantum=)}"""
    n = n or os.cpu_count()
    speeds = [0.5 + i / 40 for i in range(21)]
    quanta = [5e-4 * 2 ** (i / 4) for i in range(27)]  # 0.5 to 45 ms
    out = {}
    for world in sorted({w for _, w in got if w > n}):
        keys = [k for k in got if k[1] == world]

        def fitted(k, grid, miss):  # the grid's value at which the other runs miss least, in the median
            others = [o for o in keys if o != k] or [k]
            return min(grid, key=lambda v: abs(statistics.median(miss[o][grid.index(v)] for o in others)))

        def at(k, **slices):
            return summary(replay(got[k][0], cluster("here", **dict(fit, cores=n, **slices))))

        measured = {k: statistics.median(step_lengths(traces[k])) for k in keys}
        step = {k: [math.log(at(k, speed=s)["step_s"] / measured[k]) for s in speeds] for k in keys}  # the default slice
        for k in keys:
            out[k] = dict(speed=fitted(k, speeds, step))
        speed = statistics.median(out[k]["speed"] for k in keys)
        wait = {k: [at(k, speed=speed, quantum=q)["waiting"] - measured_waiting(got[k][1]) for q in quanta]
                for k in keys}
        for k in keys:
            out[k]["quantum"] = fitted(k, quanta, wait)
        quantum = statistics.median(out[k]["quantum"] for k in keys)
        print(f"at {world} ranks on {n} cores: a core runs at {speed:.2f} of its speed (switching between ranks), "
              f"handed out in slices of {1e3 * quantum:.1f} ms (each {world}-rank row below fitted on the other "
              f"{world}-rank runs)")
    return out


# ----------------------------------------------------------------------------- what-ifs

def zero_bubble_rows(got, here):
    """p = 4, m = 8: the measured traces replayed with a core a stage, beside simulate()'s paper figures."""
    from pipeline_parallel_bubble import on_paper
    keys = {name: (f"pipeline {name}", 4) for name in ("1f1b", "zb", "zbv")}
    if not all(k in got for k in keys.values()):
        return
    step = {name: summary(replay(got[k][0], cluster("here", **dict(here, cores=4))))["step_s"]  # no queue: no slices
            for name, k in keys.items()}
    paper = on_paper(4, 8, 4, 8, 4, 4)  # a micro-batch's F 1, B 2 (B 1 + W 1) a stage, ZB-V's chunks half
    print("p = 4, m = 8 on a core a stage (the 4-rank traces above replayed with 4 cores; on paper: simulate() at "
          "F 1, B 2, or B 1 + W 1):")
    for name in ("zb", "zbv"):
        print(f"  {name:>4}: {step[name] / step['1f1b']:.2f} of 1F1B's step replayed "
              f"({1e3 * step[name]:.1f} against {1e3 * step['1f1b']:.1f} ms), {paper[name]:.2f} on paper")


# The what-ifs' traces: the model's depth at a width (64, 16 heads) that 8 and 16 ranks split every way;
# each stretch's FLOPs and each message's bytes are scaled to the model's width (scale())
THIN = {"gpt2-thin": dict(n_layer=12, n_head=16, n_embd=64, block_size=64),
        "1.7b-thin": dict(n_layer=24, n_head=16, n_embd=64, block_size=64)}
# (label, preset traced, the shape replayed, sequences a GPU, the published figure beside it)
TARGETS = [("GPT-2 124M", "gpt2-thin", dict(n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab_size=50304),
            8, None),
           ("GPT-3-like 1.7B", "1.7b-thin", dict(n_layer=24, n_head=16, n_embd=2048, block_size=4096,
                                                 vocab_size=131072), 4,
            "Megatron-Core 1.7B, 48 x H100, dp 48, 4 x 4096 a GPU: 41.0% (bench/published_runs.json)")]
WHAT_IF_RUNS = [("ddp", "ddp", ["--overlap=True"]), ("fsdp", "fsdp", []), ("tensor", "tensor_parallel", []),
                ("pipeline 1f1b", "pipeline_parallel", ["--schedule=1f1b", "--n_micro=16"]), ("context", "context_parallel", [])]


def scale(trace, target, seqs_per_rank):
    """(flop_scale, byte_scale, the model's FLOPs a step) to replay `trace` at the `target` shape
    (a GPTConfig's fields) with seqs_per_rank sequences a rank: the model formula's FLOPs a step over
    the trace's; parameter messages (DDP, FSDP) by the parameter ratio, the rest by h x tokens."""
    import model as M
    info = trace["otherData"]
    src, dst = M.GPTConfig(**info["model"]), M.GPTConfig(**target)
    if src.n_layer != dst.n_layer:
        raise TraceError(f"the trace has {src.n_layer} layers and the target {dst.n_layer}: trace it at the "
                         f"target's depth (only the width is scaled)")
    tokens_src = info["batch_size"] * src.block_size
    tokens_dst = seqs_per_rank * info["world"] * dst.block_size
    flops = M.flops_per_token(dst) * tokens_dst
    flop_scale = flops / (M.flops_per_token(src) * tokens_src)
    if info["strategy"] in PARAM_SYNC:
        byte_scale = M.param_count(dst) / M.param_count(src)
    else:
        byte_scale = dst.n_embd * tokens_dst / (src.n_embd * tokens_src)
    return flop_scale, byte_scale, flops


def what_if(args, folder):
    import plan_cluster as PC
    print("What-ifs on H100s (a calculation from the traces taken here, not a measurement): "
          f"{PC.CLUSTERS['H100']['peak'] / 1e12:.0f} TFLOP/s x eff {PC.EFF} (plan_cluster.py's, fitted on "
          f"Narayanan et al.), NVLink {PC.CLUSTERS['H100']['nvlink_bw'] / 1e9:.0f} GB/s a GPU, "
          f"{PC.CLUSTERS['H100']['ib_bw'] / 1e9:.0f} GB/s a GPU across nodes, NCCL's latencies; no host cost an op, "
          "bf16 bytes counted as the trace's (float32)")
    print(f"{'model':>16} {'run':>14} {'GPUs':>6} {'step ms':>9} {'MFU':>6} {'exposed comm ms':>15}  "
          f"{'assumed':<40} published")
    for label_, preset, target, seqs, published in TARGETS:
        common = ["--model=" + preset, "--batch_size=16", "--block_size=64", "--dtype=float32", "--eval_interval=0",
                  "--log_interval=0", "--max_iters=4", "--trace_steps=2-3"]
        runs = [r for r in WHAT_IF_RUNS if not args.only or any(o in r[0] for o in args.only)]
        for world, layout in ((8, "8"), (16, "2 x 8")):
            traces = run_traces([(f"{preset} {n}", m, f) for n, m, f in runs], [world], folder, common, args.timeout)
            for name, _, _ in runs:
                key = (f"{preset} {name}", world)
                if key not in traces:
                    continue
                trace = traces[key]
                flop_scale, byte_scale, flops = scale(trace, target, seqs)
                cl = cluster("h100")
                assumed = (f"calculated: {cl['flops'] / 1e12:.0f} TFLOP/s, NVLink {cl['beta'] / 1e9:.0f} GB/s"
                           + (f", NICs {cl['beta_x'] / 1e9:.0f} GB/s a GPU" if world > cl["per_node"] else ""))
                row = summary(replay(programs(trace, world=world)[1], cl, flop_scale, byte_scale), flops, cl["peak"])
                print(f"{label_:>16} {name:>14} {layout:>6} {1e3 * row['step_s']:>9.1f} {100 * row['mfu']:>5.1f}% "
                      f"{1e3 * max(row['exposed_s']):>15.2f}  {assumed:<40} {published if name == 'ddp' and published else '-'}",
                      flush=True)
    print("(each row: its traced step at the model's depth and width 64, scaled to the shape; "
          + ", ".join(f"{t[0]}: {t[3]} sequences of {t[2]['block_size']} a GPU" for t in TARGETS) + ")")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("trace", nargs="?", help="a --trace file to replay")
    p.add_argument("--cluster", default="here", help="here or h100 (8 a node)")
    for k, what in (("flops", "FLOP/s a rank"), ("mem_gbs", "memory GB/s a rank"), ("op_us", "host us an op"),
                    ("call_us", "host us a call"),
                    ("alpha_us", "latency inside a node, us"), ("beta_gbs", "GB/s inside a node"),
                    ("alpha_x_us", "latency across nodes, us"), ("beta_x_gbs", "GB/s across nodes")):
        p.add_argument(f"--{k}", type=float, help=what)
    p.add_argument("--per_node", type=int, help="ranks a node")
    p.add_argument("--nodes", type=int, default=1, help="nodes (h100: the cluster has nodes x per_node ranks)")
    p.add_argument("--cores", type=int, help="cores the ranks share (0: one each)")
    p.add_argument("--slice_ms", type=float, help="shared cores: ms a rank runs before the next in the queue")
    p.add_argument("--speed", type=float, help="shared cores, more ranks than cores: the share of its speed a core keeps")
    p.add_argument("--step", type=int, help="the traced step to replay (default: the median one)")
    p.add_argument("--png", help="draw the replayed timeline here (as trace_timeline.py)")
    p.add_argument("--check", action="store_true", help="predicted against measured on this machine")
    p.add_argument("--what_if", action="store_true", help="the same programs on 8 and 2 x 8 H100s")
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    p.add_argument("--only", nargs="+", help="--check: only the runs whose label holds one of these")
    p.add_argument("--data_dir", default="")
    p.add_argument("--timeout", type=int, default=600, help="--check: seconds for each world size's runs")
    p.add_argument("--json", help="--check: write a record per run here")
    p.add_argument("--keep", help="--check: keep the traces in this folder, and reuse those already there")
    args = p.parse_args(argv)
    try:
        if args.check or args.what_if:
            with tempfile.TemporaryDirectory() as tmp:
                folder = args.keep or tmp
                if args.check:
                    records, got, here = check(args, folder)
                    zero_bubble_rows(got, here)
                    if args.json:
                        with open(args.json + ".tmp", "w") as f:
                            json.dump(records, f, indent=1)
                        os.replace(args.json + ".tmp", args.json)
                if args.what_if:
                    what_if(args, folder)
            return
        if not args.trace:
            p.error("give a trace, or --check")
        over = dict(flops=args.flops, per_node=args.per_node, cores=args.cores, speed=args.speed,
                    quantum=None if args.slice_ms is None else args.slice_ms * 1e-3,
                    **{k: (None if v is None else v * 1e-6) for k, v in
                       dict(op_s=args.op_us, call_s=args.call_us, alpha=args.alpha_us, alpha_x=args.alpha_x_us).items()},
                    **{k: (None if v is None else v * 1e9) for k, v in
                       dict(beta=args.beta_gbs, beta_x=args.beta_x_gbs, mem_bw=args.mem_gbs).items()})
        cl = cluster(args.cluster, **over)
        trace = load(args.trace)
        info = trace.get("otherData", {})
        world = None if args.cluster == "here" else args.nodes * cl["per_node"]
        step, progs, meas = programs(trace, args.step, world)
        out = replay(progs, cl)
        flops = None
        if cl["peak"] and "model" in info:  # the model's FLOPs a step, as the log's MFU counts them
            import model as M
            flops = M.flops_per_token(M.GPTConfig(**info["model"])) * info["batch_size"] * info["model"]["block_size"]
        row = summary(out, flops, cl["peak"])
        print(f"{info.get('strategy', '?')} on {len(progs)} ranks, step {step}: predicted {1e3 * row['step_s']:.2f} ms"
              + (f", MFU {100 * row['mfu']:.1f}%" if "mfu" in row else "")
              + f" (measured {1e3 * measured_step(meas):.2f} ms where it was traced)")
        for r in range(len(progs)):
            print(f"  rank {r}: busy {1e3 * row['busy_s'][r]:.2f} ms, idle {1e3 * row['idle_s'][r]:.2f} ms, "
                  f"exposed communication {1e3 * row['exposed_s'][r]:.2f} ms")
        if args.png:
            try:
                import matplotlib  # noqa: F401
            except ImportError:
                raise TraceError("--png needs matplotlib (pip install matplotlib)")
            timeline.draw([as_trace(out, info)], args.png, titles=[f"{info.get('strategy', '')} replayed on "
                                                                   f"{args.cluster}"])
    except TraceError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
