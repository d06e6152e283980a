"""Every tensor fp8lm hands to torch.distributed lives on the compute device: NCCL has no CPU
backend, so a CPU buffer next to CUDA gradients fails on GPUs while gloo on CPU (every other
distributed test) accepts it. Checked without a GPU: trace_collective_devices.py runs the
distributed code on fake CUDA tensors over torch's fake process group and reports the device of
each tensor handed over (`fp8lm.distributed.comm.recording_devices`), and the ops that wait for
the device: the step's collectives have none."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from fp8lm.distributed import comm

SCRIPT = Path(__file__).resolve().parent / "trace_collective_devices.py"
SCENARIOS = (
    "training_loop",
    "collectives",
    "data_parallel_local",
    "data_parallel_shared",
    "zero",
    "activations",
    "nonfinite",
    "pipeline",
    "fsdp_reduce_scatter",
    "clip_over_ranks",
)


@pytest.fixture(scope="module")
def traced() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_every_collective_runs_on_the_cuda_device(traced, scenario):
    result = traced[scenario]
    assert result["error"] is None, result["error"]
    handed = result["handed"]
    assert handed, f"{scenario} handed nothing to torch.distributed: the trace missed its collectives"
    on_cpu = [(kind, device) for kind, device in handed if not device.startswith("cuda")]
    assert not on_cpu, f"{scenario} handed {len(on_cpu)} of {len(handed)} tensors off the GPU: {on_cpu}"
    # a CPU tensor computed with CUDA ones (a scale, a flag) is a host round trip, or a CPU buffer
    assert result["mixed"] == [], f"{scenario}: ops on CPU and CUDA tensors together: {result['mixed']}"


# Scenarios with no host sync: on a GPU the step never waits for the device in them. The others
# read by design: `fp8_all_gather` checks that the shards' sizes agree, shared scaling counts the
# values it saturates, and FP8 ZeRO answers on the host whether the step's gradients are finite.
WITHOUT_SYNC = (
    "training_loop",
    "data_parallel_local",
    "activations",
    "pipeline",
    "fsdp_reduce_scatter",
    "clip_over_ranks",
)


@pytest.mark.parametrize("scenario", WITHOUT_SYNC)
def test_the_step_collectives_do_not_sync_the_host(traced, scenario):
    """The non-finite checks of the scales (per tensor-parallel gather, per FP8 reduction segment,
    per pipeline send) are made on the device: reading them on the host once synced every one."""
    assert traced[scenario]["syncs"] == [], traced[scenario]["syncs"]


def test_the_trace_covers_every_scenario(traced):
    assert sorted(traced) == sorted(SCENARIOS)


def test_recording_lists_each_tensor_handed_over_and_is_off_by_default(tmp_path):
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        x = torch.ones(3)
        comm.all_reduce(x)  # not recorded: nothing is listening
        assert comm._device_log is None
        with comm.recording_devices() as handed:
            comm.all_reduce(x)
            comm.all_gather(torch.empty(3), x)
            with comm.recording_devices() as inner:
                comm.broadcast(x, 0)
        assert comm._device_log is None
        cpu = torch.device("cpu")
        assert handed == [("all_reduce", cpu), ("all_gather", cpu), ("all_gather", cpu)]
        assert inner == [("broadcast", cpu)]
    finally:
        dist.destroy_process_group()
