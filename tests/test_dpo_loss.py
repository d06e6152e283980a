"""DPO math against a float64 reference written out term by term."""

import math

import pytest
import torch

from fp8lm.train.dpo_loss import dpo_loss, implicit_rewards, sequence_logprobs, token_kl


def reference_logprob(logits, targets, mask, row):
    total = 0.0
    for t in range(logits.shape[1]):
        if mask[row, t]:
            z = logits[row, t].double()
            total += float(z[targets[row, t]] - math.log(sum(math.exp(v) for v in z.tolist())))
    return total


def test_sequence_logprobs_sum_only_answer_tokens():
    torch.manual_seed(0)
    logits = torch.randn(3, 7, 11) * 3
    targets = torch.randint(0, 11, (3, 7))
    mask = torch.zeros(3, 7, dtype=torch.bool)
    mask[0, 2:] = True
    mask[1, 5:6] = True  # row 2: nothing masked in -> 0
    got = sequence_logprobs(logits, targets, mask)
    want = [reference_logprob(logits, targets, mask, r) for r in range(3)]
    assert got.dtype == torch.float32
    assert got.tolist() == pytest.approx(want, rel=1e-5, abs=1e-5)
    assert got[2] == 0
    # the prompt's logits do not matter
    logits2 = logits.clone()
    logits2[0, :2] = 100.0
    assert sequence_logprobs(logits2, targets, mask)[0] == got[0]
    # bf16 logits are computed in float32
    assert sequence_logprobs(logits.bfloat16(), targets, mask).dtype == torch.float32


def test_dpo_loss_and_rewards_match_float64():
    torch.manual_seed(1)
    pc, pr, rc, rr = (torch.randn(5, dtype=torch.float64) * 20 for _ in range(4))
    beta = 0.1
    terms = dpo_loss(pc.float(), pr.float(), rc.float(), rr.float(), beta)
    margins = [beta * ((a - c) - (b - d)) for a, b, c, d in zip(pc.tolist(), pr.tolist(), rc.tolist(), rr.tolist())]
    want = sum(math.log1p(math.exp(-m)) for m in margins) / len(margins)
    assert float(terms.loss) == pytest.approx(want, rel=1e-5)
    assert terms.margins.tolist() == pytest.approx(margins, rel=1e-4, abs=1e-5)
    assert float(terms.accuracy) == pytest.approx(sum(m > 0 for m in margins) / 5)
    assert implicit_rewards(pc, rc, 0.5).tolist() == pytest.approx((0.5 * (pc - rc)).tolist())
    # equal policy and reference: loss log 2, zero rewards, no pair counted as right
    same = dpo_loss(pc, pr, pc, pr, beta)
    assert float(same.loss) == pytest.approx(math.log(2))
    assert float(same.accuracy) == 0


def test_dpo_gradient_raises_chosen_lowers_rejected():
    chosen = torch.tensor([-10.0], requires_grad=True)
    rejected = torch.tensor([-12.0], requires_grad=True)
    terms = dpo_loss(chosen, rejected, torch.tensor([-10.0]), torch.tensor([-12.0]), beta=0.1)
    terms.loss.backward()
    assert float(chosen.grad) == pytest.approx(-0.05)  # -beta * sigmoid(0) for one pair
    assert float(rejected.grad) == pytest.approx(0.05)
    assert not terms.chosen_rewards.requires_grad


def test_token_kl_matches_float64():
    torch.manual_seed(2)
    p, r = torch.randn(2, 4, 6), torch.randn(2, 4, 6)
    mask = torch.tensor([[True, True, False, False], [False, True, True, True]])
    want, n = 0.0, 0
    for b in range(2):
        for t in range(4):
            if mask[b, t]:
                lp, lr = p[b, t].double().log_softmax(-1), r[b, t].double().log_softmax(-1)
                want += float((lp.exp() * (lp - lr)).sum())
                n += 1
    assert float(token_kl(p, r, mask)) == pytest.approx(want / n, rel=1e-5)
    assert float(token_kl(p, p, mask)) == pytest.approx(0.0, abs=1e-6)


def test_bad_input():
    with pytest.raises(ValueError, match="beta must be > 0"):
        dpo_loss(torch.zeros(1), torch.zeros(1), torch.zeros(1), torch.zeros(1), beta=0)
    with pytest.raises(ValueError, match="do not fit"):
        sequence_logprobs(torch.zeros(2, 3, 5), torch.zeros(2, 4, dtype=torch.long), torch.ones(2, 4, dtype=torch.bool))
