"""Checks for tests/test_distributed_data_parallel.py (run by dist_sync.py)."""

import torch
from torch import nn


class FP8GradWeight(torch.autograd.Function):
    """Identity on a weight whose gradient comes back as an E4M3 ScalingTensor, as the weight
    gradient of fp8lm.nn.FP8Linear does."""

    @staticmethod
    def forward(ctx, w):
        return w.view_as(w)

    @staticmethod
    def backward(ctx, g):
        from fp8lm import quantize

        return quantize(g)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 12)  # plain FP32 gradient
        self.w = nn.Parameter(torch.randn(40, 12) * 0.3)  # FP8 gradient
        self.norm = nn.LayerNorm(40)  # small plain gradients
        self.head = nn.Linear(40, 16)

    def forward(self, idx):
        h = self.emb(idx) @ FP8GradWeight.apply(self.w).t()
        return self.head(torch.relu(self.norm(h)))


def batch(rank, step, n=24):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randint(0, 16, (n,), generator=g), torch.randint(0, 16, (n,), generator=g)


def loss_of(model, idx, y):
    return nn.functional.cross_entropy(model(idx), y)


def grads(model):
    from fp8lm import ScalingTensor

    return {
        n: (p.grad.dequantize() if isinstance(p.grad, ScalingTensor) else p.grad.clone())
        for n, p in model.named_parameters()
    }


def checks(rank, world):
    import torch.distributed as dist

    from fp8lm.distributed import FP8DataParallel, comm_stats, reset_comm_stats

    out = {}
    torch.manual_seed(rank)  # different initial weights: the wrapper must broadcast rank 0's
    ddp = FP8DataParallel(Net(), bucket_mb=300 / 2**20)  # several small buckets
    model = ddp.module
    out["weights"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    out["buckets"] = len(ddp.autoscale_stats())

    # Local gradients of two micro-batches, no communication.
    reset_comm_stats()
    for step in (0, 1):
        with ddp.no_sync():
            loss_of(ddp, *batch(rank, step)).backward()
    out["no_sync_bytes"] = comm_stats()["total_bytes"]
    local = grads(model)
    out["grad_types"] = {n: type(p.grad).__name__ for n, p in model.named_parameters()}
    exact = {n: g.clone() for n, g in local.items()}
    for g in exact.values():
        dist.all_reduce(g)
        g /= world
    out["local"], out["exact_mean"] = local, exact

    # The same two micro-batches, the second one synchronized.
    model.zero_grad(set_to_none=True)
    with ddp.no_sync():
        loss_of(ddp, *batch(rank, 0)).backward()
    reset_comm_stats()
    loss_of(ddp, *batch(rank, 1)).backward()
    out["sync_stats"] = comm_stats()
    out["synced"] = grads(model)
    out["synced_types"] = {n: type(p.grad).__name__ for n, p in model.named_parameters()}
    out["last_sync"] = dict(ddp.last_sync)
    out["num_params"] = sum(p.numel() for p in model.parameters())

    # Bytes per step of a model with realistic bucket fill (default bucket_mb).
    mlp = FP8DataParallel(nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64)))
    reset_comm_stats()
    mlp(torch.randn(8, 64)).square().mean().backward()
    out["mlp_stats"] = comm_stats()
    out["mlp_params"] = sum(p.numel() for p in mlp.parameters())

    # O2 end to end through wrap(): FP8Linear weight gradients, FP8 sync, FP8AdamW.
    from fp8lm.distributed import wrap
    from fp8lm.train.model import GPT, preset

    torch.manual_seed(rank)
    gpt = GPT(preset("tiny"))
    gpt, gopt = wrap(gpt, torch.optim.AdamW(gpt.parameters(), lr=3e-3), "O2", optimizer_options={"kernel": "eager"})
    for step in range(2):
        x = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(10 * step + rank))
        _, loss = gpt(x, torch.roll(x, -1, 1))
        reset_comm_stats()
        loss.backward()
        out["o2_stats"] = comm_stats()
        out["o2_grad_types"] = {n: type(p.grad).__name__ for n, p in gpt.module.named_parameters()}
        gopt.step()
        gopt.zero_grad()
    out["o2_weights"] = {k: v.clone() for k, v in gpt.module.state_dict().items()}
    out["o2_params"] = sum(p.numel() for p in gpt.parameters())
    out["o2_head_params"] = gpt.module.lm_head.weight.numel()

    # The paper's shared scale with automatic mu: equal gradients on every rank saturate the
    # FP8 sum at mu = 1.
    torch.manual_seed(0)
    shared = FP8DataParallel(Net(), bucket_mb=1, scaling="shared", autoscale_window=2)
    mus = []
    for step in range(3):
        shared.zero_grad(set_to_none=True)
        loss_of(shared, *batch(0, step)).backward()
        mus.append(shared.autoscale_stats()[0]["mu"])
    out["shared_mus"] = mus
    out["shared_grads"] = grads(shared.module)
    state = shared.state_dict()
    out["shared_extra_state"] = state["_extra_state"]
    torch.manual_seed(0)
    again = FP8DataParallel(Net(), bucket_mb=1, scaling="shared", autoscale_window=2)
    again.load_state_dict(state)
    out["reloaded_mu"] = again.autoscale_stats()[0]["mu"]
    try:
        ddp.load_state_dict(state)
    except ValueError as e:
        out["mismatched_state_error"] = str(e)
    try:
        FP8DataParallel(Net(), bucket_mb=0)
    except ValueError as e:
        out["bad_bucket_error"] = str(e)
    return out
