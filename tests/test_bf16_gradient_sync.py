"""The gradients that data-parallel syncs keep out of FP8 (`fp8lm.distributed.sent_in_bf16`), on 2
gloo ranks (tests/dist_bf16_gradient_sync.py): the output head's, which the policy stores in BF16
because one E4M3 scale per tensor zeroes the rows of rare tokens, and a layer's switched to high
precision (a fallback, precision annealing). `FP8DataParallel`, `GradientSync`'s all-reduce after
backward and FP8 ZeRO send them in BF16 and sum them in FP32, as FSDP2's reduce-scatter does:
exactly that rounding of the ranks' gradients, no row lost. The other gradients stay FP8."""

import pytest
import torch

from dist_bf16_gradient_sync import HIDDEN, IN, VOCAB
from dist_launch import run_workers
from fp8lm.distributed import partition_by_size

WORLD = 2
SYNCS = ("data_parallel", "all_reduce", "zero")


@pytest.fixture(scope="module")
def ranks():
    return run_workers("dist_bf16_gradient_sync.py", WORLD, timeout=600.0)


def test_non_finite_values_reach_every_rank(ranks):
    """BF16 carries inf and NaN: a NaN on one rank and an inf on the other reach both ranks'
    results as they are, and a NaN in the head's gradient skips FP8 ZeRO's step on every rank."""
    for r in ranks:
        got = r["non_finite"]["all_reduce"]
        assert bool(got[0].isnan()) and got[1] == float("inf") and torch.equal(got[2:], torch.ones(4))
        assert r["non_finite"]["zero_finite"] is False


def _bf16(t: torch.Tensor) -> torch.Tensor:
    return t.bfloat16().float()


def _through_bf16(sync: str, locals_: list[torch.Tensor]) -> torch.Tensor:
    """The mean of the ranks' gradients sent in BF16 and summed in FP32; an all-reduce sends the
    mean back in BF16 too (ZeRO keeps the owner's FP32 shard)."""
    mean = sum(_bf16(g) for g in locals_) / len(locals_)
    return mean if sync == "zero" else _bf16(mean)


def _synced(ranks, case: str, name: str) -> torch.Tensor:
    """The synced gradient (under ZeRO: from the rank that owns it)."""
    held = [r[case]["synced"][name] for r in ranks if name in r[case]["synced"]]
    assert held, (case, name)
    for other in held[1:]:
        assert torch.equal(other, held[0]), (case, name)
    return held[0]


@pytest.mark.parametrize("sync", SYNCS)
@pytest.mark.parametrize("state", ["fp8", "switched"])
def test_the_heads_gradient_is_summed_from_bf16_and_loses_no_row(ranks, sync, state):
    case = f"{sync} {state}"
    locals_ = [r[case]["local"]["head.weight"] for r in ranks]
    synced = _synced(ranks, case, "head.weight")
    assert torch.equal(synced, _through_bf16(sync, locals_)), case
    exact = sum(g.double() for g in locals_) / WORLD
    rows = exact.abs().amax(1)
    assert float(rows.max() / rows.min()) > 2.0**40  # the case: far beyond E4M3's 17.8 binades
    assert bool((synced != 0).eq(exact != 0).all()), case  # nothing flushed to zero
    assert float(((synced.double() - exact).abs() / exact.abs().clamp_min(1e-300)).max()) <= 2.0**-8


@pytest.mark.parametrize("sync", SYNCS)
def test_a_switched_layers_gradient_is_summed_from_bf16(ranks, sync):
    case = f"{sync} switched"
    locals_ = [r[case]["local"]["body.weight"] for r in ranks]
    assert torch.equal(_synced(ranks, case, "body.weight"), _through_bf16(sync, locals_))


@pytest.mark.parametrize("sync", ["data_parallel", "all_reduce"])
def test_an_fp8_layers_gradient_stays_fp8(ranks, sync):
    """Not switched, the body's gradient is the FP8 all-reduce's: not what BF16 would give (FP8
    ZeRO's sum of E4M3 gradients would be the same either way: its bytes say which)."""
    case = f"{sync} fp8"
    locals_ = [r[case]["local"]["body.weight"] for r in ranks]
    synced = _synced(ranks, case, "body.weight")
    assert not torch.equal(synced, _through_bf16(sync, locals_))
    exact = sum(g.double() for g in locals_) / WORLD
    assert float((synced.double() - exact).norm() / exact.norm()) < 0.1


def test_the_bytes_data_parallel_hands_over(ranks):
    """Per rank, each all-to-all sends (N-1)/N of its buffer: 1 byte per FP8 gradient element,
    2 per BF16 one (the head's; the switched layer's), each buffer padded to the world size."""
    share = (WORLD - 1) / WORLD
    head, body, bias = VOCAB * HIDDEN, HIDDEN * IN, HIDDEN
    fp8 = ranks[0]["data_parallel fp8"]["bytes"]["all_to_all"]
    switched = ranks[0]["data_parallel switched"]["bytes"]["all_to_all"]
    assert fp8 == share * ((body + bias) + 2 * head)
    assert switched == share * (bias + 2 * (head + body))


def test_the_bytes_zero_hands_over(ranks):
    """FP8 ZeRO sends each owner its tensors' gradients: 1 byte per element in FP8, 2 in BF16 (the
    head's; switched, the body's weight too), none for the tensors the rank owns itself."""
    sizes = {"head": VOCAB * HIDDEN, "body": HIDDEN * IN, "bias": HIDDEN}
    owner = dict(zip(sizes, partition_by_size(list(sizes.values()), WORLD)))

    def sent(rank: int, bf16) -> int:
        return sum(sizes[n] * (2 if n in bf16 else 1) for n in sizes if owner[n] != rank)

    assert len(set(owner.values())) == WORLD  # each rank owns something
    for rank, r in enumerate(ranks):
        assert r["zero fp8"]["bytes"]["all_to_all"] == sent(rank, ["head"])
        assert r["zero switched"]["bytes"]["all_to_all"] == sent(rank, ["head", "body"])
