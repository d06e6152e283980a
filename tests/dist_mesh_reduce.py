"""Worker of tests/test_mesh_reduce.py: `mesh_reduce` max and min over 1-D and 2-D meshes of
every rank, each rank holding different values."""

import torch
from torch.distributed.device_mesh import init_device_mesh

from dist_launch import worker_main
from fp8lm.optim.dtensor import mesh_reduce


def checks(rank: int, world: int) -> dict:
    values = torch.tensor([float(rank), -float(rank), float((rank * 7) % 5)])
    result = {}
    for shape in [(world,), (2, world // 2)]:
        mesh = init_device_mesh("cpu", shape)
        result[shape] = (mesh_reduce(values, mesh, "max"), mesh_reduce(values, mesh, "min"))
    return result


if __name__ == "__main__":
    worker_main(checks)
