"""fsdp.py against the one-process run: same losses, same parameters; the traffic and the
per-rank state of the formulas, computed exactly from the config; the prefetch bound."""
import os

import pytest
import torch

import model as M
from harness import spawn, torchrun, assert_logs_match, assert_states_match
from conftest import VOCAB

# (world size) -> the runs that share one spawn: (name, extra flags, model)
# "small" at 3 ranks: n_embd=128, so its units do not divide by 3 and the shards are padded
# (every size of the tiny preset is a multiple of n_embd=96, which 2, 3 and 4 divide)
SMALL = ["--model=small", "--block_size=32", "--max_iters=6", "--eval_interval=5"]
RUNS = {
    2: [("zero3_prefetch2_accum2", ["--prefetch=2", "--grad_accum=2"], "tiny"),
        ("zero1_accum2", ["--zero_stage=1", "--grad_accum=2"], "tiny"),
        ("zero2_accum2", ["--zero_stage=2", "--grad_accum=2"], "tiny")],
    3: [("zero3_prefetch0", ["--prefetch=0"], "tiny"), ("zero3_small_uneven", SMALL, "small")],
    4: [("zero3", [], "tiny")],
}


def flag(extra, name, default):
    return next((type(default)(a.split("=", 1)[1]) for a in extra if a.startswith(f"--{name}=")), default)


def _train_all(rank, world, train_args, out):
    import collectives as C
    import fsdp
    results = {}
    for name, extra, _ in RUNS[world]:
        path = os.path.join(out, f"fsdp_{world}_{name}.pt")
        results[name] = (fsdp.main(train_args + extra + [f"--save_path={path}"]), path)
    # what this rank sends for the gradient norm's all-reduce of one float (a tree: it differs by rank)
    C.reset_bytes()
    C.all_reduce(torch.zeros(()))
    return results, C.bytes_sent()


def unit_sizes(config):
    """Parameters per unit of sharding: the ends (embeddings, final norm, tied head) and each block."""
    sizes = {}
    for name, p in M.GPT(config).named_parameters():  # the tied matrix once
        unit = name.split(".")[2] if name.startswith("transformer.h.") else "ends"
        sizes[unit] = sizes.get(unit, 0) + p.numel()
    return list(sizes.values())


def shard_layout(config, world):
    """(elements per rank with padding, padding in all, real elements held by each rank)."""
    sizes = unit_sizes(config)
    shards = [-(-n // world) for n in sizes]
    real = [sum(min(max(n - r * s, 0), s) for n, s in zip(sizes, shards)) for r in range(world)]
    return sum(shards), world * sum(shards) - sum(sizes), real


@pytest.fixture(scope="module")
def small_reference(train_args, tmp_path_factory):
    import ddp
    path = str(tmp_path_factory.mktemp("small") / "state.pt")
    return ddp.main(train_args + SMALL + [f"--save_path={path}"]), torch.load(path)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_parity_traffic_memory(world, train_args, reference, small_reference, tmp_path):
    returned = spawn(_train_all, world, train_args, str(tmp_path), timeout=400)
    results, norm_bytes = returned[0][0], [r[1] for r in returned]
    for name, extra, preset in RUNS[world]:
        records, path = results[name]
        ref_records, ref_state = small_reference if preset == "small" else reference
        where = f"{name}, {world} ranks"
        assert_logs_match(records, ref_records, 1e-4)
        assert_logs_match([r for r in records if "val_loss" in r], [r for r in ref_records if "val_loss" in r],
                          1e-4, key="val_loss")
        assert_states_match(torch.load(path), ref_state, 1e-5)

        stage, accum, prefetch = flag(extra, "zero_stage", 3), flag(extra, "grad_accum", 1), flag(extra, "prefetch", 1)
        config = M.make_config(preset, VOCAB, block_size=32)
        S, padding, real = shard_layout(config, world)
        if preset == "small":
            assert padding > 0, "this run is meant to have uneven shards"
        n_units = config.n_layer + 1
        # gather in forward, gather in backward, reduce-scatter: (N-1) chunks of S fp32
        # elements each, per micro-step (3(N-1)/N of the padded parameter bytes); ZeRO-1
        # reduce-scatters once per step, ZeRO-2 once per micro-step, both gather once after the step
        passes = {3: 3 * accum, 2: accum + 1, 1: 2}[stage]
        full_state = ref_records[0]["state_bytes"][0]  # the one-process DDP run: 16 bytes a parameter
        for r in records:
            assert r["comm_bytes"] == [passes * (world - 1) * 4 * S + b for b in norm_bytes], where
            # fp32 master shard + gradient shard (padded), Adam's m and v for the real elements;
            # ZeRO-2 keeps the full weights, ZeRO-1 the full gradients too
            full_copies = {3: 0, 2: 1, 1: 2}[stage]
            assert r["state_bytes"] == [8 * S + 8 * x + full_copies * 4 * world * S for x in real], where
            if stage == 3:  # the bound: the full model's state / N, plus the padding
                assert max(r["state_bytes"]) <= (full_state + 16 * padding) / world, where
                # at most 1 + prefetch units gathered at once, and the window is used in full
                assert r["max_gathered_units"] == [1 + prefetch] * world, where
            else:
                assert r["max_gathered_units"] == [n_units] * world, where


def test_one_process_matches_reference(train_args, reference, tmp_path):
    import fsdp
    path = str(tmp_path / "state.pt")
    records = fsdp.main(train_args + [f"--save_path={path}"])
    assert_logs_match(records, reference[0], 1e-4)
    assert_states_match(torch.load(path), reference[1], 1e-5)
    assert all(r["comm_bytes"] == [0] for r in records)  # one rank: nothing to send


def test_bad_input_fails_on_every_rank(train_args):
    r = torchrun("fsdp.py", 2, train_args + ["--zero_stage=4"], timeout=120)
    assert r.returncode != 0
    assert "error: --zero_stage takes 1, 2 or 3, not 4" in r.stderr
    # torchrun reports a failed rank with a traceback of its own (ChildFailedError): the
    # only one allowed; a traceback from a rank would be a separate one before it
    assert all("ChildFailedError" in t for t in r.stderr.split("Traceback (most recent call last)")[1:]), r.stderr


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_bf16_on_gpu(train_args, reference):
    """Mixed precision: bf16 compute and messages, fp32 master weights; the loss stays
    close to the fp32 run's, and the peak memory is reported."""
    import fsdp
    args = [a for a in train_args if not a.startswith("--dtype")] + ["--dtype=bfloat16"]
    records = fsdp.main(args)
    assert_logs_match(records, reference[0], 0.05)
    assert records[-1]["loss"] < records[0]["loss"] - 0.5
    assert records[-1]["peak_bytes"][0] > 0
