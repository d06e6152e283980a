"""Worker for tests/test_pipeline.py: a small FP8 model in two pipeline stages (gloo ranks) whose
boundary activations travel as FP8 carriers, trained one step with ScheduleGPipe or Schedule1F1B;
each rank also runs the whole model in one process, as FP8 and in float64. Saves what the test
compares."""

import copy
import sys

import torch
from torch import nn

from dist_launch import worker_main

BATCH, MICRO, WIDTH = 8, 4, 32
MICRO_SHAPE = (BATCH // MICRO, WIDTH)


def whole_model() -> nn.Sequential:
    from fp8lm.nn import FP8Linear

    torch.manual_seed(0)
    return nn.Sequential(
        FP8Linear(WIDTH, 64), nn.GELU(), FP8Linear(64, WIDTH), FP8Linear(WIDTH, 64), nn.GELU(), FP8Linear(64, 16)
    )


def batch():
    g = torch.Generator().manual_seed(7)
    return torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, 16, generator=g)


def loss_fn(out, target):
    return nn.functional.mse_loss(out, target)


def grads(model: nn.Module) -> dict:
    return {
        n: (p.grad.dequantize() if hasattr(p.grad, "dequantize") else p.grad).double()
        for n, p in model.named_parameters()
    }


def one_process(model: nn.Module, x, y) -> tuple[float, dict]:
    """The schedule's arithmetic in one process: the mean of the micro-batches' losses."""
    loss = sum(loss_fn(model(a), b) for a, b in zip(x.chunk(MICRO), y.chunk(MICRO))) / MICRO
    loss.backward()
    return float(loss), grads(model)


def pipeline_checks(rank, world, schedule_name) -> dict:
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

    from fp8lm.distributed import comm_stats, reset_comm_stats
    from fp8lm.distributed.pipeline import FP8PipelineStage, FP8StageInput, FP8StageOutput

    model = whole_model()
    reference, exact = copy.deepcopy(model), copy.deepcopy(model)
    exact_plain = nn.Sequential(
        *[m if not hasattr(m, "weight") else nn.Linear(m.in_features, m.out_features) for m in exact]
    )
    exact_plain.load_state_dict(exact.state_dict())
    exact_plain.double()
    x, y = batch()
    entry = FP8StageInput(MICRO_SHAPE)
    stage_module = nn.Sequential(*model[:3], FP8StageOutput()) if rank == 0 else nn.Sequential(entry, *model[3:])
    # Static shapes (no forward here: it would record amaxes in the layers' scaling state).
    example_in = torch.zeros(MICRO_SHAPE) if rank == 0 else entry.example_carrier().requires_grad_()
    example_out = (entry.example_carrier() if rank == 0 else torch.zeros(BATCH // MICRO, 16)).requires_grad_()
    stage = FP8PipelineStage(
        stage_module, rank, world, torch.device("cpu"), input_args=example_in, output_args=example_out
    )
    cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule_name]
    schedule = cls(stage, n_microbatches=MICRO, loss_fn=loss_fn)
    reset_comm_stats()
    losses: list = []
    if rank == 0:
        schedule.step(x)
    else:
        schedule.step(target=y, losses=losses)
    offset = 0 if rank == 0 else 3
    res = {
        "stats": comm_stats(),
        "grads": {
            f"{int(n.split('.')[0]) + offset - (rank == 1)}.{n.split('.', 1)[1]}": g
            for n, g in grads(stage_module).items()
        },
        "losses": [float(v.detach()) for v in losses],
        "carrier_numel": example_out.numel(),
    }
    res["ref_loss"], res["ref_grads"] = one_process(reference, x, y)
    res["exact_loss"], res["exact_grads"] = one_process(exact_plain, x.double(), y.double())
    return res


def checks(rank, world, schedule_name):
    return pipeline_checks(rank, world, schedule_name)


if __name__ == "__main__":
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    worker_main(checks)
