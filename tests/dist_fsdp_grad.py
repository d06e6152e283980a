"""Worker for tests/test_fsdp_grad.py (gloo ranks). ``formats``: the storage format of every
parameter's gradient after one backward (and after a second one accumulated), in one process and
on FSDP2 shards, at O1 and O2, with the gradients' bytes as `fp8lm.memory_report` counts them.
``wire``: FP8ReduceScatter with a BF16 span, and the spans `fully_shard` finds in a GPT."""

import torch

from dist_launch import worker_main


def tiny_gpt(opt_level: str):
    import fp8lm
    from fp8lm.train.model import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, block_size=16, n_layer=2, n_head=2, n_embd=32))
    model, _ = fp8lm.initialize(model, opt_level=opt_level)
    return model


def grad_format(grad) -> str:
    """The gradient's storage: the payload dtype of a ScalingTensor, else the plain dtype."""
    if grad is None:
        return "none"
    local = grad.to_local() if hasattr(grad, "to_local") else grad
    local = getattr(grad, "_local_tensor", local)
    if hasattr(local, "payload"):
        return f"scaled:{local.payload.dtype}"
    return str(local.dtype)


def batch(rank: int):
    g = torch.Generator().manual_seed(rank)
    x = torch.randint(0, 256, (2, 16), generator=g)
    return x, torch.roll(x, -1, dims=1)


def formats(model, rank: int) -> dict:
    """Gradient formats and bytes after one backward, and formats after a second one accumulated."""
    from fp8lm import memory_report

    _, loss = model(*batch(rank))
    loss.backward()
    result = {
        "formats": {name: grad_format(p.grad) for name, p in model.named_parameters()},
        "grad_bytes": memory_report(model)["gradients"],
        "num_params": memory_report(model)["num_params"],
    }
    _, loss = model(*batch(rank + 10))
    loss.backward()
    result["accumulated"] = {name: grad_format(p.grad) for name, p in model.named_parameters()}
    if any(hasattr(p, "device_mesh") for p in model.parameters()):  # torch's clipping on the shards
        import fp8lm

        result["norm"] = fp8lm.clip_grad_norm_(model, float("inf"))
        clipped = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        result["torch_norms"] = [
            clipped.full_tensor(),
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).full_tensor(),
        ]
    return result


def wire(rank: int, world: int) -> dict:
    """FP8ReduceScatter with a BF16 span against the float64 sum, and the spans fully_shard found
    in the tiny GPT's groups (only the output head's, in the root group)."""
    from fp8lm.distributed import comm_stats, fully_shard, reset_comm_stats
    from fp8lm.distributed.fsdp import FP8ReduceScatter

    g = torch.Generator().manual_seed(rank)
    chunk, span = 40, (8, 24)
    x = torch.randn(world * chunk, generator=g) * torch.logspace(-6, 2, world * chunk)  # rows of any size
    out = torch.empty(chunk)
    reset_comm_stats()
    FP8ReduceScatter("E4M3", [span], chunk)(out, x.clone(), None, torch.distributed.ReduceOp.AVG)
    stats = comm_stats()
    everyone = [torch.empty_like(x) for _ in range(world)]
    torch.distributed.all_gather(everyone, x)
    model = tiny_gpt("O2")
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    names = {id(p): name for name, p in model.named_parameters()}
    groups = {}
    for name, module in [*((f"blocks.{i}", b) for i, b in enumerate(model.blocks)), ("", model)]:
        group = module._get_fsdp_state()._fsdp_param_group
        groups[name] = {
            "wide": group._reduce_scatter_comm.wide,
            "params": [(names[id(f.sharded_param)], f.padded_sharded_param_size.numel()) for f in group.fsdp_params],
        }
    return {
        "out": out,
        "inputs": torch.stack(everyone),
        "chunk": chunk,
        "span": span,
        "stats": stats,
        "groups": groups,
    }


def checks(rank: int, world: int, mode: str = "formats") -> dict:
    if mode == "wire":
        return wire(rank, world)
    from fp8lm.distributed import fully_shard, precompute_fp8_scales

    result = {}
    for level in ("O1", "O2"):
        result[f"single_{level}"] = formats(tiny_gpt(level), rank)
        model = tiny_gpt(level)
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        precompute_fp8_scales(model)
        result[f"fsdp_{level}"] = formats(model, rank)
    return result


if __name__ == "__main__":
    worker_main(checks)
