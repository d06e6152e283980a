"""Worker for tests/test_tensor_parallel.py and tests/test_pipeline.py: the "tiny" GPT under its
FP8 tensor-parallel plan (``tp [RECIPE]``) or cut into FP8 pipeline stages (gloo ranks), one
forward and backward, next to the same FP8 model in one process and a float64 copy."""

import copy
import sys

import torch

from dist_launch import worker_main

BATCH, MICRO = 4, 2
# The tests' bound on the whole "tiny" GPT's per-token losses: the wires' extra roundings reach
# every token, whose error against float64 grows to 1.7-2.3x the single-process FP8 model's
# (measured over 4 seeds, FP32 and FP16 weights, tensor and pipeline parallel). The mean loss is one
# number whose error cancels by chance (ratios from 0.3x to 48x at those seeds): not the measure.
TOKEN_LOSS_GROWTH = 2.5


def models(recipe: str | None = None):
    import fp8lm
    from fp8lm.train.model import GPT, preset

    torch.manual_seed(0)
    cfg = preset("tiny")
    plain = GPT(cfg)
    exact = copy.deepcopy(plain).double()
    model, _ = fp8lm.initialize(plain, opt_level="O1", recipe=recipe)
    exact.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
    return cfg, model, copy.deepcopy(model), exact


def batch(cfg):
    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, cfg.vocab_size, (BATCH, cfg.block_size), generator=g)
    return x, torch.randint(0, cfg.vocab_size, (BATCH, cfg.block_size), generator=g)


def token_losses(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Each token's cross-entropy, in float64: the mean loss is one number whose FP8 error may
    cancel by chance (error ratios between two runs then mean nothing); these are many."""
    logits = logits.detach().double()
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1), reduction="none")


def reference(res: dict, ref, exact, x, y) -> dict:
    flat = {}
    for name, model in (("ref", ref), ("exact", exact)):
        outs = [model(a, b) for a, b in zip(x.chunk(MICRO), y.chunk(MICRO))]
        loss = sum(out[1] for out in outs) / MICRO
        loss.backward()
        res[f"{name}_loss"] = float(loss)
        res[f"{name}_token_losses"] = token_losses(torch.cat([out[0] for out in outs]), y)
        flat[name] = torch.cat([p.grad.double().reshape(-1) for p in model.parameters()])
        res[f"{name}_norm"] = float(flat[name].norm())
    res["ref_grad_error"] = float((flat["ref"] - flat["exact"]).norm() / flat["exact"].norm())
    return res


def tp_checks(rank, world, recipe: str | None = None) -> dict:
    from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

    from fp8lm import clip_grad_norm_
    from fp8lm.distributed import ParallelDims, comm_stats, reset_comm_stats
    from fp8lm.distributed.grad_sync import GradientSync, SyncPlan
    from fp8lm.train.gpt_parallel import tensor_parallel_plan

    cfg, model, ref, exact = models(recipe)
    dims = ParallelDims(tp=world)
    run_mesh = dims.build_mesh("cpu")
    mesh = run_mesh["tp"]
    parallelize_module(model, mesh, tensor_parallel_plan(cfg))
    x, y = batch(cfg)
    reset_comm_stats()
    with loss_parallel():
        outs = [model(a, b) for a, b in zip(x.chunk(MICRO), y.chunk(MICRO))]
        loss = sum(out[1] for out in outs) / MICRO
        loss.backward()
    GradientSync(SyncPlan.for_run(dims), run_mesh, fp8=True).finish(model)  # the norms' partial sums over tp
    # every rank of the group holds this stage: plain (replicated) gradients count once over it
    norm = clip_grad_norm_(model.parameters(), float("inf"), group=mesh.get_group(), stage_size=world)
    res = {"loss": float(loss.detach()), "norm": float(norm), "stats": comm_stats()}
    logits = torch.cat([out[0].full_tensor() for out in outs])  # vocabulary-sharded; gathered after counting
    res["token_losses"] = token_losses(logits, y)
    return reference(res, ref, exact, x, y)


def pp_checks(rank, world) -> dict:
    from torch.distributed.pipelining import ScheduleGPipe

    from fp8lm import clip_grad_norm_
    from fp8lm.distributed import comm_stats, reset_comm_stats
    from fp8lm.distributed.pipeline import FP8PipelineStage, carrier_numel
    from fp8lm.train.gpt_parallel import PipelineStageModule

    cfg, model, ref, exact = models()
    stage = PipelineStageModule(model, rank, world, BATCH // MICRO)
    shape = (BATCH // MICRO, cfg.block_size)
    carrier = torch.empty(carrier_numel(shape[0] * shape[1] * cfg.n_embd))
    inputs = torch.zeros(shape, dtype=torch.long) if stage.first else carrier.clone().requires_grad_()
    outputs = torch.zeros(*shape, cfg.vocab_size) if stage.last else carrier.clone()
    pipe = FP8PipelineStage(
        stage, rank, world, torch.device("cpu"), input_args=inputs, output_args=outputs.requires_grad_()
    )

    def lm_loss(logits, targets):
        return torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1))

    schedule = ScheduleGPipe(pipe, n_microbatches=MICRO, loss_fn=lm_loss)
    x, y = batch(cfg)
    reset_comm_stats()
    losses: list = []
    if stage.first:
        schedule.step(x)
    else:
        logits = schedule.step(target=y, losses=losses)  # the last stage's merged outputs
    norm = clip_grad_norm_(stage.parameters(), float("inf"), group=torch.distributed.group.WORLD)  # one stage a rank
    res = {
        "loss": sum(float(v) for v in losses) / MICRO if losses else None,
        "token_losses": None if stage.first else token_losses(logits, y),
        "norm": float(norm),
        "stats": comm_stats(),
    }
    return reference(res, ref, exact, x, y)


def checks(rank, world, mode, *args):
    return {"tp": tp_checks, "pp": pp_checks}[mode](rank, world, *args)


if __name__ == "__main__":
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    worker_main(checks)
