"""The native CPU Adam kernel: bit-exact against a float32 reference, exact stored amaxes, and the
optimizer's amax cache staying correct when the state changes behind its back."""

import numpy as np
import pytest
import torch
from torch import nn

import fp8lm
from fp8lm.formats import format_of
from fp8lm.ops.cast import saturating_cast
from fp8lm.optim import FP8AdamW, native
from fp8lm.optim.fused import amaxes_pass, no_stall, stored_amaxes

pytestmark = pytest.mark.skipif(not native.available(), reason="no C compiler for the native kernel")

F32, F16, BF16, E4M3, E5M2 = torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2
# (w, g, m, v) payload dtypes: the O2 layout, plain parameters, and every other format somewhere.
COMBOS = [
    (F16, E4M3, E4M3, F16),
    (F32, F32, E4M3, F16),
    (BF16, BF16, E5M2, E4M3),
    (F16, E5M2, F16, BF16),
    (F32, F16, BF16, E5M2),
]


def _payloads(n, dtypes, gen):
    w = torch.randn(n, generator=gen) * 3
    g = torch.randn(n, generator=gen) * torch.rand(n, generator=gen) ** 4 * 100
    m = (torch.randn(n, generator=gen) * 50).clamp(-400, 400)
    v = torch.rand(n, generator=gen) ** 6 * 1000
    v[::7] = 0.0  # some second moments stored as 0: their first moment must be dropped
    return [x.to(d) for x, d in zip((w, g, m, v), dtypes)]


def _reference(w, g, m, v, scales, new_scales, hp):
    """The step in numpy float32 (IEEE operations, correctly rounded sqrt), stored with torch's casts."""
    f = np.float32
    sw, sg, sm, sv = (f(s) for s in scales.tolist())
    lr, b1, b2, eps, decay, l2, bc1, bc2 = (f(x) for x in hp.tolist())
    wf, gf, mf, vf = (x.float().numpy() for x in (w, g, m, v))
    wf, gf, mf, vf = wf * (f(1) / sw), gf * (f(1) / sg), mf * (f(1) / sm), vf * (f(1) / sv)
    m_old = mf
    gf = gf + l2 * wf
    wf = wf * decay
    mf = mf + (f(1) - b1) * (gf - mf)
    vf = vf * b2 + (f(1) - b2) * gf * gf
    denom = np.sqrt(vf) * (f(1) / bc2) + eps
    wf = wf - (lr / bc1) * (mf / denom)
    ns = new_scales.tolist()
    v_fmt = format_of(v.dtype)
    mf = np.where(vf * f(ns[2]) <= f(v_fmt.min_subnormal / 2), f(0), mf)
    stored = [
        saturating_cast(torch.from_numpy(x), torch.tensor(s), format_of(t.dtype))
        for x, s, t in zip((wf, mf, vf), ns, (w, m, v))
    ]
    if m.dtype != F32:
        stored[1] = no_stall(
            stored[1], torch.from_numpy(mf), torch.from_numpy(m_old), torch.tensor(ns[1]), format_of(m.dtype)
        )
    return stored


def _bits(t):
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


@pytest.mark.parametrize("dtypes", COMBOS, ids=lambda c: "-".join(str(d).split(".")[1] for d in c))
def test_kernel_is_bit_exact_against_a_float32_reference(dtypes):
    gen = torch.Generator().manual_seed(0)
    # Sizes around the kernel's 512-element blocks, and enough elements to be split over threads.
    sizes = [1, 17, 511, 513, 40_000, 70_001]
    tensors = [_payloads(n, dtypes, gen) for n in sizes]
    scales = torch.tensor([[2.0, 0.5, 4.0, 8.0]] * len(sizes))
    new_scales = torch.tensor([[4.0, 2.0, 1024.0]] * len(sizes))
    hp = torch.tensor([[1e-2, 0.9, 0.999, 1e-8, 1 - 1e-4, 1e-3, 0.1, 0.03]] * len(sizes))
    expected = [_reference(*ts, s, ns, h) for ts, s, ns, h in zip(tensors, scales, new_scales, hp)]
    amaxes = native.adam_pass([tuple(ts) for ts in tensors], scales, new_scales, hp, write=True)
    for ts, exp, amax in zip(tensors, expected, amaxes):
        w, _, m, v = ts
        for got, want in zip((w, m, v), exp):
            assert torch.equal(_bits(got), _bits(want))
        # The returned amaxes are those of the stored payloads, as the next step would measure them.
        assert torch.equal(amax, stored_amaxes([w, m, v]))


def test_amax_pass_returns_the_new_unscaled_amaxes_and_writes_nothing():
    gen = torch.Generator().manual_seed(1)
    ts = _payloads(5000, COMBOS[2], gen)
    before = [t.clone() for t in ts]
    scales, hp = torch.tensor([[2.0, 0.5, 4.0, 8.0]]), torch.tensor([[1e-2, 0.9, 0.999, 1e-8, 1.0, 0.0, 0.1, 0.03]])
    amax = native.adam_pass([tuple(ts)], scales, torch.ones(1, 3), hp, write=False)[0]
    for t, b in zip(ts, before):
        assert torch.equal(_bits(t), _bits(b))
    w, g, m, v = ts
    want = amaxes_pass(w, scales[0, 0], g, scales[0, 1], m, scales[0, 2], v, scales[0, 3], hp[0])
    # The eager reference's sqrt may be 1 ulp off (torch's CPU sqrt is not correctly rounded).
    torch.testing.assert_close(amax, want, rtol=1e-6, atol=0)


@pytest.mark.parametrize("dtype", [F32, F16, BF16, E4M3, E5M2])
def test_stored_amaxes_are_exact_nan_and_inf_included(dtype):
    gen = torch.Generator().manual_seed(2)
    x = (torch.randn(100_003, generator=gen) * 30).clamp(-400, 400)
    tensors = [x.to(dtype), (-x.abs()).to(dtype), torch.zeros(3, dtype=dtype)]
    got = native.stored_amaxes(tensors)
    assert torch.equal(got, stored_amaxes(tensors))
    bad = x.clone()
    bad[77] = float("nan")
    assert torch.isnan(native.stored_amaxes([bad.to(dtype)])).all()
    if dtype != E4M3:  # E4M3 has no inf
        bad[77] = -float("inf")
        assert native.stored_amaxes([bad.to(dtype)]).item() == float("inf")


@pytest.mark.slow  # compiles the optimizer step: over a minute on 2 cores
def test_native_and_compiled_optimizer_steps_agree(monkeypatch):
    """FP8AdamW with the kernel and with its torch.compile step, on an O2-like model: the same state
    up to torch's CPU sqrt being 1 ulp off in float32 (which changes an FP16/FP8 rounding rarely)."""

    def make():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
        for lin in (model[0], model[2]):
            lin.weight = nn.Parameter(fp8lm.quantize(lin.weight.detach(), fp8lm.FP16))
        return model, FP8AdamW(model.parameters(), lr=1e-2)

    from fp8lm.ops import native as kernels

    runs = {}
    for use_native in (True, False):
        monkeypatch.setattr(kernels.KERNELS.switch, "on", use_native)
        model, opt = make()
        gen = torch.Generator().manual_seed(5)
        for _ in range(5):
            for p in model.parameters():
                g = torch.randn(p.shape, generator=gen) * 1e-2
                p.grad = fp8lm.quantize(g, fp8lm.E4M3) if p.dim() > 1 else g
            opt.step()
        runs[use_native] = (model, opt)
    for pa, pb in zip(runs[True][0].parameters(), runs[False][0].parameters()):
        sa, sb = runs[True][1].state[pa], runs[False][1].state[pb]
        for key in ("exp_avg", "exp_avg_sq"):
            a, b = sa[key].float(), sb[key].float()
            assert (a != b).float().mean() < 1e-3, key
            assert torch.equal(sa[key + "_scale"], sb[key + "_scale"])
        wa = pa.dequantize() if isinstance(pa, fp8lm.ScalingTensor) else pa.detach()
        wb = pb.dequantize() if isinstance(pb, fp8lm.ScalingTensor) else pb.detach()
        torch.testing.assert_close(wa, wb, rtol=2e-3, atol=1e-6)


def test_amax_cache_follows_in_place_changes_of_the_state():
    """The optimizer reuses the amaxes the kernel measured when it stored the state; a change made
    to the state in between must be seen (the step then equals a fresh optimizer's)."""
    torch.manual_seed(0)
    params = [nn.Parameter(fp8lm.quantize(torch.randn(300, 200) * 0.1, fp8lm.FP16))]
    opt = FP8AdamW(params, lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    grads = [fp8lm.quantize(torch.randn(300, 200, generator=gen) * 1e-2) for _ in range(3)]
    for g in grads[:2]:
        params[0].grad = g.clone()
        opt.step()
    state = opt.state[params[0]]
    state["exp_avg"].copy_((state["exp_avg"].float() * 16).clamp(-448, 448).to(torch.float8_e4m3fn))
    params[0].payload.mul_(8)  # through the payload: bumps its version like any in-place op
    # A fresh optimizer over a copy of the same state knows no amaxes: it measures everything.
    twin = [nn.Parameter(fp8lm.ScalingTensor(params[0].payload.clone(), params[0].scale.clone(), torch.float32))]
    fresh = FP8AdamW(twin, lr=1e-2)
    fresh.load_state_dict(opt.state_dict())
    for p, o in ((params[0], opt), (twin[0], fresh)):
        p.grad = grads[2].clone()
        o.step()
    assert torch.equal(params[0].payload.view(torch.int16), twin[0].payload.view(torch.int16))
    assert torch.equal(params[0].scale, twin[0].scale)
    for key in ("exp_avg", "exp_avg_scale", "exp_avg_sq", "exp_avg_sq_scale"):
        assert torch.equal(opt.state[params[0]][key].float(), fresh.state[twin[0]][key].float()), key
