"""Checkpoints are data, never code: crafted files cannot run code, reach outside the run's
folder, or load inf/NaN into a model; each is refused with one line naming the file."""

import os
import pickle
import shutil

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fp8lm
from fp8lm.distributed import FP8ZeroOptimizer, load_checkpoint, save_checkpoint
from fp8lm.distributed.checkpoint import CheckpointError
from fp8lm.train import checkpoint as train_checkpoint


class _Marker:
    """A pickle that creates ``path`` when unpickled (what a hostile checkpoint would do)."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


@pytest.fixture
def sharded(tmp_path):
    """An FP8 ZeRO model and optimizer on a one-rank gloo group, and its saved checkpoint folder."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model, opt = fp8lm.initialize(model, opt, "O3", optimizer_options={"kernel": "eager"})
        opt = FP8ZeroOptimizer(model, opt)
        model(torch.randn(2, 8)).sum().backward()
        opt.step()
        save_checkpoint(tmp_path / "step.dcp", model, opt)
        yield model, opt, tmp_path / "step.dcp"
    finally:
        dist.destroy_process_group()


def _weights(model):
    return [p.detach().float().clone() for p in model.parameters()]


def _refused(model, opt, folder, match):
    before = _weights(model)
    with pytest.raises(CheckpointError, match=match) as info:
        load_checkpoint(folder, model, opt)
    assert "\n" not in str(info.value)
    assert all(torch.equal(a, b) for a, b in zip(before, _weights(model)))


def test_sharded_checkpoint_round_trips(sharded):
    model, opt, folder = sharded
    load_checkpoint(folder, model, opt)


def test_crafted_metadata_pickle_does_not_run(sharded, tmp_path):
    model, opt, folder = sharded
    pickle.loads(pickle.dumps(_Marker(tmp_path / "proof")))  # the payload does run under plain pickle
    assert (tmp_path / "proof").exists()
    (folder / ".metadata").write_bytes(pickle.dumps(_Marker(tmp_path / "marker")))
    _refused(model, opt, folder, r"cannot read sharded checkpoint metadata .*open is not part of DCP metadata")
    assert not (tmp_path / "marker").exists()


def _rewrite_metadata(folder, change):
    with open(folder / ".metadata", "rb") as f:
        metadata = pickle.load(f)  # the test's own file
    change(metadata)
    with open(folder / ".metadata", "wb") as f:
        pickle.dump(metadata, f)


@pytest.mark.parametrize("where", ["../outside.distcp", "absolute"])
def test_data_file_outside_the_folder_is_refused(sharded, tmp_path, where):
    model, opt, folder = sharded
    outside = tmp_path / "outside.distcp"
    shutil.copy(folder / "__0_0.distcp", outside)
    name = str(outside) if where == "absolute" else where

    def point_outside(metadata):
        for info in metadata.storage_data.values():
            info.relative_path = name

    _rewrite_metadata(folder, point_outside)
    _refused(model, opt, folder, "names the data file .* outside its folder")


def test_symlink_out_of_the_folder_is_refused(sharded, tmp_path):
    model, opt, folder = sharded
    shutil.move(folder / "__0_0.distcp", tmp_path / "elsewhere.distcp")
    os.symlink(tmp_path / "elsewhere.distcp", folder / "__0_0.distcp")
    _refused(model, opt, folder, "outside its folder")


def test_pickled_bytes_entry_is_refused(sharded):
    model, opt, folder = sharded
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    def as_bytes(metadata):
        key = next(k for k in metadata.state_dict_metadata if k.startswith("model."))
        metadata.state_dict_metadata[key] = BytesStorageMetadata()

    _rewrite_metadata(folder, as_bytes)
    _refused(model, opt, folder, "as pickled bytes, not a tensor")


def test_sharded_checkpoint_with_nan_is_refused(sharded, tmp_path):
    model, opt, folder = sharded
    with torch.no_grad():
        model[0].bias.fill_(float("nan"))
    save_checkpoint(tmp_path / "nan.dcp", model, opt)
    with torch.no_grad():
        model[0].bias.zero_()
    _refused(model, opt, tmp_path / "nan.dcp", r"holds inf or NaN in 'model\.0\.bias'")


# -- single-file checkpoints of the training app ------------------------------------------------


def _saved(tmp_path, **entries):
    state = {"model": {"w": torch.ones(3)}, "optimizer_shards": None, **entries}
    return train_checkpoint.save_checkpoint(state, tmp_path / "checkpoints", step=5, keep=2)


@pytest.mark.parametrize(
    "entries, name",
    [
        ({"model": {"w": torch.tensor([1.0, float("inf")])}}, "model.w"),
        (
            {"ranks": [{"scaling": {"fc.input_meta": {"amax_history": torch.tensor([float("nan")])}}}]},
            "ranks.0.scaling.fc.input_meta.amax_history",
        ),
    ],
)
def test_training_checkpoint_with_nonfinite_values_is_refused(tmp_path, entries, name):
    path = _saved(tmp_path, **entries)
    with pytest.raises(CheckpointError, match=f"{path}.* holds inf or NaN in '{name}'.*older checkpoint"):
        train_checkpoint.load_checkpoint(tmp_path)


@pytest.mark.parametrize("shards", ["../../elsewhere.dcp", "/tmp/step_00000001.dcp", "step_1.dcp/..", "link"])
def test_training_checkpoint_shard_path_must_stay_in_the_run(tmp_path, shards):
    if shards == "link":  # a well-named folder that is a symlink elsewhere
        (tmp_path / "checkpoints").mkdir()
        (tmp_path / "elsewhere").mkdir()
        os.symlink(tmp_path / "elsewhere", tmp_path / "checkpoints" / "step_00000005.dcp")
        shards = "step_00000005.dcp"
    _saved(tmp_path, optimizer_shards=shards)
    with pytest.raises(CheckpointError, match="names the shard folder .* not a step_<n>.dcp folder next to it"):
        train_checkpoint.load_checkpoint(tmp_path)


def test_training_checkpoint_with_its_own_shard_folder_loads(tmp_path):
    import torch.distributed.checkpoint as dcp

    dcp.save({"x": torch.ones(2)}, checkpoint_id=str(tmp_path / "checkpoints" / "step_00000005.dcp"))
    _saved(tmp_path, optimizer_shards="step_00000005.dcp")
    assert train_checkpoint.load_checkpoint(tmp_path)["optimizer_shards"] == "step_00000005.dcp"


def test_crafted_training_checkpoint_pickle_does_not_run(tmp_path):
    (tmp_path / "checkpoints").mkdir()
    torch.save({"model": _Marker(tmp_path / "marker")}, tmp_path / "checkpoints" / "step_00000001.pt")
    with pytest.raises(CheckpointError, match="cannot read checkpoint"):
        train_checkpoint.load_checkpoint(tmp_path)
    assert not (tmp_path / "marker").exists()
