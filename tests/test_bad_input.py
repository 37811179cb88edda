"""Bad data, odd flags and faults: one clear line, a non-zero exit, the same verdict from
every strategy, and nothing trained before a run that cannot finish is refused.

The table runs each strategy's main() in this process (no process start-up: a bad input
must be refused before any communication, so no process group is needed), and a few
cases again as real command lines, to check that no traceback reaches the user."""
import importlib
import json
import os
import shutil

import numpy as np
import pytest

import model as M
from harness import ROOT, python
from conftest import make_dataset

STRATEGIES = [s for s in ("ddp", "fsdp", "tensor_parallel", "pipeline_parallel", "context_parallel",
                          "expert_parallel", "parallel_3d") if os.path.exists(os.path.join(ROOT, s + ".py"))]
BASE = ["--model=tiny", "--block_size=32", "--batch_size=4", "--max_iters=2", "--eval_interval=0"]


def extra(strategy):
    return ["--n_expert=2", "--top_k=1"] if strategy == "expert_parallel" else []


def spoil(folder, case):
    """Make one defect in a copy of a good data folder; -> what the error must name."""
    train, val, meta = (os.path.join(folder, f) for f in ("train.bin", "val.bin", "meta.json"))
    if case == "empty train.bin":
        open(train, "wb").close()
        return "train.bin is empty"
    if case == "odd byte count":
        with open(val, "ab") as f:
            f.write(b"\x00")
        return "val.bin has 16001 bytes: not a whole number of uint16 tokens"
    if case == "missing val.bin":
        os.remove(val)
        return "val.bin: run `python data/prepare.py` first"
    if case == "meta.json not JSON":
        open(meta, "w").write("{vocab_size: 192")
        return "meta.json is not valid JSON"
    if case == "meta.json not an object":
        json.dump([192], open(meta, "w"))
        return "meta.json must hold a JSON object, not list"
    if case == "vocab_size not a positive integer":
        json.dump({"vocab_size": "192"}, open(meta, "w"))
        return "meta.json: vocab_size must be a positive integer, not '192'"
    if case == "token ids beyond the vocabulary":
        json.dump({"vocab_size": 100}, open(meta, "w"))  # the data use ids up to 191
        return "train.bin holds token id 191"
    if case == "val shorter than a window":
        np.arange(20, dtype=np.uint16).tofile(val)
        return "val.bin has 20 tokens, too few for --block_size=32"
    raise ValueError(case)


DATA_CASES = ["empty train.bin", "odd byte count", "missing val.bin", "meta.json not JSON", "meta.json not an object",
              "vocab_size not a positive integer", "token ids beyond the vocabulary", "val shorter than a window"]


@pytest.fixture(scope="module")
def good_data(tmp_path_factory):
    return make_dataset(str(tmp_path_factory.mktemp("good")), n_train=30_000, n_val=8_000)


def refused(strategy, args, capsys):
    """Run strategy.main(args) in this process; -> (exit code, stderr lines)."""
    module = importlib.import_module(strategy)
    with pytest.raises(SystemExit) as e:
        module.main(args)
    return e.value.code, capsys.readouterr().err.strip().splitlines()


@pytest.mark.parametrize("case", DATA_CASES)
def test_bad_data_same_verdict_from_every_strategy(case, good_data, tmp_path, capsys):
    folder = str(tmp_path / "data")
    shutil.copytree(good_data, folder)
    must_say = spoil(folder, case)
    verdicts = {}
    for s in STRATEGIES:
        code, lines = refused(s, BASE + extra(s) + [f"--data_dir={folder}"], capsys)
        assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), (s, lines)
        assert must_say in lines[0], (s, lines[0])
        verdicts[s] = lines[0]
    assert len(set(verdicts.values())) == 1, verdicts  # every strategy: the same words


@pytest.mark.parametrize("flag, must_say", [
    ("--eval_iters=0", "--eval_iters must be positive"),
    ("--dropout=1.5", "--dropout"),  # out of [0, 1); strategies that need 0 say so first
    ("--block_size=-5", "--block_size must be at least 0"),
    ("--timeout_s=0", "--timeout_s must be positive"),
    ("--log_file=/etc/hostname/log.jsonl", "--log_file=/etc/hostname/log.jsonl: cannot create"),
    ("--save_path=/etc/hostname/final.pt", "--save_path=/etc/hostname/final.pt: cannot create"),
    ("--out_dir=/etc/hostname/ckpt", "--out_dir=/etc/hostname/ckpt: cannot create"),
    ("--resume=/nonexistent/step_000010", "no such checkpoint folder"),
    ("--ckpt_interval=5", "--ckpt_interval needs --out_dir"),
    ("--dtype=float16", "--dtype takes float32, bfloat16 or auto"),
])
def test_bad_flags_refused_before_step_0(flag, must_say, good_data, capsys):
    for s in STRATEGIES:
        code, lines = refused(s, BASE + extra(s) + [f"--data_dir={good_data}", "--eval_interval=1", flag], capsys)
        assert code == 2 and len(lines) == 1 and must_say in lines[0], (s, lines)


def test_command_line_shows_no_traceback(good_data, tmp_path):
    folder = str(tmp_path / "data")
    shutil.copytree(good_data, folder)
    spoil(folder, "token ids beyond the vocabulary")
    r = python("pipeline_parallel.py", BASE + [f"--data_dir={folder}"], timeout=120)
    assert r.returncode == 2 and r.stderr.startswith("error: ") and "Traceback" not in r.stderr, r.stderr


def test_a_problem_one_rank_sees_is_said_by_that_rank(monkeypatch, capsys):
    """Data missing on the second node: its local rank 0 says so, naming its global rank;
    a flag error that every rank sees is said once, by rank 0."""
    monkeypatch.setenv("RANK", "8")
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(SystemExit):
        M.die("no /data/train.bin", scope="node")
    assert capsys.readouterr().err == "error: rank 8: no /data/train.bin\n"
    with pytest.raises(SystemExit):
        M.die("--mode takes naive, bucketed or overlap")
    assert capsys.readouterr().err == ""
