"""FP8AdamW / FP8Adam: numerics against torch's Adam/AdamW, state formats, skips, bad inputs."""

import logging

import pytest
import torch
from torch import nn

import fp8lm
from fp8lm.ops.cast import saturating_cast
from fp8lm.optim import FP8Adam, FP8AdamW
from fp8lm.optim.functional import adam_ratio_bound, adam_update
from fp8lm.optim.fused import fused_adam_step_, no_stall, run_pass, stored_amaxes, write_pass
from fp8lm.optim.slots import AdamSlot


def _linear(seed=0, n=64):
    torch.manual_seed(seed)
    return nn.Linear(n, n)


def _feed(models, steps, seed=1, scale=1.0):
    """Yield after giving every model's parameters the same random gradients."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for ps in zip(*(m.parameters() for m in models)):
            g = torch.randn(ps[0].shape, generator=gen) * scale
            for p in ps:
                p.grad = g.clone()
        yield


def _state_snapshot(opt):
    return {
        id(p): {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in s.items()}
        for p, s in opt.state.items()
    }


def _assert_same_state(a, b):
    assert a.keys() == b.keys()
    for pid in a:
        assert a[pid].keys() == b[pid].keys()
        for k in a[pid]:
            x, y = a[pid][k], b[pid][k]
            if isinstance(x, torch.Tensor):
                assert x.dtype == y.dtype and torch.equal(x.float(), y.float()), k
            else:
                assert x == y, k


# -- the pure update against torch, in float64 ---------------------------------------------------


@pytest.mark.parametrize("decoupled", [True, False])
def test_adam_update_matches_torch_in_float64(decoupled):
    torch.manual_seed(0)
    w0 = torch.randn(50, dtype=torch.float64)
    p = nn.Parameter(w0.clone())
    lr, betas, eps, wd = 1e-2, (0.9, 0.99), 1e-8, 0.1
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    ref = cls([p], lr=lr, betas=betas, eps=eps, weight_decay=wd)
    w, m, v = w0.clone(), torch.zeros_like(w0), torch.zeros_like(w0)
    for step in range(1, 6):
        g = torch.randn(50, dtype=torch.float64)
        p.grad = g.clone()
        ref.step()
        decay, l2 = (1 - lr * wd, 0.0) if decoupled else (1.0, wd)
        w, m, v = adam_update(
            w, g, m, v, lr, *betas, eps, decay, l2, 1 - betas[0] ** step, (1 - betas[1] ** step) ** 0.5
        )
    torch.testing.assert_close(w, p.detach(), rtol=1e-13, atol=1e-15)
    torch.testing.assert_close(m, ref.state[p]["exp_avg"], rtol=1e-13, atol=1e-15)
    torch.testing.assert_close(v, ref.state[p]["exp_avg_sq"], rtol=1e-13, atol=1e-15)


@pytest.mark.parametrize("betas", [(0.9, 0.999), (0.9, 0.95), (0.5, 0.2), (0.0, 0.99)])
def test_adam_ratio_bound_holds_and_is_reached(betas):
    """|m_hat| / sqrt(v_hat) never exceeds the bound (random gradients, float64) and the
    Cauchy-Schwarz extremal gradients g_(t-k) ~ (b1/b2)^k reach it."""
    b1, b2 = betas
    gen = torch.Generator().manual_seed(0)
    g = torch.randn(40, 4096, generator=gen, dtype=torch.float64) * torch.exp(torch.randn(40, 4096, generator=gen))
    m, v = torch.zeros(4096, dtype=torch.float64), torch.zeros(4096, dtype=torch.float64)
    for t in range(1, 41):
        m = b1 * m + (1 - b1) * g[t - 1]
        v = b2 * v + (1 - b2) * g[t - 1] ** 2
        ratio = (m / (1 - b1**t)).abs() / (v / (1 - b2**t)).sqrt()
        assert ratio.max().item() <= adam_ratio_bound(b1, b2, t) * (1 + 1e-12)
    for t in (1, 2, 7, 40):
        m = v = 0.0
        for k in reversed(range(t)):  # g_(t-k) = (b1/b2)^k, oldest first
            gk = (b1 / b2) ** k
            m, v = b1 * m + (1 - b1) * gk, b2 * v + (1 - b2) * gk * gk
        reached = m / (1 - b1**t) / (v / (1 - b2**t)) ** 0.5
        assert reached == pytest.approx(adam_ratio_bound(b1, b2, t), rel=1e-12)


def test_adam_ratio_bound_edge_cases():
    assert adam_ratio_bound(0.9, 0.0, 1) == pytest.approx(1.0)
    assert adam_ratio_bound(0.9, 0.0, 2) == float("inf")  # no second-moment averaging: no bound
    assert adam_ratio_bound(0.99, 0.5, 5000) == float("inf")  # (b1^2/b2)^t overflows
    assert adam_ratio_bound(0.9, 0.999, 10**6) == pytest.approx(7.27, abs=0.01)


def test_stored_amaxes_are_exact_for_every_storage_format():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1000, generator=gen) * 3
    cases = [
        x,
        -x.abs(),
        x.abs(),
        torch.zeros(5),
        x.half(),
        x.bfloat16(),
        x.to(torch.float8_e4m3fn),
        (-x.abs()).to(torch.float8_e4m3fn),
        x.abs().to(torch.float8_e4m3fn),
        x.to(torch.float8_e5m2),
        (-x.abs()).to(torch.float8_e5m2),
        torch.full((3,), 2.0**-9).to(torch.float8_e4m3fn),
    ]
    expected = torch.stack([t.float().abs().amax() for t in cases])
    assert torch.equal(stored_amaxes(cases), expected)
    nan = float("nan")
    bad = [
        torch.tensor([1.0, nan]).to(torch.float8_e4m3fn),
        torch.tensor([1.0, -nan]).to(torch.float8_e4m3fn),
        torch.tensor([-1.0, -float("inf")]).to(torch.float8_e5m2),
        torch.tensor([1.0, nan]).half(),
        torch.tensor([-float("inf"), 1.0]),
    ]
    got = stored_amaxes(bad)
    assert got[:2].isnan().all() and got[2] == float("inf") and got[3].isnan() and got[4] == float("inf")


@pytest.mark.parametrize("exp_avg_sq_dtype", [fp8lm.FP16, fp8lm.E4M3])
def test_scales_from_bounds_never_overflow(exp_avg_sq_dtype):
    """The new scales come before the pass (bounds; exact amaxes for an FP8 second moment): no stored
    value may exceed its format and no scale may exceed the one of the exact amax, also when the
    gradients' rows change size by up to 2^11 from step to step."""
    torch.manual_seed(0)
    w = nn.Parameter(fp8lm.quantize(torch.randn(256, 64) * 0.05, fp8lm.FP16))
    opt = FP8AdamW([w], lr=1e-2, exp_avg_sq_dtype=exp_avg_sq_dtype)
    gen = torch.Generator().manual_seed(1)
    for _ in range(12):
        spread = torch.exp2(torch.randint(-6, 6, (256, 1), generator=gen).float())  # rows of varied size
        w.grad = fp8lm.quantize(torch.randn(256, 64, generator=gen) * spread * 1e-2, fp8lm.E4M3)
        opt.step()
        state = opt.state[w]
        for payload, scale, fmt in [
            (w.payload, w.scale, fp8lm.FP16),
            (state["exp_avg"], state["exp_avg_scale"], fp8lm.E4M3),
            (state["exp_avg_sq"], state["exp_avg_sq_scale"], exp_avg_sq_dtype),
        ]:
            amax = payload.float().abs().amax()
            assert amax < fmt.max  # nothing saturated
            exact = fp8lm.scaling.compute_scale(amax / scale, fmt)
            assert scale <= exact


# -- the optimizer against torch ------------------------------------------------------------------


def test_fp8adamw_vs_torch_adamw_64x64_linear_within_3e4():
    """The issue's check: identical gradients, 4 steps, lr 1e-3, weight decay 1e-3."""
    ours, ref = _linear(), _linear()
    opt = FP8AdamW(ours.parameters(), lr=1e-3, weight_decay=1e-3, kernel="eager")
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=1e-3)
    for _ in _feed([ours, ref], 4):
        opt.step()
        ref_opt.step()
    for p, q in zip(ours.parameters(), ref.parameters()):
        assert (p.detach() - q.detach()).abs().max().item() <= 3e-4


def test_fp8adamw_with_fp16_scaled_master_and_fp8_grads_tracks_torch():
    """O2 layout: the ScalingTensor FP16 weight is the master; gradients arrive in E4M3."""
    ours, ref = _linear(), _linear()
    ours.weight = nn.Parameter(fp8lm.quantize(ours.weight.detach(), fp8lm.FP16))
    opt = FP8AdamW(ours.parameters(), lr=1e-3, weight_decay=1e-3, kernel="eager")
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=1e-3)
    payload, scale = ours.weight.payload, ours.weight.scale
    for _ in _feed([ours, ref], 4):
        ours.weight.grad = fp8lm.quantize(ours.weight.grad, fp8lm.E4M3)
        ref.weight.grad = ours.weight.grad.dequantize()  # the same gradient values
        opt.step()
        ref_opt.step()
    assert ours.weight.payload is payload and ours.weight.scale is scale  # updated in place
    assert isinstance(ours.weight, fp8lm.ScalingTensor) and ours.weight.payload.dtype == torch.float16
    assert "master" not in opt.state[ours.weight]
    err = (ours.weight.dequantize() - ref.weight.detach()).abs().max().item()
    assert err <= 3e-4


def test_fp8adam_is_adam_with_l2_penalty():
    ours, ref = _linear(), _linear()
    opt = FP8Adam(ours.parameters(), lr=1e-3, weight_decay=0.1, kernel="eager")
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-3, weight_decay=0.1)
    for _ in _feed([ours, ref], 4):
        opt.step()
        ref_opt.step()
    for p, q in zip(ours.parameters(), ref.parameters()):
        assert (p.detach() - q.detach()).abs().max().item() <= 3e-4
    assert FP8Adam([nn.Parameter(torch.zeros(1))]).defaults["weight_decay"] == 0.0
    assert FP8AdamW([nn.Parameter(torch.zeros(1))]).defaults["weight_decay"] == 1e-2


def test_state_formats_and_power_of_two_scales():
    model = _linear()
    opt = FP8AdamW(model.parameters(), kernel="eager")
    for _ in _feed([model], 2):
        opt.step()
    state = opt.state[model.weight]
    assert state["exp_avg"].dtype == torch.float8_e4m3fn and state["exp_avg_sq"].dtype == torch.float16
    assert state["step"] == 2 and "master" not in state  # an FP32 parameter is its own master
    for key in ("exp_avg_scale", "exp_avg_sq_scale"):
        s = state[key]
        assert s.dtype == torch.float32 and s.dim() == 0
        assert torch.log2(s) == torch.round(torch.log2(s))
    # The moments use their formats' range: amax * scale lands in (max / 2, max].
    m_amax = state["exp_avg"].float().abs().max().item()
    assert 448 / 2 < m_amax <= 448


def test_bf16_parameter_keeps_fp16_master_in_state_and_gets_the_result():
    torch.manual_seed(0)
    p = nn.Parameter(torch.randn(32, 32).bfloat16())
    opt = FP8AdamW([p], lr=1e-3, kernel="eager")
    p.grad = torch.randn(32, 32).bfloat16()
    opt.step()
    state = opt.state[p]
    assert state["master"].dtype == torch.float16
    master = state["master"].float() / state["master_scale"]
    assert torch.equal(p.detach(), master.bfloat16())


@pytest.mark.parametrize("fmt", [fp8lm.E4M3, fp8lm.E5M2])
def test_second_moment_in_fp8(fmt):
    ours, ref = _linear(), _linear()
    opt = FP8AdamW(ours.parameters(), lr=1e-3, exp_avg_sq_dtype=fmt, kernel="eager")
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    for step, _ in enumerate(_feed([ours, ref], 3)):
        opt.step()
        ref_opt.step()
        if step == 0:  # one rounding so far: within the format's precision of v
            state = opt.state[ours.weight]
            assert state["exp_avg_sq"].dtype == fmt.dtype
            payload = state["exp_avg_sq"].float()
            v = payload / state["exp_avg_sq_scale"]
            ref_v = ref_opt.state[ref.weight]["exp_avg_sq"]
            normal = payload >= fmt.min_normal
            assert normal.float().mean() > 0.9
            rel = ((v - ref_v).abs() / ref_v)[normal]
            mantissa_bits = 3 if fmt is fp8lm.E4M3 else 2
            assert rel.max() <= 2.0 ** -(mantissa_bits + 1)
    assert (ours.weight.detach() - ref.weight.detach()).abs().max() <= 5e-4


def test_compiled_and_eager_steps_agree():
    """The compiled kernels and the chunked eager path (a tensor larger than one chunk) compute the
    same update: bit for bit once rounded to FP16/FP8."""
    torch.manual_seed(0)
    shapes = [(300, 300), (17,)]  # 90000 elements: two eager chunks
    params = {c: [nn.Parameter(torch.randn(s) * 0.1) for s in shapes] for c in (True, False)}
    params[True][0] = nn.Parameter(fp8lm.quantize(params[False][0].detach(), fp8lm.FP16))
    params[False][0] = nn.Parameter(fp8lm.quantize(params[False][0].detach(), fp8lm.FP16))
    params[True][1] = nn.Parameter(params[False][1].detach().clone())
    opts = {c: FP8AdamW(params[c], kernel="auto" if c else "eager") for c in (True, False)}
    gen = torch.Generator().manual_seed(3)
    for _ in range(3):
        grads = [fp8lm.quantize(torch.randn(s, generator=gen)) for s in shapes]
        for c in (True, False):
            for p, g in zip(params[c], grads):
                p.grad = g.clone() if p.dim() > 1 else g.dequantize()
            opts[c].step()
    a, b = params[True][0], params[False][0]
    assert torch.equal(a.scale, b.scale)
    assert torch.equal(a.payload, b.payload)
    for key in ("exp_avg", "exp_avg_sq", "exp_avg_scale", "exp_avg_sq_scale"):
        assert torch.equal(opts[True].state[a][key].float(), opts[False].state[b][key].float())
    # A float32 weight is not rounded to a coarser format: compiled code may differ in the last ulp.
    torch.testing.assert_close(params[True][1], params[False][1], rtol=1e-6, atol=0)


# -- non-finite gradients ------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_gradient_skips_whole_step(bad, caplog):
    model, clean = _linear(), _linear()
    model.weight = nn.Parameter(fp8lm.quantize(model.weight.detach(), fp8lm.FP16))
    clean.weight = nn.Parameter(fp8lm.quantize(clean.weight.detach(), fp8lm.FP16))
    opt = FP8AdamW(model.parameters(), kernel="eager")
    clean_opt = FP8AdamW(clean.parameters(), kernel="eager")
    feed = _feed([model, clean], 3)
    next(feed)
    opt.step()
    clean_opt.step()
    params = [p.detach().clone() for p in model.parameters()]
    state = _state_snapshot(opt)
    next(feed)
    model.bias.grad[3] = bad  # one bad element in one tensor: the other tensor must not move either
    with caplog.at_level(logging.WARNING, logger="fp8lm.optim.skipping"):
        opt.step()
    assert opt.skipped_steps == 1 and opt.last_step_skipped
    assert "skipped" in caplog.text
    for before, p in zip(params, model.parameters()):
        assert torch.equal(before, p.detach())
    _assert_same_state(state, _state_snapshot(opt))
    # The next finite step proceeds as if the bad one never happened.
    next(feed)
    opt.step()
    clean_opt.step()
    assert not opt.last_step_skipped
    for p, q in zip(model.parameters(), clean.parameters()):
        assert torch.equal(p.detach(), q.detach())
    assert opt.state_dict()["skipped_steps"] == 1


def test_nan_in_fp8_gradient_payload_skips():
    p = nn.Parameter(fp8lm.quantize(torch.randn(8, 8), fp8lm.FP16))
    opt = FP8AdamW([p], kernel="eager")
    g = fp8lm.quantize(torch.randn(8, 8))
    g.payload[0, 0] = float("nan")
    p.grad = g
    before = p.payload.clone()
    opt.step()
    assert opt.skipped_steps == 1 and torch.equal(before, p.payload)


def test_first_moment_is_dropped_where_second_moment_underflows():
    """An element whose stored v is 0 must not keep an m that the next step would divide by eps."""
    w = torch.zeros(2, dtype=torch.float16)
    m = torch.tensor([100.0, 100.0]).to(torch.float8_e4m3fn)
    v = torch.tensor([60000.0, 0.0], dtype=torch.float16)
    one = lambda: torch.ones(())  # noqa: E731
    hp = torch.tensor([1e-3, 0.9, 0.999, 1e-8, 1.0, 0.0, 0.1, 0.03])
    slot = AdamSlot(w, one(), True, torch.zeros(2), one(), m, one(), v, one(), hp)
    assert fused_adam_step_([slot], kernel="eager")
    assert slot.m[0].float() != 0 and slot.m[1].float() == 0 and slot.v[1].float() == 0


@pytest.mark.parametrize("fmt", [fp8lm.E4M3, fp8lm.E5M2, fp8lm.FP16, fp8lm.BF16])
@pytest.mark.parametrize("beta1", [0.9, 0.95, 0.99])
def test_no_stall_makes_subnormal_decay_progress_and_is_nearest_rounding_otherwise(fmt, beta1):
    """Against float64, over every representable value: a subnormal decayed by beta1 stores a
    strictly smaller magnitude (the next one toward zero where nearest rounding kept it); everywhere
    else the result is nearest rounding, also where that does not decrease."""
    codes = torch.arange(1 << (8 * fmt.bytes), dtype=torch.int32)
    old = codes.to(torch.uint8 if fmt.bytes == 1 else torch.int16).view(fmt.dtype).double()
    old = old[torch.isfinite(old) & (old != 0) & (old.abs() <= fmt.max)]
    new = old * beta1
    one = torch.ones(())
    nearest = saturating_cast(new.float(), one, fmt).double()
    stored = no_stall(nearest.to(fmt.dtype), new.float(), old.float(), one, fmt).double()
    subnormal = old.abs() < fmt.min_normal
    assert (stored[subnormal].abs() < old[subnormal].abs()).all()
    assert (stored[subnormal].abs() >= nearest[subnormal].abs() - fmt.min_subnormal).all()
    assert torch.equal(stored[~subnormal], nearest[~subnormal])
    moved = nearest.abs() < old.abs()
    assert torch.equal(stored[moved], nearest[moved])
    if 1 - beta1 > torch.finfo(fmt.dtype).eps / 2:  # a decay bigger than half a code never stalls up there
        assert (nearest[~subnormal].abs() < old[~subnormal].abs()).all()


# the compiled pass runs write_pass's code as the eager one does (test_compiled_and_eager_steps_agree)
@pytest.mark.parametrize("kernel", ["auto", "eager"])
def test_first_moment_decays_to_zero_once_the_gradient_stops(kernel):
    """Element 0 keeps a steady gradient, which holds the tensor's scales; the others' gradients
    have stopped with m at 2 E4M3 subnormal units, where 0.9 * 2 rounds back to 2 and v (FP16
    subnormal) is stuck too: rounding to nearest stepped them the same way every step, forever. Now
    their m reaches 0 and they move no further than FP32 Adam moves them from the same state."""
    n, steps, lr = 64, 40, 1e-3
    m_scale, v_scale = 256.0, 2.0**14
    m_small = 2 * fp8lm.E4M3.min_subnormal / m_scale
    v_small = (m_small / 1.5) ** 2
    signs = torch.ones(n)
    signs[::2] = -1
    m = (signs * m_small * m_scale).to(torch.float8_e4m3fn)
    v = torch.full((n,), v_small * v_scale).to(torch.float16)
    m[0], v[0] = m_scale, v_scale  # element 0: m = v = 1
    g = torch.zeros(n)
    g[0] = 1.0
    hp = torch.tensor([lr, 0.9, 0.999, 1e-8, 1.0, 0.0, 1.0, 1.0])
    scale = lambda x: torch.tensor(x)  # noqa: E731
    slot = AdamSlot(torch.zeros(n), scale(1.0), False, g, scale(1.0), m, scale(m_scale), v, scale(v_scale), hp)
    for _ in range(steps):
        assert fused_adam_step_([slot], kernel=kernel)
    assert (slot.m[1:].float() == 0).all()
    w64, m64, v64 = (
        torch.zeros(()),
        torch.tensor(m_small, dtype=torch.float64),
        torch.tensor(v_small, dtype=torch.float64),
    )
    for _ in range(steps):
        w64, m64, v64 = adam_update(w64, 0.0, m64, v64, lr, 0.9, 0.999, 1e-8, 1.0, 0.0, 1.0, 1.0)
    moved = slot.w[1:].abs()
    assert (moved > 0).all() and (moved <= w64.abs()).all()


# -- groups, schedulers ---------------------------------------------------------------------------


def test_param_groups_hyperparameters_and_lr_scheduler():
    torch.manual_seed(0)
    a, b = nn.Parameter(torch.randn(16, 16)), nn.Parameter(torch.randn(16))
    ra, rb = nn.Parameter(a.detach().clone()), nn.Parameter(b.detach().clone())
    groups = lambda x, y: [{"params": [x], "lr": 1e-2}, {"params": [y], "weight_decay": 0.0}]  # noqa: E731
    opt = FP8AdamW(groups(a, b), lr=1e-3, weight_decay=0.1, kernel="eager")
    ref = torch.optim.AdamW(groups(ra, rb), lr=1e-3, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.1)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref, step_size=2, gamma=0.1)
    gen = torch.Generator().manual_seed(1)
    for _ in range(5):
        for p, q in ((a, ra), (b, rb)):
            p.grad = torch.randn(p.shape, generator=gen)
            q.grad = p.grad.clone()
        opt.step()
        ref.step()
        sched.step()
        ref_sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-4) and opt.param_groups[1]["lr"] == pytest.approx(1e-5)
    # Tolerance: E4M3 first moment (rel. error <= 2^-4) on lr-sized steps.
    assert (a - ra).abs().max() <= 2 * 2**-4 * 1e-2 * 5
    assert (b - rb).abs().max() <= 2 * 2**-4 * 1e-3 * 5


def test_add_param_group_with_its_own_formats():
    p, q = nn.Parameter(torch.randn(4, 4)), nn.Parameter(torch.randn(4, 4))
    opt = FP8AdamW([p], kernel="eager")
    opt.add_param_group({"params": q, "exp_avg_sq_dtype": torch.float8_e5m2, "lr": 0.0, "weight_decay": 0.0})
    assert opt.param_groups[1]["exp_avg_sq_dtype"] == "E5M2" and opt.param_groups[0]["exp_avg_dtype"] == "E4M3"
    p.grad, q.grad = torch.randn(4, 4), torch.randn(4, 4)
    q0 = q.detach().clone()
    opt.step()
    assert opt.state[q]["exp_avg_sq"].dtype == torch.float8_e5m2
    assert torch.equal(q.detach(), q0)  # lr 0 in its own group


# -- bad inputs -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"amsgrad": True}, "amsgrad"),
        ({"lr": -1.0}, "lr"),
        ({"eps": -1.0}, "eps"),
        ({"weight_decay": -0.1}, "weight_decay"),
        ({"betas": (0.9, 1.0)}, "betas"),
        ({"exp_avg_dtype": "E3M4"}, "unknown format"),
        ({"master_dtype": fp8lm.E4M3}, "master_dtype"),
    ],
)
def test_bad_arguments_raise_clear_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FP8AdamW([nn.Parameter(torch.zeros(2))], **kwargs)


def test_bad_group_is_rejected_without_changing_the_optimizer():
    p = nn.Parameter(torch.zeros(2))
    opt = FP8AdamW([p])
    with pytest.raises(ValueError, match="lr"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(2))], "lr": -1})
    assert len(opt.param_groups) == 1


def test_integer_parameters_and_sparse_gradients_are_rejected():
    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
        FP8AdamW([torch.zeros(2, dtype=torch.int64)])
    emb = nn.Embedding(10, 4, sparse=True)
    opt = FP8AdamW(emb.parameters(), kernel="eager")
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()


def test_empty_parameter_is_left_alone():
    empty, full = nn.Parameter(torch.zeros(0, 4)), nn.Parameter(torch.ones(4))
    opt = FP8AdamW([empty, full], kernel="eager")
    empty.grad, full.grad = torch.zeros(0, 4), torch.ones(4)
    opt.step()
    assert empty not in opt.state and opt.state[full]["step"] == 1


# compiling the step takes 10-30 s per format: the compiled kernel is in the slow tier
@pytest.mark.parametrize("kernel", [pytest.param("compile", marks=pytest.mark.slow), "eager"])
@pytest.mark.parametrize("fmt", [fp8lm.FP16, fp8lm.E4M3, fp8lm.E5M2])
def test_first_moment_is_dropped_exactly_where_stored_second_moment_is_zero(kernel, fmt):
    """The underflow rule tests the unrounded v against half the smallest subnormal: it must agree
    with the stored payload being 0, ties (which round to the even 0) included."""
    tiny = fmt.min_subnormal
    v_vals = torch.tensor([0.0, tiny / 4, tiny / 2, tiny * 0.5000001, tiny * 0.75, tiny, 2 * tiny, 1.0])
    n = v_vals.numel()
    one = lambda: torch.ones(())  # noqa: E731
    # beta2 = 0 and the gradient sqrt(v) make the new v exactly v_vals; scale 1 keeps it unscaled.
    hp = torch.tensor([1e-3, 0.9, 0.0, 1e-8, 1.0, 0.0, 0.1, 1.0])
    slot = AdamSlot(
        torch.zeros(n, dtype=torch.float16),
        one(),
        False,
        v_vals.sqrt(),
        one(),
        torch.full((n,), 100.0).to(torch.float8_e4m3fn),
        one(),
        torch.zeros(n, dtype=fmt.dtype),
        one(),
        hp,
    )
    run_pass(write_pass, slot, kernel, torch.ones(3), slot.formats())
    stored_zero = slot.v.float() == 0
    assert stored_zero.tolist() == [True, True, True, False, False, False, False, False]
    assert torch.equal(slot.m.float() == 0, stored_zero)


def test_optimizer_falls_back_with_a_warning_when_the_native_kernel_cannot_be_built(monkeypatch, tmp_path):
    from fp8lm.ops import native

    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("FP8LM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(native, "_library", None)
    monkeypatch.setattr(native.KERNELS.switch, "on", True)
    monkeypatch.setattr(native.KERNELS, "failed", None)
    with pytest.warns(UserWarning, match="native CPU kernels unavailable"):
        assert not native.available()
    ref, ours = _linear(), _linear()
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=1e-3)
    opt = FP8AdamW(ours.parameters(), lr=1e-3, weight_decay=1e-3)
    for _ in _feed([ref, ours], 2):
        opt_ref.step()
        opt.step()
    for a, b in zip(ref.parameters(), ours.parameters()):
        assert (a - b).abs().max() <= 3e-4


# -- the kernel option ----------------------------------------------------------------------------


def test_kernel_is_checked_and_compiled_is_gone():
    p = nn.Parameter(torch.zeros(2))
    with pytest.raises(TypeError, match="unexpected keyword"):
        FP8AdamW([p], compiled=False)
    assert FP8AdamW([p]).kernel == "auto" and FP8Adam([p], kernel="eager").kernel == "eager"
    with pytest.raises(ValueError, match="kernel must be one of 'auto', 'compile', 'eager'"):
        FP8AdamW([p], kernel="native")
