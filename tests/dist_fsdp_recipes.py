"""Worker for tests/test_fsdp_recipes.py: FSDP2 with the fine-grained recipes (gloo ranks). For
each recipe a two-layer FP8 model is sharded with `fp8lm.distributed.fully_shard` next to an
unsharded copy: what the first all-gather brings (and the bytes it takes), the first step's
outputs, and the losses of a few training steps against one process that runs the ranks'
batches as micro-batches of one step."""

import contextlib
import copy
import sys

import torch
from torch import nn

from dist_launch import worker_main

RECIPES = ("rowwise", "rowwise-wgrad-bf16", "blockwise", "mxfp8", "nvfp4", "nvfp4-4over6")
LEVELS = ("O2", "O1")  # FP16-stored weights and FP8AdamW; plain FP32 weights and torch's AdamW
# 256 rows: 128 per rank on 2 ranks (whole 128 x 128 blocks); 96 rows: 48 per rank (not for blockwise).
IN, HIDDEN, OUT = 64, 256, 96
BATCH, STEPS, LR = 8, 4, 1e-2


def small_model(recipe: str, weight_format: str = "fp16") -> nn.Module:
    """Two FP8Linear layers under ``recipe``; ``weight_format="fp32"``: plain FP32 weights (O1)."""
    from fp8lm.nn import FP8Linear

    torch.manual_seed(0)
    return nn.Sequential(
        FP8Linear(IN, HIDDEN, recipe=recipe, weight_format=weight_format),
        nn.ReLU(),
        FP8Linear(HIDDEN, OUT, recipe=recipe, weight_format=weight_format),
    )


def batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's inputs and targets, the same every step (so that the loss falls)."""
    g = torch.Generator().manual_seed(1000 + rank)
    return torch.randn(BATCH, IN, generator=g), torch.randn(BATCH, OUT, generator=g)


@contextlib.contextmanager
def counted_all_reduces():
    """The ``torch.distributed.all_reduce`` calls made inside (a list of their tensors' sizes)."""
    import torch.distributed as dist

    calls, original = [], dist.all_reduce

    def counting(tensor, *args, **kwargs):
        calls.append(tensor.numel())
        return original(tensor, *args, **kwargs)

    dist.all_reduce = counting
    try:
        yield calls
    finally:
        dist.all_reduce = original


def gathered(layer) -> dict:
    """What FSDP2's all-gather brings for ``layer``'s weight, and the bytes this rank handed."""
    from fp8lm.distributed import comm_stats, reset_comm_stats

    reset_comm_stats()
    with counted_all_reduces() as all_reduces:
        layer.unshard()
    weight = layer.weight
    out = {"type": type(weight).__name__, "handed": comm_stats()["all_gather_handed_bytes"]}
    out["all_reduces"] = len(all_reduces)
    if hasattr(weight, "operand"):
        op = weight.operand
        out.update(payload=op.payload.view(torch.uint8).clone(), d=op.d.clone(), block=op.block)
        out["packed"] = weight._data.dtype == torch.uint8  # nvfp4: kept packed, as it travelled
        out["values"] = weight.dequantize()
    else:
        out["payload_dtype"] = getattr(weight, "payload", weight).dtype  # O1: a plain FP32 weight
    layer.reshard()
    if hasattr(weight, "held"):  # what the gathered weight still holds once FSDP2 freed it
        out["held_after_reshard"] = sum(t.untyped_storage().nbytes() for t in weight.held)
    return out


def forward_saving(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, list]:
    """``model(x)``, and what its forward saved for the backward that copies a weight FSDP2
    gathered as the recipe's operand: (layer, shape, bytes) of each saved tensor of a gathered
    weight's size (E4M3 bytes, or nvfp4's packed ones) that is not that operand's own storage,
    which FSDP2 frees after the forward."""
    gathered: dict[int, set] = {}

    def note(i):
        def hook(module, args):
            weight = module.weight
            if hasattr(weight, "operand"):  # a BlockScaledTensor
                gathered[i] = {t.untyped_storage().data_ptr() for t in (weight._data, weight.operand.payload)}

        return hook

    saved = []  # noted as saved: FSDP2 frees the gathered storages after the forward

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append((t.shape, t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()))
        return t

    handles = [model[i].register_forward_pre_hook(note(i)) for i in (0, 2)]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(x)
    for handle in handles:
        handle.remove()
    copies = []
    for i, (rows, cols) in zip((0, 2), [(HIDDEN, IN), (OUT, HIDDEN)]):
        if i not in gathered:
            continue
        for shape, storage, nbytes in saved:
            if (
                shape in ((rows, cols), (rows, cols // 2), (cols, rows), (cols // 2, rows))
                and storage not in gathered[i]
            ):
                copies.append((i, tuple(shape), nbytes))
    return out, copies


def rounding_seed(step: int, rank: int) -> int:
    """The seed of a rank's backward at ``step`` (nvfp4 rounds its output gradients stochastically
    from torch's generator), and of one process's micro-batch of that rank's batch: the same noise,
    which alone moves four steps' losses by ~2 %."""
    return 1000 + 100 * step + rank


def _values(weight: torch.Tensor) -> torch.Tensor:
    """A copy of the values of a stored weight: a ScalingTensor's, or a plain one's (not through
    ``Tensor.dequantize``, which makes a plain parameter a non-leaf)."""
    from fp8lm import ScalingTensor

    return weight.dequantize() if isinstance(weight, ScalingTensor) else weight.detach().clone()


def train_against_one_process(model, reference, level: str, rank: int, world: int, saving) -> dict:
    """``STEPS`` steps of the sharded ``model`` on this rank's batch next to the unsharded
    ``reference`` in one process over the ranks' batches as micro-batches (nvfp4 scales each one's
    input per tensor), each micro-batch's backward with its rank's rounding noise; O1: torch's
    AdamW, else FP8AdamW. The first forward goes through ``saving`` (`forward_saving`): what it
    saved, and the first outputs of both; the losses of every step."""
    import torch.distributed as dist

    from fp8lm.distributed import precompute_fp8_scales
    from fp8lm.optim import FP8AdamW

    optimizer = torch.optim.AdamW if level == "O1" else FP8AdamW
    opt = optimizer(model.parameters(), lr=LR)
    ref_opt = optimizer(reference.parameters(), lr=LR)
    res: dict = {"losses": [], "ref_losses": []}
    for step in range(STEPS):
        precompute_fp8_scales(model)
        x, y = batch(rank)
        if step == 0:
            out, res["saved_copies"] = saving(model, x)
            res["out"], res["ref_out"] = out.detach().clone(), reference(x).detach()
        else:
            out = model(x)
        loss = (out - y).square().mean()
        torch.manual_seed(rounding_seed(step, rank))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        res["losses"].append(float(mean) / world)
        ref_loss = 0.0
        for r in range(world):
            xr, yr = batch(r)
            micro = (reference(xr) - yr).square().mean() / world
            torch.manual_seed(rounding_seed(step, r))
            micro.backward()
            ref_loss += float(micro)
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        res["ref_losses"].append(ref_loss)
    return res


def recipe_checks(recipe: str, rank: int, world: int, level: str = "O2") -> dict:
    """The checks of one recipe: at O2 (FP16-stored weights, FP8AdamW) or O1 (plain FP32 weights,
    torch's AdamW)."""
    from fp8lm.distributed import fully_shard, precompute_fp8_scales

    model = small_model(recipe, "fp32" if level == "O1" else "fp16")
    reference = copy.deepcopy(model)
    res = {"weights": [_values(reference[i].weight) for i in (0, 2)]}
    for i in (0, 2):
        fully_shard(model[i])
    fully_shard(model)
    precompute_fp8_scales(model)
    res["gathered"] = [gathered(model[i]) for i in (0, 2)]
    res.update(train_against_one_process(model, reference, level, rank, world, forward_saving))
    # After the optimizer changed the weights: the gathers since refilled the payload and scales.
    res["final_shards"] = [_values(model[i].weight.to_local()) for i in (0, 2)]
    precompute_fp8_scales(model)  # after every optimizer step, as its contract says
    res["final_gathered"] = [gathered(model[i]) for i in (0, 2)]
    return res


def level_results(r: dict, level: str, recipe: str) -> dict:
    """A rank's results (`checks`) of ``recipe`` at ``level`` (O2: FP16-stored weights; O1: plain FP32)."""
    return r[recipe] if level == "O2" else r["O1"][recipe]


def assert_trains_as_one_process(res: dict) -> None:
    """The losses of `train_against_one_process`: the first the same forward summed in another
    order, every one within 1 % of one process's, and falling."""
    losses, ref = torch.tensor(res["losses"]), torch.tensor(res["ref_losses"])
    assert torch.allclose(losses[0], ref[0], rtol=1e-6, atol=0)
    assert bool(((losses - ref).abs() <= 0.01 * ref).all()), (losses, ref)
    assert ref[-1] < ref[0]  # it trains


def one_rank_checks(recipe: str, level: str) -> dict:
    """On one rank, where FSDP2 skips the all-gather and reads only its first input: what the
    layers get, and one step's outputs and weight gradients against the unsharded model."""
    from fp8lm.distributed import fully_shard

    model = small_model(recipe, "fp32" if level == "O1" else "fp16")
    reference = copy.deepcopy(model)
    for i in (0, 2):
        fully_shard(model[i])
    fully_shard(model)
    x, y = batch(0)
    out, ref_out = model(x), reference(x)
    for o in (out, ref_out):  # nvfp4's stochastic rounding draws the same noise for both
        torch.manual_seed(1)
        (o - y).square().mean().backward()
    grads = [_values(m.grad.full_tensor()) for m in (model[0].weight, model[2].weight)]
    ref_grads = [_values(reference[i].weight.grad) for i in (0, 2)]
    return {
        "out_equal": torch.equal(out, ref_out),
        "grads_equal": all(torch.equal(g, r) for g, r in zip(grads, ref_grads)),
    }


def checks(rank, world, mode="all"):
    if mode == "one_rank":
        return {level: {r: one_rank_checks(r, level) for r in RECIPES} for level in LEVELS}
    res = {recipe: recipe_checks(recipe, rank, world) for recipe in RECIPES}
    res["O1"] = {recipe: recipe_checks(recipe, rank, world, "O1") for recipe in RECIPES}
    return res


if __name__ == "__main__":
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    worker_main(checks)
