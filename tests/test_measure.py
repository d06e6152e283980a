"""`fp8lm.train.measure.saved_tensor_bytes`: the storages autograd saves, counted once each, as they
hold when the forward returns."""

import torch

from fp8lm.train.measure import saved_tensor_bytes


def test_a_storage_is_counted_once_and_parameters_not_at_all():
    w = torch.nn.Parameter(torch.randn(64, 32))
    x = torch.randn(8, 64, requires_grad=True)
    # x @ w saves both; x.t() views x's storage, which is counted once
    assert saved_tensor_bytes(lambda: (x @ w).sum() + (x.t().t() @ w).sum()) == (64 * 32 + 8 * 64) * 4
    assert saved_tensor_bytes(lambda: x @ w, exclude=[w]) == 8 * 64 * 4


def test_a_storage_freed_in_place_after_it_was_saved_is_not_counted():
    """FSDP2 frees a gathered weight after the forward by resizing its storage to nothing, though
    the layer saved it (it gathers it again for the backward): not activation memory. The storage
    of a tensor made after it, which may take its address, still counts."""
    x = torch.randn(8, 64, requires_grad=True)

    def forward(free: bool) -> torch.Tensor:
        gathered = torch.randn(64, 32)
        y = x @ gathered  # saves the gathered weight (x needs a gradient)
        if free:
            gathered.untyped_storage().resize_(0)
        later = torch.randn(8, 32, requires_grad=True)
        return y * later  # saves y and later

    kept = saved_tensor_bytes(lambda: forward(False))
    assert kept == (64 * 32 + 2 * 8 * 32) * 4
    assert saved_tensor_bytes(lambda: forward(True)) == kept - 64 * 32 * 4
