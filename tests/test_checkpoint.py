"""Checkpoints: exact resume, resharding from any strategy and world size to any other,
refusal of a corrupt or mismatched checkpoint, and a run that survives a killed rank.

Each strategy's own test file checks that it resumes its own checkpoints exactly; here
every pair of strategies meets once, at different world sizes: a writer trains 4 steps
and saves at step 2, a reader of another strategy resumes from it, and its losses at
iterations 2 and 3 must match the writer's (the first is the loaded weights; the
second, one optimizer step later, shows Adam's state moved too)."""
import json
import os
import shutil
import signal

import pytest
import torch

import model as M
from harness import ROOT, spawn, torchrun, python, read_log

SCRIPTS = dict(ddp="ddp.py", fsdp="fsdp.py", tp="tensor_parallel.py", pp="pipeline_parallel.py",
               cp="context_parallel.py")
MODULES = {k: v[:-3] for k, v in SCRIPTS.items()}
AT, END = 2, 4  # the checkpoint's step, and the run's last (in the warm-up: lr moves at every step)
STEP = f"step_{AT:06d}"
RUN_ARGS = [f"--max_iters={END}", "--eval_interval=0"]
CKPT_ARGS = RUN_ARGS + [f"--ckpt_interval={AT}"]
WRITERS = {1: ["ddp"], 2: ["tp", "cp"], 3: ["pp"], 4: ["fsdp"]}
# (writer, writer's world) -> [(reader, reader's world)]: every pair of strategies once
READERS = {1: [("tp", 2, "ddp"), ("cp", 2, "ddp")],
           2: [("ddp", 1, "fsdp"), ("pp", 3, "fsdp"), ("fsdp", 4, "tp")],
           4: [("ddp", 1, "pp"), ("cp", 2, "fsdp"), ("tp", 2, "pp"), ("cp", 2, "tp"), ("pp", 3, "cp")]}


def _main(name, args):
    import importlib
    return importlib.import_module(MODULES[name]).main(args)


def _train_ddp(rank, world, args):
    import ddp
    ddp.main(args)


def _write(rank, world, train_args, out):
    return {name: _main(name, train_args + CKPT_ARGS + [f"--out_dir={out}/{name}{world}"]) for name in WRITERS[world]}


def _read(rank, world, train_args, out):
    return {(w, ww): _main(r, train_args + RUN_ARGS + [f"--resume={out}/{w}{ww}/{STEP}"])
            for w, ww, r in READERS[world]}


@pytest.fixture(scope="module")
def written(train_args, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("ckpt"))
    logs = {}
    for world in WRITERS:
        got = _write(0, 1, train_args, out) if world == 1 else spawn(_write, world, train_args, out, timeout=400)[0]
        logs.update({(name, world): records for name, records in got.items()})
    return out, logs


@pytest.mark.parametrize("world", sorted(READERS))
def test_reshard_between_every_pair_of_strategies(world, written, train_args):
    out, logs = written
    got = _read(0, 1, train_args, out) if world == 1 else spawn(_read, world, train_args, out, timeout=400)[0]
    for (writer, wworld), records in got.items():
        reader = next(r for w, ww, r in READERS[world] if (w, ww) == (writer, wworld))
        what = f"{writer} at {wworld} ranks -> {reader} at {world}"
        ref = logs[(writer, wworld)]
        assert [r["iter"] for r in records] == [AT, AT + 1], what
        assert abs(records[0]["loss"] - ref[AT]["loss"]) <= 1e-6, (what, records[0]["loss"], ref[AT]["loss"])
        assert abs(records[1]["loss"] - ref[AT + 1]["loss"]) <= 1e-5, (what, records[1]["loss"], ref[AT + 1]["loss"])


def test_manifest_says_what_each_rank_holds(written):
    out, _ = written
    m = json.load(open(f"{out}/fsdp4/{STEP}/manifest.json"))
    assert m["strategy"] == "fsdp" and m["world"] == 4 and m["step"] == AT and len(m["files"]) == 4
    for f in m["files"]:
        assert os.path.getsize(f"{out}/fsdp4/{STEP}/{f['file']}") == f["bytes"] and len(f["sha256"]) == 64
        assert {p["kind"] for p in f["pieces"]} == {"param", "exp_avg", "exp_avg_sq"}
    # the four FSDP ranks hold disjoint pieces that add up to the model, three times (param, m, v)
    held = 0
    for f in m["files"]:  # each file read once (read per piece, this test took 15 s)
        tensors = torch.load(f"{out}/fsdp4/{STEP}/{f['file']}", weights_only=True)
        held += sum(tensors[p["key"]].numel() for p in f["pieces"])
    config = M.GPTConfig(**m["model"])
    assert held == 3 * M.param_count(config)
    assert sorted(os.listdir(f"{out}/ddp1")) == [STEP, f"step_{END:06d}"]  # the final one too; no .tmp left


def ddp_run(args, capsys=None):
    import ddp
    return ddp.main(args)


def refused(args, capsys):
    import ddp
    with pytest.raises(SystemExit) as e:
        ddp.main(args)
    lines = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


def test_corrupt_or_mismatched_checkpoint_is_refused(written, train_args, tmp_path, capsys):
    out, _ = written
    good = f"{out}/ddp1/{STEP}"
    args = train_args + RUN_ARGS
    bad = str(tmp_path / "flipped")
    shutil.copytree(good, bad)
    with open(f"{bad}/rank00000.pt", "r+b") as f:  # one byte changed, the size unchanged
        f.seek(2000)
        byte = f.read(1)
        f.seek(2000)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert "does not match its checksum" in refused(args + [f"--resume={bad}"], capsys)
    cut = str(tmp_path / "truncated")
    shutil.copytree(good, cut)
    os.truncate(f"{cut}/rank00000.pt", 1000)
    assert "missing or truncated" in refused(args + [f"--resume={cut}"], capsys)
    partial = str(tmp_path / "partial")
    shutil.copytree(good, partial)
    os.remove(f"{partial}/manifest.json")
    assert "not a complete checkpoint" in refused(args + [f"--resume={partial}"], capsys)
    other = [a for a in args if not a.startswith("--model")] + ["--model=small", f"--resume={good}"]
    assert "was written for another model: n_layer=12 (this run: 4)" in refused(other, capsys)


def test_latest_skips_unfinished_saves_and_keeps_the_newest(train_args, tmp_path):
    out = str(tmp_path / "run")
    first = ddp_run(train_args + ["--max_iters=6", "--eval_interval=0", "--ckpt_interval=2", "--keep_ckpts=2",
                                  f"--out_dir={out}"])
    assert sorted(os.listdir(out)) == ["step_000004", "step_000006"]
    os.makedirs(f"{out}/step_000010.tmp")  # a save that crashed: not a checkpoint
    again = ddp_run(train_args + ["--max_iters=6", "--eval_interval=0", f"--out_dir={out}", "--resume=latest"])
    assert again == []  # resumed at step 6 of 6: nothing left to do
    fresh = ddp_run(train_args + ["--max_iters=2", "--eval_interval=0", f"--out_dir={tmp_path}/empty",
                                  "--resume=latest"])
    assert [r["loss"] for r in fresh] == [r["loss"] for r in first[:2]]  # nothing there yet: a fresh start


def _choose_latest(rank, world, out):
    """Rank 1 lists an older newest checkpoint than rank 0 (a file system cache behind)."""
    from types import SimpleNamespace
    import model as M
    if rank == 1:
        M.checkpoints = lambda out_dir: [os.path.join(out_dir, "step_000004")]
    run = SimpleNamespace(cfg=SimpleNamespace(out_dir=out), world=world, device=torch.device("cpu"))
    return M.latest_checkpoint(run)


@pytest.mark.quick
def test_latest_is_rank_0s_choice_on_every_rank(tmp_path):
    for step in (4, 8):
        os.makedirs(tmp_path / f"step_{step:06d}")
        (tmp_path / f"step_{step:06d}" / "manifest.json").write_text("{}")
    chosen = spawn(_choose_latest, 2, str(tmp_path), timeout=60, fresh=True)  # fresh: rank 1's model.py is patched
    assert chosen == [str(tmp_path / "step_000008")] * 2


def run_sample(args, capsys):
    """sample.py's main(args) in this process (the command line's code, without a launch): -> (stdout, stderr)."""
    import sample
    capsys.readouterr()
    sample.main(args)
    return capsys.readouterr()


@pytest.mark.quick
def test_sample_decodes_characters(tmp_path, capsys):
    """A model trained on data/prepare.py's characters samples text in those characters:
    the vocabulary travels in the checkpoint's manifest."""
    import data.prepare
    import ddp
    text = "".join(f"ROMEO: line {i} of the play, and JULIET answers.\n" for i in range(400))
    (tmp_path / "play.txt").write_text(text)
    assert data.prepare.main(["--input", str(tmp_path / "play.txt"), "--tokenizer=char",
                              "--out_dir", str(tmp_path / "chars")]) == 0
    ddp.main(["--model=tiny", "--block_size=16", "--batch_size=4", "--max_iters=2", "--eval_interval=0",
              f"--data_dir={tmp_path / 'chars'}", f"--out_dir={tmp_path / 'out'}", "--log_interval=0"])
    out, _ = run_sample([f"--out_dir={tmp_path / 'out'}", "--start=ROMEO:", "--num_samples=1",
                         "--max_new_tokens=40", "--device=cpu"], capsys)
    sample_text = out.split("---------------")[0].rstrip("\n")
    assert sample_text.startswith("ROMEO:") and len(sample_text) == len("ROMEO:") + 40, sample_text
    assert set(sample_text) <= set(text)


def test_sample_from_a_checkpoint(written):
    out, _ = written
    r = python("sample.py", [f"--ckpt={out}/tp2/{STEP}", "--num_samples=2", "--max_new_tokens=12",
                             "--device=cpu"], timeout=120)
    assert r.returncode == 0, r.stderr
    samples = [s.split() for s in r.stdout.split("---------------") if s.strip()]
    # a synthetic 192-token vocabulary has no tokenizer: the ids, all of them real tokens
    assert len(samples) == 2 and all(len(s) == 13 and all(0 <= int(t) < 192 for t in s) for s in samples)
    assert "written by tensor_parallel on 2 ranks" in r.stderr


def test_a_killed_rank_restarts_and_finishes_the_same(train_args, tmp_path):
    """torchrun --max_restarts=1: rank 1 is SIGKILLed at iteration 3, after the checkpoint
    of step 2; every rank restarts, resumes from step 2, and ends on the same losses as
    a run that was never killed (on the harness's two ranks: the same code, threads and gloo
    as torchrun's, so the same bits, without a second launch). TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1:
    on torch 2.13 with gloo a restarted attempt sometimes cannot reconnect to a store shared
    with the agent."""
    args = train_args + ["--max_iters=5", "--eval_interval=0", "--ckpt_interval=2", "--resume=latest"]
    spawn(_train_ddp, 2, args + [f"--out_dir={tmp_path}/whole", f"--log_file={tmp_path}/whole.jsonl"], timeout=300)
    env = dict(CRASH_AT="3", CRASH_RANK="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    crashed = torchrun("tests/crash_once.py", 2, ["ddp.py"] + args + [f"--out_dir={tmp_path}/crashed",
                                                                      f"--log_file={tmp_path}/crashed.jsonl"],
                       timeout=300, env=env, extra=["--max_restarts=1"])
    assert crashed.returncode == 0, crashed.stderr[-3000:]
    assert "resumed from" in crashed.stdout and "step 2" in crashed.stdout
    a, b = read_log(f"{tmp_path}/whole.jsonl"), read_log(f"{tmp_path}/crashed.jsonl")
    assert [r["iter"] for r in b] == list(range(5))
    assert [r["loss"] for r in a] == [r["loss"] for r in b]  # bit for bit: the same batches, the same state
