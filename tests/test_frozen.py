"""fp8lm.nn.freeze_fp8: a frozen model in FP8, about one byte per parameter."""

import copy

import pytest
import torch
from torch import nn

import fp8lm
from fp8lm.memory import memory_report
from fp8lm.nn import FP8Linear, freeze_fp8
from fp8lm.tensor import ScalingTensor
from fp8lm.train.model import GPT, preset


@pytest.fixture(scope="module")
def gpt():
    torch.manual_seed(0)
    return GPT(preset("tiny", n_embd=64))


def test_weights_and_tables_are_e4m3_one_byte_each(gpt):
    ref = freeze_fp8(copy.deepcopy(gpt))
    linears = [m for m in ref.modules() if isinstance(m, FP8Linear)]
    assert len(linears) == 4 * 2 + 1  # 4 per block and the head
    for table in (ref.wte.weight, ref.wpe.weight, *(m.weight for m in linears)):
        assert isinstance(table, ScalingTensor) and table.payload.dtype == torch.float8_e4m3fn
    assert all(m.scaling == "current" for m in linears)
    assert not any(p.requires_grad for p in ref.parameters())
    assert not ref.training
    report = memory_report(ref)
    big = sum(p.numel() for p in ref.parameters() if isinstance(p, ScalingTensor))
    small = report["num_params"] - big  # norms and biases keep float32
    assert report["weights"] == big + 4 * small
    assert report["gradients"] == 0
    assert 1.0 < report["bytes_per_param"] < 1.1
    assert memory_report(gpt)["bytes_per_param"] == 4.0  # the original is untouched


def test_outputs_close_to_the_bf16_model(gpt):
    torch.manual_seed(1)
    model = copy.deepcopy(gpt)
    for p in model.parameters():  # weights of a trained model's size, not the tiny init
        p.data.normal_(0, 0.3 if p.dim() > 1 else 0.1)
    ref = freeze_fp8(copy.deepcopy(model))
    x = torch.randint(0, 256, (4, 64))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        want = model(x)[0].float().log_softmax(-1)
        got = ref(x)[0].float().log_softmax(-1)
    kl = (want.exp() * (want - got)).sum(-1).mean()
    assert got.shape == want.shape and torch.isfinite(got).all()
    assert kl < 0.02  # nats per token; the weights' E4M3 rounding is 2^-4 relative at most
    assert kl > 0  # the reference really is FP8, not a copy
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.9


def test_no_gradient_flows_and_state_dict_is_plain(gpt):
    ref = freeze_fp8(copy.deepcopy(gpt))
    x = torch.randint(0, 256, (2, 16))
    logits, _ = ref(x)
    assert not logits.requires_grad
    state = ref.state_dict()
    assert all(type(v) is torch.Tensor for v in state.values())
    plain = GPT(gpt.config)
    plain.load_state_dict(state)  # loads into an unconverted model
    assert torch.equal(plain.wte.weight, ref.wte.weight.dequantize())


def test_tied_weights_stay_tied():
    emb = torch.nn.Embedding(64, 32)
    head = torch.nn.Linear(32, 64, bias=False)
    head.weight = emb.weight
    model = torch.nn.Sequential(emb, head)
    freeze_fp8(model)
    assert model[0].weight is model[1].weight and isinstance(model[1], FP8Linear)
    assert memory_report(model)["weights"] == 64 * 32


def test_bad_input(gpt):
    with pytest.raises(ValueError, match="E4M3, E5M2 or FP16"):
        freeze_fp8(copy.deepcopy(gpt), weight_format="BF16")
    converted, _ = fp8lm.initialize(copy.deepcopy(gpt), None, opt_level="O1")
    with pytest.raises(ValueError, match="before fp8lm.initialize"):
        freeze_fp8(converted)


def test_a_bare_linear_layer_is_frozen_and_returned():
    linear = nn.Linear(32, 16)
    frozen = freeze_fp8(linear)
    assert isinstance(frozen, FP8Linear) and frozen is not linear
    assert frozen.weight.payload.dtype == torch.float8_e4m3fn and not frozen.weight.requires_grad
    x = torch.randn(4, 32)
    torch.testing.assert_close(frozen(x), linear(x), rtol=0.1, atol=0.05)
