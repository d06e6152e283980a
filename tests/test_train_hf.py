"""Hugging Face models through `fp8lm.initialize` (skipped when transformers is not installed)."""

import importlib.util
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from fp8lm.nn import FP8Linear  # noqa: E402
from fp8lm.train.data import BatchSampler  # noqa: E402

spec = importlib.util.spec_from_file_location("hf_fp8", Path(__file__).parents[1] / "examples" / "hf_fp8.py")
hf_fp8 = importlib.util.module_from_spec(spec)
sys.modules["hf_fp8"] = hf_fp8
spec.loader.exec_module(hf_fp8)


def linear_layers(model):
    return [m for m in model.modules() if type(m) is torch.nn.Linear or type(m).__name__ == "Conv1D"]


@pytest.mark.parametrize("name", hf_fp8.MODELS)
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_initialize_converts_every_linear_and_trains(name, level):
    torch.manual_seed(0)
    model = hf_fp8.build(name, width=64, layers=2, seq_len=32)
    n_linear = len(linear_layers(model))
    assert n_linear > 0
    tokens = np.frombuffer(b"def f(x):\n    return x + 1\n" * 400, dtype=np.uint8)
    losses, report = hf_fp8.train(model, level, steps=12, sampler=BatchSampler(tokens, 4, 32, seed=0), lr=3e-3)
    assert sum(isinstance(m, FP8Linear) for m in model.modules()) == n_linear
    assert not linear_layers(model)
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0] - 0.5
    assert report["bytes_per_param"] < 16
