"""fault_tolerance.py: replicas killed with SIGKILL at fixed points of a step train on, take the
dead one back from a live peer, and match the one-process run told who was away when.

Each launch is the file's own launcher (a coordinator and one process per replica, each death
restarted), with --faults placing the kills; the tiny preset, a few steps."""
import json
import os
import subprocess
import sys

import pytest
import torch

import fault_tolerance as F
import model as M
from harness import ROOT, _context, free_port, refuse, read_log, assert_logs_match, assert_states_match, one_thread
from conftest import VOCAB

FT_ARGS = ["--eval_interval=0", "--log_interval=0"]
KILL_TO_STEP_S = 10  # the bound: survivors train again within 10 s of a kill
TIMEOUT_S = 150  # a launch's hard limit


def _joiner(argv, results):
    results.put(refuse("fault_tolerance", argv))


def run_with_faults(argv, faults, tmp, joiners=()):
    """The launcher with --faults, and beside it `joiners` (argv lists), replicas started by hand
    against its coordinator (forked from the tests' server: no interpreter start each).
    -> (records, final weights, [(exit code, stderr) of each joiner])."""
    log, save, port = tmp / "log.jsonl", str(tmp / "final.pt"), free_port()
    ctx = _context()
    results = ctx.Queue()
    hand = [ctx.Process(target=_joiner, args=(a + [f"--coordinator=127.0.0.1:{port}"], results), daemon=True)
            for a in joiners]
    for p in hand:
        p.start()  # each waits for the coordinator's store
    job = subprocess.Popen([sys.executable, "fault_tolerance.py", *argv, f"--faults={faults}", f"--log_file={log}",
                            f"--save_path={save}", f"--coordinator=127.0.0.1:{port}"], cwd=ROOT, text=True,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                           env=dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES=""))
    try:
        _, err = job.communicate(timeout=TIMEOUT_S)
        refused = [results.get(timeout=TIMEOUT_S) for _ in hand]
    except Exception:
        os.killpg(job.pid, 9)
        raise AssertionError(f"timeout after {TIMEOUT_S} s (a hang?): {' '.join(job.args)}\n{job.communicate()[1][-3000:]}")
    finally:
        for p in hand:
            p.kill()
    assert job.returncode == 0, err[-3000:]
    return read_log(log), torch.load(save), sorted(refused, key=lambda r: r[1])


def check_against_reference(argv, faults, records, final):
    """Who trained each step is who --faults left alive; every step's loss and gradient norm are
    the one-process run's on those rows; all replicas hold the same weights after every step
    (so after each rejoin), the reference's at the end; survivors trained again within 10 s."""
    n = int(next(a for a in argv if a.startswith("--replicas="))[11:])
    steps = len(records)
    away = F.absences(faults, steps)
    with one_thread():
        ref, ref_state = F.reference(argv + [f"--max_iters={steps}"], away)
    assert [r["replicas"] for r in records] == [[i for i in range(n) if it not in away.get(i, ())]
                                                for it in range(steps)]
    assert_logs_match(records, ref, 1e-4)
    H = M.parse_args(F.DEFAULTS, argv).sync_every
    for r in records:  # DiLoCo's replicas part between the rounds' ends
        if (r["iter"] + 1) % H == 0:
            assert len(set(r["weights_hash"])) == 1, f"iter {r['iter']}: replicas hold different weights"
    assert_states_match(final, ref_state, 1e-5)
    kills = {s for _, s, _, _ in F.parse_faults(faults)}
    backs = {b for _, _, _, b in F.parse_faults(faults)}
    for r in records:
        assert ("fault_to_step_ms" in r) == (r["iter"] in kills), r
        # (a --faults hold on the next step would count too: the specs leave a step between)
        assert r.get("fault_to_step_ms", 0) < 1000 * KILL_TO_STEP_S, r
        assert ("death_to_rejoin_ms" in r) == (r["iter"] in backs), r


def state_bytes_sent(n_params, sync_every):
    """A joiner's message: the step, the weights, AdamW's two moments (+ DiLoCo's start and momentum)."""
    return 4 + 4 * n_params * (3 + 2 * (sync_every > 1))


@pytest.mark.quick
def test_killed_in_the_all_reduce_and_between_steps_twice(train_args, tmp_path, reference_short):
    """One of 3 replicas killed inside the all-reduce of step 2 (after its first exchange), back at
    4; killed again before step 5's forward, back at 7. Beside it, three replicas that cannot join
    (another replica count, another model, a state from a later step) are refused with one line
    each, and the run is as if they had never come. The reference, told of no absence, is ddp.py's
    one-process run."""
    with one_thread():
        records, _ = F.reference(train_args + ["--max_iters=3", "--replicas=3"])
    assert_logs_match(records, reference_short[0], 1e-4)
    future = tmp_path / "future"  # a checkpoint from a step this job has not reached
    with one_thread():
        import ddp
        ddp.main(train_args + FT_ARGS + ["--max_iters=1", f"--out_dir={future}"])
    folder = future / "step_000001"
    manifest = json.loads((folder / "manifest.json").read_text())
    (folder / "manifest.json").write_text(json.dumps(dict(manifest, step=50)))
    argv = train_args + FT_ARGS + ["--replicas=3"]
    faults = "1@2:reduce>4,1@5:start>7"
    bad = [argv + ["--replica=2", "--replicas=4"], argv + ["--replica=2", "--model=small"],
           argv + ["--replica=2", f"--resume={folder}"], argv + ["--replica=3", "--replicas=4"]]
    records, final, refused = run_with_faults(argv + ["--max_iters=8"], faults, tmp_path, bad)
    check_against_reference(argv, faults, records, final)
    for (code, err), (r, says) in zip(refused, [(2, "a different model: n_layer="),
                                                (2, "started as replica 2 of 4, the job has 3 replicas"),
                                                (2, "its state is at step 50, ahead of"),
                                                (3, "the job has 3 replicas (--replicas)")]):  # an id it has not: never unread
        assert code == 2 and err.count("\n") == 1 and err.startswith(f"error: replica {r} refused: ") and says in err, err
    n_params = M.num_params(M.GPT(M.make_config("tiny", VOCAB, block_size=32)).parameters())
    for r in records:
        n = len(r["replicas"])
        if r["iter"] not in (2, 5):  # a step with a kill sends part of an all-reduce twice
            assert sum(r["comm_bytes"]) == 2 * (n - 1) * 4 * n_params, r
        back = r["iter"] in (4, 7)  # the source (replica 0) sent the joiner its state, one message
        assert r["recovery_bytes"] == ([state_bytes_sent(n_params, 1)] * 2 + [0] if back else [0] * n), r


def test_two_of_four_killed_at_once(train_args, tmp_path):
    argv = train_args + FT_ARGS + ["--replicas=4"]
    faults = "1@2:reduce>4,2@2:reduce>4"
    records, final, _ = run_with_faults(argv + ["--max_iters=5"], faults, tmp_path)
    check_against_reference(argv, faults, records, final)


def test_diloco_a_quarter_of_the_bytes_and_a_replica_lost_mid_round(train_args, tmp_path):
    """--sync_every=4: the pseudo-gradient's all-reduce on every fourth step only, DDP's bytes
    then; replica 1 killed in the middle of the first round (its local step lost), back at the
    second; the one-process DiLoCo reference (the replicas one after another) told so."""
    argv = train_args + FT_ARGS + ["--replicas=3", "--sync_every=4"]
    faults = "1@1:start>4"
    records, final, _ = run_with_faults(argv + ["--max_iters=8"], faults, tmp_path)
    check_against_reference(argv, faults, records, final)
    config = M.make_config("tiny", VOCAB, block_size=32)
    n_params = M.num_params(M.GPT(config).parameters())
    for r in records:
        n = len(r["replicas"])
        sync = (r["iter"] + 1) % 4 == 0
        assert sum(r["comm_bytes"]) == (2 * (n - 1) * 4 * n_params if sync else 0), r
    cfg = M.parse_args(F.DEFAULTS, argv)
    ddp_step = F.traffic_per_rank(config, M.parse_args(F.DEFAULTS, argv + ["--sync_every=1"]), 3)
    assert sum(sum(r["comm_bytes"]) for r in records[4:8]) / 3 == pytest.approx(4 * F.traffic_per_rank(config, cfg, 3))
    assert F.traffic_per_rank(config, cfg, 3) == ddp_step / 4
    assert records[4]["recovery_bytes"] == [state_bytes_sent(n_params, 4)] * 2 + [0]


@pytest.mark.quick
@pytest.mark.parametrize("flags, says", [
    (["--faults=1@3:middle"], "--faults takes R@S:start|reduce[>B]"),
    (["--faults=1@3:start>2"], "--faults takes R@S:start|reduce[>B]"),
    (["--replicas=5"], "does not divide into 5 replicas"),
    (["--replica=1"], "--replica needs --coordinator"),
    (["--out_dir=x"], "recovers from a live peer, not a checkpoint"),
    (["--launch=0,3"], "--launch takes this node's replica ids"),
    (["--sync_every=4", "--faults=1@1:start>6"], "comes back at a round's start"),
])
def test_bad_flags(train_args, flags, says, capsys):
    with pytest.raises(SystemExit) as e:
        F.main(train_args + flags)
    assert e.value.code == 2 and says in capsys.readouterr().err


@pytest.mark.quick
def test_the_coordinators_rules():
    """The quorum's rules, on a store in this process: the first epoch waits for all N; a step
    commits once every member voted; after an abort the next epoch waits for every member to be
    dead or alive again (a survivor slow to say so is not left out before --timeout_s); a joiner
    is admitted at a step boundary, with the lowest survivor as its source."""
    import datetime
    import torch.distributed as dist
    store = dist.TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=5))
    cfg = M.parse_args(F.DEFAULTS, ["--replicas=3", "--max_iters=10", "--timeout_s=60"])
    job = dict(replica=0, replicas=3, sync_every=1, step=0, config={}, batch=[24, 32], seed=7)
    co = F.Coordinator(store, cfg, job)

    def announce(r):
        life = store.add(f"lives/{r}", 1) - 1
        store.set(f"join/{r}/{life}", json.dumps(dict(job, replica=r)))

    def epoch(e):
        co.tick()
        return json.loads(store.get(f"epoch/{e}")) if store.check([f"epoch/{e}"]) else None
    for r in (0, 1):
        announce(r)
    assert epoch(0) is None  # two of three
    announce(2)
    assert epoch(0)["members"] == [0, 1, 2]
    store.add("vote/0/0", 2)
    co.tick()
    assert not store.check(["next/0/0"])  # two votes of three: no verdict
    store.add("vote/0/0", 1)
    co.tick()
    assert store.get("next/0/0") == b"0"  # step 0 committed, the same epoch goes on
    store.add("vote/0/1", 2)
    store.set("dead/1/0", "-9")  # replica 1's launcher saw it die before it voted
    store.set("alive/0/0", "1")
    assert epoch(1) is None and store.check(["abort/0"]) and not store.check(["next/0/1"])  # replica 2 not heard yet
    store.set("alive/0/2", "1")
    assert epoch(1) == dict(epoch=1, members=[0, 2], step=1, joiners=[], source=0, back={})
    announce(1)  # back, and admitted when step 1 commits
    store.add("vote/1/1", 2)
    assert epoch(2)["members"] == [0, 1, 2] and epoch(2)["joiners"] == [1] and epoch(2)["source"] == 0
    assert store.get("next/1/1") == b"2" and store.get("admit/1/1") == b"2"
