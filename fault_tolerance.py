"""
Fault tolerance: N data-parallel replicas that train on when one of them dies, and take it
back from a live peer when it returns; or DiLoCo, replicas that talk every H steps.

    python fault_tolerance.py --model=tiny --batch_size=24 --replicas=3 --faults=1@3:reduce>6
    python fault_tolerance.py --model=tiny --batch_size=24 --replicas=3 --sync_every=4

The first command starts a coordinator (a TCPStore) and 3 replicas, one process each, and
restarts a replica that dies; --faults kills replica 1 with SIGKILL inside the all-reduce of
step 3 and holds the door for it until step 6. Replica i always trains on slot i of N of the
global batch of step k (drawn from (seed, k) as everywhere here); an absent replica's rows
are dropped, so a step's gradient is the mean over the rows its survivors trained on.

What keeps it going, each step (the quorum; torchft's Manager and Lighthouse, in miniature):
  1. the survivors' gradients are averaged over an epoch's process group (collectives.py's
     all-reduce on gloo): a dead peer's closed socket fails that all-reduce at once
  2. each replica votes in the store that it has the step; the coordinator, which watches
     every replica's process, commits the step when every member has voted
  3. a replica that fails (a collective, or the vote) marks the epoch aborted, drops its
     group (which fails its peers' waits on it at once) and says it is alive; the coordinator
     makes epoch e+1 of those alive, and they redo the step from their own kept gradients
  4. a replica that (re)starts announces itself; at a step boundary the coordinator admits it
     into a new epoch, and the lowest live replica sends it the weights, AdamW's state and the
     step counter (one message); no checkpoint is read. A joiner whose flags differ is refused.
The coordinator must outlive the replicas: it is the launcher (the first command), or any
process every replica reaches (--coordinator=HOST:PORT; docs/fault_tolerance.md).

--sync_every=H > 1 is DiLoCo (Douillard et al. 2023): H local AdamW steps on a replica's own
rows, then an all-reduce of the pseudo-gradient (the round's start weights minus the local
ones) and an outer Nesterov step: 2(N-1)/N of the weight bytes every H steps, 1/H of DDP's.

The lesson is everything above the "the lab" fence (a replica's step, its vote, its recovery,
the state it sends a joiner); below it: the coordinator, the launcher, faults on demand.
"""

import copy
import datetime
import hashlib
import json
import multiprocessing
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

import collectives as C
import model as M

DEFAULTS = dict(
    M.TRAIN_DEFAULTS,
    replicas=3,             # data-parallel replicas, one process each; replica i trains on slot i of N
    replica=-1,             # -1: launch the coordinator and the replicas; i: be replica i (the launcher sets it)
    coordinator="",         # HOST:PORT of a coordinator that outlives the replicas ("": this launcher hosts it)
    launch="",              # which replica ids this node launches, comma-separated ("": all of them)
    sync_every=1,           # 1: average the gradients every step; H > 1: DiLoCo, H local steps a round
    outer_lr=0.7,           # DiLoCo's outer Nesterov step: learning rate
    outer_momentum=0.9,     # and momentum
    max_restarts=3,         # how often the launcher restarts a replica that died
    faults="",              # kills on demand, R@STEP:WHERE[>BACK], e.g. 1@3:reduce>6 (see parse_faults)
    timeout_s=10,           # a peer silent this long is taken for dead
)
POLL_S = 0.002  # how often a waiting replica, or the coordinator, reads the store


class Failure(Exception):
    """The epoch cannot finish this step: a peer died, or another replica said so."""


def wait_for(store, keys):
    """-> the first of `keys` the store holds, polling (TCPStore.wait waits for all of them)."""
    while True:
        for key in keys:
            if store.check([key]):
                return key
        time.sleep(POLL_S)


def commit(store, ep, step):
    """Vote that this replica has step `step`, and wait for the coordinator's verdict: -> the
    epoch of the next step. The coordinator writes next/ only once every member voted, and
    never after abort/: so a step either commits on every survivor or on none."""
    e = ep["epoch"]
    store.add(f"vote/{e}/{step}", 1)
    wait_for(store, [f"next/{e}/{step}", f"abort/{e}"])
    if not store.check([f"next/{e}/{step}"]):  # checked again: next/ may have come just before abort/
        raise Failure(f"epoch {e} aborted")
    return int(store.get(f"next/{e}/{step}"))


def recover(store, ep, me, step):
    """The failure path: tell the others (they may be waiting on a vote), drop the group (a peer
    blocked on one of our messages fails now, not at its timeout), say we are alive and which
    step we need. -> (the epoch the coordinator makes of the survivors, the fault's first notice)."""
    e = ep["epoch"]
    noticed = float(store.compare_set(f"abort/{e}", "", str(time.time())))  # the first to notice sets it
    dist.destroy_process_group()
    store.set(f"alive/{e}/{me}", str(step))
    return e + 1, noticed


def state_tensors(model, optimizer, outer):
    """Everything a joiner needs, in one order on every replica: the weights, AdamW's moments,
    and DiLoCo's round start and outer momentum."""
    params = list(model.parameters())
    ts = [p.data for p in params] + [optimizer.state[p][m] for p in params for m in M.MOMENTS if m in optimizer.state[p]]
    if outer is not None:
        ts += [outer.param_groups[0]["params"][0].data]
        ts += [s["momentum_buffer"] for s in outer.state.values() if s.get("momentum_buffer") is not None]
    return ts


def send_state(ep, me, step, model, optimizer, outer, device):
    """The lowest live replica sends the joiners its state and the step counter, one message
    each; a joiner makes empty moments (AdamW's, the outer step's) where the source has them,
    then receives. -> the message's bytes (0 where nothing was sent)."""
    members, joiners = ep["members"], ep["joiners"]
    if not joiners or (me != ep["source"] and me not in joiners):
        return 0
    if me in joiners and step > 0:  # AdamW keeps its moments and its step count after the first step
        for p in model.parameters():
            on = p.device if device.type == "cuda" else "cpu"  # where AdamW keeps its count (fused on a GPU)
            optimizer.state[p] = dict(step=torch.tensor(float(step), device=on),
                                      **{m: torch.zeros_like(p) for m in M.MOMENTS})
        if outer is not None and step >= outer.sync_every:
            start = outer.param_groups[0]["params"][0]
            outer.state[start] = dict(momentum_buffer=torch.zeros_like(start))
    ts = state_tensors(model, optimizer, outer)
    flat = torch.cat([torch.tensor([float(step)], device=device)] + [t.reshape(-1) for t in ts]).cpu()
    with C.untracked():  # recovery traffic, logged apart (recovery_bytes)
        if me == ep["source"]:
            for j in joiners:
                C.send(flat, dst=members.index(j))
        else:
            C.recv(flat, src=members.index(ep["source"]))
            assert int(flat[0]) == step, f"the source is at step {int(flat[0])}, the epoch at {step}"
            copy_into(ts, flat[1:].to(device))
    return flat.numel() * flat.element_size()


def copy_into(tensors, flat):
    """Each tensor gets its piece of flat, in order (vector_to_parameters would make them views)."""
    with torch.no_grad():
        for t, piece in zip(tensors, flat.split([t.numel() for t in tensors])):
            t.copy_(piece.view_as(t))


def replica(cfg):
    """One replica: ddp.py's naive step (or DiLoCo's round), each step committed by the quorum."""
    me, N, H = cfg.replica, cfg.replicas, cfg.sync_every
    run = M.start(cfg, "fault_tolerance")
    device = run.device
    model = M.GPT(run.config, seed=cfg.seed).to(device)
    params = list(model.parameters())
    flat = torch.zeros(M.num_params(params), device=device)  # every gradient in one buffer, .grad views of it
    for p, g in zip(params, flat.split([p.numel() for p in params])):
        p.grad = g.view_as(p)
    optimizer = M.make_optimizer(model.named_parameters(), cfg, device)
    run.rank = -1  # not the log's writer until an epoch says so: a restarted replica must not truncate it
    M.restore(run, [(n, p, None, False) for n, p in model.named_parameters()], optimizer)
    outer = None
    if H > 1:  # DiLoCo's outer optimizer holds the round's start weights, one flat tensor
        start = torch.nn.utils.parameters_to_vector(params).detach().clone()
        outer = torch.optim.SGD([start], lr=cfg.outer_lr, momentum=cfg.outer_momentum, nesterov=True)
        outer.sync_every = H
    store, life, first = arrive(cfg, run)  # the coordinator's store, announced and admitted (or refused: one line)
    if first is None:
        return []  # the job finished before we were back
    faults = Faults(cfg.faults, me, life)

    def join(e):
        """Enter epoch e: its process group (the default group, made again on the epoch's own
        store prefix, so that collectives.py's ranks are the epoch's), who logs, a joiner's state."""
        if dist.is_initialized():
            dist.destroy_process_group()
        store.wait([f"epoch/{e}"], datetime.timedelta(seconds=3 * cfg.timeout_s))
        ep = json.loads(store.get(f"epoch/{e}"))
        if me not in ep["members"]:
            M.die(f"replica {me} was dropped from the job (it did not answer within --timeout_s={cfg.timeout_s}); "
                  "start it again to rejoin", code=1, scope="me")
        run.rank, run.world = ep["members"].index(me), len(ep["members"])
        dist.init_process_group("gloo", store=dist.PrefixStore(f"epoch{e}/", store), rank=run.rank,
                                world_size=run.world, timeout=datetime.timedelta(seconds=cfg.timeout_s))
        if (run.rank == 0) != run.log.active:
            run.log = M.Logger(cfg, run.rank, start_iter=ep["step"])
        run.recovery_bytes = send_state(ep, me, ep["step"], model, optimizer, outer, device)
        if run.rank == 0 and cfg.log_interval:
            print(f"epoch {e}: replicas {ep['members']} from step {ep['step']}" +
                  (f", {ep['joiners']} back from replica {ep['source']}'s state" if ep["joiners"] else ""), flush=True)
        return ep

    @torch.no_grad()
    def evaluate():  # on this replica's weights, the whole validation batch: no message, nothing to fail
        model.eval()
        with run.autocast:
            losses = [model(*M.batch(run, k, "val"))[1] for k in range(cfg.eval_iters)]
        model.train()
        return torch.stack(losses).mean().item()

    ep = join(first)
    for it in range(ep["step"], cfg.max_iters):
        faults.at(it, "start")
        M.begin_iter(run, it, evaluate)
        # ---------------------------------------------------------------- the training step
        flat.zero_()
        x, y = M.batch(run, it, "train", 0, 1, me, N)  # slot `me` of N, whoever else is alive
        with run.autocast:
            _, loss = model(x, y)
        loss.backward()
        sync = (it + 1) % H == 0  # every step for DDP (H = 1), a round's last for DiLoCo
        if H > 1:  # DiLoCo: an inner step on this replica's rows alone, every step
            norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip) if cfg.grad_clip else 0.0
            optimizer.step()
            if sync:  # the pseudo-gradient, sent where DDP sends the gradient
                flat.copy_(start - torch.nn.utils.parameters_to_vector(params))
        mine = flat.clone()  # this replica's share of the step: sent again if the step is redone
        noticed = None
        while True:
            try:
                if sync:  # the survivors' mean, on gloo via the host: a gloo group can be made again after
                    host = mine.to("cpu", copy=True)  # a death (an NCCL communicator must be aborted, docs)
                    faults.at(it, "reduce")
                    C.all_reduce(host, op="avg")
                    flat.copy_(host)
                nxt = commit(store, ep, it)
                break
            except (C.CommError, Failure):
                e, t = recover(store, ep, me, it)
                noticed = noticed or t
                ep = join(e)  # the survivors redo this step, on their rows alone
        if H == 1:  # after the all-reduce every replica holds the same gradient: the local norm is the global
            norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip) if cfg.grad_clip else 0.0
            optimizer.step()
        elif sync:  # the outer step from the mean pseudo-gradient, and every replica starts the next round there
            start.grad = flat
            outer.step()
            copy_into(params, start)
        # ---------------------------------------------------------------- end of the training step
        run.record.update(replicas=ep["members"])
        if noticed:
            run.record.update(fault_to_step_ms=1000 * (time.time() - noticed))
        if ep["back"] and it == ep["step"]:
            run.record.update(death_to_rejoin_ms=1000 * (time.time() - min(ep["back"].values())))
        state = M.tensor_bytes(params) * (3 + 2 * (H > 1)) + M.optimizer_state_bytes(optimizer)
        try:
            M.end_iter(run, loss=loss.item(), grad_norm=norm, state_bytes=state, weights_hash=fingerprint(params),
                       recovery_bytes=run.recovery_bytes)
        except C.CommError:  # the step is committed; its log line may be lost with the peer
            if it + 1 == cfg.max_iters:
                break  # the last step: nothing left to re-form for
            nxt, _ = recover(store, ep, me, it + 1)
        run.recovery_bytes = 0
        if nxt != ep["epoch"]:  # a new epoch from the next step on: joiners admitted, or survivors
            ep = join(nxt)
    if dist.is_initialized():
        dist.destroy_process_group()
    if cfg.save_path and run.rank == 0:  # this replica's weights are all of them: no gathering (M.finish's)
        torch.save(model.state_dict(), cfg.save_path + ".tmp")
        os.replace(cfg.save_path + ".tmp", cfg.save_path)  # written, then renamed: never half a file
    cfg.save_path = ""
    return M.finish(run)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    cfg = M.parse_args(DEFAULTS, argv, __doc__)
    if "WORLD_SIZE" in os.environ:
        M.die("fault_tolerance.py launches its own replicas, one process each: run it with python, not torchrun")
    if cfg.replicas < 1 or cfg.sync_every < 1 or not -1 <= cfg.replica < cfg.replicas:
        M.die(f"--replicas and --sync_every must be at least 1, and --replica in [0, {cfg.replicas}), "
              f"not {cfg.replicas}, {cfg.sync_every}, {cfg.replica}")
    if cfg.batch_size % cfg.replicas:
        M.die(f"--batch_size={cfg.batch_size} does not divide into {cfg.replicas} replicas")
    if cfg.out_dir or cfg.n_expert or cfg.compile or cfg.trace:
        M.die("fault_tolerance.py recovers from a live peer, not a checkpoint: --out_dir, --compile, --trace and "
              "--n_expert are ddp.py's (--resume=FOLDER starts every replica from a checkpoint)")
    if any(b is not None and b % cfg.sync_every for _, _, _, b in parse_faults(cfg.faults)):
        M.die(f"--faults: with --sync_every={cfg.sync_every} a replica comes back at a round's start (B a multiple of it)")
    if cfg.launch and not all(r.isdigit() and int(r) < cfg.replicas for r in cfg.launch.split(",")):
        M.die(f"--launch takes this node's replica ids, comma-separated, each below --replicas={cfg.replicas}, "
              f"not {cfg.launch!r}")
    if cfg.replica < 0:
        sys.exit(launch(cfg, argv))
    if not cfg.coordinator:
        M.die("--replica needs --coordinator=HOST:PORT, the launcher's store")
    return replica(cfg)


# -----------------------------------------------------------------------------
# the lab: the coordinator and the launcher, faults on demand, the one-process reference, the cost of a failure

def announce(cfg, run, me):
    """What a replica must share with the job to join it."""
    return dict(replica=me, replicas=cfg.replicas, sync_every=cfg.sync_every, step=run.start_iter,
                config=vars(run.config), batch=[cfg.batch_size, cfg.block_size], seed=cfg.seed)


def arrive(cfg, run):
    """Announce this life of the replica in the coordinator's store and wait for its verdict:
    -> (the store, life, the epoch it is admitted to or None: the job has finished); refused, one line."""
    host, _, port = cfg.coordinator.rpartition(":")
    store = dist.TCPStore(host or "127.0.0.1", int(port), is_master=False,
                          timeout=datetime.timedelta(seconds=3 * cfg.timeout_s))
    me, life = cfg.replica, int(os.environ.get("FT_LIFE", -1))  # a launcher gives it, to report this life's death
    n = int(store.get("replicas"))  # the coordinator reads ids below the job's count only: refused here, not unread
    if me >= n:
        M.die(f"replica {me} refused: the job has {n} replicas (--replicas), ids 0 to {n - 1}", scope="me")
    life = life if life >= 0 else store.add(f"lives/{me}", 1) - 1
    store.set(f"join/{me}/{life}", json.dumps(announce(cfg, run, me)))
    verdict = wait_for(store, [f"admit/{me}/{life}", f"refuse/{me}/{life}"])
    why = store.get(verdict).decode()
    if verdict.startswith("refuse") and why != "finished":
        M.die(f"replica {me} refused: {why}", scope="me")
    return store, life, None if verdict.startswith("refuse") else int(why)


class Coordinator:
    """The one process that must not die decides the epochs. Every POLL_S it reads the deaths (from
    the launchers), announcements, votes and an aborted epoch's survivors; it writes epoch/e (members,
    first step, joiners and their source), next/e/k (the epoch of step k+1, once every member voted),
    abort/e, and each announcement's admit/ or refuse/."""

    def __init__(self, store, cfg, job):
        self.store, self.cfg, self.job = store, cfg, job
        self.e, self.members, self.k, self.aborted = -1, {}, None, None  # members: replica -> its life
        self.seen, self.pending, self.died_at = set(), {}, {}  # (replica, life) read; joiners; deaths' times
        self.holds = [(b, r) for r, _, _, b in parse_faults(cfg.faults) if b is not None]
        store.set("replicas", str(cfg.replicas))  # what a replica checks its id against before it announces

    def dead(self, r, life):
        return self.store.check([f"dead/{r}/{life}"])

    def refusal(self, joiner):
        """-> why a joiner cannot join the job (one line), or None."""
        job, r, now = self.job, joiner["replica"], self.job["step"] if self.k is None else self.k
        if joiner["replicas"] != job["replicas"]:  # (main() saw to it that r < its --replicas)
            return f"it was started as replica {r} of {joiner['replicas']}, the job has {job['replicas']} replicas"
        for key in ("sync_every", "batch", "seed"):
            if joiner[key] != job[key]:
                return f"its {key} is {joiner[key]}, the job's {job[key]}"
        if joiner["config"] != job["config"]:
            diff = ", ".join(f"{k}={joiner['config'][k]} (the job's {v})" for k, v in job["config"].items()
                             if joiner["config"].get(k) != v)
            return f"a different model: {diff}"
        if joiner["step"] > now:
            return f"its state is at step {joiner['step']}, ahead of the job's step {now}: a replica of another run?"
        if self.k is None and joiner["step"] != now:
            return f"its state is at step {joiner['step']}, the job starts at step {now}"
        if r in self.pending or r in self.members and not self.dead(r, self.members[r]):
            return f"replica {r} is already in the job"
        return "finished" if self.k is not None and self.k >= self.cfg.max_iters else None

    def admit_now(self, step):
        """The joiners to admit at the start of `step`; None: wait (a --faults hold not yet ready).
        DiLoCo admits at a round's start, where every replica holds the same weights."""
        if step >= self.cfg.max_iters:
            return []
        if self.cfg.faults:
            want = [r for b, r in self.holds if b == step]
            return None if any(r not in self.pending for r in want) else want
        return list(self.pending) if step % self.cfg.sync_every == 0 else []

    def form(self, members, step, joiners):
        """Epoch e+1: the members (replica -> life) and the joiners admitted with it."""
        e, lives = self.e + 1, {**members, **{r: self.pending.pop(r) for r in joiners}}
        self.store.set(f"epoch/{e}", json.dumps(dict(
            epoch=e, members=sorted(lives), step=step, joiners=sorted(joiners) if members else [],
            source=min(members) if members else None,
            back={r: self.died_at.pop(r) for r in joiners if r in self.died_at})))
        for r in joiners:
            self.store.set(f"admit/{r}/{lives[r]}", str(e))
        self.e, self.members, self.k, self.aborted = e, lives, step, None

    def tick(self):
        """One look at the store, and what it calls for written back."""
        st, cfg = self.store, self.cfg
        for r in range(cfg.replicas):  # new replicas: refused, or wait to be admitted
            for life in range(st.add(f"lives/{r}", 0)):  # a life that died starting never announces
                if (r, life) not in self.seen and st.check([f"join/{r}/{life}"]):
                    self.seen.add((r, life))
                    why = self.refusal(json.loads(st.get(f"join/{r}/{life}")))
                    if why:
                        st.set(f"refuse/{r}/{life}", why)
                    else:
                        self.pending[r] = life
        self.pending = {r: life for r, life in self.pending.items() if not self.dead(r, life)}
        if self.k is not None and self.k >= cfg.max_iters:
            return
        if self.e < 0:  # the first epoch: all of them, each from the same start (no source)
            if len(self.pending) == cfg.replicas:
                self.form({}, self.job["step"], list(self.pending))
            return
        for r, life in self.members.items():
            if self.dead(r, life):  # a member's process is gone: nobody waits for it
                self.died_at.setdefault(r, time.time())
                if self.aborted is None:
                    st.compare_set(f"abort/{self.e}", "", str(time.time()))
        if self.aborted is None and st.check([f"abort/{self.e}"]):
            self.aborted = time.monotonic()
        if self.aborted is None:  # the step commits once every member has voted for it
            joiners = self.admit_now(self.k + 1)
            if st.add(f"vote/{self.e}/{self.k}", 0) < len(self.members) or joiners is None:
                return
            e, k = self.e, self.k
            if joiners:
                self.form(self.members, k + 1, joiners)
            else:
                self.k += 1
            st.set(f"next/{e}/{k}", str(self.e))
            return
        # aborted: wait until every member is dead or alive again (the silent: --timeout_s), then re-form
        alive = {r: life for r, life in self.members.items()
                 if not self.dead(r, life) and st.check([f"alive/{self.e}/{r}"])}
        silent = [r for r, life in self.members.items() if not self.dead(r, life) and r not in alive]
        if silent and time.monotonic() - self.aborted < cfg.timeout_s:
            return
        if not alive:
            raise SystemExit("error: every replica of the job died: nothing is left to recover from")
        step = max(int(st.get(f"alive/{self.e}/{r}")) for r in alive)
        self.form(alive, step, self.admit_now(step) or [])


def launch(cfg, argv):
    """The launcher: hosts the coordinator (unless --coordinator names another host's), starts its
    replicas (--launch, default all) as processes of their own, counts each one's death in the
    store and starts it again (--max_restarts). torchrun's agent cannot: it restarts every worker."""
    host, _, port = cfg.coordinator.rpartition(":")
    host, hosting = host or "127.0.0.1", host in ("", "127.0.0.1", "localhost")
    store = dist.TCPStore(host, int(port or 0), is_master=hosting, wait_for_workers=False,  # port 0: a free one
                          timeout=datetime.timedelta(seconds=60))
    port = store.port
    mine = [int(r) for r in cfg.launch.split(",")] if cfg.launch else list(range(cfg.replicas))
    run = M.start(cfg, "fault_tolerance")  # the flags and the data, checked once here
    job = dict(announce(cfg, run, 0), step=M.read_manifest(cfg.resume)["step"] if cfg.resume else 0)
    coordinator = Coordinator(store, cfg, job) if hosting else None
    if coordinator:
        print(f"fault_tolerance: coordinator at {host}:{port}, {cfg.replicas} replicas, " +
              (f"DiLoCo, H = {cfg.sync_every}" if cfg.sync_every > 1 else "the gradient averaged every step"), flush=True)
    args = [a for a in argv if not a.startswith(("--replica=", "--coordinator=", "--launch="))]
    lives, ctx = {}, multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "numpy", "model", "collectives", "fault_tolerance"])
    from fault_tolerance import replica_process  # by its module's name, not __main__'s, for the server

    def start(r):  # a process of its own, forked from a server that imported torch once (0.1 s, not 3)
        lives[r] = store.add(f"lives/{r}", 1) - 1
        p = ctx.Process(target=replica_process, args=(
            args + [f"--replica={r}", f"--coordinator={host}:{port}"], lives[r], mine.index(r)))
        p.start()
        return p
    procs, restarts, done = {r: start(r) for r in mine}, {r: 0 for r in mine}, set()
    try:
        while len(done) < len(mine):
            for r, p in procs.items():
                if r in done or p.exitcode is None:
                    continue
                if p.exitcode == 0:
                    done.add(r)
                    continue
                store.set(f"dead/{r}/{lives[r]}", str(p.exitcode))
                if p.exitcode != 2 and restarts[r] < cfg.max_restarts:  # 2: refused
                    restarts[r] += 1
                    procs[r] = start(r)
                    continue
                print(f"replica {r} exited with {p.exitcode}; not restarted", file=sys.stderr, flush=True)
                done.add(r)  # the others go on
                if coordinator and coordinator.e < 0:  # the first epoch waits for all N: it never comes
                    print("error: the job cannot start without every replica", file=sys.stderr, flush=True)
                    return 1
            if coordinator:
                coordinator.tick()
            time.sleep(POLL_S)
    finally:
        for p in procs.values():
            if p.exitcode is None:
                p.kill()
    return 0 if all(procs[r].exitcode == 0 for r in mine) else 1


def replica_process(argv, life, local):
    """A launcher's replica: its life (for its death's report) and its GPU (the local-th of the node)."""
    os.environ.update(FT_LIFE=str(life), LOCAL_RANK=str(local), OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    M.main_guard(lambda: main(argv))


def parse_faults(spec):
    """--faults=R@S:WHERE>B,...: replica R dies (SIGKILL, by its own hand) at step S, WHERE is
    `start` (before the step's forward) or `reduce` (inside its all-reduce, after the first
    exchange); the coordinator holds step B until R is back (>B may be left out: not awaited).
    A replica's entries apply to its lives in order. -> [(R, S, WHERE, B or None)]."""
    out = []
    for item in filter(None, spec.split(",")):
        try:
            r, rest = item.split("@")
            s, rest = rest.split(":")
            where, _, back = rest.partition(">")
            out.append((int(r), int(s), where, int(back) if back else None))
            assert where in ("start", "reduce") and (not back or int(back) > int(s))
        except (ValueError, AssertionError):
            M.die(f"--faults takes R@S:start|reduce[>B],... (B after S), not {item!r}")
    return out


def absences(spec, max_iters):
    """--faults -> {replica: the steps it is away}: from its death to the step it is back."""
    away = {}
    for r, s, _, b in parse_faults(spec):
        away.setdefault(r, set()).update(range(s, b if b is not None else max_iters))
    return away


class Faults:
    """This replica's own death, from --faults: the life-th entry that names it."""

    def __init__(self, spec, me, life):
        mine = [(s, where) for r, s, where, _ in parse_faults(spec) if r == me]
        self.kill = mine[life] if life < len(mine) else None

    def at(self, step, where):
        if self.kill != (step, where):
            return
        if where == "start":
            os.kill(os.getpid(), signal.SIGKILL)
        real = C._run

        def first_exchange_then_die(steps, *args, **kw):  # dies with part of its data sent
            try:
                real(steps[:1], *args, **kw)
            finally:
                os.kill(os.getpid(), signal.SIGKILL)
        C._run = first_exchange_then_die


def fingerprint(params):
    """48 bits of a hash of every weight, logged per replica: equal means equal to the bit."""
    data = torch.nn.utils.parameters_to_vector(params).detach().cpu().numpy().tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=6).digest(), "big")


def traffic_per_rank(config, cfg, world):
    """Bytes a replica sends a step, on average: DDP's all-reduce of the gradient, 2(N-1)/N of
    its bytes, once every --sync_every steps (DiLoCo's pseudo-gradient has the weights' size)."""
    return 2 * (world - 1) / world * 4 * M.param_count(config) / cfg.sync_every


def lost_work(failures_per_day, replicas, ckpt_interval_s, restart_s, recovery_s, rejoin_s, round_s):
    """The share of a day's work (0..1) that failures cost, each taking one replica, three ways
    (docs/fault_tolerance.md, "What a failure costs"). -> {way: share}."""
    day = 86400.0
    return {"checkpoint-restart": failures_per_day * (ckpt_interval_s / 2 + restart_s) / day,
            "per step": failures_per_day * (recovery_s + rejoin_s / replicas) / day,
            "DiLoCo": failures_per_day * (recovery_s + (round_s + rejoin_s) / replicas) / day}


def reference(argv, away=None):
    """The one-process run the replicas are held to, told who was away when ({replica: steps}, as
    absences gives). DDP: one forward over the present replicas' rows. DiLoCo: the replicas one after
    another, each its own model and AdamW; one back gets the round's start and the lowest survivor's
    AdamW state, as send_state gives it. -> (records, the final state_dict)."""
    cfg = M.parse_args(DEFAULTS, argv, __doc__)
    run = M.start(cfg, "fault_tolerance")
    N, H, away = cfg.replicas, cfg.sync_every, away or {}
    models = [M.GPT(run.config, seed=cfg.seed).to(run.device) for _ in range(1 if H == 1 else N)]
    opts = [M.make_optimizer(m.named_parameters(), cfg, run.device) for m in models]
    start = torch.nn.utils.parameters_to_vector(models[0].parameters()).detach().clone()
    outer = torch.optim.SGD([start], lr=cfg.outer_lr, momentum=cfg.outer_momentum, nesterov=True)
    records = []
    for it in range(cfg.max_iters):
        here = [r for r in range(N) if it not in away.get(r, ())]
        for o in opts:
            M.set_lr(o, M.get_lr(it, cfg))
        if H == 1:  # one model, the present replicas' rows together
            rows = [M.batch(run, it, "train", 0, 1, r, N) for r in here]
            batches = {0: (torch.cat([x for x, _ in rows]), torch.cat([y for _, y in rows]))}
        else:
            source = min(r for r in here if it - 1 not in away.get(r, ()))
            for r in here:
                if it - 1 in away.get(r, ()):  # back: the round's start weights, the source's AdamW state
                    copy_into(list(models[r].parameters()), start)
                    opts[r].load_state_dict(copy.deepcopy(opts[source].state_dict()))
            batches = {r: M.batch(run, it, "train", 0, 1, r, N) for r in here}
        losses, norms = [], []
        for r, (x, y) in batches.items():
            opts[r].zero_grad()
            with run.autocast:
                _, loss = models[r](x, y)
            loss.backward()
            norms.append(torch.nn.utils.clip_grad_norm_(models[r].parameters(), cfg.grad_clip).item())
            opts[r].step()
            losses.append(loss.item())
        if H > 1 and (it + 1) % H == 0:
            start.grad = torch.stack([start - torch.nn.utils.parameters_to_vector(models[r].parameters())
                                      for r in here]).mean(0)
            outer.step()
            for r in here:
                copy_into(list(models[r].parameters()), start)
        records.append(dict(iter=it, loss=sum(losses) / len(losses), grad_norm=norms[0]))
    return records, models[0].state_dict()


if __name__ == "__main__":
    M.main_guard(main)
