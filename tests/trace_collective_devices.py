"""Runs fp8lm's distributed code on fake CUDA tensors over torch's fake process group (no GPU, no
peers: nothing is computed or sent) and prints, as JSON, the device of every tensor each scenario
handed to torch.distributed (`fp8lm.distributed.comm.recording_devices`) and the ops that waited
for the device (``syncs``: host synchronisations on a GPU), or the error it raised.
Run by test_collective_devices.py in its own process: the fake process group and modes are global.

NCCL has no CPU backend, so on a GPU every one of these devices must be CUDA.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.testing._internal.distributed.fake_pg import FakeStore

# The C kernels read CPU memory, which a fake tensor has none of (a CPU tensor reaching them would
# crash the process rather than fail a check); torch.compile-d casts cannot run on fake tensors.
os.environ.update(FP8LM_NATIVE="0", FP8LM_FUSED_CAST="0")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import cuda_trace  # noqa: E402  (the fake CUDA path: answers host syncs on fake tensors)

import fp8lm  # noqa: E402
from fp8lm.distributed import activation_comm as ac  # noqa: E402
from fp8lm.distributed import comm  # noqa: E402
from fp8lm.distributed.collectives import (  # noqa: E402
    fp8_all_gather,
    fp8_all_reduce,
    fp8_reduce_scatter,
    shared_scale_all_reduce,
)
from fp8lm.distributed.data_parallel import FP8DataParallel  # noqa: E402
from fp8lm.distributed.fsdp import FP8ReduceScatter  # noqa: E402
from fp8lm.distributed.pipeline import FP8PipelineStage, FP8StageInput, pack_fp8, unpack_fp8  # noqa: E402
from fp8lm.distributed.zero import FP8ZeroOptimizer  # noqa: E402
from fp8lm.formats import E4M3, E5M2  # noqa: E402
from fp8lm.tensor import ScalingTensor  # noqa: E402

WORLD = 2
CUDA = "cuda"


def cuda_randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, device=CUDA)


def fp8_grad(shape: tuple[int, ...]) -> ScalingTensor:
    """An FP8 gradient as FP8Linear's backward makes it: an E4M3 payload and its scale."""
    payload = cuda_randn(*shape).to(torch.float8_e4m3fn)
    return ScalingTensor(payload, torch.ones((), device=CUDA), torch.float32)


def model() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16, device=CUDA), nn.ReLU(), nn.Linear(16, 4, device=CUDA))


def give_grads(m: nn.Module) -> None:
    """Plain gradients, and an FP8 one on the first weight (the wire format sent as is)."""
    for i, p in enumerate(m.parameters()):
        p.grad = fp8_grad(tuple(p.shape)) if i == 0 else cuda_randn(*p.shape)


# -- scenarios: each runs one code path; comm records what it hands over ------------------------------
def collectives() -> None:
    x = cuda_randn(10, 3)
    fp8_all_reduce(x)
    fp8_all_gather(x)
    fp8_reduce_scatter(x, average=True)
    shared_scale_all_reduce(x, mu=0.5)


def data_parallel_local() -> None:
    dp = FP8DataParallel(model())  # broadcasts the weights
    give_grads(dp.module)
    dp._launched_in_backward = 0  # as the first gradient hook of a backward sets it
    dp._reduce_all()  # what backward's queued callback runs: every bucket launched and reduced


def data_parallel_shared() -> None:
    dp = FP8DataParallel(model(), scaling="shared")
    give_grads(dp.module)
    dp._launched_in_backward = 0
    dp._reduce_all()  # plus the saturation count of the automatic scaling


def zero() -> None:
    """O3: FP8 weights and FP8AdamW sharded by FP8ZeroOptimizer; a clipped step (reduce, clip,
    update, weights all-gathered)."""
    plain = model()
    m, opt = fp8lm.initialize(plain, torch.optim.AdamW(plain.parameters()), "O3")
    zero = FP8ZeroOptimizer(m, opt)
    give_grads(m)
    zero.reduce_gradients()
    zero.clip_grad_norm_(1.0)
    zero.step()


def activations() -> None:
    """The FP8 activation collectives of tensor parallelism, forward and backward."""
    x = cuda_randn(4, 6, 8)
    for fp8 in (True, False):  # False: for layers switched to high precision, in x's dtype
        ctx = SimpleNamespace(dim=1, group=None, recipe=None, fp8=fp8)
        ac.gather_from_shards(x, 1, fp8=fp8)
        ac._GatherFromShards.backward(ctx, x)
        ac.reduce_scatter_to_shards(x, 1, fp8=fp8)
        ac._ReduceScatterToShards.backward(ctx, x)
        ac.all_reduce_partial(x, fp8=fp8)
        ac._CopyToParallelRegion.backward(ctx, x)
        ac._ScatterToShards.backward(ctx, x)
    for name in ("rowwise", "blockwise", "mxfp8"):  # in the layers' blocks: E8M0 and float32 scales
        recipe = fp8lm.Recipe.from_name(name)
        ac.gather_from_shards(x, 1, None, recipe)
        ac._ReduceScatterToShards.backward(SimpleNamespace(dim=1, group=None, recipe=recipe, fp8=True), x)
    ac._ReduceReplicatedGrad.backward(ctx, x)


def nonfinite() -> None:
    """The branches for inputs holding an inf or NaN (every host check answers False): the NaN
    scales of the FP8 collectives, the activation all-gather and a pipeline carrier."""
    x = torch.full((4, 6), float("inf"), device=CUDA)
    fp8_all_reduce(x)
    fp8_all_gather(x)
    fp8_all_gather(fp8_grad((4, 6)))  # a ScalingTensor sent as is
    ac.agreed_scale_all_gather(x, 0)
    comm.send(pack_fp8(x, E4M3), 1)


def pipeline() -> None:
    """A stage boundary's carriers as the schedule sends and receives them, both directions."""
    x = cuda_randn(2, 3, 8)
    stage_input = FP8StageInput((2, 3, 8))
    comm.send(pack_fp8(x, E4M3), 1)
    received = comm.recv(stage_input.example_carrier(x.device), 1)
    unpack_fp8(received, x.shape, E4M3, x.dtype)
    comm.send(pack_fp8(torch.full_like(x, float("nan")), E5M2), 1)  # a NaN scale in the carrier
    # what FP8PipelineStage notes of the sends and receives torch's schedules issue themselves
    ops = [dist.P2POp(dist.isend, pack_fp8(x, E4M3), 1), dist.P2POp(dist.irecv, stage_input.example_carrier(CUDA), 1)]
    FP8PipelineStage._counted(SimpleNamespace(group=None), ops)


def fsdp_reduce_scatter() -> None:
    grads = cuda_randn(12)
    FP8ReduceScatter()(torch.empty(6, device=CUDA), grads, None, dist.ReduceOp.AVG)


def clip_over_ranks() -> None:
    params = [nn.Parameter(cuda_randn(4, 4)) for _ in range(2)]
    for p in params:
        p.grad = cuda_randn(4, 4)
    fp8lm.clip_grad_norm_(params, 1.0, group=dist.group.WORLD)
    fp8lm.clip_grad_norm_(params, 1.0, norm_type=float("inf"), group=dist.group.WORLD)


def training_loop() -> None:
    """The loop's own collectives: the loss's mean over ranks (`fp8lm.train.ranks`), computed on
    the device the step ran on."""
    from fp8lm.distributed.mesh import ParallelDims
    from fp8lm.train.ranks import Ranks, mean_over_ranks

    loss = cuda_randn(4).sum()
    mean_over_ranks(loss, Ranks(0, ParallelDims(dp_replicate=2)))


SCENARIOS = {
    f.__name__: f
    for f in (
        training_loop,
        collectives,
        data_parallel_local,
        data_parallel_shared,
        zero,
        activations,
        nonfinite,
        pipeline,
        fsdp_reduce_scatter,
        clip_over_ranks,
    )
}


class MixedDevices(cuda_trace.OpLog):
    """`cuda_trace.OpLog` (which answers host syncs on fake tensors) that also notes every op whose
    tensor arguments sit on different devices: a CPU tensor computed with CUDA ones is a host
    round trip on a GPU, or a CPU buffer about to be communicated."""

    def __init__(self):
        super().__init__()
        self.mixed: list[str] = []
        self.truth = True  # what a host check (``bool(t)``) answers: False takes the non-finite branches
        self.syncs: list[str] = []  # the ops that wait for the device: a host sync in the step on a GPU

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in cuda_trace.SYNC_OPS or cuda_trace.to_host(name, args, kwargs or {}):
            self.syncs.append(name)
        if name == "is_nonzero":
            return self.truth
        devices = {t.device.type for t in cuda_trace.tensors_in((args, kwargs or {}))}
        if len(devices) > 1:
            self.mixed.append(func.overloadpacket.__name__)
        return super().__torch_dispatch__(func, types, args, kwargs)


def trace(scenario, log: MixedDevices) -> dict:
    log.mixed, log.truth = [], scenario is not nonfinite
    log.syncs = []
    with comm.recording_devices() as handed:
        try:
            scenario()
        except Exception:
            return {"handed": [], "mixed": log.mixed, "error": traceback.format_exc(limit=-4)}
    handed_over = [[kind, str(device)] for kind, device in handed]
    return {"handed": handed_over, "mixed": log.mixed, "syncs": log.syncs, "error": None}


def main() -> None:
    cuda_trace.load_fake_cuda_guard()  # indexing and .to() on CUDA tensors need a device guard
    cuda_trace.pretend_hopper()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    torch.manual_seed(0)
    out = {}
    with FakeTensorMode(allow_non_fake_inputs=False), MixedDevices() as log:
        for name, scenario in SCENARIOS.items():
            out[name] = trace(scenario, log)
    dist.destroy_process_group()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
