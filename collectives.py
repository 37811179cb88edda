"""
Collectives by hand: broadcast, reduce, all_reduce, scatter, gather, all_gather,
reduce_scatter and all_to_all on nothing but point-to-point messages (isend/irecv,
posted together with batch_isend_irecv). The signatures mirror torch.distributed's
tensor forms, so `C.all_reduce(t)` and `dist.all_reduce(t)` can be swapped and compared.
src/dst are GLOBAL ranks; op is "sum", "avg", "max", "min" or a dist.ReduceOp; avg is
sum then divide, and is refused (ValueError) for integer tensors rather than rounded.

Costs below are in the alpha-beta model of FORMULAS.md: a message of S bytes costs
alpha + S/beta, reducing S bytes costs S*gamma, N is the number of ranks.

Every algorithm is a list of steps (sends, recvs, then): post the step's messages
together, wait for them, call then() (say, add what arrived). _run is the one place that
posts messages, and it may keep several steps on the wire at once: that is how the
rings overlap the wire with the adder.

`torchrun --nproc_per_node=4 collectives.py` times each one against the built-in.
"""
import atexit
import contextlib
import functools
import os
import queue
import threading
from collections import defaultdict, deque

import torch
import torch.distributed as dist

# Tuning knobs, measured with the benchmark below (gloo ranks on 2 CPU cores, where alpha
# is a thread wake-up: ~0.1 ms idle, milliseconds under load). There the tree all_reduce
# beat the ring up to 4-8 MB; 64 KB keeps the tree for small messages only, the split
# that the training scripts' traffic tests assume.
SMALL_ALL_REDUCE_BYTES = 64 << 10  # all_reduce below this size: tree reduce + tree broadcast
LARGE_REDUCE_BYTES = 32 << 20      # reduce from this size on: ring reduce-scatter + gather
SEGMENT_BYTES = 4 << 20            # rings cut each chunk into segments of at most this size
PIPELINE_DEPTH = 2                 # and keep this many in flight: one moves while one is reduced

# ----------------------------------------------------------------------------- process group

_we_created_group = False


def init_distributed():
    """-> (rank, world_size, local_rank, device). The one place the backend is chosen."""
    global _we_created_group
    cuda, local_rank = torch.cuda.is_available(), int(os.environ.get("LOCAL_RANK", 0))
    if cuda:
        torch.cuda.set_device(local_rank)  # before NCCL starts, or every rank lands on GPU 0
    if not _initialized() and "WORLD_SIZE" in os.environ:  # torchrun; plain `python x.py`: no group
        if cuda:  # device_id makes NCCL create its communicator now, with every rank present
            dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
        else:
            dist.init_process_group("gloo")
        _we_created_group = True
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    return get_rank(), get_world_size(), local_rank, device


def shutdown():
    """Stop the async worker; destroy the process group only if init_distributed made it."""
    global _we_created_group
    _stop_worker()
    if _we_created_group and _initialized():
        dist.destroy_process_group()
    _we_created_group = False


def _initialized():
    return dist.is_available() and dist.is_initialized()


def get_rank(group=None):
    return dist.get_rank(group) if _initialized() else 0


def get_world_size(group=None):
    return dist.get_world_size(group) if _initialized() else 1


def _members(group):
    """-> (my index in the group, group size, global rank of each index). No group at all: one rank."""
    if not _initialized():
        return 0, 1, [0]
    me = dist.get_rank(group)
    if me < 0:
        raise ValueError("this rank is not a member of the group")
    return me, dist.get_world_size(group), dist.get_process_group_ranks(group)


def _index_of(root, ranks, what):
    if root not in ranks:
        raise ValueError(f"{what}={root} is not a (global) rank of the group {ranks}")
    return ranks.index(root)

# ----------------------------------------------------------------------------- byte accounting

_bytes = defaultdict(int)  # op name -> payload bytes this rank has sent
_untracked_depth = 0
_charge_to = None          # name of the op now running, None if untracked (one op runs at a time)


def bytes_sent():
    return sum(_bytes.values())


def bytes_by_op():
    return dict(_bytes)


def reset_bytes():
    _bytes.clear()


@contextlib.contextmanager
def untracked():
    """Ops issued inside this block are not counted (the training logs' own gathers, say)."""
    global _untracked_depth
    _untracked_depth += 1
    try:
        yield
    finally:
        _untracked_depth -= 1

# ----------------------------------------------------------------------------- the engine

# For NCCL: batch_isend_irecv is one NCCL group call, so a step's sends and receives start
# together and two neighbours sending to each other cannot deadlock (gloo's isend never
# blocks). NCCL has no tags: messages between two ranks match in posting order, and both
# sides of every algorithm here post in the same order. The first p2p call on a group
# must involve all its ranks unless the communicator exists already (init_distributed
# creates it eagerly). work.wait() on NCCL makes the current stream wait for the transfer
# instead of blocking the CPU, so a then() that reduces is ordered after its receive.

def _post(step, group):
    sends, recvs, _ = step
    ops = [dist.P2POp(dist.irecv, t, peer, group) for t, peer in recvs if t.numel()]
    ops += [dist.P2POp(dist.isend, t, peer, group) for t, peer in sends if t.numel()]
    if _charge_to is not None:
        _bytes[_charge_to] += sum(t.numel() * t.element_size() for t, _ in sends)
    return dist.batch_isend_irecv(ops) if ops else []


def _run(steps, group, depth=1):
    """Run the steps in order with up to `depth` of them posted: step i's then() runs while
    steps i+1.. are already moving. So a step may only send what a then() at least `depth`
    steps earlier produced (the rings keep depth <= segments per chunk to guarantee it)."""
    posted = deque(_post(steps[i], group) for i in range(min(depth, len(steps))))
    for i, (_, _, then) in enumerate(steps):
        for work in posted.popleft():
            work.wait()
        if then is not None:
            then()
        if i + depth < len(steps):
            posted.append(_post(steps[i + depth], group))


def _pieces(t, parts):
    """Cut flat t into `parts` contiguous views whose sizes differ by at most one element."""
    q, r = divmod(t.numel(), parts)
    starts = [i * q + min(i, r) for i in range(parts + 1)]
    return [t[starts[i]:starts[i + 1]] for i in range(parts)]

# ----------------------------------------------------------------------------- algorithms

# Ring reduce-scatter: cut the data in N chunks. In step s rank r passes its partial sum
# of chunk r-s-1 to the right and adds the partial of chunk r-s-2 arriving from the left;
# after N-1 steps rank r holds chunk r summed over all. Cost (N-1)alpha + (N-1)/N S/beta
# + (N-1)/N S gamma: each rank sends (N-1)/N S, the least possible, since it must receive
# that much it does not have; but the alphas grow with N.
# Pipelining, as gloo's own ring does it: chunks are cut into segments and while one is
# being added the next is on the wire, about max(wire, adder) instead of their sum, for
# more alphas. Measured here: 4 MB segments. Smaller ones lost, as each costs ~0.2 ms of
# CPU (Python, gloo's handshake, wake-ups), and 4 ranks on 2 cores have no idle wire to
# overlap with; at 2 ranks (a core each) splitting a 8 MB chunk in two won ~15%.

def _ring_reduce_scatter(src, me, n, left, right, combine, mine=None):
    """-> (steps, depth). Rank me ends with chunk me reduced: in place in src if mine is None
    (all_reduce), else src is only read, partials pass through two scratch chunks and the
    result lands in `mine`."""
    chunks = _pieces(src, n)
    if mine is None:
        out = lambda s, c: chunks[c]  # noqa: E731
    else:
        scratch = [torch.empty_like(chunks[0]) for _ in range(min(2, n - 2))]
        out = lambda s, c: mine if s == n - 2 else scratch[s % 2][:chunks[c].numel()]  # noqa: E731
    nseg = max(1, -(-chunks[0].numel() * src.element_size() // SEGMENT_BYTES))
    depth = min(PIPELINE_DEPTH, nseg)
    tmps = [torch.empty_like(_pieces(chunks[0], nseg)[0]) for _ in range(depth)]
    steps = []
    for s in range(n - 1):
        c_send, c_recv = (me - s - 1) % n, (me - s - 2) % n
        send = chunks[c_send] if s == 0 else out(s - 1, c_send)
        for a, b, o in zip(_pieces(send, nseg), _pieces(chunks[c_recv], nseg), _pieces(out(s, c_recv), nseg)):
            tmp = tmps[len(steps) % depth][:b.numel()]
            steps.append(([(a, right)], [(tmp, left)], functools.partial(combine, b, tmp, out=o)))
    return steps, depth


# Ring all-gather: rank r starts with chunk r; in step s it forwards chunk r-s to the right
# and receives chunk r-s-1 from the left straight into place. (N-1)alpha + (N-1)/N S/beta.

def _ring_all_gather(chunks, me, n, left, right):
    nseg = max(1, -(-chunks[0].numel() * chunks[0].element_size() // SEGMENT_BYTES))
    steps = [([(a, right)], [(b, left)], None) for s in range(n - 1)
             for a, b in zip(_pieces(chunks[(me - s) % n], nseg), _pieces(chunks[(me - s - 1) % n], nseg))]
    return steps, min(PIPELINE_DEPTH, nseg)


# Binomial trees, numbered from the root (v = my distance from it). Broadcast: in the round
# of `mask` the ranks v < mask, which have the data, send it to v + mask, so the holders
# double each round: ceil(log2 N) rounds of (alpha + S/beta), N-1 messages of S in all.
# Few alphas, so trees win for small S. (For a huge S on many ranks, scatter + ring
# all-gather, ~2 S/beta, beats log2(N) S/beta; at N=4 here it lost, so broadcast stays a tree.)

def _tree_broadcast(buf, root, me, n, ranks):
    v, steps, mask = (me - root) % n, [], 1
    while mask < n:
        if v < mask and v + mask < n:
            steps.append(([(buf, ranks[(root + v + mask) % n])], [], None))
        elif mask <= v < 2 * mask:
            steps.append(([], [(buf, ranks[(root + v - mask) % n])], None))
        mask <<= 1
    return steps


# Reduce is that tree run backwards: in round `mask` a rank with bit `mask` set hands the
# partial of its subtree to v - mask and is done; the others add the partial of v + mask.
# ceil(log2 N) rounds of (alpha + S/beta + S gamma), all the adding on the way to the root.

def _tree_reduce(src, root, me, n, ranks, combine, acc=None):
    """Partials go to acc (allocated if None and needed), src is only read."""
    v, steps, mask, tmp = (me - root) % n, [], 1, None
    while mask < n:
        if v & mask:
            steps.append(([(src if tmp is None else acc, ranks[(root + v - mask) % n])], [], None))
            break
        if v + mask < n:
            first = tmp is None
            if first:
                tmp = torch.empty_like(src)
                acc = torch.empty_like(src) if acc is None else acc
            steps.append(([], [(tmp, ranks[(root + v + mask) % n])],
                          functools.partial(combine, src if first else acc, tmp, out=acc)))
        mask <<= 1
    return steps


# Scatter and gather: the root talks to each rank directly, all messages in one step.
# (N-1)alpha + (N-1)/N S/beta, all on the root's link, which has to carry (N-1)/N S
# whatever the algorithm: a tree would only save alphas.

def _scatter_step(pieces, mine, root, me, ranks):
    if me == root:
        return [(p, ranks[i]) for i, p in enumerate(pieces) if i != me], [], None
    return [], [(mine, ranks[root])], None


def _gather_step(pieces, mine, root, me, ranks):
    if me == root:
        return [], [(p, ranks[i]) for i, p in enumerate(pieces) if i != me], None
    return [(mine, ranks[root])], [], None

# ----------------------------------------------------------------------------- async

# One background worker thread per process runs the submitted ops in FIFO order, so all
# ranks run their collectives in the order they were called and their messages match. A
# synchronous call runs inline when nothing is queued, else it queues and waits, so it
# never overtakes an async op. On gloo the overlap comes from the thread itself: gloo
# releases the GIL while bytes move, and the main thread computes meanwhile. On CUDA the
# worker runs the op on a side stream that first waits for an event recorded on the
# caller's stream (so it sees finished inputs); wait() makes the caller's current stream
# wait for an event recorded after the op: ordered on the GPU, the CPU does not block.

class Handle:
    def __init__(self, fn, device):
        self._fn, self._device, self._done, self._error, self._event = fn, device, threading.Event(), None, None

    def is_completed(self):
        return self._done.is_set() and (self._event is None or self._event.query())

    def wait(self):
        self._done.wait()
        if self._error is not None:
            raise self._error
        if self._event is not None:
            torch.cuda.current_stream(self._device).wait_event(self._event)
        self._fn = None  # held the tensors until the caller's stream was ordered after the op
        return True


_lock, _queue, _worker, _pending = threading.Lock(), None, None, 0


def _execute(name, tracked, fn):
    global _charge_to
    _charge_to = name if tracked else None
    try:
        fn()
    finally:
        _charge_to = None


def _work_loop(q):
    global _pending
    streams = {}
    while (job := q.get()) is not None:
        name, tracked, fn, device, ready, handle = job
        try:
            if ready is None:
                _execute(name, tracked, fn)
            else:
                if device not in streams:
                    streams[device] = torch.cuda.Stream(device)
                stream = streams[device]
                with torch.cuda.device(device), torch.cuda.stream(stream):
                    stream.wait_event(ready)
                    _execute(name, tracked, fn)
                    handle._event = torch.cuda.Event()
                    handle._event.record(stream)
        except BaseException as e:  # raised again at wait()
            handle._error = e
        with _lock:
            _pending -= 1
        handle._done.set()


def _stop_worker():
    global _queue, _worker
    if _worker is not None:
        _queue.put(None)  # after everything queued before it
        _worker.join(timeout=10)
    _queue, _worker = None, None


atexit.register(_stop_worker)


def _launch(name, fn, async_op, device):
    """Run fn now, or hand it to the worker; traffic is charged to `name` unless untracked()."""
    global _queue, _worker, _pending
    tracked = _untracked_depth == 0  # decided when the op is issued, not when it runs
    with _lock:
        inline = not async_op and _pending == 0
        if not inline:
            _pending += 1
    if inline:
        return _execute(name, tracked, fn)
    if _worker is None:
        _queue = queue.Queue()
        _worker = threading.Thread(target=_work_loop, args=(_queue,), daemon=True, name="collectives")
        _worker.start()
    ready = None
    if device.type == "cuda":
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(device))
    handle = Handle(fn, device)
    _queue.put((name, tracked, fn, device, ready, handle))
    if async_op:
        return handle
    handle.wait()

# ----------------------------------------------------------------------------- argument checks

_COMBINE = {"sum": torch.add, "avg": torch.add, "max": torch.maximum, "min": torch.minimum}
_FROM_REDUCE_OP = {dist.ReduceOp.SUM: "sum", dist.ReduceOp.AVG: "avg",
                   dist.ReduceOp.MAX: "max", dist.ReduceOp.MIN: "min"} if dist.is_available() else {}


def _op(op, dtype):
    op = op.lower() if isinstance(op, str) else _FROM_REDUCE_OP.get(op, op)
    if op not in _COMBINE:
        raise ValueError(f"unknown reduce op {op!r}: use one of {list(_COMBINE)}")
    if op == "avg" and not (dtype.is_floating_point or dtype.is_complex):
        raise ValueError(f"op='avg' needs a floating point tensor, got {dtype}: sum, then divide as you see fit")
    return op


def _check(ok, message):
    if not ok:
        raise ValueError(message)


def _check_pair(output, input, out_numel, in_numel, what):
    _check(output.dtype == input.dtype, f"{what}: output dtype {output.dtype} != input dtype {input.dtype}")
    _check(output.device == input.device, f"{what}: output and input are on different devices")
    _check(out_numel == in_numel, f"{what}: sizes do not match ({out_numel} vs {in_numel} elements)")


def _flat(t):
    return t.view(-1) if t.is_contiguous() else t.contiguous().view(-1)


def _copy_back(t, flat):
    if not t.is_contiguous():
        t.copy_(flat.view(t.shape))

# ----------------------------------------------------------------------------- the collectives


def send(tensor, dst, group=None, async_op=False):
    me, n, ranks = _members(group)
    _check(_index_of(dst, ranks, "dst") != me, "send: never send to yourself")
    return _launch("send", lambda: _run([([(_flat(tensor), dst)], [], None)], group), async_op, tensor.device)


def recv(tensor, src, group=None, async_op=False):
    me, n, ranks = _members(group)
    _check(_index_of(src, ranks, "src") != me, "recv: never receive from yourself")

    def fn():
        flat = _flat(tensor)
        _run([([], [(flat, src)], None)], group)
        _copy_back(tensor, flat)
    return _launch("recv", fn, async_op, tensor.device)


def broadcast(tensor, src, group=None, async_op=False):
    me, n, ranks = _members(group)
    root = _index_of(src, ranks, "src")

    def fn():
        flat = _flat(tensor)
        _run(_tree_broadcast(flat, root, me, n, ranks), group)
        _copy_back(tensor, flat)
    return _launch("broadcast", fn, async_op, tensor.device)


def reduce(tensor, dst, op="sum", group=None, async_op=False):
    """Result on dst; the other ranks' tensors are left as they were (partials go to scratch).
    Large S: ring reduce-scatter + gather (Rabenseifner), so that every rank does 1/N of the
    adding and the root receives (N-1)/N S instead of ceil(log2 N) S."""
    me, n, ranks = _members(group)
    root, op = _index_of(dst, ranks, "dst"), _op(op, tensor.dtype)

    def fn():
        flat = _flat(tensor)
        if flat.numel() * flat.element_size() < LARGE_REDUCE_BYTES or flat.numel() < n:
            _run(_tree_reduce(flat, root, me, n, ranks, _COMBINE[op], flat if me == root else None), group)
        else:
            chunks = _pieces(flat, n)
            mine = chunks[me] if me == root else torch.empty_like(chunks[me])
            steps, depth = _ring_reduce_scatter(flat, me, n, ranks[(me - 1) % n], ranks[(me + 1) % n],
                                                _COMBINE[op], mine)
            _run(steps, group, depth)
            _run([_gather_step(chunks, mine, root, me, ranks)], group)
        if me == root:
            if op == "avg":
                flat.div_(n)
            _copy_back(tensor, flat)
    return _launch("reduce", fn, async_op, tensor.device)


def all_reduce(tensor, op="sum", group=None, async_op=False):
    """Ring reduce-scatter, then ring all-gather: 2(N-1)alpha + 2(N-1)/N S/beta. For a small S
    the 2(N-1) alphas dominate, so there: tree reduce to rank 0 + tree broadcast, 2 log2(N)."""
    me, n, ranks = _members(group)
    op = _op(op, tensor.dtype)

    def fn():
        flat = _flat(tensor)
        if flat.numel() * flat.element_size() < SMALL_ALL_REDUCE_BYTES or flat.numel() < n:
            _run(_tree_reduce(flat, 0, me, n, ranks, _COMBINE[op], flat), group)
            _run(_tree_broadcast(flat, 0, me, n, ranks), group)
        else:
            left, right = ranks[(me - 1) % n], ranks[(me + 1) % n]
            rs, depth = _ring_reduce_scatter(flat, me, n, left, right, _COMBINE[op])
            ag, _ = _ring_all_gather(_pieces(flat, n), me, n, left, right)
            _run(rs + ag, group, depth)  # one pipeline: the all-gather starts as the last sums finish
        if op == "avg":
            flat.div_(n)
        _copy_back(tensor, flat)
    return _launch("all_reduce", fn, async_op, tensor.device)


def reduce_scatter(output, input, op="sum", group=None, async_op=False):
    """As dist.reduce_scatter_tensor: input has N * output elements; rank i gets chunk i reduced."""
    me, n, ranks = _members(group)
    op = _op(op, input.dtype)
    _check_pair(output, input, output.numel() * n, input.numel(), "reduce_scatter (input = world_size * output)")

    def fn():
        out, src = _flat(output), _flat(input)
        steps, depth = _ring_reduce_scatter(src, me, n, ranks[(me - 1) % n], ranks[(me + 1) % n], _COMBINE[op], out)
        _run(steps, group, depth)
        if n == 1:
            out.copy_(src)
        if op == "avg":
            out.div_(n)
        _copy_back(output, out)
    return _launch("reduce_scatter", fn, async_op, input.device)


def all_gather(output, input, group=None, async_op=False):
    """As dist.all_gather_into_tensor: output has N * input elements, rank-major."""
    me, n, ranks = _members(group)
    _check_pair(output, input, output.numel(), input.numel() * n, "all_gather (output = world_size * input)")

    def fn():
        out = _flat(output)
        chunks = _pieces(out, n)
        chunks[me].copy_(input.reshape(-1))
        steps, depth = _ring_all_gather(chunks, me, n, ranks[(me - 1) % n], ranks[(me + 1) % n])
        _run(steps, group, depth)
        _copy_back(output, out)
    return _launch("all_gather", fn, async_op, input.device)


def scatter(output, input, src, group=None, async_op=False):
    """Piece i of src's input (N * output elements; None elsewhere) lands in rank i's output."""
    me, n, ranks = _members(group)
    root = _index_of(src, ranks, "src")
    _check(me != root or input is not None, "scatter: input is required on src")
    if input is not None:  # checked wherever it is given, not only on src
        _check_pair(output, input, output.numel() * n, input.numel(), "scatter (input = world_size * output)")

    def fn():
        out, pieces = _flat(output), None
        if me == root:
            pieces = _pieces(_flat(input), n)
            out.copy_(pieces[me])
        _run([_scatter_step(pieces, out, root, me, ranks)], group)
        _copy_back(output, out)
    return _launch("scatter", fn, async_op, output.device)


def gather(output, input, dst, group=None, async_op=False):
    """Rank i's input lands in piece i of dst's output (N * input elements; None elsewhere)."""
    me, n, ranks = _members(group)
    root = _index_of(dst, ranks, "dst")
    _check(me != root or output is not None, "gather: output is required on dst")
    if output is not None:
        _check_pair(output, input, output.numel(), input.numel() * n, "gather (output = world_size * input)")

    def fn():
        out = pieces = None
        if me == root:
            out = _flat(output)
            pieces = _pieces(out, n)
            pieces[me].copy_(input.reshape(-1))
        _run([_gather_step(pieces, _flat(input), root, me, ranks)], group)
        if me == root:
            _copy_back(output, out)
    return _launch("gather", fn, async_op, input.device)


def all_to_all(output, input, group=None, async_op=False):
    """As dist.all_to_all_single with equal splits: piece i of input goes to rank i. Pairwise
    exchange: in step k rank r sends to r+k and receives from r-k, so every rank has one
    partner each way per step and no link is oversubscribed: (N-1)(alpha + S/N/beta).
    The steps are independent, so all of them go on the wire at once."""
    me, n, ranks = _members(group)
    _check_pair(output, input, output.numel(), input.numel(), "all_to_all")
    _check(input.numel() % n == 0, f"all_to_all: {input.numel()} elements do not split into {n} ranks")

    def fn():
        out = _flat(output)
        ins, outs = _pieces(_flat(input), n), _pieces(out, n)
        outs[me].copy_(ins[me])
        _run([([(ins[(me + k) % n], ranks[(me + k) % n])], [(outs[(me - k) % n], ranks[(me - k) % n])], None)
              for k in range(1, n)], group, n - 1)
        _copy_back(output, out)
    return _launch("all_to_all", fn, async_op, input.device)


def barrier(group=None):
    """Nobody leaves before everybody has arrived: an untracked all_reduce of one element."""
    if _initialized():
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else "cpu"
        with untracked():
            all_reduce(torch.zeros(1, device=device), group=group)


def gather_stats(values, group=None):
    """A few numbers from every rank (loss, bytes sent, memory...) gathered to the
    group's first rank for the log: a list of rows, one per rank, there; None elsewhere.
    Bookkeeping, so its own traffic is not counted."""
    me, n, ranks = _members(group)
    device = torch.device("cuda", torch.cuda.current_device()) if (
        _initialized() and dist.get_backend(group) == "nccl") else torch.device("cpu")
    mine = torch.tensor([float(v) for v in values], dtype=torch.float64, device=device)
    rows = torch.empty(n * len(values), dtype=torch.float64, device=device) if me == 0 else None
    with untracked():
        gather(rows, mine, ranks[0], group)
    return rows.view(n, -1).tolist() if me == 0 else None

# ----------------------------------------------------------------------------- for the pipeline
# (appended by the pipeline parallel engineer: the one call pipeline_parallel.py needs
# that the API above lacks)

def sendrecv(send_tensor, dst, recv_tensor, src, group=None, async_op=False):
    """Send send_tensor to dst and receive recv_tensor from src, both posted at once
    (one batch_isend_irecv: one NCCL group call), as MPI_Sendrecv. Either may be None.
    Why a pipeline needs it: two neighbours that each send to the other before
    receiving deadlock with blocking send/recv (NCCL, and gloo for large messages,
    hand a message over only once its receiver has posted); posting each rank's send
    and receive together, then waiting for both, cannot."""
    me, n, ranks = _members(group)
    if send_tensor is not None:
        _check(_index_of(dst, ranks, "dst") != me, "sendrecv: never send to yourself")
    if recv_tensor is not None:
        _check(_index_of(src, ranks, "src") != me, "sendrecv: never receive from yourself")
    if send_tensor is None and recv_tensor is None:
        return None

    def fn():
        sends = [(_flat(send_tensor), dst)] if send_tensor is not None else []
        flat = _flat(recv_tensor) if recv_tensor is not None else None
        _run([(sends, [(flat, src)] if flat is not None else [], None)], group)
        if flat is not None:
            _copy_back(recv_tensor, flat)
    device = (send_tensor if send_tensor is not None else recv_tensor).device
    return _launch("sendrecv", fn, async_op, device)




# ----------------------------------------------------------------------------- benchmark

def _size(text):  # "64K" -> 65536
    k = "KMG".find(text[-1].upper())
    return int(float(text[:-1]) * 1024 ** (k + 1)) if k >= 0 else int(text)


def _size_name(b):  # 65536 -> "64K"
    for unit, shift in (("G", 30), ("M", 20), ("K", 10)):
        if b >= 1 << shift and b % (1 << shift) == 0:
            return f"{b >> shift}{unit}"
    return str(b)


def _cases(op, S, n, rank, device):
    """-> (ours, built-in, busbw factor) for S bytes; S is the whole buffer, as in nccl-tests."""
    full = torch.randn(max(n, S // 4 // n * n), device=device)
    part, out, ring = torch.randn(full.numel() // n, device=device), torch.empty_like(full), (n - 1) / n
    pieces = list(full.chunk(n)) if rank == 0 else None
    return {"all_reduce": (lambda: all_reduce(full), lambda: dist.all_reduce(full), 2 * ring),
            "reduce_scatter": (lambda: reduce_scatter(part, full),
                               lambda: dist.reduce_scatter_tensor(part, full), ring),
            "all_gather": (lambda: all_gather(full, part), lambda: dist.all_gather_into_tensor(full, part), ring),
            "all_to_all": (lambda: all_to_all(out, full), lambda: dist.all_to_all_single(out, full), ring),
            "broadcast": (lambda: broadcast(full, 0), lambda: dist.broadcast(full, 0), 1.0),
            "reduce": (lambda: reduce(full, 0), lambda: dist.reduce(full, 0), 1.0),
            "scatter": (lambda: scatter(part, full, 0), lambda: dist.scatter(part, pieces, src=0), ring),
            "gather": (lambda: gather(full, part, 0), lambda: dist.gather(part, pieces, dst=0), ring)}[op]


def _benchmark():
    import argparse
    import statistics
    import time
    import warnings
    p = argparse.ArgumentParser(description="hand-written collectives against torch.distributed's own")
    p.add_argument("--sizes", default="4K,64K,1M,16M,64M")
    p.add_argument("--max_size", default="64M")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--ops", default="all_reduce,reduce_scatter,all_gather,all_to_all,broadcast,reduce,scatter,gather")
    knobs = ("SMALL_ALL_REDUCE_BYTES", "LARGE_REDUCE_BYTES", "SEGMENT_BYTES", "PIPELINE_DEPTH")
    for knob in knobs:  # --segment_bytes=4M and so on, to measure the choices above
        p.add_argument("--" + knob.lower(), type=_size, default=globals()[knob])
    args = p.parse_args()
    globals().update({knob: getattr(args, knob.lower()) for knob in knobs})
    warnings.filterwarnings("ignore", category=FutureWarning)  # all_gather_into_tensor & co. on torch >= 2.12
    rank, n, _, device = init_distributed()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    if rank == 0:
        print(f"{n} ranks, {dist.get_backend() if _initialized() else 'no group'} on {device}; "
              + ", ".join(f"{k.lower()}={globals()[k]}" for k in knobs))
        print(f"time: median over {args.iters} runs of the slowest rank; algbw = S/time, busbw = algbw * "
              "nccl-tests' factor, in GB/s")
        print(f"{'op':<15}{'size':>5} |{'ours ms':>10}{'algbw':>8}{'busbw':>8} |{'builtin ms':>11}{'algbw':>8}"
              f"{'busbw':>8} |{'ours/builtin':>13}")
    for op in args.ops.split(","):
        for S in [s for s in map(_size, args.sizes.split(",")) if s <= _size(args.max_size)]:
            ours, builtin, factor = _cases(op, S, n, rank, device)
            fns = {"ours": ours, "builtin": builtin}
            try:
                for _ in range(args.warmup):
                    builtin()
            except (RuntimeError, ValueError):  # a built-in this backend lacks: n/a
                del fns["builtin"]
            for _ in range(args.warmup):
                ours()
            times = {name: [] for name in fns}
            for _ in range(args.iters):  # alternate the two, so drift in the machine's load hits both
                for name, fn in fns.items():
                    if _initialized():
                        dist.barrier()
                    sync()
                    t0 = time.perf_counter()
                    fn()
                    sync()
                    times[name].append(time.perf_counter() - t0)
            med = {}
            for name, ts in times.items():
                t = torch.tensor(ts, dtype=torch.float64, device=device)
                if _initialized():
                    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a collective takes as long as its slowest rank
                med[name] = statistics.median(t.tolist())
            if rank == 0:
                cols = [f"{med[k] * 1e3:>{w}.3f}{S / med[k] / 1e9:>8.3f}{S / med[k] / 1e9 * factor:>8.3f}"
                        if k in med else f"{'n/a':>{w + 16}}" for k, w in (("ours", 10), ("builtin", 11))]
                ratio = f"{med['builtin'] / med['ours']:>13.2f}" if len(med) == 2 else f"{'n/a':>13}"
                print(f"{op:<15}{_size_name(S):>5} |{cols[0]} |{cols[1]} |{ratio}", flush=True)
    shutdown()


if __name__ == "__main__":
    _benchmark()
