import pytest
import torch

from fp8lm.train.model import GPT, PRESETS, GPTConfig, preset


def test_forward_shapes_and_loss_of_a_fresh_model_is_near_uniform():
    torch.manual_seed(0)
    model = GPT(PRESETS["tiny"])
    idx = torch.randint(0, 256, (3, 17))
    logits, loss = model(idx, idx)
    assert logits.shape == (3, 17, 256)
    # small init: predictions near uniform over 256 bytes, loss near ln(256)
    assert abs(loss.item() - torch.log(torch.tensor(256.0)).item()) < 0.1
    assert model(idx)[1] is None


def test_causal_the_prefix_does_not_see_the_future():
    torch.manual_seed(0)
    model = GPT(PRESETS["tiny"]).eval()
    idx = torch.randint(0, 256, (1, 20))
    changed = idx.clone()
    changed[0, 10:] = (changed[0, 10:] + 1) % 256
    a, b = model(idx)[0], model(changed)[0]
    torch.testing.assert_close(a[:, :10], b[:, :10])
    assert not torch.allclose(a[:, 10:], b[:, 10:])


@pytest.mark.parametrize("mlp", ["gelu", "swiglu"])
def test_every_linear_of_every_preset_has_dims_multiple_of_16(mlp):
    for name in PRESETS:
        cfg = preset(name, mlp=mlp, n_layer=1)
        for m in GPT(cfg).modules():
            if isinstance(m, torch.nn.Linear):
                assert m.in_features % 16 == 0 and m.out_features % 16 == 0, (name, m)


def test_swiglu_keeps_the_parameter_count_of_a_gelu_mlp_roughly():
    gelu = GPT(preset("small", n_layer=1)).num_params()
    swiglu = GPT(preset("small", n_layer=1, mlp="swiglu")).num_params()
    assert abs(swiglu - gelu) / gelu < 0.02


def test_backward_reaches_every_parameter():
    model = GPT(PRESETS["tiny"])
    idx = torch.randint(0, 256, (2, 8))
    model(idx, idx)[1].backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(n_embd=30, n_head=4), "divisible"),
        (dict(mlp="relu"), "unknown mlp"),
        (dict(n_layer=0), "n_layer"),
        (dict(dropout=1.0), "dropout"),
    ],
)
def test_bad_config_is_a_clear_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GPTConfig(**kwargs)


def test_unknown_preset_and_too_long_sequence():
    with pytest.raises(ValueError, match="unknown model preset 'huge'"):
        preset("huge")
    model = GPT(PRESETS["tiny"])
    with pytest.raises(ValueError, match="exceeds the model's block_size"):
        model(torch.zeros(1, PRESETS["tiny"].block_size + 1, dtype=torch.long))


def test_config_round_trips_through_a_dict():
    cfg = preset("small", mlp="swiglu")
    assert GPTConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="unknown GPTConfig fields"):
        GPTConfig.from_dict({**cfg.to_dict(), "n_experts": 8})
