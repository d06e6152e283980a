"""Worker for tests/test_distributed_zero.py: FP8 ZeRO (O3) on a tiny GPT.

Arguments: a checkpoint directory to write, and optionally one written at another world size to
load after training."""

import torch

from dist_launch import worker_main


def batch(rank, step, world):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randint(0, 256, (4, 32), generator=g)
    return x, torch.roll(x, -1, dims=1)


def full_state(opt):
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in opt.state_dict().items()}


def weights(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def checks(rank, world, save_dir, load_dir=None):
    import torch.distributed as dist

    import fp8lm
    from fp8lm.distributed import (
        FP8ZeroOptimizer,
        comm_stats,
        load_checkpoint,
        reset_comm_stats,
        save_checkpoint,
        wrap,
    )
    from fp8lm.train.model import GPT, preset

    out = {}
    torch.manual_seed(rank)  # replicas differ until wrap() broadcasts rank 0's
    model = GPT(preset("tiny"))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, opt = wrap(model, opt, "O3", optimizer_options={"kernel": "eager"})
    assert isinstance(opt, FP8ZeroOptimizer)
    out["payload_dtypes"] = {
        n: (p.payload.dtype if isinstance(p, fp8lm.ScalingTensor) else p.dtype) for n, p in model.named_parameters()
    }
    out["owned"] = opt.owned_names()
    out["numels"] = {n: p.numel() for n, p in model.named_parameters()}

    # An unsharded O3 replica fed the same reduced gradients must end bit-identical.
    torch.manual_seed(0)
    ref = GPT(preset("tiny"))
    ref, ref_opt = fp8lm.initialize(
        ref, torch.optim.AdamW(ref.parameters(), lr=3e-3), "O3", optimizer_options={"kernel": "eager"}
    )
    ref.load_state_dict(model.state_dict())
    ref_params = dict(ref.named_parameters())

    losses = []
    for step in range(3):
        x, y = batch(rank, step, world)
        _, loss = model(x, y)
        loss.backward()
        reset_comm_stats()
        opt.reduce_gradients()
        for name, p, owner in zip(opt.names, opt.params, opt.owners):
            g = p.grad.clone() if owner == rank else torch.empty(p.shape)
            dist.broadcast(g, src=owner)
            ref_params[name].grad = g
        opt.step()
        ref_opt.step()
        out["step_stats"] = comm_stats()
        opt.zero_grad()
        ref_opt.zero_grad()
        losses.append(float(loss))
    out["losses"] = losses
    out["matches_unsharded"] = {k: torch.equal(v, ref.state_dict()[k]) for k, v in model.state_dict().items()}
    _, loss = model(*batch(rank, 5, world))
    loss.backward()
    out["grad_norm"] = float(opt.clip_grad_norm_(1e-3))
    out["clipped_norm"] = float(opt.clip_grad_norm_(1e9))  # already reduced and clipped
    opt.zero_grad()
    out["state_bytes"] = opt.state_bytes()
    out["memory_report"] = fp8lm.memory_report(model, opt.shard)  # adds buffers and FP8 scaling state
    out["weights"] = weights(model)
    out["state"] = full_state(opt)
    save_checkpoint(save_dir, model, opt)
    if load_dir is not None:  # written at another world size
        load_checkpoint(load_dir, model, opt)
        out["loaded_state"] = full_state(opt)
        out["loaded_weights"] = weights(model)

    # A non-finite gradient on one rank: every rank skips the step, nothing changes.
    _, loss = model(*batch(rank, 9, world))
    loss.backward()
    if rank == world - 1:
        next(model.parameters()).grad.fill_(float("nan"))
    before = weights(model)
    opt.step()
    out["nan_skipped"] = opt.last_step_skipped and all(torch.equal(before[k], v) for k, v in weights(model).items())

    # A finite 1e30 on one rank: the global norm overflows float32; clipping must not zero the
    # gradients into a momentum-only step, the step is skipped and counted on every rank.
    opt.zero_grad()
    _, loss = model(*batch(rank, 10, world))
    loss.backward()
    if rank == 0:
        next(model.parameters()).grad.view(-1)[0] = 1e30
    skipped, before = opt.skipped_steps, weights(model)
    out["overflow_norm"] = float(fp8lm.clip_grad_norm_(opt, 1.0))
    opt.step()
    unchanged = all(torch.equal(before[k], v) for k, v in weights(model).items())
    out["overflow_skipped"] = opt.last_step_skipped and opt.skipped_steps == skipped + 1 and unchanged

    # Memory of the default ("small") preset after a step, all state counted by memory_report.
    small = GPT(preset("small"))
    small, small_opt = wrap(
        small, torch.optim.AdamW(small.parameters(), lr=1e-3), "O3", optimizer_options={"kernel": "eager"}
    )
    x, y = batch(rank, 0, world)
    small(x, y)[1].backward()
    small_opt.step()
    small_opt.zero_grad()
    out["small_memory"] = fp8lm.memory_report(small, small_opt.shard)
    out["small_state_bytes"] = small_opt.state_bytes()

    try:
        FP8ZeroOptimizer(model, torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1))
    except ValueError as e:
        out["foreign_param_error"] = str(e)
    try:
        opt.load_state_dict({"state.no.such.param.exp_avg": torch.zeros(1)})
    except ValueError as e:
        out["foreign_state_error"] = str(e)
    dist.barrier()
    return out


if __name__ == "__main__":
    worker_main(checks)
