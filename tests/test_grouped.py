"""FP8GroupedLinear: the experts' three GEMMs in FP8 with a scale per expert, against one FP8 GEMM
per expert (the same numbers) and a float64 reference."""

import copy

import pytest
import torch
from torch import nn

import fp8lm
from fp8lm import E4M3, E5M2, FP16, FP32, ScalingTensor, quantize
from fp8lm.nn import FP8GroupedLinear, GroupedLinear
from fp8lm.ops.gemm import FP8Operand, fp8_mm
from test_gemm import summation_bound

COUNTS = [10, 0, 21, 7]  # an expert without tokens among them


def sqnr_db(ref: torch.Tensor, x: torch.Tensor) -> float:
    ref, x = ref.double(), x.double()
    return (10 * torch.log10(ref.pow(2).sum() / (ref - x).pow(2).sum())).item()


def _layer(seed: int = 0, in_features: int = 32, out_features: int = 48) -> FP8GroupedLinear:
    torch.manual_seed(seed)
    plain = GroupedLinear(len(COUNTS), in_features, out_features)
    with torch.no_grad():
        for e, w in enumerate(plain.weight):
            w.mul_(4.0**e)  # experts of different magnitudes: different scales
    return FP8GroupedLinear.from_grouped(plain)


def _operand(t: ScalingTensor) -> FP8Operand:
    return FP8Operand(t.payload, t.scale_inv)


def _run(layer, x, g):
    xi = x.clone().requires_grad_()
    y = layer(xi, COUNTS)
    y.backward(g)
    return y.detach(), xi.grad


def _loop_reference(layer, x, g):
    """One fp8_mm per expert, every operand quantized on its own by fp8lm.quantize."""
    ys, dxs, dws = [], [], []
    for rows, grads, w in zip(x.split(COUNTS), g.split(COUNTS), layer.weight):
        if rows.shape[0] == 0:
            ys.append(torch.zeros(0, w.shape[0]))
            dxs.append(torch.zeros(0, w.shape[1]))
            dws.append(quantize(torch.zeros(w.shape), E4M3))
            continue
        x8, w8, g8 = quantize(rows, E4M3), quantize(w.dequantize(), E4M3), quantize(grads, E5M2)
        ys.append(fp8_mm(_operand(x8), _operand(w8).t()))
        dxs.append(fp8_mm(_operand(g8), _operand(w8)))
        dws.append(quantize(fp8_mm(_operand(g8).t(), _operand(x8)), E4M3))
    return torch.cat(ys), torch.cat(dxs), dws


def test_weights_are_stored_one_scale_per_expert():
    layer = _layer()
    scales = [w.scale.item() for w in layer.weight]
    assert all(isinstance(w, ScalingTensor) and w.payload.dtype == torch.float16 for w in layer.weight)
    assert scales == sorted(scales, reverse=True) and len(set(scales)) == len(scales)
    plain = FP8GroupedLinear(2, 16, 16, weight_format=FP32)
    assert all(type(w) is nn.Parameter for w in plain.weight)


def test_three_gemms_equal_one_fp8_gemm_per_expert():
    layer = _layer()
    torch.manual_seed(1)
    x, g = torch.randn(sum(COUNTS), 32), torch.randn(sum(COUNTS), 48)
    x[:10] *= 1e-3  # the first expert's tokens far smaller: their own scale
    y, dx = _run(layer, x, g)
    y_ref, dx_ref, dw_ref = _loop_reference(layer, x, g)
    assert torch.equal(y, y_ref) and torch.equal(dx, dx_ref)
    for w, ref in zip(layer.weight, dw_ref):
        assert isinstance(w.grad, ScalingTensor) and w.grad.payload.dtype == torch.float8_e4m3fn
        assert torch.equal(w.grad.payload.float(), ref.payload.float()) and torch.equal(w.grad.scale, ref.scale)
    assert not w.grad.dequantize().eq(0).all()
    assert layer.weight[1].grad.dequantize().eq(0).all()  # no tokens: a zero gradient


def test_experts_stored_in_e4m3_are_saved_as_they_are():
    """Experts whose payloads are already E4M3 (FSDP2's FP8 all-gather, an E4M3 weight) are saved
    for the backward as they are, not as the stack the grouped GEMM reads: FSDP2 frees gathered
    experts after the forward, which a saved stack would defeat. The backward stacks them again;
    the GEMMs are still one FP8 GEMM per expert."""
    torch.manual_seed(0)
    plain = GroupedLinear(len(COUNTS), 32, 48)
    with torch.no_grad():
        for e, w in enumerate(plain.weight):
            w.mul_(4.0**e)
    layer = FP8GroupedLinear.from_grouped(plain, weight_format=E4M3)
    assert all(w.payload.dtype == torch.float8_e4m3fn for w in layer.weight)
    torch.manual_seed(1)
    x, g = torch.randn(sum(COUNTS), 32), torch.randn(sum(COUNTS), 48)
    saved = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append((t.shape, t.untyped_storage().data_ptr()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y, dx = _run(layer, x, g)
    storages = {ptr for _, ptr in saved}
    assert all(w.payload.untyped_storage().data_ptr() in storages for w in layer.weight)
    assert (len(COUNTS), 48, 32) not in [shape for shape, _ in saved]
    y_ref, dx_ref, dw_ref = _loop_reference(layer, x, g)
    assert torch.equal(y, y_ref) and torch.equal(dx, dx_ref)
    for w, ref in zip(layer.weight, dw_ref):
        assert torch.equal(w.grad.payload.float(), ref.payload.float()) and torch.equal(w.grad.scale, ref.scale)


def test_backward_under_autocast_equals_the_backward_after_it():
    """A pipeline schedule runs the backward inside the forward's autocast: the E4M3 experts' saved
    payloads are stacked there too, and the gradients are those of a backward run after it."""
    torch.manual_seed(0)
    layer = FP8GroupedLinear.from_grouped(GroupedLinear(len(COUNTS), 32, 48), weight_format=E4M3)
    torch.manual_seed(1)
    x, g = torch.randn(sum(COUNTS), 32), torch.randn(sum(COUNTS), 48, dtype=torch.bfloat16)
    grads = []
    for inside in (False, True):
        xi = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = layer(xi, COUNTS)
            if inside:
                y.backward(g)
        if not inside:
            y.backward(g)
        grads.append((xi.grad, [w.grad.dequantize() for w in layer.weight]))
        layer.zero_grad(set_to_none=True)
    (dx_after, dw_after), (dx_inside, dw_inside) = grads
    assert torch.equal(dx_after, dx_inside)
    assert all(torch.equal(a, b) for a, b in zip(dw_after, dw_inside))


def test_against_float64_reference():
    layer = _layer()
    torch.manual_seed(2)
    x, g = torch.randn(sum(COUNTS), 32), torch.randn(sum(COUNTS), 48)
    y, dx = _run(layer, x, g)
    x64 = x.double().requires_grad_()
    ws = [w.dequantize().double().requires_grad_() for w in layer.weight]
    y64 = torch.cat([rows @ w.t() for rows, w in zip(x64.split(COUNTS), ws)])
    y64.backward(g.double())
    assert sqnr_db(y64.detach(), y) >= 25
    assert sqnr_db(x64.grad, dx) >= 22
    for w, w64 in zip(layer.weight, ws):
        if w64.grad.abs().sum() > 0:
            assert sqnr_db(w64.grad, w.grad.dequantize()) >= 22
    # the FP8 operands' own values multiplied in float64: only FP32 summation order apart
    x8 = [quantize(rows, E4M3).dequantize().double() for rows in x.split(COUNTS) if rows.shape[0]]
    w8 = [quantize(w.dequantize(), E4M3).dequantize().double() for w, n in zip(layer.weight, COUNTS) if n]
    exact = torch.cat([a @ b.t() for a, b in zip(x8, w8)])
    torch.testing.assert_close(y.double(), exact, rtol=1e-5, atol=1e-5)


def test_bf16_autocast_output_and_high_precision_path():
    layer = _layer()
    x = torch.randn(sum(COUNTS), 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x, COUNTS)
    assert y.dtype == torch.bfloat16 and y.shape == (sum(COUNTS), 48)
    layer.high_precision = True
    y_hp = layer(x, COUNTS)
    plain = torch.cat([rows @ w.dequantize().t() for rows, w in zip(x.split(COUNTS), layer.weight)])
    torch.testing.assert_close(y_hp, plain)


def test_counts_that_do_not_fit_are_refused_in_one_line():
    layer = _layer()
    with pytest.raises(ValueError, match="one per expert, summing to the 39 rows") as e:
        layer(torch.randn(39, 32), COUNTS)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="one per expert"):
        layer(torch.randn(38, 32), [38, 0, 0])


class _Experts(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(32, 32)
        self.experts = GroupedLinear(len(COUNTS), 32, 16)

    def forward(self, x):
        return self.experts(self.inp(x), COUNTS)


@pytest.mark.parametrize(("level", "payload"), [("O1", None), ("O2", torch.float16), ("O3", torch.float8_e4m3fn)])
def test_initialize_stores_experts_like_fp8_weights(level, payload):
    torch.manual_seed(3)
    model = _Experts()
    before = [w.detach().clone() for w in model.experts.weight]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = fp8lm.initialize(model, opt, level)
    layer = model.experts
    assert isinstance(layer, FP8GroupedLinear) and layer.recipe.name == "tensorwise-delayed"
    for w, old in zip(layer.weight, before):
        if payload is None:
            assert type(w) is nn.Parameter
        else:
            assert isinstance(w, ScalingTensor) and w.payload.dtype == payload and w.scale.numel() == 1
        torch.testing.assert_close(w.detach().float() if payload is None else w.dequantize(), old, rtol=0.07, atol=0)
    expected = fp8lm.optim.FP8AdamW if level != "O1" else torch.optim.AdamW
    assert isinstance(opt, expected)
    held = {id(p) for g in opt.param_groups for p in g["params"]}
    assert all(id(w) in held for w in layer.weight)
    x = torch.randn(sum(COUNTS), 32)
    model(x).square().mean().backward()
    assert all(isinstance(w.grad, ScalingTensor) and w.grad.fmt == E4M3 for w in layer.weight)
    opt.step()
    moved = [not torch.equal(w.detach().float(), old) for w, old, n in zip(layer.weight, before, COUNTS) if n]
    assert all(moved)
    if level != "O1":
        state = opt.state[layer.weight[0]]
        assert state["exp_avg"].dtype == torch.float8_e4m3fn
    sd = model.state_dict()
    assert [k for k in sd if k.startswith("experts.")] == [f"experts.weight.{e}" for e in range(len(COUNTS))]
    assert all(type(sd[f"experts.weight.{e}"]) is torch.Tensor for e in range(len(COUNTS)))
    fresh = _Experts()
    fresh.load_state_dict(sd)
    for w, v in zip(fresh.experts.weight, layer.weight):
        assert torch.equal(w.detach(), v.detach().float() if payload is None else v.dequantize())


def test_policy_override_must_cover_every_expert():
    model = _Experts()
    with pytest.raises(ValueError, match="different formats") as e:
        fp8lm.initialize(model, None, "O2", policy={"experts.weight.1": {"weight": FP32}})
    assert "\n" not in str(e.value)
    model, _ = fp8lm.initialize(_Experts(), None, "O2", policy={"experts": {"fp8_gemm": False}})
    assert model.experts.fp8_enabled is False and model.experts.weight[0].fmt == FP16


def test_telemetry_records_each_expert_and_no_gradient_loss_for_one_without_tokens():
    from fp8lm.telemetry import Telemetry

    torch.manual_seed(5)
    model = _Experts()
    model, opt = fp8lm.initialize(model, torch.optim.AdamW(model.parameters()), "O2")
    telemetry = Telemetry(model, opt, every=1)
    with telemetry.step(0):
        model(torch.randn(sum(COUNTS), 32)).square().mean().backward()
    records = telemetry.after_backward()
    opt.step()
    records += telemetry.after_optimizer_step()
    by_expert = {e: {r["kind"] for r in records if r["layer"] == f"experts.expert{e}"} for e in range(len(COUNTS))}
    assert by_expert[0] == {"input", "weight", "grad_output", "weight_grad", "exp_avg", "exp_avg_sq"}
    assert by_expert[1] == {"weight", "exp_avg", "exp_avg_sq"}  # no tokens: no input, no gradient to lose
    inputs = [r for r in records if r["kind"] == "input" and r["layer"].startswith("experts.")]
    assert len(inputs) == 3 and all(r["saturation"] == 0 for r in inputs)  # each group scaled from its own amax


def test_telemetry_splits_each_backward_by_its_own_forwards_counts():
    """A pipeline schedule runs every micro-batch's forward before the backwards: each output
    gradient is split by the counts of the forward that made it, and an expert that took tokens in
    any of the step's forwards has its weight gradient judged."""
    from fp8lm.telemetry import Telemetry

    class Routed(nn.Module):
        def __init__(self):
            super().__init__()
            self.experts = GroupedLinear(len(COUNTS), 32, 16)

        def forward(self, x, counts):
            return self.experts(x, counts)

    torch.manual_seed(5)
    model = Routed()
    model, opt = fp8lm.initialize(model, torch.optim.AdamW(model.parameters()), "O2")
    telemetry = Telemetry(model, opt, every=1)
    first, second = [10, 0, 21, 7], [3, 9, 0, 4]  # 38 and 16 rows; expert 1 only in the second
    with telemetry.step(0):
        losses = [model(torch.randn(sum(c), 32), c).square().mean() for c in (first, second)]
        for loss in losses:
            loss.backward()
    records = telemetry.after_backward()
    grads = [
        [r for r in records if r["layer"] == f"experts.expert{e}" and r["kind"] == "grad_output"] for e in range(4)
    ]
    assert [len(g) for g in grads] == [2, 1, 1, 2]  # each expert once per forward it took tokens in
    judged = {r["layer"] for r in records if r["kind"] == "weight_grad"}
    assert judged == {f"experts.expert{e}" for e in range(4)}


def test_grouped_kernel_path_equals_the_per_expert_loop(monkeypatch):
    """The GPU path's grouped GEMMs (torch._grouped_mm over device offsets), run on CPU: the same
    numbers as a GEMM per expert, an expert without rows included."""
    import fp8lm.nn.grouped as grouped

    layer = _layer()
    torch.manual_seed(6)
    x, g = torch.randn(sum(COUNTS), 32), torch.randn(sum(COUNTS), 48)
    y_loop, dx_loop = _run(layer, x, g)
    dw_loop = [w.grad for w in layer.weight]
    layer.zero_grad(set_to_none=True)
    calls = []

    def kernel(a, b):
        calls.append(1)
        return True

    monkeypatch.setattr(grouped, "uses_grouped_kernel", kernel)
    y, dx = _run(layer, x, g)
    assert len(calls) == 3  # forward, input gradient, weight gradient
    assert torch.equal(y, y_loop) and torch.equal(dx, dx_loop)
    for w, ref in zip(layer.weight, dw_loop):
        assert torch.equal(w.grad.payload.float(), ref.payload.float()) and torch.equal(w.grad.scale, ref.scale)


def test_bf16_grouped_function_is_a_bf16_gemm_per_expert():
    """The plain experts' path under BF16 autocast on a GPU (three torch._grouped_mm), on CPU:
    BF16 operands, FP32 accumulation, each result rounded to BF16 once."""
    from fp8lm.nn.grouped import _BF16GroupedFunction, groups_of

    torch.manual_seed(7)
    weights = [torch.randn(48, 32, requires_grad=True) for _ in COUNTS]
    x = torch.randn(sum(COUNTS), 32, requires_grad=True)
    g = torch.randn(sum(COUNTS), 48).bfloat16()
    y = _BF16GroupedFunction.apply(x, groups_of(COUNTS, len(COUNTS), x.shape[0]), *weights)
    y.backward(g)
    x16, g32 = x.detach().bfloat16().float(), g.float()
    w16 = [w.detach().bfloat16().float() for w in weights]
    xs, gs = x16.split(COUNTS), g32.split(COUNTS)
    y_ref = torch.cat([(rows @ w.t()).bfloat16() for rows, w in zip(xs, w16)])
    dx_ref = torch.cat([(rows @ w).bfloat16() for rows, w in zip(gs, w16)]).float()
    assert y.dtype == torch.bfloat16 and torch.equal(y, y_ref) and torch.equal(x.grad, dx_ref)
    for w, rows, grads in zip(weights, xs, gs):
        assert torch.equal(w.grad, (grads.t() @ rows).bfloat16().float())


def assert_is_fp32_product(got: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``got`` is ``a @ b`` accumulated in FP32 in some order: within `summation_bound` of the exact
    product (torch's CPU GEMM sums in another order with more threads, so two FP32 products of
    the same operands need not be equal)."""
    a, b = a.double(), b.double()
    bound = summation_bound(a, b, torch.finfo(torch.float32).eps)
    error = (got.double() - a @ b).abs()
    assert (error <= bound).all(), f"off by {(error - bound).max().item():.3g} beyond the FP32 summation bound"


@pytest.mark.parametrize("recipe", ["rowwise", "rowwise-wgrad-bf16", "blockwise", "mxfp8"])
def test_fine_grained_recipe_is_fake_quantize_per_expert(recipe):
    """Each expert's three GEMMs with the recipe's blocks of its own rows and weight: against
    fake_quantize of each expert's operands along each GEMM's reduction dimension, multiplied
    exactly (in float64) and allowed only FP32 summation-order error."""
    from fp8lm.ops.finegrained import fake_quantize

    torch.manual_seed(8)
    plain = GroupedLinear(len(COUNTS), 160, 48)
    with torch.no_grad():
        for e, w in enumerate(plain.weight):
            w.mul_(4.0**e)
    layer = FP8GroupedLinear.from_grouped(plain, recipe=recipe, weight_grad_format=FP32)
    x, g = torch.randn(sum(COUNTS), 160), torch.randn(sum(COUNTS), 48)
    x[:10] *= 1e-3
    y, dx = _run(layer, x, g)

    def fq(t, role):  # quantized along the last dim: the reduction dim of the GEMM reading it
        return fake_quantize(t.contiguous(), recipe, role)

    for rows, grads, w, y_e, dx_e in zip(
        x.split(COUNTS), g.split(COUNTS), layer.weight, y.split(COUNTS), dx.split(COUNTS)
    ):
        value = w.dequantize()
        if rows.shape[0] == 0:
            assert torch.equal(w.grad, torch.zeros(48, 160))  # no tokens: a zero gradient
            continue
        assert_is_fp32_product(y_e, fq(rows, "input"), fq(value, "weight").t())
        assert_is_fp32_product(dx_e, fq(grads, "grad_output"), fq(value.t(), "weight").t())
        if recipe.endswith("wgrad-bf16"):  # BF16 operands, FP32 accumulation
            assert_is_fp32_product(w.grad, grads.t().bfloat16(), rows.bfloat16())
        else:  # both along the tokens
            assert_is_fp32_product(w.grad, fq(grads.t(), "grad_output"), fq(rows.t(), "input").t())
    assert not torch.equal(y, torch.cat([r @ w.dequantize().t() for r, w in zip(x.split(COUNTS), layer.weight)]))


@pytest.mark.parametrize("recipe", ["nvfp4", "nvfp4-4over6"])
def test_nvfp4_experts_are_one_nvfp4_linear_per_expert(recipe):
    """nvfp4 experts compute exactly what one nvfp4 FP8Linear per expert computes on its rows
    (the same autograd graph shape, so the stochastic rounding of the output gradients draws the
    same noise): outputs, input and weight gradients bit for bit, over an expert without tokens
    and experts whose tokens are not whole 16-row groups."""
    torch.manual_seed(8)
    plain = GroupedLinear(len(COUNTS), 160, 48)
    layer = FP8GroupedLinear.from_grouped(plain, recipe=recipe)
    singles = []
    for w in layer.weight:
        single = fp8lm.nn.FP8Linear(160, 48, bias=False, recipe=recipe)
        single.weight = nn.Parameter(w.detach().clone())
        singles.append(single)
    x, g = torch.randn(sum(COUNTS), 160), torch.randn(sum(COUNTS), 48)
    torch.manual_seed(9)
    y, dx = _run(layer, x, g)
    xi = x.clone().requires_grad_()
    torch.manual_seed(9)
    y_ref = torch.cat([single(rows) for single, rows in zip(singles, xi.split(COUNTS))])
    y_ref.backward(g)
    assert torch.equal(y, y_ref.detach()) and torch.equal(dx, xi.grad)
    for w, single in zip(layer.weight, singles):
        assert torch.equal(w.grad.float(), single.weight.grad.float())
    assert torch.equal(layer.weight[1].grad.float(), torch.zeros(48, 160))  # the expert without tokens


def test_the_experts_list_knows_its_layer_through_copies_and_pickles(tmp_path):
    """FSDP2 hands an expert's all-gather the list that holds the weight (`ExpertWeights`): it
    names its layer, also in a deep copy, a pickled layer, `FP8GroupedLinear.from_grouped`'s and an
    expert-parallel rank's local layer, and is not a submodule (the names stay ``weight.<e>``)."""
    from fp8lm.distributed.expert_parallel import _local_experts

    layer = GroupedLinear(3, 32, 16)
    fp8 = FP8GroupedLinear.from_grouped(layer)
    torch.save(fp8, tmp_path / "layer.pt")
    loaded = torch.load(tmp_path / "layer.pt", weights_only=False)
    local = _local_experts(fp8, range(1, 2))
    for owner in (layer, fp8, copy.deepcopy(fp8), loaded, local):
        assert owner.weight.grouped_layer is owner
        assert [name for name, _ in owner.named_modules()] == ["", "weight"]
    assert [name for name, _ in local.named_parameters()] == ["weight.1"]
    assert sorted(fp8.state_dict()) == ["weight.0", "weight.1", "weight.2"]


@pytest.mark.parametrize(("name", "make"), [("tensorwise-delayed", "_experts_scales"), ("rowwise", "_rowwise_weights")])
def test_the_experts_weights_are_cast_once_per_change_on_an_fp8_gemm_backend(monkeypatch, name, make):
    """On an FP8 GEMM backend the experts' FP8 weights (all experts in one pass) are made once per
    change of the weights and kept, as FP8Linear keeps its weight's: the micro-batches of one step
    reuse them with the same results, and an optimizer step makes them anew."""
    from fp8lm.nn import grouped

    calls, real = [], getattr(grouped, make)
    monkeypatch.setattr(grouped, make, lambda *args: calls.append(1) or real(*args))
    layer = _layer()
    layer.recipe = fp8lm.Recipe.from_name(name).replace(backend="scaled_mm")
    anew = copy.deepcopy(layer)
    gen = torch.Generator().manual_seed(0)
    for step in range(3):
        x, g = torch.randn(38, 32, generator=gen), torch.randn(38, 48, generator=gen)
        before = len(calls)
        kept = _run(layer, x, g)
        assert len(calls) - before == (1 if step == 0 else 0)
        anew._experts_operands.clear()  # as experts that cast their weights in every forward
        for a, b in zip(kept, _run(anew, x, g)):
            assert torch.equal(a, b)
        for a, b in zip(layer.weight, anew.weight):  # the gradients accumulated so far
            assert torch.equal(a.grad.dequantize(), b.grad.dequantize())
    assert layer.kept_operands()
    opt = fp8lm.optim.FP8AdamW(layer.parameters(), lr=1e-2)
    opt.step()
    before = len(calls)
    _run(layer, x, g)
    assert len(calls) - before == 1
