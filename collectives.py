"""
Collectives by hand, on nothing but point-to-point messages (isend/irecv, each step's posted
together). The signatures mirror torch.distributed's tensor forms, so `C.all_reduce(t)` and
`dist.all_reduce(t)` can be swapped and compared:

    broadcast(tensor, src), reduce(tensor, dst, op="sum"), all_reduce(tensor, op="sum")
    reduce_scatter(output, input, op="sum"), all_gather(output, input)
    scatter(output, input, src), gather(output, input, dst)
    all_to_all(output, input, output_split_sizes=None, input_split_sizes=None)
    send(tensor, dst), recv(tensor, src), sendrecv(send_tensor, dst, recv_tensor, src)
    batch_sendrecv(sends, recvs), barrier(group=None, timeout_s=None), gather_stats({name: number})

Each takes group=None (the world) and, but the last two, async_op=False (True: a handle with
wait() and is_completed()). src/dst are GLOBAL ranks; op is "sum", "avg", "max", "min" or a
dist.ReduceOp (avg: sum, then divide). Every algorithm is a list of steps (sends, recvs,
then): post the step's messages together, wait for them, call then() (say, add what arrived);
_run keeps several steps on the wire at once, which is how the rings overlap the wire with the
adder. Costs are in the alpha-beta model (Thakur, Rabenseifner & Gropp 2005; docs/formulas.md):
a message of S bytes costs alpha + S/beta, reducing S bytes S*gamma, N ranks.

The lesson is the algorithms and the collectives built on them, down to gather_stats; then
use("torch"), which puts torch.distributed's own in their place (--collectives=torch), bytes
still counted as these would send them; behind the fence the plumbing: init_distributed,
new_group, get_rank, byte counts (bytes_sent, untracked), --trace's spans, the flight recorder
and diagnose() (which rank is behind where), the engine and the async workers.
`torchrun --nproc_per_node=4 bench/collectives_vs_torch.py` times each against the built-in.
"""
import atexit
import contextlib
import datetime
import functools
import json
import math
import operator
import os
import queue
import sys
import threading
import time
import weakref
from collections import defaultdict, deque

import torch
import torch.distributed as dist

# Tuning knobs, measured with bench/collectives_vs_torch.py on gloo ranks on 2 CPU cores (alpha:
# a thread wake-up, ~0.1 ms idle). The tree all_reduce beat the ring up to 4-8 MB there; 64 KB
# keeps it for small messages only, the split the traffic tests assume. Two ranks swapping whole
# buffers took 0.5-0.9 of gloo's time at 4 KB and 295 KB, the ring 1.2-2.6.
SMALL_ALL_REDUCE_BYTES = 64 << 10  # all_reduce below this size: tree reduce + tree broadcast
LARGE_REDUCE_BYTES = 32 << 20      # reduce from this size on: ring reduce-scatter + gather
SEGMENT_BYTES = 4 << 20            # rings cut each chunk into segments of at most this size
PIPELINE_DEPTH = 2                 # and keep this many in flight: one moves while one is reduced
PAIR_EXCHANGE_BYTES = 1 << 20      # all_reduce on two ranks up to this size: one exchange, then add

# ----------------------------------------------------------------------------- the ring

# A ring all-reduce is a reduce-scatter, then an all-gather, N-1 steps each. Cut the data
# in N chunks; every rank sends to its right neighbour and receives from its left.
# Reduce-scatter: in step s rank r passes its partial sum of chunk r-s-1 to the right and
# adds the partial of chunk r-s-2 arriving from the left; after N-1 steps rank r holds
# chunk r summed over all. All-gather: rank r starts with chunk r; in step s it forwards
# chunk r-s to the right and receives chunk r-s-1 from the left straight into place.
# Each half costs (N-1)alpha + (N-1)/N S/beta (the reduce-scatter + (N-1)/N S gamma):
# each rank sends (N-1)/N S, the least possible, since it must receive that much it does
# not have; but the alphas grow with N.

def _ring_all_reduce(flat, me, n, left, right, combine):
    """-> (steps, depth): 2(N-1)alpha + 2(N-1)/N S/beta, as one pipeline (the all-gather
    starts while the last sums finish)."""
    rs, depth = _ring_reduce_scatter(flat, me, n, left, right, combine)
    ag, _ = _ring_all_gather(_pieces(flat, n), me, n, left, right)
    return rs + ag, depth


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
    nseg, depth = _segments(chunks[0])
    tmps = [torch.empty_like(_pieces(chunks[0], nseg)[0]) for _ in range(depth)]  # what arrives
    steps = []
    for s in range(n - 1):
        c_send, c_recv = (me - s - 1) % n, (me - s - 2) % n
        send = chunks[c_send] if s == 0 else out(s - 1, c_send)
        for a, b, o in _segmented(nseg, send, chunks[c_recv], out(s, c_recv)):
            tmp = tmps[len(steps) % depth][:b.numel()]
            steps.append(([(a, right)], [(tmp, left)], functools.partial(combine, b, tmp, out=o)))
    return steps, depth


def _ring_all_gather(chunks, me, n, left, right):
    """-> (steps, depth). chunks[me] holds this rank's part; the others fill in place."""
    nseg, depth = _segments(chunks[0])
    steps = [([(a, right)], [(b, left)], None) for s in range(n - 1)
             for a, b in _segmented(nseg, chunks[(me - s) % n], chunks[(me - s - 1) % n])]
    return steps, depth


# Segmentation, as gloo's own ring does it: each chunk is cut into segments, and while one
# is being added the next is on the wire, about max(wire, adder) instead of their sum, for
# more alphas. Measured here: 4 MB segments. Smaller ones lost, as each costs ~0.2 ms of
# CPU (Python, gloo's handshake, wake-ups), and 4 ranks on 2 cores have no idle wire to
# overlap with; at 2 ranks (a core each) splitting a 8 MB chunk in two won ~15%.

def _segments(chunk):
    """-> (segments per chunk, steps kept in flight) for chunks the size of `chunk` (the
    first, the largest). depth <= segments: a step then only sends a partial that a then()
    at least depth steps earlier finished."""
    nseg = max(1, -(-chunk.numel() * chunk.element_size() // SEGMENT_BYTES))
    return nseg, min(PIPELINE_DEPTH, nseg)


def _segmented(nseg, *chunks):
    """The chunks cut into nseg segments each, zipped: segment i of every chunk together."""
    # a list: on a worker thread, CPython 3.11's tuple from a generator races gc.get_objects() (SystemError)
    return zip(*[_pieces(c, nseg) for c in chunks])


def _pieces(t, parts):
    """Cut flat t into `parts` contiguous views whose sizes differ by at most one element
    (the first ones one larger). One split call: a slice t[a:b] costs ~2 us of Python each."""
    q, r = divmod(t.numel(), parts)
    return t.split([q + (i < r) for i in range(parts)])

# ----------------------------------------------------------------------------- trees, root to all, all to all

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


# Two ranks are a special case of everything above: the ring and the tree both make each rank
# send S in two messages, one after the other (2 alpha + S/beta). Swapping whole buffers
# sends the same S in one step, both ways at once: alpha + S/beta, for twice the adding
# (each rank sums all of S; a + b == b + a exactly, so both hold the same bits). Recursive
# doubling generalises it (log2 N exchanges of S), but past two ranks it sends more than
# the ring, so it stops here.

def _pair_exchange(flat, peer, combine):
    tmp = torch.empty_like(flat)
    return [(flat, peer)], [(tmp, peer)], functools.partial(combine, flat, tmp, out=flat)


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


# Pairwise exchange (all-to-all): in step k rank r sends to r+k and receives from r-k, so
# every rank has one partner each way per step and no link is oversubscribed:
# (N-1)(alpha + S/N/beta) for equal splits. The steps are independent, so all of them can
# go on the wire at once.

def _pairwise_exchange(send, recv, me, n, ranks):
    """send[j]: the piece for rank j; recv[j]: where rank j's piece lands (recv[me] is ours)."""
    return [([(send[(me + k) % n], ranks[(me + k) % n])], [(recv[(me - k) % n], ranks[(me - k) % n])], None)
            for k in range(1, n)]

# ----------------------------------------------------------------------------- the collectives

def all_reduce(tensor, op="sum", group=None, async_op=False):
    """The ring: 2(N-1)alpha + 2(N-1)/N S/beta. For a small S the 2(N-1) alphas dominate, so
    there: tree reduce to rank 0 + tree broadcast, 2 log2(N) alphas. Two ranks: one exchange."""
    me, n, ranks = _members(group)
    op = _op(op, tensor.dtype)

    def fn():
        flat = _flat(tensor)
        if n == 2 and flat.numel() * flat.element_size() <= PAIR_EXCHANGE_BYTES:
            _run([_pair_exchange(flat, ranks[1 - me], _COMBINE[op])], group)
        elif flat.numel() * flat.element_size() < SMALL_ALL_REDUCE_BYTES or flat.numel() < n:
            _run(_tree_reduce(flat, 0, me, n, ranks, _COMBINE[op], flat), group)
            _run(_tree_broadcast(flat, 0, me, n, ranks), group)
        else:
            steps, depth = _ring_all_reduce(flat, me, n, ranks[(me - 1) % n], ranks[(me + 1) % n], _COMBINE[op])
            _run(steps, group, depth)
        if op == "avg":
            flat.div_(n)
        _copy_back(tensor, flat)
    return _launch("all_reduce", fn, async_op, tensor.device, group)


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
    return _launch("reduce_scatter", fn, async_op, input.device, group)


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
    return _launch("all_gather", fn, async_op, input.device, group)


def broadcast(tensor, src, group=None, async_op=False):
    me, n, ranks = _members(group)
    root = _index_of(src, ranks, "src")

    def fn():
        flat = _flat(tensor)
        _run(_tree_broadcast(flat, root, me, n, ranks), group)
        _copy_back(tensor, flat)
    return _launch("broadcast", fn, async_op, tensor.device, group)


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
    return _launch("reduce", fn, async_op, tensor.device, group)


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
    return _launch("scatter", fn, async_op, output.device, group)


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
    return _launch("gather", fn, async_op, input.device, group)


def _rows(t):
    return t.shape[0] if t.dim() else 1


def _split_sizes(sizes, t, n, what):
    """-> the rows of t going to (input) or coming from (output) each rank, checked."""
    if sizes is None:
        _check(_rows(t) % n == 0, f"all_to_all: dim 0 of the {what} ({_rows(t)}) does not split equally into {n} ranks")
        return [_rows(t) // n] * n
    try:
        sizes = [operator.index(s) for s in sizes]
    except TypeError:
        raise ValueError(f"all_to_all: {what}_split_sizes must be whole numbers, got {sizes}") from None
    _check(len(sizes) == n, f"all_to_all: {what}_split_sizes has {len(sizes)} entries for {n} ranks")
    _check(min(sizes) >= 0, f"all_to_all: negative {what}_split_sizes {sizes}")
    _check(sum(sizes) == _rows(t), f"all_to_all: {what}_split_sizes {sizes} do not add up to dim 0 ({_rows(t)})")
    return sizes


def all_to_all(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
    """As dist.all_to_all_single: input's dim 0 is cut into input_split_sizes[i] rows for rank
    i (None: N equal parts), and what rank j sends lands in output's part j, cut the same way
    by output_split_sizes. The rows rank i sends rank j must be the rows rank j expects from
    rank i: checking that would cost a message, so a mismatch times out (CommError).
    The pairwise exchange, every step on the wire at once."""
    me, n, ranks = _members(group)
    _check(output.dtype == input.dtype, f"all_to_all: output dtype {output.dtype} != input dtype {input.dtype}")
    _check(output.device == input.device, "all_to_all: output and input are on different devices")
    _check(output.shape[1:] == input.shape[1:],
           f"all_to_all: rows of different shapes ({tuple(output.shape[1:])} vs {tuple(input.shape[1:])})")
    outs = _split_sizes(output_split_sizes, output, n, "output")
    ins = _split_sizes(input_split_sizes, input, n, "input")
    _check(ins[me] == outs[me], f"all_to_all: this rank sends itself {ins[me]} rows but expects {outs[me]}")
    row = math.prod(input.shape[1:])

    def fn():
        out = _flat(output)
        send, recv = _flat(input).split([s * row for s in ins]), out.split([s * row for s in outs])
        recv[me].copy_(send[me])
        # _post skips an empty piece; the peer's matching piece is empty too, so it skips the
        # receive: no empty messages, and the two sides still pair up
        steps = _pairwise_exchange(send, recv, me, n, ranks)
        if _is_nccl(group):  # one group call: NCCL runs a communicator's group calls one after another
            steps = [([m for s, _, _ in steps for m in s], [m for _, r, _ in steps for m in r], None)]
        _run(steps, group, max(1, len(steps)))
        _copy_back(output, out)
    return _launch("all_to_all", fn, async_op, input.device, group)


def send(tensor, dst, group=None, async_op=False):
    return _p2p("send", [(tensor, dst)], [], group, async_op)


def recv(tensor, src, group=None, async_op=False):
    return _p2p("recv", [], [(tensor, src)], group, async_op)


def sendrecv(send_tensor, dst, recv_tensor, src, group=None, async_op=False):
    """The pipeline's primitive (and the attention ring's), as MPI_Sendrecv: send send_tensor
    to dst and receive recv_tensor from src, both posted at once (one NCCL group call); either
    may be None. Two neighbours that each send to the other before receiving deadlock with
    blocking send/recv (NCCL, and gloo for large messages, hand a message over only once its
    receiver has posted); posting each rank's send and receive together cannot."""
    return _p2p("sendrecv", [(send_tensor, dst)] if send_tensor is not None else [],
                [(recv_tensor, src)] if recv_tensor is not None else [], group, async_op)


def batch_sendrecv(sends, recvs, group=None, async_op=False):
    """sendrecv for several messages: every (tensor, dst) of sends and (tensor, src) of recvs
    posted at once, as the interleaved pipeline's steady state posts its two sends and two
    receives. Messages between two ranks match in list order."""
    return _p2p("sendrecv", sends, recvs, group, async_op)


def _p2p(name, sends, recvs, group, async_op):
    me, n, ranks = _members(group)
    for _, dst in sends:
        _check(_index_of(dst, ranks, "dst") != me, f"{name}: never send to yourself")
    for _, src in recvs:
        _check(_index_of(src, ranks, "src") != me, f"{name}: never receive from yourself")
    if not sends and not recvs:
        return None

    def fn():
        flats = [_flat(t) for t, _ in recvs]
        _run([([(_flat(t), dst) for t, dst in sends], [(f, src) for f, (_, src) in zip(flats, recvs)], None)], group)
        for (t, _), f in zip(recvs, flats):
            _copy_back(t, f)
    return _launch(name, fn, async_op, (sends or recvs)[0][0].device, group)


def barrier(group=None, timeout_s=None):
    """Nobody leaves before everybody has arrived: a tree all_reduce of one element, untracked,
    which the CPU waits for (on NCCL too); a peer that does not come is a CommError after
    --timeout_s. timeout_s: wait this long instead, for host work (a checkpoint's writing and
    hashing), through the rendezvous store: NCCL's watchdog would abort a message that old."""
    if not _initialized():
        return
    me, n, ranks = _members(group)
    t, by_store = torch.zeros(1, device=_comm_device(group)), timeout_s is not None and _store is not None

    def fn():
        if by_store:
            return _store_barrier(ranks, timeout_s)
        _run(_tree_reduce(t, 0, me, n, ranks, torch.add, t), group, block=True, timeout_s=timeout_s)
        _run(_tree_broadcast(t, 0, me, n, ranks), group, block=True, timeout_s=timeout_s)
    with untracked():  # through the store: no messages on the group, so no number in its flight record
        _launch("store barrier" if by_store else "barrier", fn, False, t.device, group)


_store_barriers = defaultdict(int)  # the group's global ranks -> store barriers so far


def _store_barrier(ranks, timeout_s):
    """Each rank marks its arrival under a key of its own; the last to arrive opens the door."""
    key = f"collectives/barrier/{'-'.join(map(str, ranks))}/{_store_barriers[tuple(ranks)]}"
    _store_barriers[tuple(ranks)] += 1
    _store.set(f"{key}/{get_rank()}", "1")
    if _store.add(key, 1) == len(ranks):
        _store.set(f"{key}/all", "1")
    try:
        _store.wait([f"{key}/all"], datetime.timedelta(seconds=timeout_s))
    except RuntimeError as e:
        late = ", ".join(f"rank {r}" for r in ranks if not _store.check([f"{key}/{r}"]))
        raise CommError(f"rank {get_rank()}: barrier on ranks {ranks} timed out after {timeout_s} s "
                        f"waiting for {late}") from e


def gather_stats(values, group=None):
    """A few numbers from every rank gathered to the group's first rank for the log: values is
    {name: number}, the same names on every rank. -> {name: [the value on each rank]} there,
    None elsewhere. Bookkeeping: not counted, and the CPU waits for it (on NCCL too)."""
    _check(isinstance(values, dict), f"gather_stats: values must be {{name: number}}, not {type(values).__name__}")
    me, n, ranks = _members(group)
    if n == 1:  # one rank: nothing to gather, nothing launched
        return {k: [float(v)] for k, v in values.items()}
    names, device = list(values), _comm_device(group)
    mine = torch.tensor([float(values[k]) for k in names], dtype=torch.float64, device=device)
    rows = torch.empty(n * len(names), dtype=torch.float64, device=device) if me == 0 else None

    def fn():
        pieces = _pieces(rows, n) if me == 0 else None
        if me == 0:
            pieces[0].copy_(mine)
        _run([_gather_step(pieces, mine, 0, me, ranks)], group, block=True)
    with untracked():
        _launch("gather_stats", fn, False, device, group)
    return dict(zip(names, rows.view(n, len(names)).t().tolist())) if me == 0 else None


# ----------------------------------------------------------------------------- the collectives autograd can differentiate

# The strategies move activations with the collectives above, and each needs its conjugate in
# backward: an all-gather's gradient is reduce-scattered, a reduce-scatter's all-gathered, and
# an all-to-all's sent back by the same exchange reversed. Each is the identity on a group of
# one. name (optional) labels the trace's spans "<op> <name> (forward)" and "(backward)".
# torch.compile runs them eagerly (a graph break): dynamo must not trace this file's lock and worker.

def _gather_or_scatter(x, gather, group, name, when):
    """x's rows all-gathered (rank-major) or reduce-scattered (rank i keeping block i)."""
    n = get_world_size(group)
    out = x.new_empty(x.shape[0] * n if gather else x.shape[0] // n, *x.shape[1:])
    with labelled(f"{'all_gather' if gather else 'reduce_scatter'} {name} ({when})" if name else _label):
        (all_gather if gather else reduce_scatter)(out, x.contiguous(), group=group)
    return out


def _exchange_rows(x, send, recv, group, name, when):
    out = x.new_empty(sum(recv) if recv else x.shape[0], *x.shape[1:])
    with labelled(f"all_to_all {name} ({when})" if name else _label):
        all_to_all(out, x.contiguous(), recv, send, group=group)
    return out


class _GatherOrScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, gather, group, name):
        ctx.args = gather, group, name
        return _gather_or_scatter(x, gather, group, name, "forward")

    @staticmethod
    def backward(ctx, grad):
        gather, group, name = ctx.args
        return _gather_or_scatter(grad, not gather, group, name, "backward"), None, None, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, send, recv, group, name):
        ctx.args = recv, send, group, name  # backward: what arrived goes back where it came from
        return _exchange_rows(x, send, recv, group, name, "forward")

    @staticmethod
    def backward(ctx, grad):
        return _exchange_rows(grad, *ctx.args, "backward"), None, None, None, None


@torch.compiler.disable
def all_gather_rows(x, group=None, name=None):
    """Every rank's x concatenated along dim 0, rank-major; backward: a reduce-scatter."""
    return x if get_world_size(group) == 1 else _GatherOrScatter.apply(x, True, group, name)


@torch.compiler.disable
def reduce_scatter_rows(x, group=None, name=None):
    """x summed over the ranks, rank i keeping the i-th of N blocks of rows; backward: an all-gather."""
    return x if get_world_size(group) == 1 else _GatherOrScatter.apply(x, False, group, name)


@torch.compiler.disable
def all_to_all_rows(x, send=None, recv=None, group=None, name=None):
    """send[j] rows of x to rank j, recv[i] rows arriving from rank i (None: N equal parts);
    backward: the gradients go back the way they came."""
    return x if get_world_size(group) == 1 else _AllToAll.apply(x, send, recv, group, name)


def all_reduce_flat(tensors, op="avg", group=None):
    """The tensors (say, a list of .grad) all-reduced as one flat message, copied back in place:
    one message's latency for all of them."""
    if not tensors or get_world_size(group) == 1:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    all_reduce(flat, op=op, group=group)
    for t, part in zip(tensors, flat.split([t.numel() for t in tensors])):
        t.copy_(part.view_as(t))


# ----------------------------------------------------------------------------- the built-ins (--collectives=torch)

# use("torch") puts torch.distributed's own collectives (NCCL's on GPUs, gloo's on CPUs) in
# the place of the hand-written ones above, under the same names and signatures, so the
# strategy files run unchanged on the engine a cluster trains with. Each still counts the
# bytes the hand-written one would send (a dry run on meta tensors, once per shape), so every
# traffic figure and test holds on both. Point-to-point, barrier and gather_stats stay ours;
# avg is sum, then divide (gloo has no avg).

def use(kind):
    """kind: "hand" (the default) or "torch"."""
    _check(kind in ("hand", "torch"), f"collectives: use 'hand' or 'torch', not {kind!r}")
    if not _HAND:
        _HAND.update({name: globals()[name] for name in _BUILTINS})
    # one process has no group for torch's to run on; ours send nothing there anyway
    globals().update(_HAND if kind == "hand" or not _initialized() else _BUILTINS)


def _torch_all_reduce(tensor, op="sum", group=None, async_op=False):
    entry, flat = _charge("all_reduce", (tensor,), dict(op=op, group=group)), _flat(tensor)
    work = dist.all_reduce(flat, op=_REDUCE_OP[_op(op, tensor.dtype)], group=group, async_op=async_op)
    return _finish(work, tensor, flat, entry, op, group)


def _torch_reduce_scatter(output, input, op="sum", group=None, async_op=False):
    entry, out = _charge("reduce_scatter", (output, input), dict(op=op, group=group)), _flat(output)
    work = _reduce_scatter_single(out, _flat(input), op=_REDUCE_OP[_op(op, input.dtype)], group=group,
                                  async_op=async_op)
    return _finish(work, output, out, entry, op, group)


def _torch_all_gather(output, input, group=None, async_op=False):
    entry, out = _charge("all_gather", (output, input), dict(group=group)), _flat(output)
    return _finish(_all_gather_single(out, _flat(input), group=group, async_op=async_op), output, out, entry)


def _torch_all_to_all(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
    entry = _charge("all_to_all", (output, input), dict(output_split_sizes=output_split_sizes,
                                                          input_split_sizes=input_split_sizes, group=group))
    out = output.contiguous()
    work = dist.all_to_all_single(out, input.contiguous(), output_split_sizes, input_split_sizes, group=group,
                                  async_op=async_op)
    return _finish(work, output, out, entry)


def _torch_broadcast(tensor, src, group=None, async_op=False):
    entry, flat = _charge("broadcast", (tensor,), dict(src=src, group=group)), _flat(tensor)
    return _finish(dist.broadcast(flat, src, group=group, async_op=async_op), tensor, flat, entry)


def _torch_reduce(tensor, dst, op="sum", group=None, async_op=False):
    entry = _charge("reduce", (tensor,), dict(dst=dst, op=op, group=group))
    mine = get_rank() == dst  # gloo's reduce uses the others' tensors as scratch; ours leaves them as they were
    flat = _flat(tensor) if mine else tensor.flatten().clone()
    work = dist.reduce(flat, dst, op=_REDUCE_OP[_op(op, tensor.dtype)], group=group, async_op=async_op)
    return _finish(work, tensor, flat if mine else None, entry, op, group)


def _torch_scatter(output, input, src, group=None, async_op=False):
    entry, out = _charge("scatter", (output, input), dict(src=src, group=group)), _flat(output)
    pieces = list(_flat(input).chunk(get_world_size(group))) if get_rank() == src else None
    return _finish(dist.scatter(out, pieces, src=src, group=group, async_op=async_op), output, out, entry)


def _torch_gather(output, input, dst, group=None, async_op=False):
    entry, out = _charge("gather", (output, input), dict(dst=dst, group=group)), None
    if get_rank() == dst:
        out = _flat(output)
    work = dist.gather(input.contiguous(), list(out.chunk(get_world_size(group))) if out is not None else None,
                       dst=dst, group=group, async_op=async_op)
    return _finish(work, output, out, entry)


_reduce_scatter_single = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)  # renamed in 2.12
_all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_REDUCE_OP = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
              "min": dist.ReduceOp.MIN} if dist.is_available() else {}
_BUILTINS = dict(all_reduce=_torch_all_reduce, reduce_scatter=_torch_reduce_scatter, all_gather=_torch_all_gather,
                 all_to_all=_torch_all_to_all, broadcast=_torch_broadcast, reduce=_torch_reduce,
                 scatter=_torch_scatter, gather=_torch_gather)
_HAND = {}  # the hand-written ones, by name, filled by the first use()


class _Finished:
    """A built-in's async work, and what is left to do once it is done."""

    def __init__(self, work, then):
        self._work, self._then = work, then

    def wait(self):
        self._work.wait()
        then, self._then = self._then, lambda: None
        then()
        return True

    def is_completed(self):
        return self._work.is_completed()


def _finish(work, tensor, flat, entry, op=None, group=None):
    """avg's divide, the copy back into a non-contiguous tensor, and the op's flight record
    marked done (on a GPU, once the stream has passed it): now, or at wait() (async_op)."""
    def done():
        if flat is not None:
            if op is not None and _op(op, flat.dtype) == "avg":
                flat.div_(get_world_size(group))
            _copy_back(tensor, flat)
        _mark_done(entry)
    if work is not None:
        return _Finished(work, done)
    done()


_would_send = {}  # (op, shapes, dtypes, arguments, group) -> bytes the hand-written op sends from this rank


def _charge(name, tensors, kw):
    """Count the bytes the hand-written op would send: run it dry once per shape (its steps
    built and counted, nothing posted, on meta tensors), then from the cache."""
    if not _initialized():
        return None
    hand, group = _HAND[name], kw["group"]
    link = _link(group)  # the group's ranks in the key, never the group: a cache must not keep a destroyed one alive
    # the flight record, as the hand-written ops keep it: a hang inside torch's is diagnosed too
    entry = _flight_entry(name, group, tensors[0].device if tensors[0] is not None else tensors[1].device)
    entry[4].update(r for r in link.ranks if r != get_rank())
    if _untracked_depth:
        return entry
    key = (name, tuple(None if t is None else (t.shape, t.dtype) for t in tensors),
           tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in kw.items() if k != "group"), tuple(link.ranks),
           SMALL_ALL_REDUCE_BYTES, LARGE_REDUCE_BYTES, PAIR_EXCHANGE_BYTES, SEGMENT_BYTES)  # the path it takes
    sent = _would_send.get(key)
    if sent is None:
        _running.dry = 0
        try:
            with untracked():
                hand(*[None if t is None else torch.empty(t.shape, dtype=t.dtype, device="meta") for t in tensors],
                     **kw)
            sent = _would_send[key] = _running.dry
        finally:
            _running.dry = None
    _add_bytes(name, link, sent)
    entry[3] = sent
    return entry


# ============================================================================================= the fence
# Below: the plumbing. Process groups, byte accounting, trace and flight recorder, the engine
# that posts a step's messages and waits for them, the async workers, argument checks.

# ----------------------------------------------------------------------------- process group

_we_created_group = False
_timeout_s = None  # --timeout_s: the deadline of the waits that block the CPU (None: torch's default)
_group_timeout = None  # what init_distributed gave the world, for new_group to give each sub-group
_store = None  # the rendezvous store of the group we made: barriers that outlast the timeout use it
NCCL_GRACE_S = 60  # NCCL's watchdog fires this much after our own CPU-side deadline


def init_distributed(timeout_s=None, backend=None):
    """-> (rank, world_size, local_rank, device); the one place the backend is chosen (None:
    NCCL where there is a GPU, else gloo). timeout_s: how long a rank waits for a peer before
    its collective fails (CommError)."""
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    # The device follows the group's backend: inside a group someone else made on gloo (the
    # tests') we stay on the CPU, GPUs or not, or gloo would be handed CUDA pointers.
    gpu = (dist.get_backend(_world(None)) == "nccl" if _initialized()
           else backend != "gloo" and torch.cuda.is_available())
    device = _visible_gpu(local_rank) if gpu else torch.device("cpu")
    if gpu:
        torch.cuda.set_device(device)  # before NCCL starts, or every rank lands on GPU 0
    if not _initialized() and "WORLD_SIZE" in os.environ:  # torchrun; plain `python x.py`: no group
        _make_group(timeout_s, device)
    return get_rank(), get_world_size(), local_rank, device


def _visible_gpu(local_rank):
    """This process's GPU: its local rank's among all of the node's, or the only one it sees
    (one GPU per process, as some SLURM set-ups give it)."""
    count = torch.cuda.device_count()
    if count == 1 or local_rank < count:
        return torch.device("cuda", 0 if count == 1 else local_rank)
    print(f"error: rank {os.environ.get('RANK', '0')}: LOCAL_RANK={local_rank} but this process sees {count} GPUs "
          f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}): give each process all of "
          "its node's GPUs, or exactly one", file=sys.stderr, flush=True)
    sys.exit(2)


_groups_made = 0  # world groups this process has made: each reads and writes its own keys


def _make_group(timeout_s, device):
    global _we_created_group, _timeout_s, _group_timeout, _store, _groups_made
    kw = {} if timeout_s is None else {"timeout": datetime.timedelta(seconds=timeout_s)}
    # A store can outlive its group (torchrun's agent's store outlives a failed attempt, any
    # store a group destroyed to make another), and ranks would read the old group's addresses
    # from it. So each group gets its own prefix, and in the agent's shared store each attempt
    # too (its restart count, each agent's own: across nodes, TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
    # gives every attempt a fresh store and leaves the count out).
    store, rank, world = next(dist.rendezvous("env://", **kw))
    shared = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") if shared else "0"
    _store = dist.PrefixStore(f"attempt{attempt}/group{_groups_made}/", store)
    _groups_made += 1
    nccl = device.type == "cuda"
    if nccl and timeout_s is not None:
        # NCCL's waits do not block the CPU: our deadline is checked where the CPU waits
        # (barrier, gather_stats), and the watchdog's abort comes a grace period later.
        kw["timeout"] = datetime.timedelta(seconds=timeout_s + NCCL_GRACE_S)
    kw.update(store=_store, rank=rank, world_size=world)
    if nccl:  # device_id makes NCCL create its communicator now, with every rank present
        dist.init_process_group("nccl", device_id=device, **kw)
    else:
        dist.init_process_group("gloo", **kw)
    _we_created_group, _timeout_s, _group_timeout = True, timeout_s, kw.get("timeout")


def shutdown():
    """Stop the async workers; destroy the process group only if init_distributed made it."""
    global _we_created_group, _timeout_s, _group_timeout, _store
    _stop_workers()  # runs everything still queued first
    if _we_created_group and _initialized():
        # torch < ~2.6 destroys an NCCL group by aborting its communicator, in-flight work
        # included: the GPU finishes, then everybody arrives, then the group goes.
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        try:
            barrier()
        finally:
            dist.destroy_process_group()
    _we_created_group, _timeout_s, _group_timeout, _store = False, None, None, None


def _initialized():
    return dist.is_available() and dist.is_initialized()


def _world(group):
    # None means the whole world, but before torch 2.8 not every call takes None for it
    # (get_process_group_ranks(None) raises KeyError): always name the group
    return dist.group.WORLD if group is None else group


def get_rank(group=None):
    return dist.get_rank(_world(group)) if _initialized() else 0


def get_world_size(group=None):
    return dist.get_world_size(_world(group)) if _initialized() else 1


def group_ranks(group=None):
    """-> the global rank of each rank of the group, in group rank order (None: the world)."""
    return dist.get_process_group_ranks(_world(group)) if _initialized() else [0]


def _members(group):
    """-> (my index in the group, group size, global rank of each index). No group at all: one rank."""
    if not _initialized():
        return 0, 1, [0]
    link = _link(group)
    return link.me, link.n, link.ranks


class _Link:
    """What every op asks of its group, looked up once (torch's look-ups cost microseconds
    each). The group is held weakly, as the byte counts hold it (see _stop_workers)."""

    def __init__(self, pg):
        self._pg, self.me, self.n = weakref.ref(pg), dist.get_rank(pg), dist.get_world_size(pg)
        self.ranks = dist.get_process_group_ranks(pg)
        self.index = {r: i for i, r in enumerate(self.ranks)}
        self.name, self.nccl = pg.group_name, dist.get_backend(pg) == "nccl"

    @property
    def pg(self):
        return self._pg()


_links = weakref.WeakKeyDictionary()  # process group -> its _Link (a group never changes)


def _link(group):
    pg = _world(group)
    link = None if isinstance(pg, int) else _links.get(pg)  # (new_group gives a non-member an int)
    if link is None:
        if dist.get_rank(pg) < 0:
            raise ValueError("this rank is not a member of the group")
        link = _links[pg] = _Link(pg)
    return link


def _index_of(root, ranks, what):
    if root not in ranks:
        raise ValueError(f"{what}={root} is not a (global) rank of the group {ranks}")
    return ranks.index(root)


def _comm_device(group):
    """Where a scratch tensor for this group must live: NCCL moves only GPU memory."""
    if _is_nccl(group):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def new_group(ranks):
    """A group of some global ranks: -> the group on its members, None on the others. Every
    rank must call it, members or not, in the same order (torch numbers groups by creation,
    and on NCCL creating one splits the world's communicator, a collective over all ranks)."""
    ranks = sorted(ranks)
    _check(len(set(ranks)) == len(ranks) and all(0 <= r < get_world_size() for r in ranks),
           f"new_group: {ranks} are not distinct ranks of a world of {get_world_size()}")
    if not _initialized():
        return None  # one rank, so the group is the whole world
    _drain()  # the split must not interleave with our worker's messages on the world
    group = dist.new_group(ranks, timeout=_group_timeout)  # None: torch's default, not the world's
    if get_rank() not in ranks:
        return None
    # The communicator now, with every member present: before torch 2.5 members made it lazily
    # while non-members split eagerly, and a 3+ stage pipeline hung, each waiting on the other.
    barrier(group)
    return group

# ----------------------------------------------------------------------------- byte accounting

# Written by whichever thread runs an op (the async worker, often) and read by the main
# thread: all access under _lock, or sum() over a dict that just grew a key raises.
_lock = threading.Lock()
_bytes = defaultdict(int)        # op name -> payload bytes this rank has sent
_group_bytes = defaultdict(int)  # the group's global ranks, as a tuple -> payload bytes sent on it
_handle_bytes = weakref.WeakKeyDictionary()  # the group itself -> payload bytes sent through it (weak: see _stop_workers)
_untracked_depth = 0


def _add_bytes(name, link, sent):
    with _lock:
        _bytes[name] += sent
        _group_bytes[tuple(link.ranks)] += sent
        _handle_bytes[link.pg] = _handle_bytes.get(link.pg, 0) + sent


class _PerThread(threading.local):
    op = None   # (name, tracked, flight entry, span) of the op this thread runs now
    dry = None  # a number while this thread dry-runs an op for a built-in's bytes (_charge)


_running = _PerThread()


def bytes_sent(group=None):
    """Payload bytes this rank has sent: in all (None); through `group`, a group object
    (dist.group.WORLD: the world's own traffic), counted apart from another group of the same
    ranks; or among a tuple of global ranks, whichever groups carried it."""
    with _lock:
        if group is None:
            return sum(_bytes.values())
        if isinstance(group, (tuple, list)):
            return _group_bytes.get(tuple(group), 0)
        return _handle_bytes.get(_key(group), 0) if _initialized() else 0


def bytes_by_op():
    with _lock:
        return dict(_bytes)


def bytes_by_group():
    """-> {tuple of the group's global ranks: payload bytes this rank sent on that group}."""
    with _lock:
        return dict(_group_bytes)


def reset_bytes():
    with _lock:
        _bytes.clear()
        _group_bytes.clear()
        _handle_bytes.clear()


@contextlib.contextmanager
def untracked():
    """Ops issued inside this block are not counted (the training logs' own gathers, say)."""
    global _untracked_depth
    _untracked_depth += 1
    try:
        yield
    finally:
        _untracked_depth -= 1

# ----------------------------------------------------------------------------- trace and flight recorder

# Tracing (model.py's --trace): while trace_on() holds, every tracked op appends a span to
# _spans: op, group, peers, bytes (counted in _post with comm_bytes, so they agree to the
# byte), start and end (CUDA events on a GPU, else the CPU's clock). An async op's span is on
# its worker's row, its wait() a second span on the caller's. Off, _launch reads one flag.
_tracing = False
_spans = []    # this rank's spans, in the order they were issued
_label = None  # the name the caller gives the ops it issues now (model.py's span(name, comm=True))
_count = None  # trace_on(count): the caller's stamps of its work so far ("at", "upto"; model.py's _Count)


def trace_on(count=None):
    global _tracing, _count
    _tracing, _count = True, count


def trace_off():
    """-> the spans recorded since trace_on(), times still as _stamp() made them."""
    global _tracing, _count
    _tracing, _count = False, None
    with _lock:
        spans = list(_spans)
        _spans.clear()
    return spans


@contextlib.contextmanager
def labelled(name):
    """The ops issued inside this block are traced as `name` (their op stays in the args)."""
    global _label
    outer, _label = _label, name
    try:
        yield
    finally:
        _label = outer


def _stamp(device):
    if device.type == "cuda":
        event = torch.cuda.Event(enable_timing=True)
        event.record()  # on the current stream: the caller's, or the worker's side stream
        return event
    return time.perf_counter()


def _trace_span(op, group, device, async_op):
    span = dict(name=_label or op, op=op, cat="comm", row="comm" if async_op else "main", ranks=group_ranks(group),
                bytes=0, peers=set(), device=device, t0=None, t1=None, posted=_stamp(device) if async_op else None,
                to={}, frm={}, at=_count() if _count else None)
    with _lock:
        _spans.append(span)
    return span


def _trace_wait(span, device):
    waited = dict(span, name=f"wait {span['name']}", cat="wait", row="main", bytes=0, device=device,
                  t0=_stamp(device), t1=None, posted=None, to={}, frm={}, at=_count() if _count else None,
                  of=(span["at"] or [None])[0])
    with _lock:
        _spans.append(waited)
    return waited


# The flight recorder, as NCCL's: for each group, the last FLIGHT_RECORDS ops this rank issued
# on it, each [seq, op, group, bytes sent so far, peers, state, device]. An op is done when its
# function has returned (on a GPU, when the event recorded after its kernels has completed).
# Collectives are numbered per group in issue order, which every member shares, so #17 is #17
# on every rank; point-to-point messages are not (ranks exchange different numbers of them).
# When a wait fails (CommError) or on Ctrl-C, diagnose() compares the ranks' records.
FLIGHT_RECORDS = 16
_flight = {}                  # the group's name -> (its global ranks, deque of entries), under _lock
_flight_seq = defaultdict(int)
_UNNUMBERED = ("send", "recv", "sendrecv", "store barrier")
_diagnoses = 0                # diagnose() calls so far: each compares under keys of its own


def _flight_entry(op, group, device):
    link = _link(group)
    name = link.name
    with _lock:
        if name not in _flight:
            _flight[name] = (link.ranks, deque(maxlen=FLIGHT_RECORDS))
        seq = None
        if op not in _UNNUMBERED:
            seq = _flight_seq[name]
            _flight_seq[name] += 1
        entry = [seq, op, name, 0, set(), "posted", device]
        _flight[name][1].append(entry)
    return entry


def flight_record():
    """-> this rank's record: {group name: [its global ranks, [[seq, op, bytes, peers, state], ...]]}."""
    with _lock:
        return {name: [ranks, [[e[0], e[1], e[3], sorted(e[4]), _state(e[5])] for e in ops]]
                for name, (ranks, ops) in _flight.items()}


def _mark_done(entry):
    """The op's function has returned: done, or on a GPU an event after its kernels, on the
    stream they went to (the caller's or the worker's), that says when."""
    if entry is not None:
        entry[5] = _stamp(entry[6]) if entry[6].type == "cuda" else "done"


def _state(state):  # "posted", "done", or the CUDA event that says which
    if isinstance(state, str):
        return state
    try:
        return "done" if state.query() else "posted"
    except RuntimeError:  # a sticky CUDA error makes every query raise: not known done, so still waited for
        return "posted"


def diagnose(wait_s=None):
    """Compare the ranks' flight records through the rendezvous store, waiting up to wait_s
    (default: --timeout_s, or 30 s) for the others' (a rank stuck in another op answers when
    that op times out; one that never answers is named as such). -> (one line saying who is
    behind where, or "", the ranks that answered)."""
    global _diagnoses
    store = _store
    if store is None and _initialized():
        try:
            store = dist.distributed_c10d._get_default_store()
        except Exception:
            store = None
    me, world = get_rank(), get_world_size()
    mine = flight_record()
    if store is None or world == 1:
        return _diagnosis({me: mine}, []), [me]
    key = f"collectives/flight/{_diagnoses}"
    _diagnoses += 1
    store.set(f"{key}/{me}", json.dumps(mine))
    wait_s = wait_s if wait_s is not None else (_timeout_s or 30)
    deadline, records = time.monotonic() + wait_s, {me: mine}
    while True:
        for r in range(world):
            if r not in records and store.check([f"{key}/{r}"]):
                records[r] = json.loads(store.get(f"{key}/{r}"))
        if len(records) == world or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    silent = [r for r in range(world) if r not in records]
    return _diagnosis(records, silent, wait_s), sorted(records)


def _diagnosis(records, silent, wait_s=0):
    """records: rank -> flight_record(); silent: the ranks that did not answer."""
    by_ranks = defaultdict(set)
    for rec in records.values():
        for name, (ranks, _) in rec.items():
            by_ranks[tuple(ranks)].add(name)

    def where(name, ranks):
        return f"{ranks}" + (f" (group {name})" if len(by_ranks[tuple(ranks)]) > 1 else "")

    def waiting(r):
        return [(name, ranks, e) for name, (ranks, ops) in records[r].items() for e in ops if e[4] == "posted"]

    def what(name, ranks, seq, op):
        return f"{op} " + (f"#{seq} " if seq is not None else "") + f"on {where(name, ranks)}"

    clauses, never = [], set()
    for r in sorted(records):
        for name, ranks, (seq, op, nbytes, peers, _) in waiting(r):
            # a message's peers, or a collective's other members: what is each of them doing?
            for j in [j for j in (ranks if seq is not None else peers) if j != r and (j in records or j in silent)]:
                if j in silent:
                    clauses.append(f"rank {j} did not answer within {wait_s:g} s (stopped, or gone); rank {r} "
                                   f"is waiting for it in {what(name, ranks, seq, op)}")
                    continue
                if seq is None:
                    theirs = [what(n, rk, s, o) for n, rk, (s, o, *_) in waiting(j)]
                    clauses.append(f"rank {r} is waiting in {op} with rank {j}, which is "
                                   + (f"in {', '.join(theirs)}" if theirs else "in no communication"))
                    continue
                ops = records[j].get(name, [ranks, []])[1]
                numbered = {e[0]: e for e in ops if e[0] is not None}
                if max(numbered, default=-1) < seq:
                    aside = [f"{o} on {where(n, rk)}" for n, rk, (s, o, *_) in waiting(j) if s is None]
                    clauses.append(f"rank {j} never posted {op} #{seq} on {where(name, ranks)}; rank {r} is waiting "
                                   f"in it" + (f" (rank {j} is in {', '.join(aside)})" if aside else ""))
                    never.add((j, r))
                elif seq in numbered and numbered[seq][1] != op:
                    clauses.append(f"rank {r} and rank {j} issued different collectives as #{seq} on "
                                   f"{where(name, ranks)}: {op} and {numbered[seq][1]}")
    if not clauses:
        return ""
    line = "; ".join(dict.fromkeys(clauses))
    if any((r, j) in never for j, r in never):
        line += ": each waits for the other, so the ranks issue these groups' collectives in different orders"
    return line


# ----------------------------------------------------------------------------- the engine

# On NCCL a step is one batch_isend_irecv, one group call: its sends and receives start
# together, so two neighbours sending to each other cannot deadlock (gloo's isend never
# blocks). NCCL has no tags: messages between two ranks match in posting order, the same on
# both sides of every algorithm here. Its work.wait() makes the current stream wait instead
# of the CPU, so a then() that reduces is still ordered after its receive.

class CommError(RuntimeError):
    """Waiting for a peer, or posting to it, failed (a timeout, a peer gone). The message
    names the op, the group, this rank and the peers of the messages it was waiting for.
    The group is unusable afterwards: messages still posted would match the next op's."""


def _post(step, link, op, nccl):
    """-> (works, the posted messages as (kind, peer, tensor), in the order of the works).
    op: the (name, tracked, flight entry, span) of the op this thread runs."""
    sends, recvs, _ = step
    posted = [("recv", peer, t) for t, peer in recvs if t.numel()]
    posted += [("send", peer, t) for t, peer in sends if t.numel()]
    name, tracked, entry, span = op
    sent = sum(t.numel() * t.element_size() for t, _ in sends)
    if _running.dry is not None:  # a built-in's dry run (_charge): count, post nothing
        _running.dry += sent
        return [], posted
    if tracked:
        _add_bytes(name, link, sent)
    if entry is not None:  # the flight record: what this op has put on the wire so far, and to whom
        entry[3] += sent
        entry[4].update(peer for _, peer, _ in posted)
    if span is not None:
        span["bytes"] += sent
        span["peers"].update(peer for _, peer, _ in posted)
        for kind, peer, t in posted:  # each message, by peer and way: what a replay matches and times
            tally = (span["to"] if kind == "send" else span["frm"]).setdefault(peer, [0, 0])
            tally[0] += 1
            tally[1] += t.numel() * t.element_size()
    try:  # gloo refuses to post to a peer it already gave up on (a closed pair)
        if nccl:  # one NCCL group call: the step's sends and receives start together
            return dist.batch_isend_irecv([dist.P2POp(dist.irecv if kind == "recv" else dist.isend, t, peer, link.pg)
                                           for kind, peer, t in posted]) if posted else [], posted
        # gloo: a work per message whatever the call; post straight to the group, as dist.isend
        # and dist.irecv end up doing after ~10 us of checks per message
        return [(link.pg.recv if kind == "recv" else link.pg.send)([_real(t)], link.index[peer], 0)
                for kind, peer, t in posted], posted
    except RuntimeError as e:
        raise _comm_error(e, posted, link.ranks, "failed posting to") from e


def _real(t):
    return torch.view_as_real(t) if t.is_complex() else t


def _comm_error(e, posted, ranks, doing):
    peers = ", ".join(f"rank {peer} ({kind} {t.numel() * t.element_size()} bytes)" for kind, peer, t in posted)
    first = (str(e).strip().splitlines() or [type(e).__name__])[0]
    return CommError(f"rank {get_rank()}: {_running.op[0]} on ranks {ranks} {doing} {peers}: {first}")


def _run(steps, group, depth=1, block=False, timeout_s=None):
    """Run the steps in order with up to `depth` of them posted: step i's then() runs while
    steps i+1.. are moving, so a step may only send what a then() at least `depth` steps
    earlier produced (the rings keep depth <= segments per chunk). block: the CPU waits for
    every message (on NCCL too); timeout_s: that wait's deadline instead of the group's."""
    if not _initialized():  # one rank: no step has a message, only the then()s to run
        for _, _, then in steps:
            if then is not None:
                then()
        return
    link, op, nccl = _link(group), _running.op, _is_nccl(group)
    poll = block and nccl
    posted = deque(_post(steps[i], link, op, nccl) for i in range(min(depth, len(steps))))
    for i, (_, _, then) in enumerate(steps):
        works, messages = posted.popleft()
        for j, work in enumerate(works):
            try:
                _wait(work, poll, timeout_s)
            except RuntimeError as e:
                # gloo returns a work per message, so the messages from the failed one on are
                # still awaited; NCCL returns one work for the whole step: all of them are
                awaited = messages[j:] if len(works) == len(messages) else messages
                timeout = "timed out" in str(e).lower() or "timeout" in str(e).lower()
                doing = ("timed out" if timeout else "failed") + " waiting for"
                raise _comm_error(e, awaited, link.ranks, doing) from e
        if then is not None:
            then()
        if i + depth < len(steps):
            posted.append(_post(steps[i + depth], link, op, nccl))


def _wait(work, poll, timeout_s):
    """gloo's wait blocks the CPU, up to the group's timeout or timeout_s. NCCL's only makes the
    stream wait (and its wait(timeout) blocks only from torch ~2.5 on): where we must block
    (poll), we poll with our own deadline, so that a timeout is a CommError like gloo's."""
    if not poll:
        return work.wait() if timeout_s is None else work.wait(datetime.timedelta(seconds=timeout_s))
    work.wait()
    limit = timeout_s if timeout_s is not None else _timeout_s
    deadline = None if limit is None else time.monotonic() + limit
    while not work.is_completed():
        if deadline is not None and time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {limit} s (checked on the CPU)")
        time.sleep(0.0002)


def _is_nccl(group):
    return _initialized() and _link(group).nccl

# ----------------------------------------------------------------------------- async

# One worker thread and queue per process group runs its ops in FIFO order, so every rank
# runs a group's collectives in the order they were called and their messages match; other
# groups do not wait (in 3-D the tensor-parallel all-reduce on the critical path must not
# queue behind the data-parallel buckets). A sync call runs inline when nothing of its group
# is queued, else queues and waits: it never overtakes. On gloo the overlap comes from the
# threads (gloo releases the GIL while bytes move). On CUDA each worker runs on a side stream
# that first waits for an event of the caller's stream; wait() makes the caller's stream wait
# for an event after the op, without blocking the CPU. An async op's tensors are the op's
# until wait(), and torch.distributed itself must not be called on a group while an op of
# ours may be queued on it (the two threads' messages would interleave differently per rank).

class Handle:
    def __init__(self, fn, device, span=None):
        self._fn, self._device, self._done, self._error, self._event = fn, device, threading.Event(), None, None
        self._span = span  # tracing: the op's span, so that the wait can be traced beside it

    def is_completed(self):
        return self._done.is_set() and (self._event is None or self._event.query())

    def wait(self):
        waited = _trace_wait(self._span, self._device) if self._span is not None else None
        self._done.wait()
        if self._error is not None:
            raise self._error
        if self._event is not None:
            torch.cuda.current_stream(self._device).wait_event(self._event)
        if waited is not None:
            waited["t1"] = _stamp(self._device)  # on a GPU: when the caller's stream got past the op
            if _count:
                waited["upto"] = _count()
        self._fn = self._span = None  # held the tensors until the caller's stream was ordered after the op
        return True


class _Worker:
    """A group's thread and queue; pending: its ops queued or running, under _lock."""

    def __init__(self, key):
        self.queue, self.pending = queue.Queue(), 0
        self.thread = threading.Thread(target=_work_loop, args=(self,), daemon=True, name=f"collectives {key}")
        self.thread.start()


_workers = {}  # the group (None: no process group at all) -> its _Worker, under _lock


def _key(group):
    return _world(group) if _initialized() else None


def _execute(name, tracked, fn, entry=None, span=None):
    # The op's name is kept even when untracked, for CommError; thread-local, as workers and
    # caller each run ops. no_grad: grad mode is per thread, and a sync op run by a worker
    # would otherwise record autograd history that the same op run inline would not.
    _running.op = (name, tracked, entry, span)
    try:
        if span is not None:
            span["t0"] = _stamp(span["device"])
        with torch.no_grad():
            out = fn()
        if span is not None:
            span["t1"] = _stamp(span["device"])
            if _count and span["row"] == "main":
                span["upto"] = _count()
        _mark_done(entry)
        return out
    finally:
        _running.op = None


def _run_job(streams, name, tracked, fn, device, ready, handle, entry, span):
    try:
        if ready is None:
            _execute(name, tracked, fn, entry, span)
            return
        if device not in streams:
            streams[device] = torch.cuda.Stream(device)
        stream = streams[device]
        with torch.cuda.device(device), torch.cuda.stream(stream):
            stream.wait_event(ready)
            _execute(name, tracked, fn, entry, span)  # its span's CUDA events on this side stream
            handle._event = torch.cuda.Event()
            handle._event.record(stream)
    except BaseException as e:  # raised again at wait()
        handle._error = e


def _work_loop(worker):
    streams = {}  # this group's side stream on each device
    while True:
        job = worker.queue.get()
        if job is None:
            return
        handle = job[5]
        _run_job(streams, *job)
        # Drop the op (its closure holds its tensors) now, not when the next job arrives:
        # FSDP's last reduce-scatter input would otherwise outlive the optimizer step.
        job = None
        with _lock:
            worker.pending -= 1
        handle._done.set()
        handle = None


def _stop_workers(timeout=None):
    """Let each worker finish what is queued, then end it. No timeout (shutdown): they must be
    gone before anything runs inline, or their last ops and those would be on the wire at once."""
    with _lock:
        workers = list(_workers.values())
    for w in workers:
        w.queue.put(None)  # after everything queued before it
    for w in workers:
        w.thread.join(timeout)
    with _lock:
        _workers.clear()


# Nothing here may keep a destroyed process group alive: freed during the interpreter's
# teardown, its C++ side (gloo's threads) can abort the process. So the byte counts hold
# groups weakly, and the workers, which hold theirs, are ended at exit while all is whole.
atexit.register(_stop_workers, 10)


def _launch(name, fn, async_op, device, group=None):
    """Run fn now, or hand it to the group's worker; traffic is charged to `name` unless untracked()."""
    tracked = _untracked_depth == 0  # decided when the op is issued, not when it runs
    key = _key(group)
    entry = _flight_entry(name, group, device) if key is not None and name != "drain" and _running.dry is None else None
    span = _trace_span(name, group, device, async_op) if _tracing and tracked and name != "drain" else None
    with _lock:
        worker = _workers.get(key)
        inline = not async_op and (worker is None or worker.pending == 0)
        if not inline:
            if worker is None:  # under the lock: two issuing threads must not start two workers
                worker = _workers[key] = _Worker(key)
            worker.pending += 1
    if inline:
        return _execute(name, tracked, fn, entry, span)
    ready = None
    if device.type == "cuda":
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(device))
    handle = Handle(fn, device, span if async_op else None)
    worker.queue.put((name, tracked, fn, device, ready, handle, entry, span))
    if async_op:
        return handle
    handle.wait()


def _drain():
    """Return once every worker has run everything queued: a sync no-op per group never overtakes."""
    with _lock:
        keys = list(_workers)
    for key in keys:
        _launch("drain", lambda: None, False, torch.device("cpu"), key)

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
