"""
Text from a trained model: load any checkpoint (written by any strategy, at any world
size) into one model.GPT on one device, and sample from it, as nanoGPT's sample.py does.

    python sample.py --out_dir=out                       # the newest checkpoint in out/
    python sample.py --ckpt=out/step_000150 --start="ROMEO:" --num_samples=3 --max_new_tokens=200

A checkpoint holds each rank's pieces of the model (see model.py, "checkpoints"); here
they are put back together into the full tensors, so a model trained with tensor
parallelism on 4 GPUs samples on a laptop. The text is decoded as data/prepare.py
encoded it: by characters (the vocabulary is kept in the checkpoint's manifest) or with
GPT-2's BPE; a data folder with its own vocabulary but no tokenizer prints ids.
"""
import os
import sys

import torch
import torch.nn.functional as F

import model as M

DEFAULTS = dict(
    ckpt="",               # a checkpoint folder (step_XXXXXX); or:
    out_dir="",            # the newest checkpoint in this folder
    start="\n",            # the prompt; FILE:path reads it from a file
    num_samples=2,         # samples to draw, one after the other
    max_new_tokens=200,    # tokens each sample adds to the prompt
    temperature=0.8,       # < 1 sharper, > 1 more random
    top_k=200,             # keep only the k likeliest tokens (0: all)
    seed=1337,             # seeds the sampling
    device="auto",         # auto: cuda if available, else cpu
    dtype="auto",          # float32 | bfloat16 | auto
    threads=0,             # CPU threads; 0: half the cores (a token's small matmuls lose more to threads' hand-offs)
)


@torch.no_grad()
def generate(model, idx, max_new_tokens, temperature=1.0, top_k=0, vocab_size=None):
    """Append max_new_tokens tokens to idx (b, t), one at a time, each drawn from the
    softmax of the last position's logits; the context is cropped to block_size."""
    for _ in range(max_new_tokens):
        context = idx[:, -model.config.block_size:]
        logits, _ = model(context)
        logits = logits[:, -1, :].float() / max(temperature, 1e-6)
        if vocab_size:
            logits[:, vocab_size:] = -float("inf")  # the padding rows of the vocabulary are never tokens
        if top_k:
            kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
            logits[logits < kth] = -float("inf")
        idx = torch.cat((idx, torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)), dim=1)
    return idx


def encoding(manifest):
    """(encode, decode) for the checkpoint's data: by characters, with the vocabulary the
    manifest keeps; GPT-2's BPE, found offline the way data/prepare.py finds it; else ids."""
    chars = manifest.get("tokenizer", {}).get("chars")
    if chars:
        stoi = {c: i for i, c in enumerate(chars)}
        return (lambda s: [stoi[c] for c in s if c in stoi]), (lambda ids: "".join(chars[i] for i in ids))
    if manifest.get("vocab_size", M.GPT2_VOCAB) == M.GPT2_VOCAB:
        try:
            sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "data"))
            import prepare
            enc = prepare.get_encoding()
            return (lambda s: enc.encode(s, allowed_special={"<|endoftext|>"}) or [M.GPT2_VOCAB - 1]), enc.decode
        except Exception:
            pass
    return (lambda s: [0]), (lambda ids: " ".join(map(str, ids)))


def main(argv=None):
    cfg = M.parse_args(DEFAULTS, argv, __doc__)
    folder = cfg.ckpt
    if not folder:
        if not cfg.out_dir:
            M.die("pass --ckpt=FOLDER (a step_XXXXXX checkpoint) or --out_dir=FOLDER (its newest)")
        done = M.checkpoints(cfg.out_dir)
        if not done:
            M.die(f"no complete checkpoint in {cfg.out_dir}")
        folder = done[-1]
    if not os.path.isdir(folder):
        M.die(f"--ckpt={folder}: no such folder")
    if cfg.max_new_tokens < 0 or cfg.num_samples < 1 or cfg.temperature <= 0 or cfg.threads < 0:
        M.die("--max_new_tokens must be >= 0, --num_samples >= 1, --temperature > 0 and --threads >= 0")
    device = torch.device("cuda" if cfg.device == "auto" and torch.cuda.is_available() else
                          "cpu" if cfg.device == "auto" else cfg.device)
    dtype = M.auto_dtype() if cfg.dtype == "auto" else cfg.dtype
    # One token at a time is a chain of small ops: each parallel region costs a hand-off between
    # threads, and one thread descheduled by another process stalls them all. On 2 busy cores
    # 1 thread made 200 tokens of --model=small in 1.0-1.8 s, 2 (torch's default) in 13-26 s.
    torch.set_num_threads(cfg.threads or max(1, torch.get_num_threads() // 2))

    state, manifest = M.load_full_state(folder)
    config = M.GPTConfig(**manifest["model"])
    model = M.GPT(config).to(device)
    model.load_state_dict(state)
    model.eval()
    vocab_size = manifest.get("vocab_size", M.GPT2_VOCAB)  # the data's, before padding
    print(f"{folder}: step {manifest['step']}, written by {manifest['strategy']} on {manifest['world']} ranks, "
          f"{M.param_count(config) / 1e6:.2f}M parameters", file=sys.stderr)

    encode, decode = encoding(manifest)
    start = open(cfg.start[5:]).read() if cfg.start.startswith("FILE:") else cfg.start
    ids = encode(start) or [0]  # an empty prompt: BPE starts at <|endoftext|>, characters at id 0
    torch.manual_seed(cfg.seed)
    ctx = torch.autocast(device.type, dtype=torch.bfloat16) if dtype == "bfloat16" else torch.no_grad()
    x = torch.tensor([ids], dtype=torch.long, device=device)
    for k in range(cfg.num_samples):
        with ctx:
            y = generate(model, x, cfg.max_new_tokens, cfg.temperature, cfg.top_k, vocab_size)[0].tolist()
        print(decode(y))
        print("---------------")


if __name__ == "__main__":
    main()
