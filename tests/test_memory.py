"""memory_report: bytes per kind of training state, checked against the tensors alive in the process."""

import gc

import pytest
import torch
from torch import nn

import fp8lm
from fp8lm.memory import REPORT_KEYS
from fp8lm.train.model import GPT, GPTConfig


def _gpt_o2(exp_avg_sq=fp8lm.FP16):
    """The issue's model: 4 layers, 384 wide, byte vocabulary, under O2, after one training step."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=4, n_embd=384, n_head=6, block_size=64))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    policy = fp8lm.policy.preset("O2").override("*", exp_avg_sq=exp_avg_sq)
    model, opt = fp8lm.initialize(model, opt, "O2", policy=policy, optimizer_options={"kernel": "eager"})
    idx = torch.randint(0, 256, (2, 64))
    _, loss = model(idx, idx)
    loss.backward()
    opt.step()
    return model, opt


def _alive_storages() -> dict:
    """Every gc-visible plain tensor's storage, keyed by address (the tensors are kept alive, so
    an address cannot be reused while the dict exists)."""
    out = {}
    for obj in gc.get_objects():
        if issubclass(type(obj), torch.Tensor) and not issubclass(type(obj), fp8lm.ScalingTensor):
            try:  # tensors without real storage (fake tensors of torch.compile caches) have no address
                storage = obj.untyped_storage()
                out[(obj.device, storage.data_ptr())] = (storage.nbytes(), obj)
            except (RuntimeError, NotImplementedError):
                continue
    return out


def _report_and_alive_bytes(build) -> tuple:
    """``build()``'s model and optimizer, their `memory_report`, and the bytes of the storages that
    became alive while it ran."""
    gc.collect()
    before = _alive_storages()
    model, opt = build()
    report = fp8lm.memory_report(model, opt)
    # Compiled kernels keep a few example scalars of their own; they are not training state.
    torch._dynamo.reset()
    gc.collect()
    alive = sum(v[0] for k, v in _alive_storages().items() if k not in before)
    return model, opt, report, alive


def test_o2_gpt_is_under_6_1_bytes_per_param_and_alive_tensors_agree():
    model, opt, report, alive = _report_and_alive_bytes(_gpt_o2)
    assert alive == report["total"]

    n = report["num_params"]
    assert n == sum(p.numel() for p in model.parameters())
    assert report["bytes_per_param"] == report["total"] / n
    assert report["bytes_per_param"] <= 6.1
    assert report["master_weights"] == 0  # the FP16 weights are the masters
    # Every parameter has a 1-byte first moment and a 2-byte second moment.
    assert report["exp_avg"] == n and report["exp_avg_sq"] == 2 * n
    assert report["total"] == sum(report[k] for k in REPORT_KEYS)
    assert report["scales"] > 0


def test_o2_gpt_with_fp8_second_moment_is_under_5_1_bytes_per_param():
    model, opt = _gpt_o2(exp_avg_sq=fp8lm.E4M3)
    report = fp8lm.memory_report(model, opt)
    assert report["exp_avg_sq"] == report["num_params"]
    assert report["bytes_per_param"] <= 5.1


def test_fp32_adamw_costs_16_bytes_per_param():
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    report = fp8lm.memory_report(model, opt)
    n = report["num_params"]
    assert report["weights"] == report["gradients"] == report["exp_avg"] == report["exp_avg_sq"] == 4 * n
    assert report["other"] == 4 * 4  # torch's float32 step counter per parameter
    assert report["bytes_per_param"] == pytest.approx(16, abs=0.01)


def test_shared_storage_is_counted_once():
    a = nn.Linear(16, 16, bias=False)
    b = nn.Linear(16, 16, bias=False)
    b.weight = a.weight  # tied
    c = nn.Linear(16, 16, bias=False)
    base = torch.zeros(2, 16, 16)
    c.weight = nn.Parameter(base[0])
    d = nn.Linear(16, 16, bias=False)
    d.weight = nn.Parameter(base[1])  # two parameters viewing one storage
    report = fp8lm.memory_report(nn.ModuleList([a, b, c, d]))
    assert report["weights"] == 16 * 16 * 4 + base.untyped_storage().nbytes()


def test_scaling_tensors_and_fp8_layer_state_count_as_scales():
    layer = fp8lm.nn.FP8Linear(32, 32, bias=False)
    layer(torch.randn(4, 32)).sum().backward()
    report = fp8lm.memory_report(layer)
    assert report["weights"] == 32 * 32 * 2  # FP16 payload
    assert report["gradients"] == 32 * 32  # E4M3 payload
    metas = [layer.input_meta, layer.grad_output_meta]
    # scale, amax history, last amax (float32); step and rescales (int64)
    meta_bytes = sum(4 * (2 + m.amax_history.numel()) + 8 + 8 for m in metas)
    assert report["scales"] == meta_bytes + 4 + 4  # + weight scale + gradient scale


def test_bad_arguments():
    with pytest.raises(TypeError, match="nn.Module"):
        fp8lm.memory_report(torch.zeros(3))
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        fp8lm.memory_report(nn.Linear(2, 2), optimizer={"state": {}})


def test_peak_memory_follows_storages_until_they_are_freed():
    from fp8lm.memory import PeakMemory

    with PeakMemory("cpu", baseline=100) as peak:
        a = torch.empty(1000)  # 4000 bytes
        del a
        b = torch.empty(500)  # 2000: a's bytes are free again
        b.view(2, 250).add_(1)  # views and in-place ops allocate nothing
        c = fp8lm.quantize(torch.ones(64))  # a temporary 256 (freed) and its payload and scale
    assert peak.peak == 4000 and peak.total == 4100
    del b, c
    x = torch.randn(1000, requires_grad=True)
    with PeakMemory("cpu") as peak:
        y = x * 2  # 4000, kept for sin's backward
        y.sin().sum().backward()  # at most y, cos(y) and the gradient grad * cos(y) at once
    assert 12000 <= peak.peak <= 12016  # and the loss and its gradient


@pytest.mark.parametrize(("recipe", "bytes_per_element"), [("tensorwise-delayed", 1), ("rowwise", 2), ("blockwise", 1)])
def test_kept_weight_operands_are_counted_and_alive_tensors_agree(recipe, bytes_per_element):
    """On an FP8 GEMM backend the FP8 layers keep their weights' GEMM operands between forwards
    (1 byte per element with one scale or square blocks, 2 where the two GEMMs read the weight in
    different blocks): real storage, reported as ``weight_operands``, so the total still equals
    the tensors alive."""

    def build():
        torch.manual_seed(0)
        model = GPT(GPTConfig(n_layer=2, n_embd=128, n_head=4, block_size=64))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        fast = fp8lm.Recipe.from_name(recipe).replace(backend="scaled_mm")  # torch's CPU kernel, or the emulation
        model, opt = fp8lm.initialize(model, opt, "O2", recipe=fast, optimizer_options={"kernel": "eager"})
        idx = torch.randint(0, 256, (2, 64))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(idx, idx)[1].backward()
        opt.step()
        return model, opt

    model, opt, report, alive = _report_and_alive_bytes(build)
    assert alive == report["total"]
    fp8_layers = [m for m in model.modules() if isinstance(m, fp8lm.nn.FP8Linear) and m.fp8_enabled]
    elements = sum(m.weight.numel() for m in fp8_layers)
    assert elements and all(m.kept_operands() for m in fp8_layers)
    # the payloads, and their scales: one per tensor, per row, or per 128 x 128 block
    assert bytes_per_element * elements < report["weight_operands"] < (bytes_per_element + 0.1) * elements
