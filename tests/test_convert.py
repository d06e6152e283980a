import io

import pytest
import torch
from torch import nn

import fp8lm
from fp8lm import Recipe, ScalingTensor
from fp8lm.nn import (
    FP8Linear,
    convert_linears,
    linear_targets,
    load_scaling_state_dict,
    replace_modules,
    scaling_state_dict,
)


class Conv1D(nn.Module):
    """Stand-in with the layout of transformers.pytorch_utils.Conv1D (weight (in, out))."""

    def __init__(self, nf, nx):
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.02)
        self.bias = nn.Parameter(torch.zeros(nf))

    def forward(self, x):
        return torch.addmm(self.bias, x.reshape(-1, x.size(-1)), self.weight).view(*x.shape[:-1], self.nf)


class TinyLM(nn.Module):
    """Tied embedding / output head (like nanoGPT), a Conv1D, a layer with odd dims, an MHA."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(256, 64)
        self.attn = nn.MultiheadAttention(64, 4, batch_first=True)
        self.c_fc = Conv1D(128, 64)
        self.proj = nn.Linear(128, 64)
        self.odd = nn.Linear(64, 10)
        self.head = nn.Linear(64, 256, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx):
        h = self.emb(idx)
        h = h + self.attn(h, h, h, need_weights=False)[0]
        h = h + self.proj(torch.relu(self.c_fc(h)))
        return self.head(h), self.odd(h)


def make_pair():
    torch.manual_seed(0)
    model = TinyLM()
    ref = TinyLM()
    ref.load_state_dict(model.state_dict())
    return model, ref


def test_targets_skip_odd_dims_subclasses_and_filtered():
    model, _ = make_pair()
    assert linear_targets(model) == ["c_fc", "proj", "head"]  # not odd (10 outputs), not attn.out_proj
    assert linear_targets(model, lambda name, m: name != "head") == ["c_fc", "proj"]
    assert linear_targets(model, multiple_of=2) == ["c_fc", "proj", "odd", "head"]
    with pytest.raises(ValueError, match="multiple_of"):
        linear_targets(model, multiple_of=0)


def test_convert_keeps_ties_values_and_checkpoint_format():
    model, ref = make_pair()
    keys = list(ref.state_dict())
    new = convert_linears(model)
    assert set(new) == {"c_fc", "proj", "head"}
    assert all(isinstance(getattr(model, n), FP8Linear) for n in new)
    assert type(model.odd) is nn.Linear
    assert model.head.weight is model.emb.weight and isinstance(model.emb.weight, ScalingTensor)
    assert len(list(model.parameters())) == len(list(ref.parameters()))

    sd = model.state_dict()
    assert list(sd) == keys
    assert all(type(v) is torch.Tensor for v in sd.values())
    for k, v in ref.state_dict().items():
        assert v.shape == sd[k].shape
        torch.testing.assert_close(sd[k], v, rtol=2**-11, atol=0)  # FP16 storage of the weights

    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    plain = TinyLM()
    plain.load_state_dict(torch.load(buf, weights_only=True))
    model.load_state_dict(ref.state_dict())
    torch.testing.assert_close(model.state_dict()["c_fc.weight"], ref.c_fc.weight, rtol=2**-11, atol=0)

    idx = torch.randint(0, 256, (2, 16))
    (logits, odd), (ref_logits, ref_odd) = model(idx), ref(idx)
    assert odd.shape == ref_odd.shape
    rel = (logits - ref_logits).norm() / ref_logits.norm()
    assert rel < 0.1
    (logits.sum() + odd.sum()).backward()
    assert isinstance(model.c_fc.weight.grad, ScalingTensor)
    assert model.emb.weight.grad is not None


@pytest.mark.parametrize("bias", [True, False])
def test_fp8_linear_registers_weight_then_bias_like_nn_linear(bias):
    torch.manual_seed(0)
    ref = nn.Linear(32, 16, bias=bias)
    torch.manual_seed(0)
    layer = FP8Linear(32, 16, bias=bias)
    assert [n for n, _ in layer.named_parameters()] == [n for n, _ in ref.named_parameters()]
    assert list(layer.state_dict()) == list(ref.state_dict())
    for (name, p), q in zip(layer.named_parameters(), ref.parameters()):  # same draws in the same order
        torch.testing.assert_close(p.detach().float(), q.detach(), rtol=2**-11, atol=0, msg=name)


@pytest.mark.parametrize("opt_level", ["O1", "O2", "O3"])
def test_initialize_keeps_parameter_and_state_dict_order(opt_level):
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32, bias=False), nn.LayerNorm(32), nn.Linear(32, 16)
    )
    names, keys = [n for n, _ in model.named_parameters()], list(model.state_dict())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = fp8lm.initialize(model, optimizer, opt_level=opt_level)
    assert isinstance(model[0], FP8Linear) and isinstance(model[4], FP8Linear)
    assert [n for n, _ in model.named_parameters()] == names
    assert list(model.state_dict()) == keys
    assert [id(p) for g in optimizer.param_groups for p in g["params"]] == [id(p) for p in model.parameters()]


def test_converting_twice_changes_nothing():
    model, _ = make_pair()
    convert_linears(model)
    params = [id(p) for p in model.parameters()]
    assert convert_linears(model) == {}
    assert [id(p) for p in model.parameters()] == params


def test_module_registered_twice_is_swapped_everywhere():
    shared = nn.Linear(32, 32)
    model = nn.ModuleDict({"a": shared, "b": nn.Sequential(shared)})
    convert_linears(model)
    assert isinstance(model["a"], FP8Linear) and model["b"][0] is model["a"]


def test_replace_unknown_name_changes_nothing():
    model, _ = make_pair()
    before = dict(model.named_modules())
    with pytest.raises(KeyError, match="nope"):
        replace_modules(model, {"proj": FP8Linear(128, 64), "nope": FP8Linear(16, 16)})
    assert dict(model.named_modules()) == before


def test_scaling_state_round_trip():
    model, _ = make_pair()
    convert_linears(model, recipe=Recipe(history_len=4))
    model(torch.randint(0, 256, (2, 16)))[0].sum().backward()
    state = scaling_state_dict(model)
    assert set(state) == {f"{n}.{m}" for n in ("c_fc", "proj", "head") for m in ("input_meta", "grad_output_meta")}
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    other, _ = make_pair()
    convert_linears(other, recipe=Recipe(history_len=4))
    load_scaling_state_dict(other, torch.load(buf, weights_only=True))
    assert torch.equal(other.proj.input_meta.amax_history, model.proj.input_meta.amax_history)
    assert other.proj.input_meta.step == 1

    short, _ = make_pair()
    convert_linears(short, recipe=Recipe(history_len=2))
    with pytest.raises(ValueError, match="history_len"):
        load_scaling_state_dict(short, state)
    with pytest.raises(ValueError, match="missing"):
        load_scaling_state_dict(other, {k: v for k, v in state.items() if not k.startswith("head")})


def test_deepcopy_and_pickle_keep_trainable_fp8_parameters():
    import copy

    model, _ = make_pair()
    convert_linears(model)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    for clone in (copy.deepcopy(model), torch.load(buf, weights_only=False)):
        assert clone.head.weight is clone.emb.weight  # still tied
        for p in clone.parameters():
            assert isinstance(p, nn.Parameter) and p.requires_grad
        clone(torch.randint(0, 256, (2, 8)))[0].sum().backward()
        assert isinstance(clone.proj.weight.grad, ScalingTensor)
        assert torch.equal(clone.proj.weight.payload, model.proj.weight.payload)


def test_a_layer_left_unconverted_for_its_dims_is_named_in_one_warning():
    import warnings

    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 50257))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fp8lm.initialize(model, opt_level="O1")
    messages = [str(w.message) for w in caught if "high precision" in str(w.message)]
    assert messages == [
        "fp8lm: linear layer '1' (32x50257) stays in high precision: FP8 GEMMs need in and out features that are "
        "multiples of 16; pad it (e.g. a vocabulary of 50257 to 50304) to train it in FP8"
    ]
    assert isinstance(model[0], FP8Linear) and type(model[1]) is nn.Linear
