"""Worker for tests/test_fsdp_optim.py: FP8AdamW on FSDP2 shards and Distributed Checkpoint (gloo
ranks). Modes: ``optim`` (sharded steps against one process fed the same gradients, skipping,
memory, and a few training steps against one process on the whole batch), ``save`` (train, save,
train on), ``load`` (load at any world size), ``resume`` (load at the saving world size, train on)."""

import copy
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from dist_launch import worker_main

STEPS_BEFORE_SAVE, STEPS_AFTER_SAVE = 3, 2
LR = 1e-2


def tiny_gpt(opt_level: str = "O2"):
    """A 2-block GPT (FP16 weights, FP8 GEMMs); a vocabulary of 250 makes uneven shards."""
    import fp8lm
    from fp8lm.train.model import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=250, block_size=16, n_layer=2, n_head=2, n_embd=32))
    model, _ = fp8lm.initialize(model, opt_level=opt_level)
    return model


def o1_weights(model) -> dict:
    """This rank's weight values (local shards) of an O1 model: torch's AdamW requantizes each
    FP16 shard with its own scale."""
    values = {}
    for name, p in model.named_parameters():
        value = stored(p)
        values[name] = value[0].float() / value[1] if isinstance(value, tuple) else value
    return values


def shard(model):
    from fp8lm.distributed import fully_shard

    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model


def optimizer(model):
    from fp8lm.optim import FP8AdamW

    return FP8AdamW(model.parameters(), lr=LR, weight_decay=0.1)


def batch(step: int, rank: int, rows: int = 2):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randint(0, 250, (rows, 16), generator=g)
    return x, torch.roll(x, -1, dims=1)


def train_steps(model, opt, steps, rank):
    """Steps ``steps`` (an iterable of step numbers) on this rank's batches; returns the losses."""
    from fp8lm.distributed import precompute_fp8_scales

    losses = []
    for step in steps:
        precompute_fp8_scales(model)
        _, loss = model(*batch(step, rank))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    return losses


def stored(t: torch.Tensor):
    """This rank's part of a parameter or state tensor as (payload bits, scale), or plain values."""
    t = t.to_local() if hasattr(t, "to_local") else t
    if hasattr(t, "payload"):
        return (t.payload.clone(), t.scale.clone())
    return t.detach().clone()


def snapshot(model, opt) -> dict:
    """This rank's weights and optimizer state (local shards), by parameter name."""
    out = {}
    for name, p in model.named_parameters():
        state = opt.state[p]
        out[name] = {"weight": stored(p)}
        out[name].update({k: stored(v) if isinstance(v, torch.Tensor) else v for k, v in state.items()})
    out["skipped_steps"] = opt.skipped_steps
    return out


# -- mode "optim" ---------------------------------------------------------------------------------


def wide_gradient(shape, step: int) -> torch.Tensor:
    """The same gradient on every rank, its first rows 1000x larger: shards' amaxes differ."""
    g = torch.Generator().manual_seed(7 + step)
    x = torch.randn(shape, generator=g) * torch.exp(torch.randn(shape, generator=g))
    x[: max(shape[0] // 3, 1)] *= 1000
    return x


def everyone(t: torch.Tensor) -> torch.Tensor:
    """The dim-0 shards of all ranks, concatenated (what FSDP2's Shard(0) layout split)."""
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, t.contiguous().view(torch.uint8))  # float8 does not pickle across ranks
    return torch.cat(parts).view(t.dtype)


def whole(value):
    """A gathered `stored` value: (payload, scale) pairs keep the (agreed) scale of rank 0."""
    if isinstance(value, tuple):
        return everyone(value[0]), value[1]
    return everyone(value) if isinstance(value, torch.Tensor) and value.dim() else value


def set_reference(reference, ref_opt, sharded_state: dict) -> None:
    """Make the one-process model and optimizer hold exactly the sharded run's (gathered) state."""
    for name, p in reference.named_parameters():
        saved = sharded_state[name]
        w = saved["weight"]
        if isinstance(w, tuple):
            p.payload.copy_(w[0])
            p.scale.copy_(w[1])
        else:
            p.data.copy_(w)
        state = ref_opt.state[p]
        state["step"] = saved["step"]
        for key in ("exp_avg", "exp_avg_sq"):
            state[key], state[key + "_scale"] = saved[key].clone(), saved[key + "_scale"].clone()


def same_step_checks(model, rank) -> dict:
    """Per step: the one-process optimizer starts from the sharded state, both get the same
    gradients; returns both results (gathered) and the shards' local gradient amaxes."""
    from torch.distributed.tensor import distribute_tensor

    reference = copy.deepcopy(tiny_gpt())
    sharded_opt, ref_opt = optimizer(model), optimizer(reference)
    ref_params = dict(reference.named_parameters())
    res: dict = {"steps": [], "local_grad_amax": {}}
    for step in range(3):
        for name, p in model.named_parameters():
            full = wide_gradient(p.shape, step)
            p.grad = distribute_tensor(full, p.device_mesh, p.placements)
            ref_params[name].grad = full.clone()
            local = p.grad.to_local()
            res["local_grad_amax"][name] = float(local.abs().max()) if local.numel() else 0.0
        before = {
            n: {k: whole(v) for k, v in s.items()} for n, s in snapshot(model, sharded_opt).items() if n in ref_params
        }
        if step:
            set_reference(reference, ref_opt, before)
        sharded_opt.step()
        ref_opt.step()
        after = {
            n: {k: whole(v) for k, v in s.items()} for n, s in snapshot(model, sharded_opt).items() if n in ref_params
        }
        res["steps"].append({"sharded": after, "reference": snapshot(reference, ref_opt)})
    res["skip"] = skip_checks(model, sharded_opt, rank)
    return res


def skip_checks(model, opt, rank) -> dict:
    """A NaN in rank 1's shard of one gradient only: every rank skips the step, nothing changes."""
    from torch.distributed.tensor import distribute_tensor

    for p in model.parameters():
        p.grad = distribute_tensor(torch.ones(p.shape), p.device_mesh, p.placements)
    name, p = next((n, p) for n, p in model.named_parameters() if p.dim() == 2)
    if rank == 1:
        p.grad.to_local()[0, 0] = float("nan")
    before = snapshot(model, opt)
    opt.step()
    after = snapshot(model, opt)
    return {"skipped": opt.last_step_skipped, "count": opt.skipped_steps, "before": before, "after": after}


def optim_checks(rank, world) -> dict:
    from fp8lm import memory_report

    res = same_step_checks(shard(tiny_gpt()), rank)
    # Training: the sharded run against one process on the whole batch, same weights.
    model, single = shard(tiny_gpt()), tiny_gpt()
    opt, single_opt = optimizer(model), optimizer(single)
    res["losses"] = train_steps(model, opt, range(5), rank)
    steps = range(5)
    res["single_losses"] = []
    for step in steps:
        x, y = zip(*(batch(step, r) for r in range(world)))
        _, loss = single(torch.cat(x), torch.cat(y))
        loss.backward()
        single_opt.step()
        single_opt.zero_grad(set_to_none=True)
        res["single_losses"].append(loss.detach())
    res["memory"], res["single_memory"] = memory_report(model, opt), memory_report(single, single_opt)
    return res


# -- checkpoints ----------------------------------------------------------------------------------


def save_checks(rank, world, folder) -> dict:
    from fp8lm.distributed import save_fsdp_checkpoint
    from fp8lm.nn import scaling_state_dict

    model = shard(tiny_gpt())
    opt = optimizer(model)
    train_steps(model, opt, range(STEPS_BEFORE_SAVE), rank)
    save_fsdp_checkpoint(Path(folder) / "dcp", model, opt)
    torch.save(scaling_state_dict(model), Path(folder) / f"scaling{rank}.pt")
    res = {"saved": snapshot(model, opt)}
    steps = range(STEPS_BEFORE_SAVE, STEPS_BEFORE_SAVE + STEPS_AFTER_SAVE)
    res["losses"] = train_steps(model, opt, steps, rank)
    res["final"] = snapshot(model, opt)
    o1 = shard(tiny_gpt("O1"))
    o1_opt = torch.optim.AdamW(o1.parameters(), lr=LR)
    train_steps(o1, o1_opt, range(STEPS_BEFORE_SAVE), rank)
    save_fsdp_checkpoint(Path(folder) / "dcp_o1", o1, o1_opt)
    res["o1_saved"] = o1_weights(o1)
    return res


def load_checks(rank, world, folder) -> dict:
    from fp8lm.distributed import load_fsdp_checkpoint

    model = shard(tiny_gpt())
    opt = optimizer(model)
    load_fsdp_checkpoint(Path(folder) / "dcp", model, opt)
    o1 = shard(tiny_gpt("O1"))
    load_fsdp_checkpoint(Path(folder) / "dcp_o1", o1, torch.optim.AdamW(o1.parameters(), lr=LR))
    return {"loaded": snapshot(model, opt), "o1_loaded": o1_weights(o1)}


def resume_checks(rank, world, folder) -> dict:
    from fp8lm.distributed import load_fsdp_checkpoint
    from fp8lm.nn import load_scaling_state_dict

    model = shard(tiny_gpt())
    opt = optimizer(model)
    load_fsdp_checkpoint(Path(folder) / "dcp", model, opt)
    load_scaling_state_dict(model, torch.load(Path(folder) / f"scaling{rank}.pt", weights_only=True))
    steps = range(STEPS_BEFORE_SAVE, STEPS_BEFORE_SAVE + STEPS_AFTER_SAVE)
    return {"losses": train_steps(model, opt, steps, rank), "final": snapshot(model, opt)}


def checks(rank, world, mode, *args):
    modes = {"optim": optim_checks, "save": save_checks, "load": load_checks, "resume": resume_checks}
    return modes[mode](rank, world, *args)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    worker_main(checks)
