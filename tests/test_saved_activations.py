"""FP8-saved activations (`fp8lm.nn.saved`): the group quantization against a float64 reference,
each module's forward equal to the plain module's bit for bit, its backward the exact gradient at
the dequantized input, what it saves, and the switch in `fp8lm.initialize`."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fp8lm
from fp8lm.nn import saved
from fp8lm.nn.saved import (
    FP8SavedAttention,
    FP8SavedGELU,
    FP8SavedLayerNorm,
    FP8SavedRMSNorm,
    FP8SavedSwiGLU,
    RMSNorm,
    ScaledDotProductAttention,
    SwiGLU,
    dequantize_groups,
    quantize_groups,
    rms_norm,
)
from fp8lm.train.measure import saved_tensor_bytes
from fp8lm.train.model import GPT, preset


def rows_of_many_ranges(*shape, dtype=torch.float32, seed=0):
    """Rows whose magnitudes span 1e-3 .. 1e3: what one scale per tensor would flush to zero."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g)
    return (x * torch.logspace(-3, 3, shape[-2]).unsqueeze(-1)).to(dtype)


def e4m3_grid() -> torch.Tensor:
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).double()
    return grid[torch.isfinite(grid)].unique()


@pytest.mark.parametrize(("columns", "group"), [(256, 128), (96, 128), (64, 16)])
def test_group_quantization_matches_a_float64_reference(columns, group):
    x = rows_of_many_ranges(2, 12, columns)
    payload, scale = quantize_groups(x, fp8lm.E4M3, group)
    g = group if columns % group == 0 else columns
    assert payload.shape == x.shape and payload.dtype == torch.float8_e4m3fn
    assert scale.shape == (2, 12, columns // g) and scale.dtype == torch.float32
    # each group's scale: the power of two that puts its amax in (max/2, max]
    amax = x.double().unflatten(-1, (columns // g, g)).abs().amax(-1)
    assert torch.equal(scale.log2(), scale.log2().round())
    assert ((amax * scale <= 448.0) & (amax * scale > 224.0)).all()
    # the payload: x * scale rounded to the nearest E4M3 value
    scaled = x.double().unflatten(-1, (columns // g, g)) * scale.double().unsqueeze(-1)
    flat = scaled.flatten()
    nearest = (flat[:, None] - e4m3_grid()[None, :]).abs().min(dim=1).values
    assert torch.equal((payload.double().flatten() - flat).abs(), nearest)
    back = dequantize_groups(payload, scale, torch.float64)
    assert torch.equal(back, payload.double() / scale.double().repeat_interleave(g, dim=-1))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs_quantize_as_their_float32_values(dtype):
    x = rows_of_many_ranges(2, 12, 256, dtype=dtype)
    payload, scale = quantize_groups(x)
    want_payload, want_scale = quantize_groups(x.float())
    assert torch.equal(scale, want_scale) and torch.equal(payload.view(torch.uint8), want_payload.view(torch.uint8))
    back = dequantize_groups(payload, scale, dtype)
    assert back.dtype == dtype
    assert torch.equal(back, dequantize_groups(payload, scale, torch.float64).to(dtype))


def test_every_row_keeps_its_precision_however_small():
    x = rows_of_many_ranges(1, 16, 128)
    back = dequantize_groups(*quantize_groups(x), torch.float32)
    normal = x.abs() >= x.abs().amax(-1, keepdim=True) * 2.0**-7  # E4M3 normals in the row's scale
    assert (((back - x).abs() / x.abs())[normal] <= 2.0**-4).all()
    assert back.ne(0).sum() >= 0.99 * x.numel()


def test_non_finite_groups_read_back_as_nan_and_zero_groups_as_zero():
    x = torch.randn(4, 256)
    x[0, 3], x[1, 200], x[2] = float("inf"), float("nan"), 0.0
    back = dequantize_groups(*quantize_groups(x), torch.float32)
    assert back[0, :128].isnan().all() and back[0, 128:].isfinite().all()  # only the group of the inf
    assert back[1, 128:].isnan().all() and back[1, :128].isfinite().all()
    assert torch.equal(back[2], torch.zeros(256))


def _layer_norm():
    ln = nn.LayerNorm(256)
    with torch.no_grad():
        ln.weight.normal_(), ln.bias.normal_()
    return ln


def _rms_norm():
    norm = RMSNorm(256, 1e-5)
    with torch.no_grad():
        norm.weight.normal_()
    return norm


def _reference(module, xd, params):
    """The plain module's function in float64 at ``xd`` with the float64 ``params``."""
    if isinstance(module, nn.LayerNorm):
        return F.layer_norm(xd, (xd.shape[-1],), *params, module.eps)
    if isinstance(module, RMSNorm):
        return rms_norm(xd, params[0], module.eps)
    return module(xd)


def _dequantized(module, x):
    if isinstance(module, SwiGLU):
        payload, scale = quantize_groups(x.detach().unflatten(-1, (2, -1)))
        return dequantize_groups(payload, scale, torch.float64).flatten(-2)
    return dequantize_groups(*quantize_groups(x.detach()), torch.float64)


@pytest.mark.parametrize("make", [_layer_norm, _rms_norm, nn.GELU, lambda: nn.GELU("tanh"), SwiGLU])
def test_forward_is_the_plain_modules_and_backward_the_exact_gradient_at_the_saved_input(make):
    plain = make()
    fp8 = saved.saving_counterpart(plain)
    assert fp8 is not None and all(a is b for a, b in zip(fp8.parameters(), plain.parameters()))
    x = rows_of_many_ranges(3, 8, 256).requires_grad_()
    y = fp8(x)
    assert torch.equal(y, plain(x))
    grad = torch.randn_like(y)
    params = list(plain.parameters())
    got = torch.autograd.grad(y, [x, *params], grad)
    xd = _dequantized(plain, x).requires_grad_()
    ref_params = [p.detach().double().requires_grad_() for p in params]
    ref_y = _reference(plain, xd, ref_params)
    want = torch.autograd.grad(ref_y, [xd, *ref_params], grad.double())
    for a, b in zip(got, want):
        assert a.dtype == torch.float32
        assert (a.double() - b).abs().max() <= 1e-5 * b.abs().max()


@pytest.mark.parametrize("make", [nn.GELU, SwiGLU])
def test_bf16_activations_backward_as_autograd_at_the_saved_input(make):
    plain = make()
    fp8 = saved.saving_counterpart(plain)
    x = rows_of_many_ranges(2, 8, 256, dtype=torch.bfloat16).requires_grad_()
    y = fp8(x)
    assert torch.equal(y, plain(x)) and y.dtype == torch.bfloat16
    grad = torch.randn_like(y)
    (got,) = torch.autograd.grad(y, x, grad)
    xd = _dequantized(plain, x).to(torch.bfloat16).requires_grad_()
    (want,) = torch.autograd.grad(plain(xd), xd, grad)
    assert torch.equal(got, want)


def test_norms_under_bf16_autocast_give_the_plain_modules_outputs():
    for plain in (_layer_norm(), _rms_norm()):
        fp8 = saved.saving_counterpart(plain)
        for dtype in (torch.float32, torch.bfloat16):
            x = rows_of_many_ranges(2, 8, 256, dtype=dtype).requires_grad_()
            with torch.autocast("cpu", torch.bfloat16):
                y, want = fp8(x), plain(x)
            assert y.dtype == want.dtype and torch.equal(y, want)
            (gx,) = torch.autograd.grad(y.float().sum(), x)
            assert gx.dtype == dtype and gx.isfinite().all()


@pytest.mark.parametrize("make", [_layer_norm, _rms_norm, nn.GELU, SwiGLU])
def test_only_the_fp8_input_and_its_scales_are_saved(make):
    plain = make()
    fp8 = saved.saving_counterpart(plain)
    x = rows_of_many_ranges(4, 16, 256).requires_grad_()
    params = list(plain.parameters())
    got = saved_tensor_bytes(lambda: fp8(x), exclude=params)
    assert got == x.numel() + 4 * x.numel() // 128  # E4M3 bytes + one FP32 scale per 128 columns
    assert saved_tensor_bytes(lambda: plain(x), exclude=params) >= 4 * x.numel()


def test_without_gradients_the_plain_module_runs():
    fp8 = FP8SavedLayerNorm(64)
    with torch.no_grad():
        assert torch.equal(fp8(torch.ones(2, 64)), torch.zeros(2, 64))
    x = torch.randn(0, 64, requires_grad=True)  # an empty batch has nothing to scale
    assert fp8(x).shape == (0, 64)


def test_hf_style_rms_norm_is_recognized_and_other_modules_are_not():
    class LlamaRMSNorm(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(32))
            self.variance_epsilon = 1e-6

        def forward(self, x):
            xf = x.to(torch.float32)
            return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)).to(
                x.dtype
            )

    hf = LlamaRMSNorm()
    fp8 = saved.saving_counterpart(hf)
    assert isinstance(fp8, FP8SavedRMSNorm) and fp8.weight is hf.weight and fp8.eps == 1e-6
    x = torch.randn(3, 32, requires_grad=True)
    assert torch.equal(fp8(x), hf(x))
    for other in (nn.LayerNorm((4, 8)), nn.RMSNorm(32), nn.SiLU(), FP8SavedGELU(), nn.Linear(16, 16)):
        assert saved.saving_counterpart(other) is None


def test_refusals_are_one_line():
    with pytest.raises(ValueError, match="E4M3 or E5M2"):
        FP8SavedGELU(saved_format="FP16")
    with pytest.raises(ValueError, match="group_size must be >= 1"):
        FP8SavedSwiGLU(group_size=0)
    with pytest.raises(ValueError, match="odd size 7"):
        FP8SavedSwiGLU()(torch.randn(2, 7, requires_grad=True))
    with pytest.raises(ValueError, match="unknown activations 'fp4'"):
        fp8lm.policy.preset("O2").with_activations("fp4")


def _gpt(arch):
    torch.manual_seed(0)
    return GPT(preset("tiny", arch=arch, vocab_size=256, block_size=32))


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_initialize_swaps_the_norms_and_activations_and_keeps_the_loss(arch):
    base = _gpt(arch)
    plain, _ = fp8lm.initialize(copy.deepcopy(base), None, "O2", activations="bf16")
    fp8, _ = fp8lm.initialize(copy.deepcopy(base), None, "O2")  # O2's default
    assert fp8._fp8lm_policy.activations == "fp8" and plain._fp8lm_policy.activations == "bf16"
    kinds = {type(m) for m in fp8.modules()}
    norm = FP8SavedRMSNorm if arch == "llama" else FP8SavedLayerNorm
    act = FP8SavedSwiGLU if arch == "llama" else FP8SavedGELU
    assert {norm, act, FP8SavedAttention} <= kinds
    assert not kinds & {nn.LayerNorm, RMSNorm, nn.GELU, SwiGLU, ScaledDotProductAttention}
    assert not {norm, act} & {type(m) for m in plain.modules()}
    assert list(fp8.state_dict()) == list(base.state_dict())
    idx = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", torch.bfloat16):
        loss_plain = plain(idx, idx)[1]
        bytes_plain = saved_tensor_bytes(lambda: plain(idx, idx), exclude=plain.parameters())
        loss_fp8 = fp8(idx, idx)[1]
        bytes_fp8 = saved_tensor_bytes(lambda: fp8(idx, idx), exclude=fp8.parameters())
    assert torch.equal(loss_plain, loss_fp8)  # the same forward
    assert bytes_fp8 < 0.85 * bytes_plain  # a tiny model: the FP8 weight copies weigh much here
    loss_fp8.backward()
    assert all(p.grad is not None for p in fp8.parameters())


def test_policy_overrides_choose_which_modules_save_in_fp8():
    base = _gpt("gpt")
    policy = {"*.mlp.*": {"activations": "bf16"}, "ln_f": {"activations": "bf16"}}
    model, _ = fp8lm.initialize(copy.deepcopy(base), None, "O2", policy=policy)
    kinds = {name: type(m) for name, m in model.named_modules()}
    assert kinds["blocks.0.mlp.act"] is nn.GELU and kinds["ln_f"] is nn.LayerNorm
    assert kinds["blocks.0.ln_1"] is FP8SavedLayerNorm and kinds["blocks.1.attn.sdpa"] is FP8SavedAttention
    # the level's activations="bf16" with one kind of module back in FP8
    model, _ = fp8lm.initialize(
        copy.deepcopy(base), None, "O2", activations="bf16", policy={"*.sdpa": {"activations": "fp8"}}
    )
    saving = sorted(name for name, m in model.named_modules() if type(m).__name__.startswith("FP8Saved"))
    assert saving == ["blocks.0.attn.sdpa", "blocks.1.attn.sdpa"]


def test_initialize_refuses_an_unknown_activations_value_and_changes_nothing():
    model = _gpt("gpt")
    before = [type(m) for m in model.modules()]
    with pytest.raises(ValueError, match="unknown activations 'int8': use one of bf16, fp8"):
        fp8lm.initialize(model, None, "O2", activations="int8")
    assert [type(m) for m in model.modules()] == before and not hasattr(model, "_fp8lm_opt_level")


@pytest.mark.slow  # dynamo's first compile in a process takes several seconds
def test_fullgraph_compile_traces_the_saving_modules():
    torch._dynamo.reset()
    chain = nn.Sequential(_layer_norm(), nn.GELU(), _rms_norm(), SwiGLU())
    fp8 = nn.Sequential(*(saved.saving_counterpart(m) for m in chain))
    x = rows_of_many_ranges(2, 8, 256).requires_grad_()
    compiled = torch.compile(fp8, backend="aot_eager", fullgraph=True)
    y = compiled(x)
    assert torch.equal(y, fp8(x)) and torch.equal(y, chain(x))
    grad = torch.randn_like(y)
    params = [x, *fp8.parameters()]
    for a, b in zip(torch.autograd.grad(y, params, grad), torch.autograd.grad(fp8(x), params, grad)):
        assert torch.equal(a, b)


# -- attention ----------------------------------------------------------------------------------


def _qkv(dtype, heads=4, kv_heads=4, seq=24, dim=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, heads, seq, dim, generator=g)
    k, v = (torch.randn(2, kv_heads, seq, dim, generator=g) * 3 for _ in range(2))
    return [t.to(dtype).requires_grad_() for t in (q, k, v)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("is_causal", [True, False])
def test_attention_forward_is_the_kernels_and_backward_the_exact_gradient_at_the_saved_inputs(dtype, is_causal):
    q, k, v = _qkv(dtype)
    out = FP8SavedAttention()(q, k, v, is_causal=is_causal)
    assert torch.equal(out, F.scaled_dot_product_attention(q, k, v, is_causal=is_causal))
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(
        dtype
    )  # not the global RNG: order-free
    got = torch.autograd.grad(out, (q, k, v), grad)
    # autograd through the plain kernel at the dequantized inputs: one scale per token and head
    deq = [dequantize_groups(*quantize_groups(t.detach()), dtype).requires_grad_() for t in (q, k, v)]
    want = torch.autograd.grad(F.scaled_dot_product_attention(*deq, is_causal=is_causal), deq, grad)
    for a, b in zip(got, want, strict=True):
        assert a.dtype == dtype and torch.equal(a, b)
    # and within FP8's rounding of the gradient at the exact inputs
    exact = torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, is_causal=is_causal), (q, k, v), grad)
    for a, b in zip(got, exact, strict=True):
        assert (a.float() - b.float()).norm() < 0.1 * b.float().norm()


def test_attention_under_autocast_computes_what_sdpa_computes_from_fp32_inputs():
    q, k, v = _qkv(torch.float32)
    with torch.autocast("cpu", torch.bfloat16):
        out = FP8SavedAttention()(q, k, v, is_causal=True)
        want = ScaledDotProductAttention()(q, k, v, is_causal=True)
    assert out.dtype == want.dtype == torch.bfloat16 and torch.equal(out, want)
    grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    assert all(g.dtype == torch.float32 and g.isfinite().all() for g in grads)


def test_attention_saves_only_fp8_inputs_and_their_scales():
    q, k, v = _qkv(torch.bfloat16, seq=32, dim=32)
    got = saved_tensor_bytes(lambda: FP8SavedAttention()(q, k, v, is_causal=True))
    elements = sum(t.numel() for t in (q, k, v))
    assert got == elements + 4 * elements // 32  # E4M3 payloads, one float32 scale per 32 columns
    plain = saved_tensor_bytes(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
    assert plain >= 2 * elements + 2 * q.numel()  # q, k, v and the output in BF16


def test_attention_with_dropout_or_without_gradients_runs_the_plain_kernel():
    q, k, v = _qkv(torch.float32)
    fp8 = FP8SavedAttention()
    assert saved_tensor_bytes(lambda: fp8(q, k, v, dropout_p=0.5)) >= 4 * sum(t.numel() for t in (q, k, v))
    with torch.no_grad():
        assert torch.equal(fp8(q, k, v, is_causal=True), ScaledDotProductAttention()(q, k, v, is_causal=True))


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_attention_in_a_model_keeps_the_loss_and_moves_the_gradients_less_than_the_norms_do(arch):
    """The model's loss is the same with FP8-saved attention, and what it changes in the gradients
    (the attention's backward at the dequantized q, k, v) is smaller than what FP8-saved norms and
    activation functions already change, which the 5-seed training comparison accepted."""
    base = _gpt(arch)  # llama: grouped-query attention, k and v repeated to the query heads
    # O1: the gradients in FP32 (O2 stores them in FP8, another rounding)
    ref, _ = fp8lm.initialize(copy.deepcopy(base), None, "O1", activations="bf16")
    rest, _ = fp8lm.initialize(copy.deepcopy(base), None, "O1", activations="fp8")
    full, _ = fp8lm.initialize(copy.deepcopy(base), None, "O1", activations="fp8")
    for block in rest.blocks:
        block.attn.sdpa = ScaledDotProductAttention()
    idx = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    grads = []
    with torch.autocast("cpu", torch.bfloat16):
        losses = [m(idx, idx)[1] for m in (ref, rest, full)]
    assert torch.equal(losses[0], losses[1]) and torch.equal(losses[1], losses[2])
    for model, loss in zip((ref, rest, full), losses, strict=True):
        loss.backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    by_attention = (grads[2] - grads[1]).norm() / grads[0].norm()
    by_the_rest = (grads[1] - grads[0]).norm() / grads[0].norm()
    assert 0 < by_attention < by_the_rest


@pytest.mark.slow  # dynamo's first compile in a process takes several seconds
def test_fullgraph_compile_traces_the_saving_attention():
    torch._dynamo.reset()
    q, k, v = _qkv(torch.bfloat16)
    fp8 = FP8SavedAttention()
    compiled = torch.compile(fp8, backend="aot_eager", fullgraph=True)
    y = compiled(q, k, v, is_causal=True)
    assert torch.equal(y, fp8(q, k, v, is_causal=True))
    grad = torch.randn_like(y)
    got = torch.autograd.grad(y, (q, k, v), grad)
    for a, b in zip(got, torch.autograd.grad(fp8(q, k, v, is_causal=True), (q, k, v), grad), strict=True):
        assert torch.equal(a, b)
