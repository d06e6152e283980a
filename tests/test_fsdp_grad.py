"""Gradient formats on FSDP2 (gloo ranks, tests/dist_fsdp_grad.py): every parameter's gradient
shard is stored in its policy's format after backward (E4M3 for the FP8 GEMMs' weights, BF16 for
the output head's, FP32 for 1-D parameters, and O2's embeddings in E4M3), as one process stores
the whole gradient, also when a second backward accumulates; FSDP2's flat FP32 reduce-scatter
output is then freed, so `memory_report` counts each rank half of one process's gradient bytes."""

import pytest

from dist_launch import run_workers

TIMEOUT = 600.0  # FSDP2 workers import torch.distributed's whole stack: slow on a loaded machine
E4M3, BF16, FP32 = "scaled:torch.float8_e4m3fn", "scaled:torch.bfloat16", "torch.float32"


@pytest.fixture(scope="module")
def ranks():
    return run_workers("dist_fsdp_grad.py", 2, timeout=TIMEOUT)


def expected(name: str, level: str) -> str:
    if name == "lm_head.weight":
        return BF16  # the output-head rule
    if name.endswith(".bias") or ".ln_" in name or name.startswith("ln_f"):
        return FP32  # 1-D parameters
    if name in ("wte.weight", "wpe.weight"):
        return E4M3 if level == "O2" else FP32
    return E4M3  # the FP8 GEMMs' weights


@pytest.mark.slow
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_each_gradient_shard_is_stored_in_its_policy_format(ranks, level):
    for r in ranks:
        single, sharded = r[f"single_{level}"], r[f"fsdp_{level}"]
        want = {name: expected(name, level) for name in single["formats"]}
        assert single["formats"] == want
        assert sharded["formats"] == want
        assert sharded["accumulated"] == want


@pytest.mark.slow
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_each_rank_holds_half_the_gradient_bytes_of_one_process(ranks, level):
    for r in ranks:
        single, sharded = r[f"single_{level}"], r[f"fsdp_{level}"]
        # Every shape divides by 2 ranks (scales count apart, under "scales").
        assert sharded["grad_bytes"] == single["grad_bytes"] // 2


@pytest.mark.slow
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_torchs_clip_grad_norm_clips_the_stored_shards(ranks, level):
    for r in ranks:
        sharded = r[f"fsdp_{level}"]
        before, after = (float(n) for n in sharded["torch_norms"])
        assert before == pytest.approx(float(sharded["norm"]), rel=1e-5)  # fp8lm's norm of the same shards
        assert before > 1.0
        assert after == pytest.approx(1.0, abs=2.0**-4)  # each clipped shard requantized to E4M3 (4 bits)


@pytest.fixture(scope="module")
def wire():
    return run_workers("dist_fsdp_grad.py", 2, "wire", timeout=TIMEOUT)


@pytest.mark.slow
def test_the_output_heads_gradient_crosses_the_wire_in_bf16(wire):
    for r in wire:
        for name, group in r["groups"].items():
            offsets, offset = {}, 0
            for param, numel in group["params"]:
                offsets[param], offset = (offset, offset + numel), offset + numel
            want = [offsets["lm_head.weight"]] if name == "" else []  # the root group holds the head
            assert list(group["wide"]) == want, name


@pytest.mark.slow
def test_a_bf16_span_is_summed_within_bf16_rounding_and_the_rest_as_fp8(wire):
    import torch

    from fp8lm import E4M3 as E4M3_FORMAT
    from fp8lm.ops.cast import saturating_cast
    from fp8lm.scaling import compute_scale

    world = len(wire)
    inputs = wire[0]["inputs"].double().view(world, world, -1)  # [sender, owner, column]
    start, end = wire[0]["span"]
    for rank, r in enumerate(wire):
        mine = inputs[:, rank]
        want = mine.mean(0)
        got = r["out"].double()
        wide = got[start:end] - want[start:end]
        bound = 2.0**-8 * mine[:, start:end].abs().sum(0) / world  # each input rounded to BF16 (8 bits) once
        assert bool((wide.abs() <= bound * (1 + 1e-6)).all())
        # the other columns: each sender's E4M3 chunk with its own scale, summed in FP32
        narrow = torch.cat([mine[:, :start], mine[:, end:]], dim=1).float()
        cast = []
        for row in narrow:
            scale = compute_scale(row.abs().max(), E4M3_FORMAT)
            cast.append(saturating_cast(row, scale, E4M3_FORMAT).float() / scale)
        expect = torch.stack(cast).sum(0) / world
        assert torch.allclose(torch.cat([got[:start], got[end:]]).float(), expect, rtol=1e-6, atol=0)
    # handed to the all-to-alls: the BF16 span 2 bytes per element, the rest 1 (scales all-gathered apart)
    chunk, width = wire[0]["chunk"], end - start
    assert wire[0]["stats"]["all_to_all_handed_bytes"] == world * ((chunk - width) + 2 * width)
