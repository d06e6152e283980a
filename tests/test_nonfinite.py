"""Non-finite values and outliers never pass silently: inf survives quantization as NaN, a step
with a non-finite gradient is skipped and counted, and a finite spike does not silence the
following steps of delayed scaling."""

import pytest
import torch
from torch import nn

import fp8lm
from fp8lm import ScalingMeta, ScalingTensor
from fp8lm.nn import FP8Linear
from fp8lm.ops import cast, native
from fp8lm.telemetry import Telemetry

INF, NAN = float("inf"), float("nan")


@pytest.mark.skipif(not native.available(), reason="needs the C kernels")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", [fp8lm.E4M3, fp8lm.E5M2])
def test_c_kernels_and_torch_ops_keep_inf_visible_alike(dtype, fmt):
    x = torch.tensor([1.0, INF, -INF, 3e38, -2.0, 0.5] * 700, dtype=dtype)  # > one 512-element block
    scale = torch.tensor(4.0)
    c_payload, c_amax = native.cast(x, 4.0, fmt.dtype, True)[:2]
    torch_payload = cast._eager_cast(x, scale, fmt.max, fmt.dtype)
    assert torch.equal(c_payload.view(torch.uint8), torch_payload.view(torch.uint8))
    values = c_payload.float()
    assert torch.isnan(values[1::6]).all() and torch.isnan(values[2::6]).all()
    assert (values[3::6] == fmt.max).all() and (values[4::6] == -8.0).all()
    assert c_amax.item() == INF


def test_inf_in_a_gradient_reaches_grads_are_finite_and_clip():
    p = nn.Parameter(torch.ones(4))
    p.grad = fp8lm.quantize(torch.tensor([1.0, INF, 2.0, 3.0]))
    assert not fp8lm.grads_are_finite([p])
    assert not torch.isfinite(fp8lm.clip_grad_norm_([p], 1.0))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.fc = nn.Linear(8, 8)

    def forward(self, idx, poison_row: int | None = None):
        h = self.emb(idx)
        if poison_row is not None:  # an inf in the gradient of one embedding row only
            h.register_hook(lambda g: g.index_put((torch.tensor([0]), torch.tensor([poison_row])), torch.tensor(INF)))
        return self.fc(h).square().mean()


def _params(model):
    return [p.detach().float().clone() for p in model.parameters()]


def test_o2_skips_a_step_whose_embedding_gradient_has_one_inf():
    torch.manual_seed(0)
    model, opt = fp8lm.initialize(m := Net(), torch.optim.AdamW(m.parameters(), lr=1e-2), "O2")
    idx = torch.randint(0, 16, (1, 6))
    model(idx).backward()
    opt.step()
    opt.zero_grad()
    before = _params(model)
    model(idx, poison_row=2).backward()
    assert isinstance(model.emb.weight.grad, ScalingTensor)  # the FP8 gradient of the O2 policy
    assert not fp8lm.grads_are_finite(model)
    opt.step()
    assert opt.last_step_skipped and opt.skipped_steps == 1
    assert all(torch.equal(a, b) for a, b in zip(before, _params(model)))


def test_readme_loop_under_o1_with_a_torch_optimizer_skips_a_nonfinite_step():
    torch.manual_seed(0)
    model, opt = fp8lm.initialize(m := Net(), torch.optim.AdamW(m.parameters(), lr=1e-2), "O1")
    idx = torch.randint(0, 16, (1, 6))
    applied = []
    for poison in (None, 3, None):
        before = _params(model)
        model(idx, poison_row=poison).backward()
        norm = fp8lm.clip_grad_norm_(model.parameters(), 1.0)
        if torch.isfinite(norm):  # the README's loop
            opt.step()
        opt.zero_grad()
        applied.append(not all(torch.equal(a, b) for a, b in zip(before, _params(model))))
    assert applied == [True, False, True]
    assert all(torch.isfinite(p).all() for p in _params(model))


# -- a finite spike -----------------------------------------------------------------------------


def test_scaling_meta_recovers_from_a_spike_at_once():
    meta = ScalingMeta(fp8lm.E5M2, history_len=16)
    for _ in range(4):
        meta.scale_for(torch.tensor([1.0]))
    ordinary = meta.scale.clone()
    # The spike, scaled from the history, would saturate 1e30 / 57344 times over: scaled from its own amax.
    assert meta.scale_for(torch.tensor([1e30])) == fp8lm.compute_scale(torch.tensor(1e30), fp8lm.E5M2)
    assert meta.rescales.item() == 1
    # The next ordinary tensor, scaled from a history holding 1e30, would be all zeros: rescaled.
    assert torch.equal(meta.scale_for(torch.tensor([1.0])), ordinary)
    assert meta.rescales.item() == 2
    assert torch.equal(meta.scale_for(torch.tensor([1.0])), ordinary)  # back to delayed scaling
    assert meta.rescales.item() == 2


@pytest.mark.parametrize("amax", [INF, NAN])
def test_a_nonfinite_amax_is_not_recorded(amax):
    meta = ScalingMeta(fp8lm.E4M3, history_len=4)
    meta.scale_for(torch.tensor([2.0]))
    scale = meta.scale.clone()
    meta.record(torch.tensor(amax))
    assert torch.equal(meta.scale, scale) and meta.amax_history.isfinite().all()
    assert meta.last_amax.isnan() or meta.last_amax.isinf()  # still visible to the caller
    assert meta.rescales.item() == 0


def _layer_grads(layer, x, loss_factor):
    layer.zero_grad()
    (layer(x).square().sum() * loss_factor).backward()
    grad = layer.weight.grad
    return grad.dequantize() if isinstance(grad, ScalingTensor) else grad.clone()


def test_fp8_linear_gradients_after_a_loss_spike_are_not_zero():
    torch.manual_seed(0)
    layer = FP8Linear(32, 16)
    reference = nn.Linear(32, 16)
    reference.weight.data.copy_(layer.weight.float())
    reference.bias.data.copy_(layer.bias)
    x = torch.randn(8, 32)
    for _ in range(3):
        before = _layer_grads(layer, x, 1.0)
    spike = _layer_grads(layer, x, 1e30)
    assert torch.isfinite(spike).all() and spike.abs().max() > 1e28
    after = _layer_grads(layer, x, 1.0)
    assert torch.equal(after, before)  # the same FP8 gradient as before the spike, not zeros
    expected = _layer_grads(reference, x, 1.0)
    assert (after - expected).norm() < 0.1 * expected.norm()  # FP8 rounding of three casts
    assert layer.grad_output_meta.rescales.item() == 2  # the spike and the step after it
    assert layer.input_meta.rescales.item() == 0


def test_telemetry_reports_rescaled_streams():
    torch.manual_seed(0)
    model = nn.Sequential(FP8Linear(8, 8), FP8Linear(8, 4))
    telemetry = Telemetry(model, every=1)
    x = torch.randn(4, 8)
    for factor in (1.0, 1.0, 1e30, 1.0):
        model.zero_grad()
        (model(x).sum() * factor).backward()
    assert telemetry.rescales() == {"0.grad_output": 2, "1.grad_output": 2}
