"""FP8 tensor + sequence parallelism with the layers switched to high precision (2 gloo ranks,
tests/dist_tp_high_precision.py), as a fallback or precision annealing switches them: the
activations and gradients of switched layers travel in their own dtype (FP32 here), the
reductions summed in FP32, so the block computes what one process does, up to the order of FP32
sums. Before, they travelled in E4M3 / E5M2 whatever the layers' precision."""

import pytest
import torch

from dist_launch import run_workers
from dist_tp import BATCH, EMBD, SEQ

WORLD = 2


@pytest.fixture(scope="module")
def rank0():
    return run_workers("dist_tp_high_precision.py", WORLD, timeout=300.0)[0]


def _errors(res: dict) -> dict:
    """Largest difference from one process's, relative to the largest value, per tensor."""
    ref = res["ref"]

    def rel(a, b):
        return float((a - b).abs().max() / b.abs().max())

    found = {"out": rel(res["out"], ref["out"]), "grad_x": rel(res["grad_x"], ref["grad_x"])}
    return {**found, **{n: rel(res["grads"][n], g) for n, g in ref["grads"].items()}}


def test_switched_layers_compute_as_one_process(rank0):
    errors = _errors(rank0["high"])
    assert len(errors) == 10  # output, input gradient, the 4 layers' weight and bias gradients
    assert max(errors.values()) < 1e-6, errors


def test_in_fp8_the_same_comparison_sees_the_fp8_wire(rank0):
    errors = _errors(rank0["fp8"])
    assert errors["out"] > 1e-3 and errors["grad_x"] > 1e-3, errors


def test_switched_back_the_block_computes_as_before(rank0):
    before, after = rank0["fp8"], rank0["back"]
    assert torch.equal(before["out"], after["out"]) and torch.equal(before["grad_x"], after["grad_x"])
    assert all(torch.equal(before["grads"][n], after["grads"][n]) for n in before["grads"])
    assert before["bytes"] == after["bytes"]


def test_switched_activations_travel_in_their_own_dtype(rank0):
    """Each rank's sequence shard, FP32: two gathers forward (attention's and the MLP's inputs)
    and two backward (the row-wise outputs' gradients); four reductions (the row-wise outputs,
    the gathered inputs' gradients), each rank sending its whole partial sum."""
    shard = BATCH * SEQ // WORLD * EMBD
    assert rank0["high"]["bytes"]["all_gather"] == 4 * shard * 4
    assert rank0["high"]["bytes"]["all_to_all"] == 4 * WORLD * shard * 4
    assert rank0["fp8"]["bytes"]["all_to_all"] == 4 * WORLD * shard * 1  # E4M3


def test_the_column_wise_layers_switched_gather_their_input_in_its_own_dtype(rank0):
    """c_attn and c_fc switched, the row-wise c_proj not (a fallback may switch them apart): the
    attention's and the MLP's gathered inputs and their gradients' reductions in FP32, as their
    consumers, the c_proj outputs' reductions still in E4M3."""
    shard = BATCH * SEQ // WORLD * EMBD
    assert rank0["column_wise"]["bytes"]["all_to_all"] == 2 * WORLD * shard * 4 + 2 * WORLD * shard * 1
    fp8_backward_gathers = rank0["fp8"]["bytes"]["all_gather"] // 2  # the forward's are E4M3 alike
    assert rank0["column_wise"]["bytes"]["all_gather"] == 2 * shard * 4 + fp8_backward_gathers
