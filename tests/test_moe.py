"""The mixture of experts: routing, load-balancing loss, the MoE layer against a per-token
reference, the GPT and llama models with experts, and training them with the app."""

import math
import shutil
import sysconfig
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fp8lm
from fp8lm.nn import FP8GroupedLinear, MoE
from fp8lm.nn.moe import load_balance, load_balance_loss, route
from fp8lm.train.config import RunError, TrainConfig
from fp8lm.train.loop import train
from fp8lm.train.model import GPT, GPTConfig
from fp8lm.train.report import read_metrics

EMAIL = str(Path(sysconfig.get_paths()["stdlib"]) / "email")
TINY = dict(model="tiny", batch_size=4, seq_len=32, eval_every=4, eval_batches=2, progress=False, lr=1e-2, data=EMAIL)
MOE = dict(moe_experts=4, moe_top_k=2)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("tokens"))


def cfg(tmp_path, cache, **kw):
    return TrainConfig(**{**TINY, **MOE, "out": str(tmp_path / "run"), "cache_dir": cache, **kw})


@pytest.mark.parametrize("router", ["softmax", "sigmoid"])
def test_route_against_a_float64_reference(router):
    torch.manual_seed(0)
    logits = torch.randn(50, 6)
    weights, experts, probs = route(logits, 2, router)
    scores = logits.double().softmax(-1) if router == "softmax" else logits.double().sigmoid()
    for t in range(50):
        order = sorted(range(6), key=lambda e: -scores[t, e].item())[:2]
        assert experts[t].tolist() == order
        chosen = scores[t, order]
        torch.testing.assert_close(weights[t].double(), chosen / chosen.sum(), rtol=1e-6, atol=1e-7)
    expected = scores if router == "softmax" else scores / scores.sum(-1, keepdim=True)
    torch.testing.assert_close(probs.double(), expected, rtol=1e-6, atol=1e-7)
    one, _, _ = route(logits, 1, router)  # top-1: the probability itself, so the loss trains the router
    torch.testing.assert_close(one.double().squeeze(1), scores.max(-1).values, rtol=1e-6, atol=1e-7)


def test_load_balance_loss_is_one_when_uniform_and_e_when_collapsed():
    uniform = torch.full((8, 4), 0.25)
    experts = torch.arange(8).remainder(4).reshape(8, 1)
    assert load_balance_loss(uniform, experts).item() == pytest.approx(1.0)
    collapsed = torch.tensor([[1.0, 0.0, 0.0, 0.0]]).repeat(8, 1)
    assert load_balance_loss(collapsed, torch.zeros(8, 2, dtype=torch.long)).item() == pytest.approx(4.0)
    torch.manual_seed(1)
    probs = torch.randn(10, 4).softmax(-1)
    chosen = probs.topk(2).indices
    share = torch.tensor([(chosen == e).sum().item() / 20 for e in range(4)], dtype=torch.float64)
    ref = 4 * (share * probs.double().mean(0)).sum()
    assert load_balance_loss(probs, chosen).item() == pytest.approx(ref.item(), rel=1e-6)


def test_load_balance_summary():
    assert load_balance(torch.tensor([5, 5, 5, 5])) == {"max_over_mean": 1.0, "cv": 0.0}
    skewed = load_balance(torch.tensor([8, 0, 0, 0]))
    assert skewed["max_over_mean"] == 4.0 and skewed["cv"] == pytest.approx(math.sqrt(3))


@pytest.mark.parametrize(("activation", "shared"), [("gelu", False), ("swiglu", True)])
def test_moe_matches_a_per_token_reference(activation, shared):
    torch.manual_seed(2)
    shared_expert = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)) if shared else None
    layer = MoE(16, 32, 4, 2, activation=activation, shared_expert=shared_expert)
    x = torch.randn(3, 5, 16)
    y = layer(x)
    weights, experts, _ = route(layer.router(x.reshape(-1, 16)), 2)

    def expert(e, v):
        h = v @ layer.c_fc.weight[e].t()
        h = F.gelu(h) if activation == "gelu" else F.silu(h.chunk(2)[0]) * h.chunk(2)[1]
        return h @ layer.c_proj.weight[e].t()

    for t, v in enumerate(x.reshape(-1, 16)):
        ref = sum(weights[t, j] * expert(experts[t, j].item(), v) for j in range(2))
        if shared:
            ref = ref + shared_expert(v)
        torch.testing.assert_close(y.reshape(-1, 16)[t], ref, rtol=1e-5, atol=1e-6)
    assert layer.take_routed().sum().item() == 15 * 2 and layer.routed.sum().item() == 0
    aux = layer.take_aux_loss()
    assert aux is not None and layer.take_aux_loss() is None
    y.sum().backward()
    assert layer.router.weight.grad is not None and layer.router.weight.grad.abs().sum() > 0
    layer.eval()
    layer(x)
    assert layer.aux_loss is None and layer.routed.sum().item() == 0  # evaluation neither counts nor keeps it


def test_capacity_drops_the_slots_beyond_it_first_tokens_first():
    torch.manual_seed(6)
    layer = MoE(16, 32, 4, 2, capacity_factor=0.5)
    with torch.no_grad():
        layer.router.weight[0] += 2.0 * layer.router.weight[1]  # a skewed router: some experts overflow
    x = torch.randn(15, 16)
    y = layer(x)
    weights, experts, _ = route(layer.router(x), 2)
    capacity = math.ceil(0.5 * 30 / 4)
    taken, ref = [0] * 4, torch.zeros(15, 16)
    for t in range(15):
        for j in range(2):
            e = experts[t, j].item()
            if taken[e] < capacity:
                taken[e] += 1
                h = F.gelu(x[t] @ layer.c_fc.weight[e].t())
                ref[t] += weights[t, j] * (h @ layer.c_proj.weight[e].t())
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-6)
    dropped = 30 - sum(taken)
    assert dropped > 0 and int(layer.dropped) == dropped
    assert int(layer.take_routed().sum()) == 30 and int(layer.dropped) == 0  # routed counts the dropped too
    with pytest.raises(ValueError, match="capacity_factor must be a finite number > 0"):
        MoE(16, 32, 4, 2, capacity_factor=0.0)


def test_moe_config_checks():
    with pytest.raises(ValueError, match="moe_top_k must be in \\[1, moe_experts=4\\], got 5"):
        GPTConfig(moe_experts=4, moe_top_k=5)
    with pytest.raises(ValueError, match="unknown moe_router 'relu'"):
        GPTConfig(moe_experts=4, moe_router="relu")
    with pytest.raises(ValueError, match="moe_experts must be >= 0"):
        GPTConfig(moe_experts=-1)
    assert GPTConfig.from_dict(GPTConfig(moe_experts=4).to_dict()).moe_experts == 4


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_moe_gpt_converts_every_expert_and_adds_the_aux_loss(arch):
    torch.manual_seed(3)
    model = GPT(GPTConfig(block_size=16, n_layer=2, n_head=2, n_embd=32, arch=arch, moe_experts=4, moe_top_k=2))
    assert all(isinstance(b.mlp, MoE) for b in model.blocks)
    kind = nn.GELU if arch == "gpt" else fp8lm.nn.SwiGLU
    assert isinstance(model.blocks[0].mlp.act, kind)
    idx = torch.randint(0, 256, (2, 16))
    model.eval()
    _, ce = model(idx, idx)
    model.train()
    _, loss = model(idx, idx)
    aux = model.moe_aux_loss
    assert aux is not None and aux.item() >= 1.0 - 1e-6  # its minimum is 1 (a uniform load)
    assert loss.item() == pytest.approx(ce.item() + 0.01 * aux.item(), rel=1e-5)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = fp8lm.initialize(model, opt, "O2")
    grouped = [m for m in model.modules() if isinstance(m, FP8GroupedLinear)]
    assert len(grouped) == 4 and all(m.fp8_enabled for m in grouped)
    assert all(isinstance(w, fp8lm.ScalingTensor) for m in grouped for w in m.weight)


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_tiny_moe_trains_at_bf16_and_o2(tmp_path, cache, arch):
    for level in ("bf16", "O2"):
        out = tmp_path / f"{arch}-{level}"
        s = train(cfg(tmp_path, cache, opt_level=level, arch=arch, steps=12, out=str(out), telemetry_every=6))
        records = read_metrics(out / "metrics.jsonl")
        losses = [r["train_loss"] for r in records]
        assert all(math.isfinite(v) for v in losses) and math.isfinite(s["val_loss"])
        assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.3
        tokens = 4 * 32 * 2 * 2  # tokens x top-k x blocks
        assert all(sum(r["moe_tokens_per_expert"]) == tokens for r in records)
        assert all(r["moe_load_max_over_mean"] >= 1.0 and r["moe_aux_loss"] >= 1.0 - 1e-6 for r in records)
        assert s["moe"]["load_max_over_mean"] >= 1.0 and sum(s["moe"]["tokens_per_expert"]) == 12 * tokens
        if level == "O2":
            telemetry = read_metrics(out / "telemetry.jsonl")
            experts = {r["layer"] for r in telemetry if ".expert" in r["layer"]}
            assert "blocks.0.mlp.c_fc.expert0" in experts
            kinds = {r["kind"] for r in telemetry if r["layer"] == "blocks.1.mlp.c_proj.expert3"}
            assert {"weight", "exp_avg", "exp_avg_sq"} <= kinds
            assert any(r["kind"] == "weight_grad" for r in telemetry if ".expert" in r["layer"])


@pytest.mark.parametrize("recipe", ["rowwise", "blockwise", "mxfp8", "nvfp4"])
def test_tiny_moe_trains_with_a_fine_grained_recipe(tmp_path, cache, recipe):
    s = train(cfg(tmp_path, cache, opt_level="O2", recipe=recipe, steps=8))
    losses = [r["train_loss"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")]
    assert all(math.isfinite(v) for v in losses) and math.isfinite(s["val_loss"])
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.2


def test_capacity_factor_run_logs_the_dropped_share(tmp_path, cache):
    train(cfg(tmp_path, cache, opt_level="O2", steps=3, moe_capacity_factor=1.0))
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert all(0.0 <= r["moe_dropped"] < 1.0 for r in records)
    train(cfg(tmp_path, cache, opt_level="O2", steps=1, out=str(tmp_path / "none")))
    assert "moe_dropped" not in read_metrics(tmp_path / "none" / "metrics.jsonl")[0]


def test_moe_resume_continues_bit_identically(tmp_path, cache):
    kw = dict(opt_level="O2", steps=6, save_every=3, keep_checkpoints=3, moe_router="sigmoid", moe_shared_expert=True)
    whole = train(cfg(tmp_path, cache, **kw))
    out, resumed_out = tmp_path / "run", tmp_path / "resumed"
    shutil.copytree(out, resumed_out)
    (resumed_out / "summary.json").unlink()
    (resumed_out / "checkpoints" / "step_00000006.pt").unlink()
    resumed = train(cfg(tmp_path, cache, **kw, out=str(resumed_out), resume=True))
    assert (resumed_out / "metrics.jsonl").read_bytes() == (out / "metrics.jsonl").read_bytes()
    assert resumed["val_loss"] == whole["val_loss"] and resumed["moe"] == whole["moe"]


def test_moe_model_at_o2_is_near_6_bytes_per_param():
    torch.manual_seed(4)
    model = GPT(GPTConfig(n_layer=2, n_embd=128, n_head=4, block_size=32, moe_experts=8, moe_top_k=2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = fp8lm.initialize(model, opt, "O2")
    idx = torch.randint(0, 256, (2, 32))
    model(idx, idx)[1].backward()
    opt.step()
    report = fp8lm.memory_report(model, opt)
    assert report["num_params"] == sum(p.numel() for p in model.parameters())
    assert 5.9 <= report["bytes_per_param"] <= 6.1
    assert report["exp_avg"] == report["num_params"] and report["master_weights"] == 0


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(ep=2, tp=2), "of each tensor-parallel place: launch torchrun with a multiple of 4 ranks"),
        (dict(ep=2, pp=2, tp=2), "of each pipeline stage and tensor-parallel place: .* multiple of 8 ranks"),
        (dict(moe_top_k=5), "moe_top_k must be in \\[1, moe_experts=4\\]"),
        (dict(ep=2, moe_experts=0), "--ep 2 spreads the experts of --moe-experts"),
        (dict(ep=3), "pass --moe-experts E with E a multiple of 3 \\(got 4\\)"),
        (dict(ep=2, opt_level="O3"), "--ep with O3"),
        (dict(ep=2), "launch torchrun with a multiple of 2 ranks \\(this run has 1\\)"),
        (dict(ep=0), "--ep must be >= 1"),
    ],
)
def test_bad_moe_run_is_refused_before_any_output(tmp_path, cache, kw, match):
    with pytest.raises(RunError, match=match) as e:
        train(cfg(tmp_path, cache, **kw))
    assert "\n" not in str(e.value)
    assert not (tmp_path / "run").exists()


def test_checkpointed_blocks_train_the_moe_exactly_as_without(tmp_path, cache):
    """Activation checkpointing recomputes the routing and the experts' FP8 casts bit for bit; the
    load-balancing loss and the token counts are taken once per forward."""
    kw = dict(opt_level="O2", steps=4, eval_every=4)
    plain = train(cfg(tmp_path, cache, **kw, out=str(tmp_path / "plain")))
    full = train(cfg(tmp_path, cache, **kw, activation_checkpointing="full", out=str(tmp_path / "full")))
    a, b = (read_metrics(tmp_path / name / "metrics.jsonl") for name in ("plain", "full"))
    for ra, rb in zip(a, b):
        for key in ("train_loss", "grad_norm", "moe_aux_loss", "moe_tokens_per_expert"):
            assert ra[key] == rb[key], key
    assert plain["val_loss"] == full["val_loss"]


def test_fp8_saved_activations_cover_the_experts(tmp_path, cache):
    s = train(cfg(tmp_path, cache, opt_level="O2", arch="llama", steps=3, activations="fp8"))
    assert math.isfinite(s["val_loss"]) and sum(s["moe"]["tokens_per_expert"]) == 3 * 4 * 32 * 2 * 2
