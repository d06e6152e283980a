import io

import pytest
import torch
from torch import nn

import fp8lm
from fp8lm import ScalingTensor
from fp8lm.nn import FP8Linear
from fp8lm.optim import FP8Adam, FP8AdamW
from fp8lm.train.model import GPT, GPTConfig

EAGER = {"optimizer_options": {"kernel": "eager"}}


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, 32)
        self.fc = nn.Linear(32, 64)
        self.norm = nn.LayerNorm(64)
        self.out = nn.Linear(64, 32)
        self.odd = nn.Linear(32, 3)

    def forward(self, idx):
        h = self.out(torch.relu(self.norm(self.fc(self.emb(idx)))))
        return self.odd(h).sum() + h.square().mean()


def net_and_adamw(seed=0, **kw):
    torch.manual_seed(seed)
    model = Net()
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0, "lr": 5e-4}],
        lr=1e-3,
        betas=(0.8, 0.99),
        eps=1e-7,
        **kw,
    )
    return model, opt


def snapshot(model):
    return [(n, type(m), id(m)) for n, m in model.named_modules()], [id(p) for p in model.parameters()]


def train_steps(model, opt, steps=3):
    idx = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(0))
    for _ in range(steps):
        model(idx).backward()
        opt.step()
        opt.zero_grad()


def test_o1_converts_linears_and_repoints_the_same_optimizer():
    model, opt = net_and_adamw()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    groups_before = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    model2, opt2 = fp8lm.initialize(model, opt, "O1")
    assert model2 is model and opt2 is opt
    assert isinstance(model.fc, FP8Linear) and isinstance(model.out, FP8Linear)
    assert type(model.odd) is nn.Linear  # 3 outputs: not a multiple of 16
    assert [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] == groups_before
    owned = {id(p) for p in model.parameters()}
    assert all(id(p) in owned for g in opt.param_groups for p in g["params"])
    assert sum(len(g["params"]) for g in opt.param_groups) == len(owned)
    # O1 keeps FP32 weights (torch's AdamW updates them as ever); their gradients are E4M3
    assert not any(isinstance(p, ScalingTensor) for p in model.parameters())
    assert model.fc.weight.dtype == torch.float32

    before = model.fc.weight.detach().clone()
    idx = torch.randint(0, 64, (4, 8))
    model(idx).backward()
    assert isinstance(model.fc.weight.grad, ScalingTensor) and model.fc.weight.grad.payload.dtype == torch.float8_e4m3fn
    opt.step()
    sched.step()
    assert not torch.equal(model.fc.weight, before)
    assert opt.param_groups[0]["lr"] == pytest.approx(5e-4)


def test_o2_replaces_adamw_keeping_hyperparameters_and_groups():
    model, opt = net_and_adamw()
    model, opt2 = fp8lm.initialize(model, opt, "O2", **EAGER)
    assert isinstance(opt2, FP8AdamW)
    assert [g["weight_decay"] for g in opt2.param_groups] == [0.1, 0.0]
    assert [g["lr"] for g in opt2.param_groups] == [1e-3, 5e-4]
    assert all(g["betas"] == (0.8, 0.99) and g["eps"] == 1e-7 for g in opt2.param_groups)
    assert opt2.param_groups[0]["exp_avg_dtype"] == "E4M3" and opt2.param_groups[0]["exp_avg_sq_dtype"] == "FP16"
    owned = {id(p) for p in model.parameters()}
    assert {id(p) for g in opt2.param_groups for p in g["params"]} == owned
    # every matrix, the embedding included, has an FP16 scaled weight; 1-D ones stay FP32
    for name, p in model.named_parameters():
        if p.dim() >= 2 and name != "odd.weight":
            assert isinstance(p, ScalingTensor) and p.payload.dtype == torch.float16, name
        elif p.dim() == 1:
            assert type(p) is nn.Parameter, name
    model(torch.randint(0, 64, (4, 8))).backward()
    assert isinstance(model.emb.weight.grad, ScalingTensor)  # FP8 gradient through the policy's hook
    assert model.emb.weight.grad.payload.dtype == torch.float8_e4m3fn
    before = model.emb.weight.dequantize().clone()
    opt2.step()
    assert not torch.equal(model.emb.weight.dequantize(), before)
    train_steps(model, opt2)


def test_o2_maps_adam_to_fp8adam():
    torch.manual_seed(0)
    model = Net()
    _, opt = fp8lm.initialize(model, torch.optim.Adam(model.parameters(), lr=2e-3, weight_decay=1e-4), "O2", **EAGER)
    assert type(opt) is FP8Adam and opt.param_groups[0]["weight_decay"] == 1e-4
    train_steps(model, opt)


def test_o3_stores_fp8_weights_with_fp16_master():
    model, opt = net_and_adamw()
    model, opt = fp8lm.initialize(model, opt, "O3", **EAGER)
    assert model.fc.weight.payload.dtype == torch.float8_e4m3fn
    assert opt.param_groups[0]["master_dtype"] == "FP16"
    train_steps(model, opt, steps=2)
    assert opt.state[model.fc.weight]["master"].dtype == torch.float16


def test_policy_override_keeps_a_layer_in_high_precision():
    model, opt = net_and_adamw()
    policy = {"out": {"fp8_gemm": False, "weight": "FP32", "grad": "FP32"}}
    model, opt = fp8lm.initialize(model, opt, "O2", policy=policy, **EAGER)
    assert not model.out.fp8_enabled and model.fc.fp8_enabled
    assert type(model.out.weight) is nn.Parameter
    model(torch.randint(0, 64, (4, 8))).backward()
    assert type(model.out.weight.grad) is torch.Tensor
    with pytest.raises(ValueError, match="is for O1 but opt_level is O2"):
        fp8lm.initialize(Net(), None, "O2", policy=fp8lm.policy.preset("O1"))


def test_module_filter_and_no_optimizer():
    model = Net()
    model, opt = fp8lm.initialize(model, opt_level="O1", module_filter=lambda name, m: name == "out")
    assert opt is None and isinstance(model.out, FP8Linear) and type(model.fc) is nn.Linear


def test_checkpoint_of_initialized_model_loads_into_plain_model():
    model, opt = net_and_adamw()
    model, opt = fp8lm.initialize(model, opt, "O2", **EAGER)
    train_steps(model, opt, steps=1)
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    buf.seek(0)
    plain = Net()
    plain.load_state_dict(torch.load(buf, weights_only=True))
    assert torch.equal(plain.emb.weight, model.emb.weight.dequantize())
    again = fp8lm.initialize(Net(), opt_level="O2")[0]
    again.load_state_dict(plain.state_dict())
    assert torch.equal(again.fc.weight.dequantize(), model.fc.weight.dequantize())


@pytest.mark.parametrize("level", ["O0", "o1", "O4", 2, None])
def test_unknown_opt_level(level):
    model = Net()
    with pytest.raises(ValueError, match="valid levels are O1, O2, O3"):
        fp8lm.initialize(model, None, level)


def assert_unchanged(model, opt, before, groups):
    assert snapshot(model) == before
    assert [[id(p) for p in g["params"]] for g in opt.param_groups] == groups


@pytest.mark.parametrize(
    "case", ["foreign", "twice_o2", "sgd_o2", "amsgrad_o2", "stepped_o2", "bad_policy", "tensor_lr"]
)
def test_bad_input_leaves_model_and_optimizer_untouched(case):
    model, opt = net_and_adamw(amsgrad=case == "amsgrad_o2")
    level, options, match = "O2", dict(EAGER), None
    if case == "foreign":
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(7, 3))]})
        level, match = "O1", "not in the model.*\\(7, 3\\)"
    elif case == "twice_o2":
        fp8lm.initialize(model, opt, "O1")
        match = "already initialized"
    elif case == "sgd_o2":
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        match = "got SGD"
    elif case == "amsgrad_o2":
        match = "amsgrad"
    elif case == "stepped_o2":
        train_steps(model, opt, steps=1)
        match = "fresh optimizer"
    elif case == "bad_policy":
        options["policy"] = {"fc": {"wieght": "FP32"}}
        match = "unknown precision field"
    elif case == "tensor_lr":
        opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-3))
        match = "float lr"
    before = snapshot(model)
    groups = [[id(p) for p in g["params"]] for g in opt.param_groups]
    with pytest.raises(ValueError, match=match):
        fp8lm.initialize(model, opt, level, **options)
    assert_unchanged(model, opt, before, groups)


@pytest.mark.slow  # a GPT trained twice
def test_gpt_o1_trains_like_fp32():
    """Short smoke run on the project's GPT (the 200-step comparison is tests/test_convergence.py)."""
    cfg = GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=32)
    with open(fp8lm.policy.__file__, "rb") as f:  # some real text: this package's own source
        text = torch.tensor(list(f.read()[:20000]), dtype=torch.long)
    g = torch.Generator().manual_seed(0)
    starts = torch.randint(0, text.numel() - 33, (40, 8), generator=g)
    losses = {}
    for level in ("fp32", "O1"):
        torch.manual_seed(0)
        model = GPT(cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        if level == "O1":
            model, opt = fp8lm.initialize(model, opt, "O1")
            assert sum(isinstance(m, FP8Linear) for m in model.modules()) == 4 * cfg.n_layer + 1
        for s in starts:
            x = torch.stack([text[i : i + 32] for i in s])
            y = torch.stack([text[i + 1 : i + 33] for i in s])
            _, loss = model(x, y)
            loss.backward()
            fp8lm.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
        losses[level] = loss.item()
    assert losses["O1"] < 3.5  # from ln(256) = 5.5 at the start
    assert abs(losses["O1"] - losses["fp32"]) / losses["fp32"] < 0.05


def test_state_formats_in_optimizer_options_point_to_the_policy():
    """Under O2 the policy sets the optimizer's state formats per parameter: a format passed in
    optimizer_options would be overridden, so it is refused with the way to ask for it."""
    model = nn.Sequential(nn.Linear(32, 32))
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(ValueError, match=r"policy=\{'\*': \{'exp_avg_sq': 'E4M3'\}\}"):
        fp8lm.initialize(model, opt, "O2", optimizer_options={"exp_avg_sq_dtype": "E4M3"})
    assert isinstance(model[0], nn.Linear)  # nothing changed
    model, opt = fp8lm.initialize(model, opt, "O2", policy={"*": {"exp_avg_sq": "E4M3"}})
    x = torch.randn(4, 32)
    model(x).sum().backward()
    opt.step()
    assert opt.state[model[0].weight]["exp_avg_sq"].dtype == torch.float8_e4m3fn


class Conv1D(nn.Module):
    """GPT-2's layer layout (weight (in, out), ``nf`` outputs), under the class name fp8lm looks for."""

    def __init__(self, nf, nx):
        super().__init__()
        self.nf, self.weight, self.bias = nf, nn.Parameter(torch.randn(nx, nf) * 0.1), nn.Parameter(torch.rand(nf))

    def forward(self, x):
        return x @ self.weight + self.bias


@pytest.mark.parametrize("level", ["O1", "O2"])
@pytest.mark.parametrize("layer", ["linear", "conv1d"])
@pytest.mark.parametrize("with_optimizer", [False, True])
def test_a_model_that_is_itself_a_linear_layer_is_converted_and_returned(level, layer, with_optimizer):
    torch.manual_seed(0)
    model = nn.Linear(32, 48) if layer == "linear" else Conv1D(48, 32)
    x = torch.randn(8, 32)
    expected = model(x).detach()
    weight_before = model.weight.detach().clone()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2) if with_optimizer else None
    options = EAGER if with_optimizer and level == "O2" else {}
    new, new_opt = fp8lm.initialize(model, opt, level, **options)
    assert isinstance(new, FP8Linear) and new is not model
    assert type(model.weight) is nn.Parameter and torch.equal(model.weight, weight_before)  # the old one untouched
    out = new(x)
    assert (out - expected).norm() / expected.norm() < 0.05  # FP8 GEMM of the same weights (E4M3: 2^-4 steps)
    with pytest.raises(ValueError, match="already initialized"):
        fp8lm.initialize(new, None, level)
    if not with_optimizer:
        assert new_opt is None
        return
    assert new_opt is opt if level == "O1" else isinstance(new_opt, FP8AdamW)
    assert {id(p) for g in new_opt.param_groups for p in g["params"]} == {id(p) for p in new.parameters()}
    out.square().mean().backward()
    new_opt.step()
    assert not torch.equal(new.weight.detach(), FP8Linear.from_linear(model).weight.detach())


def test_replacing_the_model_together_with_its_submodules_is_refused():
    model = nn.Sequential(nn.Linear(16, 16))
    with pytest.raises(KeyError, match="either the model or its submodules"):
        fp8lm.nn.replace_modules(model, {"": FP8Linear(16, 16), "0": FP8Linear(16, 16)})
    assert type(model[0]) is nn.Linear


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_the_output_head_runs_bf16_gemms_and_stores_its_weight_gradient_in_bf16(level):
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_embd=32, n_head=2, block_size=16))
    assert fp8lm.nn.output_head(model) == "lm_head"
    model, opt = fp8lm.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), level)
    idx = torch.randint(0, 256, (2, 16))
    model(idx, idx)[1].backward()
    head_grad = model.lm_head.weight.grad
    assert not model.lm_head.fp8_enabled and model.lm_head.weight_grad_format == fp8lm.BF16
    assert isinstance(head_grad, ScalingTensor) and head_grad.payload.dtype == torch.bfloat16
    other = model.blocks[0].mlp.c_fc
    assert other.weight_grad_format == fp8lm.E4M3 and other.weight.grad.payload.dtype == torch.float8_e4m3fn
    # without the rule the head is like every linear layer
    plain, _ = fp8lm.initialize(
        GPT(GPTConfig(n_layer=1, n_embd=32, n_head=2, block_size=16)),
        None,
        level,
        policy=fp8lm.policy.preset(level, output_head=False),
    )
    assert plain.lm_head.weight_grad_format == fp8lm.E4M3 and plain.lm_head.fp8_enabled


def test_output_head_is_the_last_linear_layer():
    assert fp8lm.nn.output_head(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2), nn.LayerNorm(2))) == "2"
    assert fp8lm.nn.output_head(nn.Sequential(nn.ReLU())) is None
    assert fp8lm.nn.output_head(nn.Linear(4, 4)) is None  # the model itself is not its own head
