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
