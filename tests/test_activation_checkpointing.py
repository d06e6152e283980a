"""Activation checkpointing with FP8 layers (`fp8lm.nn.checkpoint`, `GPT.checkpoint_blocks`): the
recomputed forward gives bit-identical tensors, the delayed scaling state advances once per
forward, and training with none, selective or full checkpointing is the same training, bit for bit."""

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint
from torch.utils.checkpoint import set_checkpoint_early_stop

import fp8lm
from fp8lm.nn import FP8Linear, scaling_state_dict
from fp8lm.nn.checkpoint import checkpoint, is_recomputing
from fp8lm.nn.saved import SAVING_MODULES
from fp8lm.train import model as model_module
from fp8lm.train.measure import saved_tensor_bytes
from fp8lm.train.model import GPT, preset


def build(arch="gpt", activations="fp8", mode="none", n_layer=2):
    torch.manual_seed(0)
    model = GPT(preset("tiny", arch=arch, vocab_size=256, block_size=32, n_layer=n_layer))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = fp8lm.initialize(model, opt, "O2", activations=activations)
    model.checkpoint_blocks(mode)
    return model, opt


def batches(n):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 256, (4, 32), generator=g) for _ in range(n)]


def train(model, opt, steps=3):
    """Losses and, per step, every gradient's bytes (payload and scale of the FP8 ones)."""
    losses, grads = [], []
    for idx in batches(steps):
        with torch.autocast("cpu", torch.bfloat16):
            loss = model(idx, idx)[1]
        loss.backward()
        losses.append(loss.detach())
        grads.append([g.clone() for p in model.parameters() for g in _parts(p.grad)])
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses, grads


def _parts(t):
    return (t.payload, t.scale) if isinstance(t, fp8lm.ScalingTensor) else (t,)


def same(a, b) -> bool:
    return len(a) == len(b) and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize(("arch", "mode"), [("gpt", "full"), ("gpt", "selective"), ("llama", "full")])
def test_checkpointed_training_is_the_same_training_bit_for_bit(arch, mode):
    plain, plain_opt = build(arch)
    ckpt, ckpt_opt = build(arch, mode=mode)
    losses, grads = train(plain, plain_opt)
    losses_ckpt, grads_ckpt = train(ckpt, ckpt_opt)
    assert same(losses, losses_ckpt)
    assert all(same(a, b) for a, b in zip(grads, grads_ckpt))
    assert same(list(plain.state_dict().values()), list(ckpt.state_dict().values()))
    # one amax recorded per forward: the delayed scaling histories and scales are the plain run's
    states, states_ckpt = scaling_state_dict(plain), scaling_state_dict(ckpt)
    assert states.keys() == states_ckpt.keys()
    for key in states:
        assert all(torch.equal(states[key][k], states_ckpt[key][k]) for k in states[key]), key
    fp8_layers = [m for m in ckpt.modules() if isinstance(m, FP8Linear) and m.fp8_enabled]
    assert fp8_layers and all(int(m.input_meta.step) == int(m.grad_output_meta.step) == 3 for m in fp8_layers)


def _record_outputs(model):
    """Every FP8 layer's and FP8-saving module's output, with whether it was a recomputation."""
    records = []
    for name, m in model.named_modules():
        if isinstance(m, (FP8Linear, *SAVING_MODULES)):
            m.register_forward_hook(lambda m, a, out, name=name: records.append((name, is_recomputing(), out.clone())))
    return records


def test_the_recomputation_gives_the_forwards_tensors_bit_for_bit():
    model, opt = build(mode="full")
    train(model, opt, steps=2)  # delayed scaling with history: the scale now comes from earlier steps
    records = _record_outputs(model)
    (idx,) = batches(1)
    # the whole region recomputed (by default it stops once the last saved tensor is back)
    with torch.autocast("cpu", torch.bfloat16), set_checkpoint_early_stop(False):
        model(idx, idx)[1].backward()
    forward = {name: out for name, again, out in records if not again}
    again = [(name, out) for name, was, out in records if was]
    in_blocks = {name for name in forward if name.startswith("blocks.")}
    assert {name for name, _ in again} == in_blocks and len(again) == len(in_blocks)
    for name, out in again:
        assert out.dtype == forward[name].dtype and torch.equal(out, forward[name]), name


def test_without_the_scaling_contexts_the_recomputation_would_differ(monkeypatch):
    """What the test above guards against: torch's plain checkpoint recomputes with the scale the
    forward recorded (the next one) and records the same step's amax twice."""

    def plain_checkpoint(fn, *args, scaling=None):
        return torch_checkpoint(fn, *args, use_reentrant=False)

    monkeypatch.setattr(model_module, "checkpoint", plain_checkpoint)
    model, opt = build(mode="full")
    train(model, opt, steps=2)
    counts = {int(m.step) for n, m in model.named_modules() if n.startswith("blocks.") and n.endswith("input_meta")}
    assert counts == {4}  # two amaxes per forward


def test_checkpointing_keeps_only_the_block_inputs():
    idx = batches(1)[0]
    sizes = {}
    for mode in ("none", "selective", "full"):
        model, _ = build(mode=mode, n_layer=4)
        with torch.autocast("cpu", torch.bfloat16):
            sizes[mode] = saved_tensor_bytes(lambda m=model: m(idx, idx)[1], exclude=model.parameters())
    assert sizes["full"] < sizes["selective"] < sizes["none"]
    per_block_none = (sizes["none"] - sizes["full"]) / 4
    assert sizes["selective"] == pytest.approx(sizes["full"] + 2 * per_block_none, rel=0.02)


def test_evaluation_does_not_checkpoint_and_a_function_needs_its_modules():
    model, _ = build(mode="full")
    idx = batches(1)[0]
    with torch.no_grad():
        assert model(idx)[0].shape == (4, 32, 256)
    with pytest.raises(TypeError, match="pass scaling="):
        checkpoint(lambda x: x * 2, torch.ones(2, requires_grad=True))
    with pytest.raises(ValueError, match="unknown activation checkpointing 'some'"):
        model.checkpoint_blocks("some")
    layer = nn.Linear(16, 16)
    x = torch.randn(2, 16, requires_grad=True)
    assert torch.equal(checkpoint(layer, x), layer(x))


def test_telemetry_records_each_layer_once_under_checkpointing():
    model, opt = build(mode="full")
    telemetry = fp8lm.telemetry.Telemetry(model, opt, every=1)
    (idx,) = batches(1)
    with telemetry.step(0), torch.autocast("cpu", torch.bfloat16):
        model(idx, idx)[1].backward()
    records = telemetry.after_backward()
    inputs = [(r["layer"], r["kind"]) for r in records if r["kind"] in ("input", "weight", "grad_output")]
    assert inputs and len(inputs) == len(set(inputs))


@pytest.mark.slow  # two fullgraph compiles of the model (about a minute each on 2 cores)
def test_compiled_checkpointing_with_current_scaling_trains_as_eager_and_delayed_is_refused():
    def build_compiled(recipe):
        torch.manual_seed(0)
        model = GPT(preset("tiny", vocab_size=256, block_size=32))
        model.checkpoint_blocks("full")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        return fp8lm.initialize(model, opt, "O2", recipe=recipe, activations="fp8")

    torch._dynamo.reset()
    eager, eager_opt = build_compiled("tensorwise-current")
    model, opt = build_compiled("tensorwise-current")
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    assert same(train(compiled, opt)[0], train(eager, eager_opt)[0])
    torch._dynamo.reset()
    model, opt = build_compiled("tensorwise-delayed")
    with pytest.raises(Exception, match="recomputes delayed-scaled FP8 layers"):
        train(torch.compile(model, fullgraph=True, backend="aot_eager"), opt, steps=1)
