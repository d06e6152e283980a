"""Worker for tests/test_expert_parallel.py: a mixture of experts spread over the gloo ranks
(`ExpertParallelMoE`), next to the whole mixture in one process with the same FP8 round trips
emulated where the all-to-alls make them; saves what the test compares."""

import copy

import torch

from dist_launch import worker_main

DIM, HIDDEN, EXPERTS, TOP_K, TOKENS = 32, 64, 4, 2, 24


def rank_tokens(rank: int) -> torch.Tensor:
    return torch.randn(TOKENS, DIM, generator=torch.Generator().manual_seed(100 + rank))


def build():
    from fp8lm.nn import MoE

    torch.manual_seed(0)
    return MoE(DIM, HIDDEN, EXPERTS, TOP_K, activation="swiglu")


class _RoundTrip(torch.autograd.Function):
    """What the all-to-alls do to values: E4M3 rows forward, E5M2 rows backward."""

    @staticmethod
    def forward(ctx, x):
        from fp8lm.distributed.expert_parallel import GRADIENT_FORMAT, TOKEN_FORMAT, pack_rows, unpack_rows

        ctx.fmts = (GRADIENT_FORMAT, pack_rows, unpack_rows)
        return unpack_rows(pack_rows(x, TOKEN_FORMAT), x.shape[1], TOKEN_FORMAT, x.dtype)

    @staticmethod
    def backward(ctx, g):
        fmt, pack_rows, unpack_rows = ctx.fmts
        return unpack_rows(pack_rows(g, fmt), g.shape[1], fmt, g.dtype)


def reference_forward_backward(model, x, g):
    """The whole mixture in this process, the FP8 round trips of dispatch and combine emulated."""
    from fp8lm.nn import MoE

    def run_experts(xs, counts):
        return _RoundTrip.apply(MoE.run_experts(model, _RoundTrip.apply(xs), counts))

    model.run_experts = run_experts
    x = x.clone().requires_grad_()
    y = model(x)
    y.backward(g)
    return y.detach(), x.grad


def switched_experts(whole, x) -> dict:
    """At O2 with both expert layers switched to high precision (and, for comparison, not): the
    rows' outputs against one process's mixture switched alike, and the all-to-alls' bytes."""
    import fp8lm
    from fp8lm.distributed import comm_stats, reset_comm_stats
    from fp8lm.distributed.expert_parallel import expert_parallel

    ep = torch.nn.Sequential(copy.deepcopy(whole))
    expert_parallel(ep)
    ep, _ = fp8lm.initialize(ep, None, "O2")
    one, _ = fp8lm.initialize(torch.nn.Sequential(copy.deepcopy(whole)), None, "O2")
    res = {}
    for high in (False, True):
        for model in (ep, one):
            model[0].c_fc.high_precision = model[0].c_proj.high_precision = high
        reset_comm_stats()
        with torch.no_grad():
            y = ep(x)
        res[high] = {"y": y, "ref_y": one(x).detach(), "bytes": comm_stats()["expert_all_to_all_bytes"]}
    return res


def checks(rank, world):
    from fp8lm.distributed import comm_stats, reset_comm_stats
    from fp8lm.distributed.expert_parallel import ExpertParallelMoE, expert_parallel

    out = {}
    whole = build()
    ep = ExpertParallelMoE.from_moe(copy.deepcopy(whole), None)
    out["local_experts"] = list(ep.local_experts)
    out["ep_expert_weights"] = [w.detach().clone() for _, w in ep.c_fc.held_weights()]
    x, g = rank_tokens(rank), torch.randn(TOKENS, DIM, generator=torch.Generator().manual_seed(200 + rank))
    xi = x.clone().requires_grad_()
    reset_comm_stats()
    y = ep(xi)
    forward_stats = comm_stats()
    y.backward(g)
    out["stats_forward"], out["stats"] = forward_stats, comm_stats()
    out["y"], out["dx"] = y.detach(), xi.grad
    out["expert_grads"] = [w.grad.clone() for _, w in ep.c_fc.held_weights() + ep.c_proj.held_weights()]
    out["router_grad"] = ep.router.weight.grad.clone()
    out["counts"] = ep.take_routed()
    # the same tokens in one process: with the FP8 round trips emulated, and without them
    out["ref_y"], out["ref_dx"] = reference_forward_backward(copy.deepcopy(whole), x, g)
    plain = copy.deepcopy(whole)
    out["plain_y"] = plain(x).detach()
    # every rank's tokens through the whole mixture (the loss a sum over ranks): the expert gradients
    full = copy.deepcopy(whole)
    for r in range(world):
        gr = torch.randn(TOKENS, DIM, generator=torch.Generator().manual_seed(200 + r))
        reference_forward_backward(full, rank_tokens(r), gr)
    out["ref_expert_grads"] = [full.c_fc.weight[e].grad for e in ep.local_experts] + [
        full.c_proj.weight[e].grad for e in ep.local_experts
    ]
    # at O2 the local experts are FP8 grouped layers and train
    import fp8lm

    model = torch.nn.Sequential(copy.deepcopy(whole))
    expert_parallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = fp8lm.initialize(model, opt, "O2")
    model(x).square().mean().backward()
    opt.step()
    layer = model[0].c_fc
    out["switched"] = switched_experts(whole, x)
    out["o2"] = {
        "type": type(model[0]).__name__,
        "layer": type(layer).__name__,
        "experts": len(layer.held_weights()),
        "names": sorted(n for n, _ in model.named_parameters() if ".c_fc." in n),
        "grad_fmt": layer.held_weights()[0][1].grad.fmt.name,
        "finite": all(bool(torch.isfinite(w.dequantize()).all()) for _, w in layer.held_weights()),
    }
    return out


if __name__ == "__main__":
    worker_main(checks)
