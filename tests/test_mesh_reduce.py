"""`fp8lm.optim.dtensor.mesh_reduce` over 4 gloo ranks (tests/dist_mesh_reduce.py): the elementwise
max and min of every rank's values on a 1-D and a 2-D mesh, without DTensor's warning about
reducing several mesh dimensions in one redistribute."""

import torch

from dist_launch import launch


def test_mesh_reduce_gives_every_ranks_max_and_min_on_1d_and_2d_meshes_without_a_warning():
    codes, logs, results = launch("dist_mesh_reduce.py", 4, timeout=300.0)
    assert codes == [0, 0, 0, 0], logs
    # rank r holds [r, -r, 7r mod 5]: over ranks 0-3 the max is [3, 0, 4] and the min [0, -3, 0]
    for result in results:
        for shape in [(4,), (2, 2)]:
            high, low = result[shape]
            torch.testing.assert_close(high, torch.tensor([3.0, 0.0, 4.0]), rtol=0, atol=0)
            torch.testing.assert_close(low, torch.tensor([0.0, -3.0, 0.0]), rtol=0, atol=0)
    assert not any("sequential all_reduce" in log for log in logs), [log[-2000:] for log in logs]
