"""Worker for tests/test_fsdp_o1_gather.py: O1 models (FP32 weights, FP8 GEMMs) on FSDP2 with
`fp8lm.distributed.fully_shard` (gloo ranks). Modes: ``same_batch`` (every rank the same batch,
FP32 gradient reduce-scatter: the run against one process's), ``wire`` (each rank its own batch,
the default FP8 reduce-scatter: against torch's ``fully_shard``, which gathers the FP32 weights),
``int_reshard`` (4 ranks resharded to 2 after forward), ``save`` / ``load`` (Distributed Checkpoint),
``autocast_head`` (the output head's FP32 weight gathered in BF16 under BF16 autocast)."""

import sys
from pathlib import Path

import torch
from torch import nn

from dist_launch import worker_main

STEPS = 4
LR = 1e-2


def o1_model(output_head: bool = False) -> nn.Module:
    """Three FP8Linear layers at O1 (plain FP32 weights, FP8 GEMMs), one with rows that 2 ranks
    shard unevenly (13), and biases (FP32 on the wire). The last layer's GEMMs run in FP8 too
    (no output-head rule: every weight's gather is E4M3), or with ``output_head`` in high
    precision (BF16 under autocast), as the rule says."""
    import fp8lm

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 13), nn.GELU(), nn.Linear(13, 8))
    policy = fp8lm.policy.preset("O1", output_head=output_head)
    model, _ = fp8lm.initialize(model, None, "O1", policy=policy, multiple_of=1)
    return model


def shard(model: nn.Module, **options) -> nn.Module:
    from fp8lm.distributed import fully_shard

    for layer in model[::2]:
        fully_shard(layer, **options)
    fully_shard(model, **options)
    return model


def torch_shard(model: nn.Module) -> nn.Module:
    """torch's fully_shard with fp8lm's counted FP32 all-gather and FP8 reduce-scatter: FSDP2 as
    it shards O1 weights without fp8lm (in FP32), the gradient shards stored in the policy's
    formats as fp8lm's fully_shard stores them."""
    from torch.distributed.fsdp import fully_shard

    from fp8lm.distributed.fsdp import CountedAllGather, FP8ReduceScatter, _grad_format_hooks, _move_grad_format_hooks

    for layer in [*model[::2], model]:
        hooks = _grad_format_hooks(layer)
        fully_shard(layer)
        _move_grad_format_hooks(layer, hooks)
        layer.set_custom_all_gather(CountedAllGather())
        layer.set_custom_reduce_scatter(FP8ReduceScatter())
    return model


def batch(step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(6, 16, generator=g) * (1 + step)


def full(p: torch.Tensor) -> torch.Tensor:
    return (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()


def train(model: nn.Module, batches, precompute: bool, autocast: bool = False) -> dict:
    """AdamW steps on ``batches`` (``precompute``: agree the all-gather scales before each step,
    else each all-gather agrees its own; ``autocast``: the forward under BF16 autocast); the
    outputs, losses, counted bytes per step and final weights."""
    from fp8lm.distributed import comm_stats, precompute_fp8_scales, reset_comm_stats

    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    res: dict = {"outs": [], "losses": [], "stats": []}
    for x in batches:
        if precompute:
            precompute_fp8_scales(model)
        reset_comm_stats()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = model(x)
        loss = out.square().mean()
        loss.backward()
        res["stats"].append(comm_stats())
        opt.step()
        opt.zero_grad(set_to_none=True)
        res["outs"].append(out.detach())
        res["losses"].append(loss.detach())
    res["weights"] = {n: full(p) for n, p in model.named_parameters()}
    return res


def same_batch_checks(rank, world) -> dict:
    """Every rank the same batch and FP32 gradient reduce-scatter (the mean of equal gradients is
    exact): the sharded run's numbers against one process's on that batch."""
    from fp8lm.distributed.fp32_gather import FP8GatheredWeight

    model = shard(o1_model(), fp8_reduce_scatter=False)
    kinds = {n: type(p.to_local()).__name__ for n, p in model.named_parameters()}
    batches = [batch(step, 0) for step in range(STEPS)]
    res = {"sharded": train(model, batches, True), "single": train(o1_model(), batches, False), "kinds": kinds}
    from fp8lm import memory_report

    res["memory"] = memory_report(model)
    res["wrapped"] = sorted(n for n, p in model.named_parameters() if isinstance(p.to_local(), FP8GatheredWeight))
    return res


def forward_gather(model: nn.Module, x: torch.Tensor, layer: int = 2) -> dict:
    """The counted all-gathers of one forward without autograd (one per FSDP group), and the
    gathered weight of ``layer`` (the middle one by default: 13 rows, uneven shards)."""
    from fp8lm.distributed import comm_stats, precompute_fp8_scales, reset_comm_stats

    precompute_fp8_scales(model)
    reset_comm_stats()
    with torch.no_grad():
        model(x)
    stats = comm_stats()
    model[layer].unshard()
    w = model[layer].weight
    gathered = (w.payload.clone(), w.scale.clone()) if hasattr(w, "payload") else w.detach().clone()
    model[layer].reshard()
    return {"stats": stats, "gathered": gathered}


def wire_checks(rank, world) -> dict:
    """Each rank its own batches, FP8 reduce-scatter: fp8lm's fully_shard against torch's (FP32
    all-gather) from the same weights."""
    batches = [batch(step, rank) for step in range(STEPS)]
    fp8, fp32 = shard(o1_model()), torch_shard(o1_model())
    res = {"fp8_forward": forward_gather(fp8, batches[0]), "fp32_forward": forward_gather(fp32, batches[0])}
    res["shards"] = {n: p.to_local().detach().clone() for n, p in fp8.named_parameters()}
    res["fp8"], res["fp32"] = train(fp8, batches, True), train(fp32, batches, True)
    res["fp8_own_scales"] = train(shard(o1_model()), batches, False)
    return res


def int_reshard_checks(rank, world) -> dict:
    """``reshard_after_forward=2`` on 4 ranks (FSDP2 then runs no all-gather extensions): the FP32
    weights stay plain and are gathered in FP32; training runs as with the default."""
    from fp8lm.distributed.fp32_gather import FP8GatheredWeight

    batches = [batch(step, rank) for step in range(2)]
    model = shard(o1_model(), reshard_after_forward=2)
    wrapped = [n for n, p in model.named_parameters() if isinstance(p.to_local(), FP8GatheredWeight)]
    return {"wrapped": wrapped, "run": train(model, batches, True), "default": train(shard(o1_model()), batches, True)}


def autocast_head_checks(rank, world) -> dict:
    """O1 with the output-head rule (the last layer's GEMMs in BF16 under autocast), each rank its
    own batches, FP8 reduce-scatter: the head's weight gathered in BF16 (``autocast_dtype``)
    against in FP32, and the same batch on every rank with FP32 reduce-scatter against one process."""
    from fp8lm.distributed.fp32_gather import AutocastGatheredWeight

    batches = [batch(step, rank) for step in range(STEPS)]
    model = shard(o1_model(output_head=True), autocast_dtype=torch.bfloat16)
    res = {"kinds": {n: type(p.to_local()).__name__ for n, p in model.named_parameters()}}
    res["head_shard"] = model[4].weight.to_local().detach().clone()
    res["forward"] = forward_gather(model, batches[0], layer=4)
    fp32 = shard(o1_model(output_head=True))
    res["fp32_forward"] = forward_gather(fp32, batches[0], layer=4)
    res["bf16"] = train(model, batches, True, autocast=True)
    res["fp32"] = train(fp32, batches, True, autocast=True)
    same = [batch(step, 0) for step in range(STEPS)]
    one = shard(o1_model(output_head=True), autocast_dtype=torch.bfloat16, fp8_reduce_scatter=False)
    res["same_batch"] = train(one, same, True, autocast=True)
    res["single"] = train(o1_model(output_head=True), same, False, autocast=True)
    res["cast_wrapped"] = [n for n, p in model.named_parameters() if isinstance(p.to_local(), AutocastGatheredWeight)]
    return res


def save_checks(rank, world, folder) -> dict:
    from fp8lm.distributed import save_fsdp_checkpoint
    from fp8lm.nn import scaling_state_dict

    model = shard(o1_model())
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    batches = [batch(step, rank) for step in range(STEPS)]
    train_with(model, opt, batches[:2])
    save_fsdp_checkpoint(Path(folder) / "dcp", model, opt)
    torch.save(scaling_state_dict(model), Path(folder) / f"scaling{rank}.pt")
    saved = {n: full(p) for n, p in model.named_parameters()}
    return {"saved": saved, "losses": train_with(model, opt, batches[2:])}


def load_checks(rank, world, folder) -> dict:
    from fp8lm.distributed import load_fsdp_checkpoint
    from fp8lm.nn import load_scaling_state_dict

    model = shard(o1_model())
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    load_fsdp_checkpoint(Path(folder) / "dcp", model, opt)
    load_scaling_state_dict(model, torch.load(Path(folder) / f"scaling{rank}.pt", weights_only=True))
    loaded = {n: full(p) for n, p in model.named_parameters()}
    batches = [batch(step, rank) for step in range(STEPS)]
    return {"loaded": loaded, "losses": train_with(model, opt, batches[2:])}


def train_with(model: nn.Module, opt, batches) -> list:
    from fp8lm.distributed import precompute_fp8_scales

    losses = []
    for x in batches:
        precompute_fp8_scales(model)
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    return losses


def checks(rank, world, mode, *args):
    modes = {
        "same_batch": same_batch_checks,
        "wire": wire_checks,
        "int_reshard": int_reshard_checks,
        "autocast_head": autocast_head_checks,
        "save": save_checks,
        "load": load_checks,
    }
    return modes[mode](rank, world, *args)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    worker_main(checks)
