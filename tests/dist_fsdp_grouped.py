"""Worker for tests/test_fsdp_grouped.py: FSDP2 with the fine-grained recipes on a mixture's
experts (gloo ranks). Per recipe, a model of 2 experts (an `FP8GroupedLinear` over a fixed split of
the tokens) and an `FP8Linear` is sharded with `fp8lm.distributed.fully_shard` next to an unsharded
copy: what the first all-gather brings for each expert (and the bytes it takes), what the forward
saves for the backward, the first step's outputs and a few training steps against one process."""

import copy
import sys

import torch
from torch import nn

from dist_fsdp_recipes import BATCH, HIDDEN, IN, OUT, RECIPES, _values, train_against_one_process
from dist_launch import worker_main

EXPERTS = 2
COUNTS = (5, 3)  # rows of the batch per expert, in order


class Experts(nn.Module):
    """An `FP8GroupedLinear` of ``EXPERTS`` experts over the rows of ``x`` split as ``COUNTS``."""

    def __init__(self, recipe: str, weight_format: str) -> None:
        super().__init__()
        from fp8lm.nn.grouped import FP8GroupedLinear

        self.layer = FP8GroupedLinear(EXPERTS, IN, HIDDEN, recipe=recipe, weight_format=weight_format)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x, list(COUNTS))


def small_model(recipe: str, weight_format: str = "fp16") -> nn.Module:
    """The experts and an FP8Linear under ``recipe``; ``weight_format="fp32"``: plain FP32 weights (O1)."""
    from fp8lm.nn import FP8Linear

    assert sum(COUNTS) == BATCH
    torch.manual_seed(0)
    return nn.Sequential(
        Experts(recipe, weight_format), nn.ReLU(), FP8Linear(HIDDEN, OUT, recipe=recipe, weight_format=weight_format)
    )


def gathered_experts(experts: nn.Module) -> list[dict]:
    """What FSDP2's all-gather brings for each expert's weight, and the bytes this rank handed
    (all the experts' shards in one all-gather)."""
    from fp8lm.distributed import comm_stats, reset_comm_stats

    reset_comm_stats()
    experts.unshard()
    handed = comm_stats()["all_gather_handed_bytes"]
    found = []
    for weight in experts.layer.weight:
        out = {"type": type(weight).__name__, "handed": handed}
        if hasattr(weight, "operand"):
            op = weight.operand
            out.update(payload=op.payload.view(torch.uint8).clone(), d=op.d.clone(), block=op.block)
            out["held"] = weight.held
        else:
            out["payload_dtype"] = weight.payload.dtype
        found.append(out)
    experts.reshard()
    for out in found:
        held = out.pop("held", None)
        if held is not None:  # what the gathered weight still holds once FSDP2 freed it
            out["held_after_reshard"] = sum(t.untyped_storage().nbytes() for t in held)
    return found


def forward_saving(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, list]:
    """``model(x)``, and the tensors its forward saved for the backward of the size of an expert's
    weight or of all of them stacked (E4M3 bytes, nvfp4's packed ones) that are not the storage of
    a weight FSDP2 gathered: (shape, bytes) of each."""
    gathered: set[int] = set()

    def note(module, args):
        for weight in module.layer.weight:
            if hasattr(weight, "operand"):  # a BlockScaledTensor
                gathered.update(t.untyped_storage().data_ptr() for t in (*weight.held, weight.operand.payload))

    saved = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append((tuple(t.shape), t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()))
        return t

    handle = model[0].register_forward_pre_hook(note)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(x)
    handle.remove()
    weight_shapes = set()
    for rows, cols in ((HIDDEN, IN), (HIDDEN, IN // 2), (IN, HIDDEN), (IN // 2, HIDDEN)):
        weight_shapes.update({(rows, cols), (EXPERTS, rows, cols)})
    copies = [(shape, nbytes) for shape, ptr, nbytes in saved if shape in weight_shapes and ptr not in gathered]
    return out, copies


def recipe_checks(recipe: str, rank: int, world: int, level: str = "O2") -> dict:
    """The checks of one recipe: at O2 (FP16-stored weights, FP8AdamW) or O1 (plain FP32 weights,
    torch's AdamW)."""
    from fp8lm.distributed import fully_shard, precompute_fp8_scales

    model = small_model(recipe, "fp32" if level == "O1" else "fp16")
    reference = copy.deepcopy(model)
    res = {"weights": [_values(w) for w in reference[0].layer.weight]}
    fully_shard(model[0])
    fully_shard(model)
    precompute_fp8_scales(model)
    res["gathered"] = gathered_experts(model[0])
    res.update(train_against_one_process(model, reference, level, rank, world, forward_saving))
    res["final_shards"] = [_values(w.to_local()) for w in model[0].layer.weight]
    precompute_fp8_scales(model)  # after every optimizer step, as its contract says
    res["final_gathered"] = gathered_experts(model[0])
    return res


def torch_fully_shard_gathers(recipe: str, weight_format: str = "fp16") -> list[dict]:
    """What the first all-gather brings for each expert with torch's own ``fully_shard`` (no fp8lm
    call), the same model and recipe."""
    from torch.distributed.fsdp import fully_shard

    model = small_model(recipe, weight_format)
    fully_shard(model[0])
    fully_shard(model)
    return gathered_experts(model[0])


def checks(rank, world):
    res = {recipe: recipe_checks(recipe, rank, world) for recipe in RECIPES}
    res["O1"] = {recipe: recipe_checks(recipe, rank, world, "O1") for recipe in RECIPES}
    res["torch_fully_shard"] = {r: torch_fully_shard_gathers(r) for r in (*RECIPES, "tensorwise-delayed")}
    return res


if __name__ == "__main__":
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    worker_main(checks)
