"""A mixture of experts under sequence parallelism on 2 gloo ranks (`SequenceParallelMoE`): each
rank routes its slice of the sequences through the whole router and experts; with the slices'
gradients summed, it is the whole mixture on the whole sequences (fp32)."""

import pytest
import torch

from dist_launch import run_workers
from dist_sequence_moe import EXPERTS


@pytest.fixture(scope="module")
def ranks():
    return run_workers("dist_sequence_moe.py", 2, timeout=240)


def test_each_slice_is_the_whole_mixtures_output_on_it(ranks):
    for r in ranks:
        torch.testing.assert_close(r["y"], r["whole_y"], rtol=1e-5, atol=1e-6)


def test_the_load_balancing_loss_is_the_whole_sequences(ranks):
    """A slice's own loss differs from the whole's; every rank reports the whole's."""
    for r in ranks:
        torch.testing.assert_close(r["aux"], r["whole_aux"], rtol=1e-6, atol=0)
        assert torch.equal(r["routed"], r["whole_routed"])  # tokens per expert: both slices'


def test_the_slices_gradients_add_up_to_the_whole_mixtures(ranks):
    """The router's too: its load-balancing gradient is each slice's part of the whole loss's."""
    for r in ranks:
        assert r["parameters"] == 1 + 2 * EXPERTS  # the router, each expert's two weights
        for name, grad in r["whole_grads"].items():
            torch.testing.assert_close(r["grads"][name], grad, rtol=1e-5, atol=1e-6, msg=name)


def test_a_capacity_applies_to_each_slice_and_counts_both_slices_drops(ranks):
    for r in ranks:
        assert r["capped_dropped"] > 0
        assert torch.equal(r["capped_dropped"], r["slices_dropped"])


def test_experts_spread_over_the_ranks_too_keep_each_slices_output(ranks):
    """`SequenceExpertParallelMoE.from_moe` of an `ExpertParallelMoE`: half the experts a rank."""
    for r in ranks:
        assert r["spread_experts"] == EXPERTS // 2
        torch.testing.assert_close(r["spread_y"], r["whole_y"], rtol=1e-5, atol=1e-6)


def test_from_moe_takes_an_expert_parallel_mixture_and_names_what_to_do_otherwise():
    from dist_sequence_moe import build
    from fp8lm.distributed.sequence_moe import SequenceExpertParallelMoE

    with pytest.raises(TypeError, match="spread its experts with ExpertParallelMoE first"):
        SequenceExpertParallelMoE.from_moe(build(), None)
