"""Worker for tests/test_sequence_moe.py: a mixture of experts under sequence parallelism
(`SequenceParallelMoE`), each gloo rank routing its slice of the same sequences, next to the whole
mixture on the whole sequences in this process; saves what the test compares."""

import torch

from dist_launch import worker_main

DIM, HIDDEN, EXPERTS, TOP_K, BATCH, SEQ = 32, 64, 4, 2, 2, 12


def build(**kw):
    from fp8lm.nn import MoE

    torch.manual_seed(0)
    return MoE(DIM, HIDDEN, EXPERTS, TOP_K, **kw)


def inputs() -> tuple[torch.Tensor, torch.Tensor]:
    """The whole batch's input (BATCH, SEQ, DIM) and an output gradient, the same on every rank."""
    g = torch.Generator().manual_seed(7)
    return torch.randn(BATCH, SEQ, DIM, generator=g), torch.randn(BATCH, SEQ, DIM, generator=g)


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def checks(rank: int, world: int) -> dict:
    from fp8lm.distributed import comm
    from fp8lm.distributed.sequence_moe import SequenceParallelMoE, sequence_parallel_parameters

    x, g = inputs()
    part = slice(rank * SEQ // world, (rank + 1) * SEQ // world)
    whole = build()
    y = whole(x)
    aux = whole.take_aux_loss()
    (y * g).sum().add(aux).backward()
    out = {"whole_y": y.detach()[:, part], "whole_aux": aux.detach(), "whole_grads": grads(whole)}
    out["whole_routed"] = whole.take_routed()

    model = SequenceParallelMoE(build(), group=None)
    y = model(x[:, part])
    aux = model.take_aux_loss()
    (y * g[:, part]).sum().add(aux).backward()
    summed = {}
    for name, p in model.named_parameters():
        summed[name] = comm.all_reduce(p.grad.detach().clone())
    out.update(y=y.detach(), aux=aux.detach(), grads=summed, routed=model.take_routed())
    out["parameters"] = len(sequence_parallel_parameters(model))

    # a capacity applies to each slice; the dropped slots add up over the slices
    capped = SequenceParallelMoE(build(capacity_factor=0.5), group=None)
    capped(x[:, part])
    alone = build(capacity_factor=0.5)
    for r in range(world):
        alone(x[:, r * SEQ // world : (r + 1) * SEQ // world])
    out["capped_dropped"], out["slices_dropped"] = capped.dropped.clone(), alone.dropped.clone()

    # experts spread over the ranks too (the world as both groups): each rank's slice, its tokens
    # sent to their experts' ranks, is still the whole mixture on that slice
    from fp8lm.distributed import ExpertParallelMoE
    from fp8lm.distributed.sequence_moe import SequenceExpertParallelMoE

    spread = SequenceExpertParallelMoE.from_moe(ExpertParallelMoE.from_moe(build(), None, fp8=False), None)
    out["spread_y"] = spread(x[:, part]).detach()
    out["spread_experts"] = len(spread.local_experts)
    return out


if __name__ == "__main__":
    worker_main(checks)
