"""fp8lm on FSDP2 (gloo ranks, tests/dist_fsdp.py): FP8 weight all-gather with one agreed scale
and uneven shards, outputs equal to the unsharded model's, FP8 gradient reduce-scatter within the
FP8 bound of an FP32 reduce-scatter; and the single-process pieces (padding, bad input)."""

import pytest
import torch
import torch.distributed as dist

from dist_collectives import rank_input
from dist_launch import run_workers
from fp8lm import E4M3, FP16, quantize
from fp8lm.distributed import fp8_all_reduce_error_bound
from fp8lm.distributed.fsdp import FP8ReduceScatter
from fp8lm.ops.cast import saturating_cast
from fp8lm.scaling import compute_scale

TIMEOUT = 600.0  # the FSDP2 workers import torch.distributed's whole stack: slow on a loaded machine


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"{n}ranks")
def model_ranks(request):
    return run_workers("dist_fsdp.py", request.param, "model", timeout=TIMEOUT)


@pytest.mark.slow
def test_sharded_output_equals_unsharded_fp8_model(model_ranks):
    for r in model_ranks:
        assert torch.equal(r["out"], r["ref_out"])


@pytest.mark.slow
def test_weight_gathered_as_e4m3_with_one_agreed_scale(model_ranks):
    world = len(model_ranks)
    shards = [r["shards"]["0.weight"] for r in model_ranks]
    assert [s.shape[0] for s in shards] == [len(c) for c in torch.arange(13).chunk(world)] + [0] * (
        world - len(torch.arange(13).chunk(world))
    )  # 13 rows: uneven shards
    full = torch.cat(shards)
    scale = compute_scale(full.abs().max(), E4M3)
    expected = saturating_cast(full, scale, E4M3).float()
    for r in model_ranks:
        payload, gathered_scale, dtype = r["gathered"]
        assert dtype == torch.float8_e4m3fn
        assert torch.equal(gathered_scale, scale)
        assert torch.equal(payload, expected)


@pytest.mark.slow
def test_torch_fully_shard_on_an_fp8lm_model_gathers_e4m3():
    for r in run_workers("dist_fsdp.py", 2, "torch", timeout=TIMEOUT):
        assert r["gathered_dtype"] == torch.float8_e4m3fn
        assert torch.equal(r["out"], r["ref_out"])


@pytest.mark.slow
def test_gradients_within_fp8_bound_of_fp32_reduce_scatter(model_ranks):
    largest_err = 0.0
    for name in model_ranks[0]["grads"]:
        got = torch.cat([r["grads"][name].reshape(-1) for r in model_ranks])
        per_rank = [r["ref_grads"][name].reshape(-1).double() for r in model_ranks]
        exact = torch.stack(per_rank).mean(0)
        # One scale per chunk of FSDP's flat buffer, whose amax is at most the rank's largest gradient:
        # the bound with that amax appended (one segment) holds for every chunk.
        rank_amax = [max(g.abs().max() for g in r["ref_grads"].values()).double() for r in model_ranks]
        inputs = [torch.cat([g, a.reshape(1)]) for g, a in zip(per_rank, rank_amax)]
        bound = fp8_all_reduce_error_bound(inputs, average=True, segment=exact.numel() + 1)[:-1]
        err = (got.double() - exact).abs()
        assert bool((err <= bound).all()), (name, (err - bound).max())
        largest_err = max(largest_err, float(err.max()))
    # The FP8 path ran: the FP32 bias gradients round (E4M3 weight gradients may pass exactly).
    assert largest_err > 0


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_reduce_scatter_comm_vs_fp32(world):
    ranks = run_workers("dist_fsdp.py", world, "reduce_scatter", timeout=TIMEOUT)
    inputs = [rank_input(r, 250 * world) for r in range(world)]
    exact = torch.stack([x.double() for x in inputs]).mean(0)
    bound = fp8_all_reduce_error_bound(inputs, average=True, segment=250)
    for r, res in enumerate(ranks):
        chunk = slice(250 * r, 250 * (r + 1))
        err = (res["rs_out"].double() - exact[chunk]).abs()
        assert bool((err <= bound[chunk]).all())
        assert float(err.max()) > 0


def test_new_zeros_of_a_scaling_tensor_keeps_its_format():
    x = quantize(torch.randn(5, 3), FP16)
    padded = x.new_zeros((6, 3))
    assert padded.payload.dtype == torch.float16 and padded.shape == (6, 3) and padded.dtype == torch.float32
    assert torch.equal(padded.dequantize(), torch.zeros(6, 3))
    padded.narrow(0, 0, 5).copy_(x)
    assert torch.equal(padded.dequantize()[:5], x.dequantize())


def test_fp8_reduce_scatter_rejects_bad_format_and_op():
    with pytest.raises(ValueError, match="fmt must be E4M3 or E5M2"):
        FP8ReduceScatter(FP16)
    with pytest.raises(ValueError, match="sums or averages"):
        FP8ReduceScatter()(torch.empty(2), torch.empty(4), None, dist.ReduceOp.MAX)
