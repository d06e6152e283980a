"""`fp8lm.distributed.reshard`: the row order of chunked tensor-parallel layers, both ways."""

import torch

from fp8lm.distributed.reshard import rows_to_model_order, rows_to_rank_order


def rank_ordered(weight: torch.Tensor, chunks: int, tp: int) -> torch.Tensor:
    """What a chunked column-wise style's DTensor holds as a whole: each rank's slice of each block."""
    blocks = weight.chunk(chunks)
    return torch.cat([torch.cat([b.chunk(tp)[r] for b in blocks]) for r in range(tp)])


def test_rank_order_round_trips_to_the_model_order():
    weight = torch.arange(24 * 5, dtype=torch.float32).reshape(24, 5)  # q, k, v blocks of 8 rows
    for chunks, tp in ((3, 2), (3, 4), (2, 2), (1, 4), (3, 1)):
        saved = rank_ordered(weight, chunks, tp)
        assert torch.equal(rows_to_model_order(saved, chunks, tp), weight)
        assert torch.equal(rows_to_rank_order(weight, chunks, tp), saved)


def test_a_bias_reorders_like_its_weight():
    bias = torch.arange(12.0)
    assert torch.equal(rows_to_model_order(rank_ordered(bias, 3, 2), 3, 2), bias)
    # tp 2 -> tp 4: through the model's order
    assert torch.equal(
        rows_to_rank_order(rows_to_model_order(rank_ordered(bias, 3, 2), 3, 2), 3, 4), rank_ordered(bias, 3, 4)
    )
