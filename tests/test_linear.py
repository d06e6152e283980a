import io

import pytest
import torch
from torch import nn

import fp8lm
from fp8lm import Recipe, ScalingTensor
from fp8lm.nn import FP8Linear


def sqnr_db(ref: torch.Tensor, x: torch.Tensor) -> float:
    ref, x = ref.double(), x.double()
    return (10 * torch.log10(ref.pow(2).sum() / (ref - x).pow(2).sum())).item()


def grad_values(p: torch.Tensor) -> torch.Tensor:
    return p.grad.dequantize() if isinstance(p.grad, ScalingTensor) else p.grad


class Conv1D(nn.Module):
    """Stand-in with the layout of transformers.pytorch_utils.Conv1D (weight (in, out))."""

    def __init__(self, nf, nx):
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.02)
        self.bias = nn.Parameter(torch.randn(nf) * 0.02)

    def forward(self, x):
        out = torch.addmm(self.bias, x.reshape(-1, x.size(-1)), self.weight)
        return out.view(*x.shape[:-1], self.nf)


@pytest.fixture(scope="module")
def big_pair():
    """FP32 nn.Linear(1024, 1024) vs its FP8Linear on 4096 Gaussian tokens: outputs and grads."""
    torch.manual_seed(0)
    ref = nn.Linear(1024, 1024)
    fp8 = FP8Linear.from_linear(ref)
    x = torch.randn(4096, 1024)
    g = torch.randn(4096, 1024)
    out = {}
    for name, layer in (("ref", ref), ("fp8", fp8)):
        xi = x.clone().requires_grad_()
        y = layer(xi)
        y.backward(g)
        out[name] = (y.detach(), xi.grad, layer.weight)
    return out


def test_must_show_sqnr_vs_fp32_linear(big_pair):
    y_ref, dx_ref, w_ref = big_pair["ref"]
    y, dx, w = big_pair["fp8"]
    assert sqnr_db(y_ref, y) >= 25
    assert sqnr_db(dx_ref, dx) >= 22
    assert isinstance(w.grad, ScalingTensor) and w.grad.payload.dtype == torch.float8_e4m3fn
    assert w.grad.dtype == torch.float32 and w.grad.payload.element_size() == 1
    assert sqnr_db(w_ref.grad, w.grad.dequantize()) >= 22


def test_weight_is_fp16_scaled_parameter():
    lin = nn.Linear(32, 16)
    layer = FP8Linear.from_linear(lin)
    w = layer.weight
    assert isinstance(w, nn.Parameter) and isinstance(w, ScalingTensor)
    assert w.payload.dtype == torch.float16 and w.dtype == torch.float32 and w.requires_grad
    torch.testing.assert_close(w.dequantize(), lin.weight.detach(), rtol=2**-11, atol=0)
    assert torch.equal(layer.bias, lin.bias) and layer.bias is not lin.bias
    plain = FP8Linear(32, 16, weight_format=fp8lm.FP32)
    assert type(plain.weight) is nn.Parameter and plain.weight.dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_output_dtype_and_accuracy(dtype):
    torch.manual_seed(1)
    ref = nn.Linear(256, 128)
    layer = FP8Linear.from_linear(ref)
    x = torch.randn(2, 512, 256)
    xr, x8 = x.clone().requires_grad_(), x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=dtype):
        y_ref, y = ref(xr), layer(x8)
    assert y.dtype == dtype and y.shape == (2, 512, 128)
    g = torch.randn_like(y_ref.float())
    y_ref.float().backward(g)
    y.float().backward(g)
    assert x8.grad.dtype == torch.float32 and layer.bias.grad.dtype == torch.float32
    assert sqnr_db(y_ref, y) >= 25
    assert sqnr_db(xr.grad, x8.grad) >= 22
    assert sqnr_db(ref.weight.grad, layer.weight.grad.dequantize()) >= 22
    assert sqnr_db(ref.bias.grad, layer.bias.grad) >= 40


def test_backward_saves_only_fp8_copies():
    layer = FP8Linear(256, 128)
    x = torch.randn(512, 256, requires_grad=True)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = layer(x)
    big = [t for t in saved if t.numel() > 1]
    assert {t.dtype for t in big} == {torch.float8_e4m3fn}
    assert sorted(t.numel() for t in big) == sorted([x.numel(), layer.weight.numel()])
    y.sum().backward()
    assert x.grad is not None and layer.weight.grad is not None


def test_microbatch_accumulation_matches_one_big_batch():
    torch.manual_seed(2)
    ref = nn.Linear(256, 256)
    x = torch.randn(4, 512, 256)
    g = torch.randn(4, 512, 256)
    ref(x.reshape(-1, 256)).backward(g.reshape(-1, 256))
    exact = ref.weight.grad

    big = FP8Linear.from_linear(ref)
    big(x.reshape(-1, 256)).backward(g.reshape(-1, 256))
    micro = FP8Linear.from_linear(ref)
    for i in range(4):
        micro(x[i]).backward(g[i])
    assert isinstance(micro.weight.grad, ScalingTensor)
    assert micro.weight.grad.payload.dtype == torch.float8_e4m3fn
    one, accumulated = big.weight.grad.dequantize(), micro.weight.grad.dequantize()
    # FP8 tolerance: each of the 4 accumulations requantizes to E4M3 (rel. error <= 2^-4 per step).
    assert sqnr_db(exact, one) >= 22
    assert sqnr_db(exact, accumulated) >= 20
    assert sqnr_db(one, accumulated) >= 20
    torch.testing.assert_close(micro.bias.grad, ref.bias.grad, rtol=1e-2, atol=1e-2)


def test_delayed_and_current_scaling():
    delayed = FP8Linear(64, 32, recipe=Recipe(history_len=4))
    current = FP8Linear(64, 32, recipe="tensorwise-current")
    for step in range(6):
        x = torch.randn(16, 64) * (10.0**step)
        delayed(x)
        current(x)
    assert delayed.input_meta.delayed and delayed.input_meta.step == 6
    assert not current.input_meta.delayed
    # current scaling fits the last tensor; delayed keeps a window of the last 4 amaxes
    last_amax = x.abs().max()
    assert torch.equal(current.input_meta.scale, fp8lm.compute_scale(last_amax, fp8lm.E4M3))
    assert torch.equal(delayed.input_meta.last_amax, last_amax)


def test_high_precision_fallback_switch():
    torch.manual_seed(3)
    ref = nn.Linear(64, 32)
    layer = FP8Linear.from_linear(ref)
    layer.fp8_enabled = False
    x = torch.randn(8, 64)
    # FP16 weight storage is the only difference left
    torch.testing.assert_close(layer(x), ref(x), rtol=1e-3, atol=1e-3)
    layer.fp8_enabled = True
    assert sqnr_db(ref(x), layer(x)) >= 25


def test_nonfinite_inputs_and_grads_stay_visible():
    layer = FP8Linear(32, 16)
    x = torch.randn(4, 32)
    x[1, 3] = float("inf")
    assert not bool(torch.isfinite(layer(x)).all())  # the saturating cast alone would hide it
    layer.zero_grad()
    y = layer(torch.randn(4, 32))
    g = torch.ones_like(y)
    g[0, 0] = float("nan")
    y.backward(g)
    assert not fp8lm.grads_are_finite(layer.parameters())


@pytest.mark.parametrize(
    "make_opt",
    [
        lambda ps: torch.optim.SGD(ps, lr=0.1),
        lambda ps: torch.optim.AdamW(ps, lr=1e-2),
    ],
)
@pytest.mark.parametrize("weight_format", [fp8lm.FP16, fp8lm.FP32])
def test_torch_optimizers_step_on_fp8_gradients(make_opt, weight_format):
    """ScalingTensor gradients on a ScalingTensor or plain weight: torch optimizers see correct values."""
    torch.manual_seed(4)
    layer = FP8Linear(64, 32, weight_format=weight_format)
    ref = nn.Linear(64, 32)
    with torch.no_grad():
        ref.weight.copy_(layer.weight)
        ref.bias.copy_(layer.bias)
    x = torch.randn(16, 64)
    layer(x).square().sum().backward()
    assert isinstance(layer.weight.grad, ScalingTensor)
    ref.weight.grad = layer.weight.grad.dequantize().clone()
    ref.bias.grad = layer.bias.grad.clone()
    opt, opt_ref = make_opt(layer.parameters()), make_opt(ref.parameters())
    opt.step()
    opt_ref.step()
    assert isinstance(layer.weight, ScalingTensor) == (weight_format == fp8lm.FP16)  # still stored scaled
    tol = 2**-10 if weight_format == fp8lm.FP16 else 1e-6  # FP16 storage of the updated weight
    torch.testing.assert_close(layer.weight.detach().float(), ref.weight.detach(), rtol=tol, atol=1e-6)
    state = opt.state[layer.weight]
    for value in state.values():
        assert not isinstance(value, ScalingTensor)  # O1: the optimizer's own FP32 states


def test_state_dict_is_plain_and_loads_into_nn_linear():
    layer = FP8Linear(64, 32)
    sd = layer.state_dict()
    assert all(type(v) is torch.Tensor for v in sd.values())
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    plain = nn.Linear(64, 32)
    plain.load_state_dict(torch.load(buf, weights_only=True))
    assert torch.equal(plain.weight, layer.weight.dequantize())
    fresh = FP8Linear(64, 32)
    fresh.load_state_dict(plain.state_dict())
    assert isinstance(fresh.weight, ScalingTensor)
    assert torch.equal(fresh.weight.dequantize(), layer.weight.dequantize())


def test_conv1d_layout():
    torch.manual_seed(5)
    conv = Conv1D(48, 32)
    layer = FP8Linear.from_linear(conv)
    assert (layer.in_features, layer.out_features) == (32, 48)
    x = torch.randn(3, 16, 32)
    assert sqnr_db(conv(x), layer(x)) >= 25
    sd = layer.state_dict()
    assert sd["weight"].shape == (32, 48)
    other = Conv1D(48, 32)
    other.load_state_dict(sd)
    torch.testing.assert_close(other.weight, conv.weight, rtol=2**-11, atol=0)
    layer.load_state_dict(conv.state_dict())


def test_bad_arguments():
    with pytest.raises(ValueError, match="delayed, current"):
        FP8Linear(16, 16, recipe=Recipe(scaling="lazy"))
    with pytest.raises(ValueError, match="history_len"):
        FP8Linear(16, 16, recipe=Recipe(history_len=0))
    with pytest.raises(ValueError, match="auto, scaled_mm, emulated"):
        FP8Linear(16, 16, recipe=Recipe(backend="tensor-cores"))
    with pytest.raises(ValueError, match="unknown format"):
        FP8Linear(16, 16, weight_format="E3M4")
    with pytest.raises(TypeError, match="nn.Linear or a GPT-2 Conv1D"):
        FP8Linear.from_linear(nn.Conv1d(4, 4, 1))


def test_scaled_mm_backend_matches_emulation():
    torch.manual_seed(6)
    ref = nn.Linear(128, 64)
    a = FP8Linear.from_linear(ref, recipe=Recipe(backend="scaled_mm"))
    b = FP8Linear.from_linear(ref, recipe=Recipe(backend="emulated"))
    x = torch.randn(256, 128)
    ya, yb = a(x), b(x)
    # same FP8 operands, FP32 accumulation in a different order: see test_gemm for the bound
    torch.testing.assert_close(ya, yb, rtol=1e-5, atol=1e-5)
    ya.sum().backward()
    yb.sum().backward()
    torch.testing.assert_close(a.weight.grad.dequantize(), b.weight.grad.dequantize(), rtol=2**-3, atol=1e-6)


def _count_weight_casts(monkeypatch) -> list:
    """Calls of the function that scales a weight for its FP8 cast, counted."""
    import fp8lm.nn.linear as linear

    calls = []
    original = linear._weight_scales

    def counted(*args):
        calls.append(1)
        return original(*args)

    monkeypatch.setattr(linear, "_weight_scales", counted)
    return calls


def test_weight_is_cast_once_per_change_of_the_weight(monkeypatch):
    """On an FP8 GEMM backend the weight's FP8 copy is made once per change of the weight, not per
    forward, and every way of changing it (an optimizer step, load_state_dict, an in-place op, a
    write through .data) makes a new one: the results equal a fresh copy's (which casts anew)."""
    import copy

    torch.manual_seed(0)
    layer = FP8Linear(32, 16, recipe=fp8lm.Recipe(backend="scaled_mm"))
    opt = torch.optim.AdamW(layer.parameters(), lr=0.1)
    x = torch.randn(8, 32)
    calls = _count_weight_casts(monkeypatch)

    def forward_matches_a_fresh_copy():
        fresh = copy.deepcopy(layer)  # new payload tensors: nothing cached for them
        expected = fresh(x)
        before = len(calls)
        torch.testing.assert_close(layer(x), expected, rtol=0, atol=0)
        return len(calls) - before

    assert forward_matches_a_fresh_copy() == 1
    assert forward_matches_a_fresh_copy() == 0  # unchanged weight: the cached copy
    layer(x).sum().backward()
    opt.step()
    assert forward_matches_a_fresh_copy() == 1
    other = nn.Linear(32, 16)
    layer.load_state_dict(other.state_dict())
    assert forward_matches_a_fresh_copy() == 1
    with torch.no_grad():
        layer.weight.mul_(-2.0)
    assert forward_matches_a_fresh_copy() == 1
    layer.weight.data.copy_(torch.randn(16, 32))
    assert forward_matches_a_fresh_copy() == 1
    assert forward_matches_a_fresh_copy() == 0


def test_the_weight_operand_is_layer_state_and_every_weight_write_invalidates_it(monkeypatch):
    """The cached FP8 weight operand lives on the layer (no module-level cache), copies of the layer
    start without it, and each way of writing the weight (FP8AdamW's step, load_state_dict, an
    in-place copy_ of the parameter) makes the next forward cast anew, matching a fresh copy."""
    import copy

    import fp8lm.nn.linear as linear
    from fp8lm.optim import FP8AdamW

    assert not any(isinstance(v, dict) and "OPERAND" in k for k, v in vars(linear).items())
    torch.manual_seed(0)
    layer = FP8Linear(32, 16, recipe=fp8lm.Recipe(backend="scaled_mm"))
    opt = FP8AdamW(layer.parameters(), lr=0.1)
    x = torch.randn(8, 32)
    calls = _count_weight_casts(monkeypatch)

    def casts_in_forward():
        expected = copy.deepcopy(layer)(x)
        before = len(calls)
        torch.testing.assert_close(layer(x), expected, rtol=0, atol=0)
        return len(calls) - before

    layer(x)
    assert layer._weight_operand._entry is not None and copy.deepcopy(layer)._weight_operand._entry is None
    assert casts_in_forward() == 0
    layer(x).sum().backward()
    opt.step()
    assert casts_in_forward() == 1
    layer.load_state_dict(nn.Linear(32, 16).state_dict())
    assert casts_in_forward() == 1
    with torch.no_grad():
        layer.weight.copy_(torch.randn(16, 32))
    assert casts_in_forward() == 1
    assert casts_in_forward() == 0


def _count_weight_amaxes(monkeypatch, layer: FP8Linear) -> list:
    """Amax reductions FP8Linear runs over ``layer``'s weight payload, counted."""
    import fp8lm.nn.linear as linear

    calls = []
    original = linear.traceable_amax

    def counted(x):
        calls.extend([1] if x is layer.weight.payload else [])
        return original(x)

    monkeypatch.setattr(linear, "traceable_amax", counted)
    return calls


@pytest.mark.parametrize("optimizer", ["FP8AdamW", "torch AdamW"])
@pytest.mark.parametrize("backend", ["scaled_mm", "emulated"])
def test_weight_amax_comes_from_the_optimizer_step(monkeypatch, backend, optimizer):
    """The optimizer's write of a weight notes its payload's amax (FP8AdamW's pass measures it; a
    torch optimizer's in-place update requantizes, which knows it); FP8Linear scales the weight
    with it instead of reading the payload again, with the same result, and measures it itself
    once the payload changes in any other way (the noted amax is then stale)."""
    import copy

    from fp8lm.optim import FP8AdamW

    torch.manual_seed(0)
    layer = FP8Linear(32, 16, recipe=fp8lm.Recipe(backend=backend))
    opt = (FP8AdamW if optimizer == "FP8AdamW" else torch.optim.AdamW)(layer.parameters(), lr=0.01)
    x = torch.randn(8, 32)
    layer(x).sum().backward()
    opt.step()
    payload = layer.weight.payload
    assert layer.weight.known_payload_amax() == payload.float().abs().amax()
    calls = _count_weight_amaxes(monkeypatch, layer)
    expected = copy.deepcopy(layer)(x)  # a new payload: nothing noted for it, its amax measured
    assert len(calls) == 0
    torch.testing.assert_close(layer(x), expected, rtol=0, atol=0)
    assert len(calls) == 0
    with torch.no_grad():
        layer.weight.mul_(-2.0)  # an in-place op requantizes: it notes the new amax
    assert layer.weight.known_payload_amax() == layer.weight.payload.float().abs().amax()
    torch.testing.assert_close(layer(x), copy.deepcopy(layer)(x), rtol=0, atol=0)
    with torch.no_grad():
        layer.weight.mul_(0.5)  # a positive factor changes the scale alone: the amax still holds
    assert layer.weight.known_payload_amax() == layer.weight.payload.float().abs().amax()
    torch.testing.assert_close(layer(x), copy.deepcopy(layer)(x), rtol=0, atol=0)
    assert len(calls) == 0
    layer.weight.payload.mul_(0.5)  # a write of the payload itself: the noted amax no longer holds
    assert layer.weight.known_payload_amax() is None
    torch.testing.assert_close(layer(x), copy.deepcopy(layer)(x), rtol=0, atol=0)
    assert len(calls) == 1
    # The reader does use a noted amax: a wrong one (2**10 x) scales small weights into underflow.
    true_amax = layer.weight.payload.float().abs().amax()
    layer.weight.payload.add_(0)  # a new version: nothing cached from the last forward
    layer.weight.note_payload_amax(true_amax * 2**10)
    assert not torch.equal(layer(x), copy.deepcopy(layer)(x))


def test_emulated_backend_keeps_no_weight_copy(monkeypatch):
    """The emulated GEMM also reads the weight upcast: that is not kept between steps (its memory
    would exceed the FP8 copy's), so each forward casts the weight."""
    layer = FP8Linear(32, 16, recipe=fp8lm.Recipe(backend="emulated"))
    calls = _count_weight_casts(monkeypatch)
    x = torch.randn(8, 32)
    layer(x), layer(x)
    assert len(calls) == 2


def test_empty_batch():
    layer = FP8Linear(32, 16)
    x = torch.zeros(0, 32, requires_grad=True)
    y = layer(x)
    assert y.shape == (0, 16)
    y.sum().backward()
    assert x.grad.shape == (0, 32)


def test_model_with_more_fp8_layers_than_the_recompile_limit_compiles_once_not_per_layer():
    """A compiled model with more FP8Linear layers than torch.compile's recompile limit (8) is one
    graph, compiled once: the layers are traced into it, not compiled per layer, the delayed scales
    changing between calls recompile nothing, and the results equal eager ones. (``aot_eager``:
    the graphs and recompiles are dynamo's and AOTAutograd's, without generating code.)"""
    import copy

    from torch._dynamo.testing import CompileCounterWithBackend

    torch.manual_seed(0)
    layers = []
    for _ in range(9):
        layers += [FP8Linear(32, 32), nn.GELU()]
    model = nn.Sequential(*layers)
    eager = copy.deepcopy(model)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    x = torch.randn(16, 32)
    for _ in range(3):  # the delayed scales change between calls
        out = compiled(x)
        out.sum().backward()
        ref = eager(x)
        ref.sum().backward()
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    assert counter.frame_count == 1
    for a, b in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(
            a.grad.dequantize() if isinstance(a.grad, fp8lm.ScalingTensor) else a.grad,
            b.grad.dequantize() if isinstance(b.grad, fp8lm.ScalingTensor) else b.grad,
        )


@pytest.mark.parametrize("kernels", [True, False])
def test_compiled_cpu_graph_holds_the_c_kernels_or_the_plain_casts(kernels, monkeypatch):
    """Traced on CPU, the casts are fp8lm's C kernels as opaque ops while they are on; without them
    (``FP8LM_NATIVE=0``, no C compiler) the graph holds the plain cast expressions, as a CUDA graph
    does, for Inductor to fuse. Either way the results are eager's."""
    import copy

    from fp8lm.ops import native

    monkeypatch.setattr(native.KERNELS.switch, "on", kernels)
    torch.manual_seed(0)
    layer = FP8Linear(64, 32)
    eager = copy.deepcopy(layer)
    targets: set[str] = set()

    def backend(gm, example_inputs):
        from functorch.compile import make_boxed_func
        from torch._functorch.aot_autograd import aot_module_simplified

        def record(graph, _):
            targets.update(str(n.target) for n in graph.graph.nodes if n.op == "call_function")
            return make_boxed_func(graph)

        return aot_module_simplified(gm, example_inputs, fw_compiler=record, bw_compiler=record)

    compiled = torch.compile(layer, backend=backend, fullgraph=True)
    x = torch.randn(16, 64)
    for _ in range(2):
        out, ref = compiled(x), eager(x)
        out.sum().backward()
        ref.sum().backward()
        torch.testing.assert_close(out, ref, rtol=0, atol=0)
    assert any(t.startswith("fp8lm.") for t in targets) == kernels, sorted(targets)
    torch.testing.assert_close(layer.weight.grad.dequantize(), eager.weight.grad.dequantize(), rtol=0, atol=0)
