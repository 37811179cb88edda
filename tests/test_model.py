"""The shared GPT and the pieces every strategy must agree on."""
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import model as M
from harness import ROOT, python

pytestmark = pytest.mark.quick  # every test here is cheap: all of them are in the quick tier
V = 192


def tiny(vocab=V, **kw):
    return M.make_config("tiny", vocab, **kw)


def test_shapes_and_loss_near_uniform():
    cfg = tiny(block_size=16)
    gpt = M.GPT(cfg, seed=0)
    x = torch.randint(0, V, (3, 16), generator=torch.Generator().manual_seed(0))
    y = torch.randint(0, V, (3, 16), generator=torch.Generator().manual_seed(1))
    logits, loss = gpt(x, y)
    assert logits.shape == (3, 16, cfg.vocab_size) and loss.shape == ()
    # a fresh model is nearly uniform over the vocabulary: loss ~ ln(V)
    assert abs(loss.item() - math.log(cfg.vocab_size)) < 0.1
    logits, loss = gpt(x)
    assert loss is None and logits.shape == (3, 16, cfg.vocab_size)


def test_vocab_is_padded_and_presets_have_their_sizes():
    assert M.make_config("gpt2").vocab_size == 50304
    assert M.pad_vocab(65) == 128 and M.pad_vocab(192) == 192
    # GPT-2 124M: count from the shapes, without allocating
    c = M.make_config("gpt2")
    per_block = 12 * c.n_embd ** 2 + 13 * c.n_embd
    total = c.vocab_size * c.n_embd + c.block_size * c.n_embd + c.n_layer * per_block + 2 * c.n_embd
    assert 123e6 < total < 125e6
    tiny_cfg = M.PRESETS["tiny"]
    for n in (2, 3, 4):  # every test world size splits the tiny preset
        assert tiny_cfg["n_layer"] % n == 0 and tiny_cfg["n_head"] % n == 0 and 24 % n == 0


def test_weight_tie():
    gpt = M.GPT(tiny(block_size=8), seed=0)
    assert gpt.lm_head.weight is gpt.transformer.wte.weight
    x = torch.randint(0, V, (2, 8))
    gpt(x, x)[1].backward()
    # the tied matrix gets gradient from both uses: rows of tokens never seen in the
    # input still get a gradient, through the head's softmax
    g = gpt.transformer.wte.weight.grad
    unseen = torch.ones(V, dtype=torch.bool)
    unseen[x.unique()] = False
    assert g[unseen].abs().sum() > 0 and g[~unseen].abs().sum() > 0
    assert M.num_params(gpt.parameters()) == sum(p.numel() for p in gpt.parameters())  # parameters() yields it once


def test_init_scale():
    cfg = M.make_config("small", 50257)
    gpt = M.GPT(cfg, seed=0)
    proj = torch.cat([b.attn.c_proj.weight.flatten() for b in gpt.transformer.h] +
                     [b.mlp.c_proj.weight.flatten() for b in gpt.transformer.h])
    fc = torch.cat([b.mlp.c_fc.weight.flatten() for b in gpt.transformer.h])
    assert abs(fc.std().item() - 0.02) < 0.001
    assert abs(proj.std().item() - 0.02 / math.sqrt(2 * cfg.n_layer)) < 0.0005
    assert abs(gpt.transformer.wte.weight.std().item() - 0.02) < 0.001
    b = gpt.transformer.h[0]
    assert torch.all(b.ln_1.weight == 1) and torch.all(b.ln_1.bias == 0) and torch.all(b.attn.c_attn.bias == 0)


def test_units_build_alone_as_in_the_whole_model():
    cfg = tiny()
    gpt = M.GPT(cfg, seed=3)
    assert torch.equal(M.build_unit(cfg, 5, 3).mlp.c_fc.weight, gpt.transformer.h[5].mlp.c_fc.weight)
    assert torch.equal(M.build_unit(cfg, "embed", 3).wte.weight, gpt.transformer.wte.weight)
    assert torch.equal(M.build_unit(cfg, "ln_f", 3).weight, gpt.transformer.ln_f.weight)
    assert not torch.equal(M.build_unit(cfg, 5, 4).mlp.c_fc.weight, gpt.transformer.h[5].mlp.c_fc.weight)
    assert not torch.equal(M.build_unit(cfg, 4, 3).mlp.c_fc.weight, gpt.transformer.h[5].mlp.c_fc.weight)


def test_training_lowers_loss_on_a_fixed_batch():
    cfg = tiny(block_size=16)
    gpt = M.GPT(cfg, seed=0)
    opt = torch.optim.AdamW(gpt.parameters(), lr=3e-3)
    x = torch.randint(0, V, (4, 17), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(15):
        loss = gpt(x[:, :-1], x[:, 1:])[1]
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 1.0


def test_decay_groups_and_lr_schedule():
    gpt = M.GPT(tiny(block_size=8), seed=0)
    cfg = M.parse_args(M.TRAIN_DEFAULTS, ["--lr=1.0", "--min_lr=0.1", "--warmup_iters=10", "--max_iters=110"])
    opt = M.make_optimizer(gpt.named_parameters(), cfg, "cpu")
    decay, no_decay = opt.param_groups
    assert all(p.dim() == 2 for p in decay["params"]) and all(p.dim() == 1 for p in no_decay["params"])
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert sum(p.numel() for g in opt.param_groups for p in g["params"]) == M.num_params(gpt.parameters())
    lrs = [M.get_lr(i, cfg) for i in range(120)]
    assert lrs[0] < lrs[5] < lrs[9] < lrs[10] == 1.0  # warmup up to the peak
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))  # then never rises
    assert abs(lrs[60] - 0.55) < 1e-9 and lrs[110] == lrs[119] == 0.1  # cosine midpoint, floor


def test_clip_coef_matches_torch():
    p = torch.nn.Parameter(torch.ones(10))
    p.grad = torch.full((10,), 3.0)
    norm = torch.nn.utils.clip_grad_norm_([p], 1.0)
    assert abs(M.clip_coef(norm, 1.0) * 3.0 - p.grad[0].item()) < 1e-7
    assert M.clip_coef(0.5, 1.0) == 1.0 and M.clip_coef(5.0, 0) == 1.0


def test_flops_and_peak():
    c = M.make_config("gpt2")
    n = 124_475_904  # GPT-2 124M with the padded vocabulary, counted in test_vocab...
    f = M.flops_per_token(c, n)
    assert f == 6 * (n - 1024 * 768) + 12 * 12 * 12 * 64 * 1024
    assert M.flops_per_token(c) == f  # the count from the config alone
    assert M.peak_flops("cpu") is None and M.peak_flops("cpu", 1e12) == 1e12


@pytest.mark.parametrize("name, bf16, fp32", [
    ("NVIDIA H200", 989e12, 494e12), ("NVIDIA H100 80GB HBM3", 989e12, 494e12),
    ("NVIDIA H100 PCIe", 756e12, 378e12), ("NVIDIA H100 NVL", 835e12, 418e12), ("NVIDIA H200 NVL", 835e12, 418e12), ("NVIDIA GH200 480GB", 989e12, 494e12),
    ("NVIDIA A100-SXM4-80GB", 312e12, 156e12), ("NVIDIA L40S", 362e12, 183e12), ("NVIDIA L40", 181e12, 90.5e12),
    ("NVIDIA L4", 121e12, 60e12), ("NVIDIA A10G", 70e12, 35e12), ("NVIDIA A10", 125e12, 62.5e12),
    ("Tesla V100-SXM2-16GB", 125e12, 15.7e12), ("Tesla T4", 65e12, 8.1e12), ("NVIDIA GeForce RTX 4090", 165e12, 82.6e12),
    ("Some Future GPU", None, None),
])
def test_peak_by_device_name_and_dtype(name, bf16, fp32):
    """The most specific name wins (L40 is not an L4, an H100 PCIe is not an SXM), and a
    float32 run is measured against the TF32/fp32 peak, not the bf16 one."""
    assert M.device_peak(name, "bfloat16") == bf16 and M.device_peak(name, "float32") == fp32


@pytest.mark.parametrize("capability, want", [((7, 0), "float32"), ((7, 5), "float32"), ((8, 0), "bfloat16"),
                                              ((9, 0), "bfloat16")])
def test_auto_dtype_needs_native_bf16(monkeypatch, capability, want):
    """V100 (7.0) and T4 (7.5) emulate bf16, slower than float32: auto picks float32 there."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert M.auto_dtype() == want


def test_every_window_can_be_drawn():
    """A window is block_size + 1 tokens: data of exactly that length has one, and the
    last window of any data is drawn too."""
    data = np.arange(33, dtype=np.uint16)
    x, y = M.get_batch(data, 0, 0, 4, 32)
    assert torch.equal(x[0], torch.arange(32)) and torch.equal(y[0], torch.arange(1, 33))
    data = np.arange(40, dtype=np.uint16)
    starts = {M.get_batch(data, 0, k, 8, 32)[0][:, 0].tolist()[i] for k in range(50) for i in range(8)}
    assert starts == set(range(8))  # 40 - 32 = 8 windows, the last (7) included


# ---------------------------------------------------------------- the sampler

def test_sampler_is_a_function_of_seed_and_step():
    data = np.arange(10_000, dtype=np.uint16) % V
    x1, y1 = M.get_batch(data, 7, 3, 24, 32)
    x2, _ = M.get_batch(data, 7, 3, 24, 32)
    x3, _ = M.get_batch(data, 7, 4, 24, 32)
    x4, _ = M.get_batch(data, 8, 3, 24, 32)
    xv, _ = M.get_batch(data, 7, 3, 24, 32, split="val")
    assert x1.shape == (24, 32) and x1.dtype == torch.int64
    assert torch.equal(x1, x2) and not torch.equal(x1, x3) and not torch.equal(x1, x4) and not torch.equal(x1, xv)
    assert torch.equal(x1[:, 1:], y1[:, :-1])  # targets are the inputs shifted by one
    # data parallel slices tile the global batch exactly
    for n in (2, 3, 4):
        parts = [M.get_batch(data, 7, 3, 24, 32, rows=slice(r * 24 // n, (r + 1) * 24 // n))[0] for r in range(n)]
        assert torch.equal(torch.cat(parts), x1)


def test_sampler_agrees_across_processes(tmp_path):
    data = np.arange(10_000, dtype=np.uint16) % V
    path = tmp_path / "d.bin"
    data.tofile(path)
    code = ("import sys, numpy as np; sys.path.insert(0, %r); import model as M; "
            "d = np.memmap(%r, dtype=np.uint16, mode='r'); print(M.get_batch(d, 7, 3, 24, 32)[0].sum().item())"
            % (ROOT, str(path)))
    out = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
           for _ in range(2)]
    assert out[0] == out[1] == f"{M.get_batch(data, 7, 3, 24, 32)[0].sum().item()}\n"


# ---------------------------------------------------------------- the command line

def test_parse_args_forms():
    d = dict(a=1, b=0.5, c=False, s="x")
    cfg = M.parse_args(d, ["--a=3", "--b", "2.5", "--c=True", "--s=y"])
    assert (cfg.a, cfg.b, cfg.c, cfg.s) == (3, 2.5, True, "y")
    assert M.parse_args(d, ["--c", "1"]).c is True and M.parse_args(d, ["--c=False"]).c is False
    for bad in (["--nope=1"], ["--a=x"], ["--c=maybe"], ["a"], ["--a"]):
        with pytest.raises(SystemExit) as e:
            M.parse_args(d, bad)
        assert e.value.code == 2


def test_help_is_one_line_a_flag_with_its_comment():
    """--help: --name=default, then the comment on the flag's line in its DEFAULTS dict. Every
    common flag has one; a string default with whitespace is shown as Python writes it."""
    r = python("sample.py", ["--help"], timeout=60)
    assert r.returncode == 0 and "--start='\\n'" in r.stdout and "the prompt" in r.stdout, r.stdout
    lines = M.flag_help(M.TRAIN_DEFAULTS).splitlines()
    assert len(lines) == len(M.TRAIN_DEFAULTS)
    for line, (k, v) in zip(lines, M.TRAIN_DEFAULTS.items()):
        flag, _, note = line.strip().partition("  ")
        assert flag == f"--{k}={v}" and note.strip(), line


@pytest.mark.parametrize("args, message", [
    (["--data_dir=/nonexistent"], "no /nonexistent/train.bin"),
    (["--model=huge"], "unknown --model 'huge'"),
    (["--learning_rate=1"], "unknown flag --learning_rate"),
    (["--batch_size=abc"], "--batch_size takes an integer, not 'abc'"),
    (["--overlap=fast"], "--overlap takes True or False, not 'fast'"),
])
def test_bad_input_is_one_clear_line(args, message, data_dir, capsys):
    """The first case as a user types it (a process of its own: no traceback reaches the
    terminal); the others in this process, which is the same code at no start-up cost."""
    if args == ["--data_dir=/nonexistent"]:
        r = python("ddp.py", [f"--data_dir={data_dir}"] + args, timeout=60)
        code, err = r.returncode, r.stderr
    else:
        import ddp
        with pytest.raises(SystemExit) as e:
            ddp.main([f"--data_dir={data_dir}"] + args)
        code, err = e.value.code, capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], err


def test_baseline_run_logs_every_field(train_args, tmp_path):
    log = tmp_path / "log.jsonl"
    r = python("ddp.py", train_args + ["--max_iters=3", "--eval_interval=2", f"--log_file={log}", "--log_interval=1"])
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("iter ") == 3
    records = [json.loads(line) for line in open(log)]
    assert [rec["iter"] for rec in records] == [0, 1, 2]
    for rec in records:
        for k in ("loss", "lr", "dt_ms", "tokens_per_s", "mfu", "comm_bytes", "state_bytes", "cpu_ms"):
            assert k in rec
        assert rec["comm_bytes"] == [0] and rec["mfu"] is None  # one process sends nothing; no CPU peak
        assert len(rec["cpu_ms"]) == 1 and rec["cpu_ms"][0] > 0  # a step computes: the process's CPU clock moved
    assert "val_loss" in records[0] and "val_loss" in records[2] and "val_loss" not in records[1]
    # state: params + grads + 2 Adam moments, all fp32 = 16 bytes a parameter
    n = M.num_params(M.GPT(M.make_config("tiny", V, block_size=32)).parameters())
    assert records[-1]["state_bytes"] == [16 * n]


def test_param_count_from_shapes():
    import dataclasses
    for bias in (True, False):
        c = dataclasses.replace(tiny(), bias=bias)
        assert M.param_count(c) == M.num_params(M.GPT(c).parameters())


def _what_a_rank_sees(rank, world):
    import torch
    return os.environ.get("CUDA_VISIBLE_DEVICES"), torch.cuda.device_count()


def test_the_suite_hides_gpus_from_every_rank():
    """On a machine with GPUs the suite still runs CPU ranks over gloo: conftest hides CUDA
    before torch is imported, and every rank the harness starts inherits it (the device
    choice inside a gloo group is tested with CUDA faked, in test_collectives)."""
    from harness import spawn
    assert os.environ.get("CUDA_VISIBLE_DEVICES") == ""
    assert spawn(_what_a_rank_sees, 2, timeout=60) == [("", 0), ("", 0)]


def test_every_clip_stays_on_the_device(monkeypatch):
    """No strategy reads the norm on the host to decide whether to clip (a GPU sync a step):
    the five sharded strategies clip through model.clip_by_global_norm, ddp.py and
    context_parallel.py through torch's clip_grad_norm_; both run here with Tensor.__bool__
    raising, clipped and unclipped, and agree with each other."""
    grads = [torch.randn(5, 3), torch.randn(7)]
    for max_norm in (0.5, 100.0):  # clipped, and not
        ours = [g.clone() for g in grads]
        theirs = [torch.nn.Parameter(g.clone()) for g in grads]
        for p, g in zip(theirs, grads):
            p.grad = g.clone()
        with monkeypatch.context() as m:
            m.setattr(torch.Tensor, "__bool__", lambda self: (_ for _ in ()).throw(RuntimeError("host sync")))
            sq = torch.stack([g.pow(2).sum() for g in ours]).sum()
            norm = M.clip_by_global_norm(sq, ours, max_norm)
            ref = torch.nn.utils.clip_grad_norm_(theirs, max_norm)
        assert torch.allclose(norm, ref)
        assert all(torch.allclose(a, p.grad) for a, p in zip(ours, theirs))
    for f in ("fsdp.py", "tensor_parallel.py", "pipeline_parallel.py", "expert_parallel.py", "parallel_nd.py"):
        assert "M.clip_by_global_norm(" in open(os.path.join(ROOT, f)).read(), f
    for f in ("ddp.py", "context_parallel.py"):
        assert "clip_grad_norm_(" in open(os.path.join(ROOT, f)).read(), f
