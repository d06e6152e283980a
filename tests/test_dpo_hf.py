"""fp8lm.integrations.hf: the optimizer factory and frozen reference; the Trainer / DPOTrainer
example runs where transformers and TRL are installed (skipped elsewhere)."""

import importlib.util
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from fp8lm.integrations.hf import fp8_optimizer, frozen_reference
from fp8lm.nn import FP8Linear
from fp8lm.optim import FP8AdamW
from fp8lm.tensor import ScalingTensor


def test_factory_converts_and_returns_the_fp8_optimizer():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(64, 32), torch.nn.Linear(32, 64))
    reference = frozen_reference(model)
    optimizer = fp8_optimizer(model, "O2", lr=1e-3, weight_decay=0.1)
    assert isinstance(optimizer, FP8AdamW) and isinstance(model[1], FP8Linear)
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.0]
    assert isinstance(reference[1], FP8Linear) and reference[1].weight.payload.dtype == torch.float8_e4m3fn
    assert isinstance(reference[0].weight, ScalingTensor) and not reference[0].weight.requires_grad
    x = torch.randint(0, 64, (4, 8))
    before = reference(x)
    loss = model(x).logsumexp(-1).mean()
    loss.backward()
    optimizer.step()
    assert torch.equal(reference(x), before)  # the reference is a copy: the policy's step leaves it
    with pytest.raises(ValueError, match="no parameters that require gradients"):
        fp8_optimizer(reference)


@pytest.mark.slow
def test_trainer_and_dpo_trainer_example(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("trl")
    path = Path(__file__).parents[1] / "examples" / "trl_dpo.py"
    spec = importlib.util.spec_from_file_location("trl_dpo", path)
    example = importlib.util.module_from_spec(spec)
    sys.modules["trl_dpo"] = example
    spec.loader.exec_module(example)
    torch.manual_seed(0)
    tokens = np.frombuffer(b"def add(a, b):\n    return a + b\n\n" * 2000, dtype=np.uint8)
    tokenizer = example.byte_tokenizer()
    assert tokenizer("a\x00é")["input_ids"] == [97, 0, 195, 169]
    model = example.small_llama(272)
    losses = example.sft(model, tokenizer, tokens, 20, str(tmp_path / "sft"))
    assert sum(isinstance(m, FP8Linear) for m in model.modules()) == 2 * 7 + 1
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0] - 1.0
    model.save_pretrained(tmp_path / "model")  # plain weights
    policy = type(model).from_pretrained(tmp_path / "model")
    assert not any(isinstance(m, FP8Linear) for m in policy.modules())
    trainer, reference, optimizer = example.dpo(policy, tokenizer, tokens, 10, str(tmp_path / "dpo"))
    assert isinstance(optimizer, FP8AdamW)
    logs = [r for r in trainer.state.log_history if "eval_loss" in r][-1]
    assert math.isfinite(logs["eval_loss"]) and logs["eval_loss"] < math.log(2)  # learned from the pairs
    assert all(not p.requires_grad for p in reference.parameters())
