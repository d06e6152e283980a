"""Injected non-finite values and outliers: a gradient norm that overflows float32 skips the step
at every level, and `benchmarks/inject.py`'s checks hold on a short run of each level."""

import math
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import fp8lm

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import inject  # noqa: E402


def _bytes(model, optimizer):
    return inject.snapshot(model, optimizer)


def _spiked_backward(model):
    """A finite 1e30 in one element of the first layer's output gradient: every gradient is finite,
    but float32 sums of their squares overflow."""
    x = torch.randn(4, 32)
    h = model[0](x)
    h.register_hook(lambda g: g.index_put((torch.tensor([0]), torch.tensor([3])), torch.tensor(1e30)))
    model[1](h).square().mean().backward()


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_a_gradient_norm_that_overflows_skips_the_step(level):
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 16))
    model, optimizer = fp8lm.initialize(plain, torch.optim.AdamW(plain.parameters(), lr=1e-2), level)
    model(torch.randn(4, 32)).square().mean().backward()  # one ordinary step: moments to keep
    fp8lm.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    fp8lm.zero_grad(model)
    _spiked_backward(model)
    assert fp8lm.grads_are_finite(model.parameters())
    before = _bytes(model, optimizer)
    norm = fp8lm.clip_grad_norm_(model.parameters(), 1.0)
    assert not torch.isfinite(norm)  # 1e30 squared overflows float32
    # not zeros, which an optimizer would apply (momentum alone still moves the weights)
    assert not fp8lm.grads_are_finite(model.parameters())
    if level == "O2":
        optimizer.step()
        assert optimizer.last_step_skipped and optimizer.skipped_steps == 1
    assert _bytes(model, optimizer) == before


def test_ordinary_clipping_is_unchanged():
    g = torch.tensor([3.0, 4.0])
    p = nn.Parameter(torch.zeros(2))
    p.grad = g.clone()
    assert float(fp8lm.clip_grad_norm_([p], 1.0)) == 5.0
    assert torch.equal(p.grad, g * torch.clamp(1.0 / (torch.tensor(5.0) + 1e-6), max=1.0))


def test_plan_is_seeded_and_spaced():
    layers = ["a", "b", "c"]
    a = inject.plan(20, 10, 6, layers, seed=3)
    assert a == inject.plan(20, 10, 6, layers, seed=3) and a != inject.plan(20, 10, 6, layers, seed=4)
    steps = [i.step for i in a]
    assert steps[0] >= 10 and all(b - s >= 6 - 6 // 2 + 1 for s, b in zip(steps, steps[1:]))
    assert {i.value for i in a} == set(inject.VALUES) and {i.site for i in a} == set(inject.SITES)


def test_poisoned_element_and_snapshot_sees_one_changed_byte():
    t = torch.zeros(2, 5)
    inj = inject.Injection(0, "x", "activation", "nan", element=0.75)
    out = inject._poisoned(t, inj)
    assert math.isnan(out.view(-1)[7]) and int(torch.isnan(out).sum()) == 1 and not torch.isnan(t).any()
    model = nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    before = inject.snapshot(model, optimizer)
    with torch.no_grad():
        model.bias[0] = torch.nextafter(model.bias[0], torch.tensor(1.0))
    assert inject.snapshot(model, optimizer) != before


@pytest.mark.slow
@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_injections_are_skipped_counted_and_recovered(level):
    gap, warmup, n = 6, 20, 8
    data = inject.batches(inject.corpus_tokens(), warmup + n * gap + gap, 4, 32, seed=0)
    layers = inject.injection_sites(inject.GPT(inject.preset("tiny")))
    report = inject.level_report(level, data, inject.plan(n, warmup, gap, layers, 0), gap, 0.05, seed=0)
    assert report["injections"] == n and report["clean_skips"] == 0
    assert report["nonfinite_not_skipped"] == 0
    assert report["skipped"] >= sum(v for k, v in report["by_value"].items() if k != "1e30")
    assert report["skipped_with_states_untouched"] == report["skipped"]
    assert report["counts_right"] and report["skip_counter"] == report["skipped"]
    assert report["recovered"] == n and report["weights_always_finite"]
