"""The llama architecture (``GPTConfig.arch="llama"``): its pieces against float64 references, the
whole model at every precision level, and training runs of it (resume, refusals)."""

import math
import shutil

import pytest
import torch

import fp8lm
from fp8lm.train.checkpoint import CheckpointError
from fp8lm.train.config import OPT_LEVELS, RunError, TrainConfig
from fp8lm.train.loop import train
from fp8lm.train.model import GPT, PRESETS, GPTConfig, GroupedQueryAttention, apply_rope, preset, rms_norm, rope_angles
from test_train import TINY

# tiny's sizes with 4 query heads sharing 2 key/value heads (head_dim 16: every Linear converts to FP8)
GQA = dict(arch="llama", n_embd=64, n_head=4, n_kv_head=2)


def test_rms_norm_matches_a_float64_reference():
    g = torch.Generator().manual_seed(0)
    x, w = (
        torch.randn(3, 5, 48, generator=g, dtype=torch.float64) * 7,
        torch.randn(48, generator=g, dtype=torch.float64),
    )
    ref = (
        torch.tensor(
            [
                [[v / math.sqrt(sum(u * u for u in row) / 48 + 1e-5) for v in row] for row in plane]
                for plane in x.tolist()
            ],
            dtype=torch.float64,
        )
        * w
    )
    torch.testing.assert_close(rms_norm(x, w, 1e-5), ref, rtol=1e-12, atol=1e-12)
    # bf16 input: normalized in FP32, returned in bf16
    out = rms_norm(x.bfloat16(), w.float(), 1e-5)
    assert out.dtype == torch.float32 and (out - ref).abs().max() <= 0.02 * ref.abs().max()


def test_rope_rotates_each_channel_pair_by_its_angle():
    t, d, theta = 9, 16, 10000.0
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, t, d, generator=g, dtype=torch.float64)
    cos, sin = rope_angles(t, d, theta, dtype=torch.float64)
    got = apply_rope(x, cos, sin)
    # reference: channel pair (i, i + d/2) as one complex number, times exp(1j * p * theta^(-2i/d))
    half = d // 2
    z = torch.complex(x[..., :half], x[..., half:])
    angle = torch.tensor([[p * theta ** (-2 * i / d) for i in range(half)] for p in range(t)], dtype=torch.float64)
    ref = z * torch.polar(torch.ones_like(angle), angle)
    torch.testing.assert_close(got, torch.cat((ref.real, ref.imag), dim=-1), rtol=1e-12, atol=1e-12)
    # float32 angles (what the model uses) within float32 rounding of the positions' angles
    cos32, sin32 = rope_angles(t, d, theta)
    torch.testing.assert_close(apply_rope(x.float(), cos32, sin32).double(), got, rtol=0, atol=1e-5)


def test_rope_scores_depend_on_the_offset_only():
    d, theta = 16, 500.0
    g = torch.Generator().manual_seed(2)
    q, k = torch.randn(d, generator=g, dtype=torch.float64), torch.randn(d, generator=g, dtype=torch.float64)
    cos, sin = rope_angles(12, d, theta, dtype=torch.float64)
    at = lambda v, p: apply_rope(v, cos[p], sin[p])  # noqa: E731
    assert float(at(q, 7) @ at(k, 4)) == pytest.approx(float(at(q, 3) @ at(k, 0)), rel=1e-12)


def test_grouped_query_attention_matches_a_float64_reference():
    torch.manual_seed(0)
    cfg = preset("tiny", **GQA)
    attn = GroupedQueryAttention(cfg).double()
    x = torch.randn(2, 11, cfg.n_embd, dtype=torch.float64)
    t, hd, group = 11, cfg.head_dim, cfg.n_head // cfg.n_kv_head
    q = (x @ attn.c_q.weight.T).view(2, t, cfg.n_head, hd)
    k, v = (x @ attn.c_kv.weight.T).view(2, t, 2, cfg.n_kv_head, hd).unbind(2)
    cos, sin = rope_angles(t, hd, cfg.rope_theta, dtype=torch.float64)
    mask = torch.ones(t, t).tril().bool()
    heads = []
    for h in range(cfg.n_head):  # query head h reads key/value head h // group
        qh = apply_rope(q[:, :, h], cos, sin)
        kh, vh = apply_rope(k[:, :, h // group], cos, sin), v[:, :, h // group]
        scores = (qh @ kh.transpose(1, 2) / math.sqrt(hd)).masked_fill(~mask, -math.inf)
        heads.append(scores.softmax(-1) @ vh)
    ref = torch.cat(heads, dim=-1) @ attn.c_proj.weight.T
    torch.testing.assert_close(attn(x), ref, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("name", list(PRESETS))
def test_every_preset_builds_a_llama_whose_linears_convert_to_fp8(name):
    cfg = preset(name, arch="llama", n_layer=1)
    assert (cfg.mlp, cfg.bias, cfg.n_kv_head) == ("swiglu", False, cfg.n_head)
    model = GPT(cfg)
    assert model.wpe is None
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            assert m.bias is None and m.in_features % 16 == 0 and m.out_features % 16 == 0, (name, m)
        assert not isinstance(m, torch.nn.LayerNorm)
    assert model.lm_head.weight is not model.wte.weight


def test_causal_and_near_uniform_at_init():
    torch.manual_seed(0)
    model = GPT(preset("tiny", **GQA)).eval()
    idx = torch.randint(0, 256, (1, 20))
    changed = idx.clone()
    changed[0, 10:] = (changed[0, 10:] + 1) % 256
    a, b = model(idx)[0], model(changed)[0]
    torch.testing.assert_close(a[:, :10], b[:, :10])
    assert not torch.allclose(a[:, 10:], b[:, 10:])
    assert abs(model(idx, idx)[1].item() - math.log(256)) < 0.1


# The FP8 levels' loss against fp32's on a fresh tiny llama, relative: FP8 GEMMs in E4M3 (3 mantissa
# bits, ~6% relative rounding per element) averaged over many tokens; measured at this seed below 0.2%.
FP8_LOSS_REL = 0.01


@pytest.mark.parametrize("level", OPT_LEVELS)
def test_forward_backward_at_every_level(level):
    torch.manual_seed(0)
    cfg = preset("tiny", **GQA)
    ref_model = GPT(cfg)
    model = GPT(cfg)
    model.load_state_dict(ref_model.state_dict())
    idx = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(1))
    ref_loss = ref_model(idx, idx)[1]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if level in ("O1", "O2", "O3"):
        model, optimizer = fp8lm.initialize(model, optimizer, opt_level=level)
    with torch.autocast("cpu", torch.bfloat16, enabled=level != "fp32"):
        loss = model(idx, idx)[1]
    loss.backward()
    params = list(model.parameters())
    assert all(p.grad is not None and torch.isfinite(p.grad.float()).all() for p in params)
    if level == "fp32":
        assert loss.item() == ref_loss.item()
    else:
        assert abs(loss.item() - ref_loss.item()) <= FP8_LOSS_REL * ref_loss.item()
    optimizer.step()
    with torch.autocast("cpu", torch.bfloat16, enabled=level != "fp32"):
        assert math.isfinite(float(model(idx, idx)[1]))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(arch="bert"), "unknown arch 'bert'"),
        (dict(n_kv_head=2), "grouped-query attention is arch llama's"),
        (dict(arch="llama", mlp="gelu"), "SwiGLU MLP and no biases"),
        (dict(arch="llama", bias=True), "SwiGLU MLP and no biases"),
        (dict(arch="llama", n_kv_head=3), "must divide n_head"),
        (dict(arch="llama", n_kv_head=0), "must divide n_head"),
    ],
)
def test_bad_llama_config_is_a_clear_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GPTConfig(**kwargs)


def test_config_round_trips_and_older_configs_read_as_gpt():
    cfg = preset("small", **GQA)
    assert GPTConfig.from_dict(cfg.to_dict()) == cfg
    before = {
        k: v for k, v in preset("small").to_dict().items() if k not in ("arch", "n_kv_head", "rope_theta", "norm_eps")
    }
    assert GPTConfig.from_dict(before) == preset("small")


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("tokens"))


def run_cfg(tmp_path, cache, **kw) -> TrainConfig:
    return TrainConfig(**{**TINY, "out": str(tmp_path / "run"), "cache_dir": cache, "arch": "llama", **kw})


@pytest.mark.parametrize("level", ["bf16", pytest.param("O2", marks=pytest.mark.slow)])
def test_llama_resume_continues_byte_for_byte(tmp_path, cache, level):
    kw = dict(opt_level=level, steps=4, save_every=2, keep_checkpoints=3, n_embd=64, n_head=4, n_kv_head=2)
    whole = train(run_cfg(tmp_path, cache, **kw))
    out, resumed_out = tmp_path / "run", tmp_path / "resumed"
    shutil.copytree(out, resumed_out)
    (resumed_out / "summary.json").unlink()
    (resumed_out / "checkpoints" / "step_00000004.pt").unlink()
    resumed = train(run_cfg(tmp_path, cache, **kw, out=str(resumed_out), resume=True))
    assert (resumed_out / "metrics.jsonl").read_bytes() == (out / "metrics.jsonl").read_bytes()
    assert resumed["val_loss"] == whole["val_loss"] and whole["model_config"]["arch"] == "llama"


def test_resume_with_another_arch_or_kv_heads_is_refused(tmp_path, cache):
    train(run_cfg(tmp_path, cache, steps=2, n_embd=64, n_head=4, n_kv_head=2))
    before = (tmp_path / "run" / "metrics.jsonl").read_bytes()
    with pytest.raises(RunError, match="trained with --arch llama, this command has --arch gpt; pass --arch llama"):
        train(run_cfg(tmp_path, cache, steps=3, resume=True, arch="gpt", n_embd=64, n_head=4))
    with pytest.raises(RunError, match="trained with --n-kv-head 2, this command has --n-kv-head 4"):
        train(run_cfg(tmp_path, cache, steps=3, resume=True, n_embd=64, n_head=4))
    assert (tmp_path / "run" / "metrics.jsonl").read_bytes() == before
    with pytest.raises(CheckpointError, match="arch=llama \\(here gpt\\)"):
        train(run_cfg(tmp_path, cache, steps=1, arch="gpt", init_from=str(tmp_path / "run"), out=str(tmp_path / "ft")))
    assert not (tmp_path / "ft").exists()


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(arch="t5"), "unknown arch 't5'"),
        (dict(arch="gpt", n_kv_head=1), "grouped-query attention is arch llama's"),
        (dict(mlp="gelu"), "SwiGLU MLP"),
        (dict(n_kv_head=1, tp=2), "--tp 2 shards --n-kv-head \\(1\\)"),
    ],
)
def test_bad_llama_run_is_refused_before_any_output(tmp_path, cache, kw, match):
    with pytest.raises(RunError, match=match):
        train(run_cfg(tmp_path, cache, **kw))
    assert not (tmp_path / "run").exists()
