"""The Adam math of fp8lm's optimizers, as pure functions (no state, no storage formats).

`adam_update` is one step on dequantized values; `adam_hyperparams` is the vector of its
coefficients for one step; `adam_ratio_bound` and `amax_bounds` bound the new values' magnitudes
before a step, which lets the fused step (`fp8lm.optim.fused`) pick the new scales before it writes.
"""

from __future__ import annotations

import math

import torch

__all__ = ["adam_update", "adam_hyperparams", "adam_ratio_bound", "amax_bounds", "BOUND_SLACK"]

# Covers FP32 rounding in the kernels, far below any format's resolution.
BOUND_SLACK = 1 + 2.0**-16


def adam_update(w, g, m, v, lr, beta1, beta2, eps, decay, l2, bias_correction1, bias_correction2_sqrt):
    """One Adam step on dequantized values: returns the new ``(w, m, v)``.

    ``decay = 1 - lr * weight_decay`` with ``l2 = 0`` is AdamW's decoupled decay; ``decay = 1`` with
    ``l2 = weight_decay`` is Adam's L2 penalty. Same operation order as ``torch.optim.AdamW``.
    Works on tensors of any float dtype (float64 in the tests) and on scalars or 0-d tensors.
    """
    g = g + l2 * w
    w = w * decay
    m = m + (1 - beta1) * (g - m)
    v = v * beta2 + (1 - beta2) * g * g
    # Scalar reciprocals: one vector division per element (m / denom) instead of three.
    denom = v.sqrt() * (1 / bias_correction2_sqrt) + eps
    w = w - (lr / bias_correction1) * (m / denom)
    return w, m, v


def adam_hyperparams(
    lr: float, betas: tuple[float, float], eps: float, weight_decay: float, decoupled: bool, step: int
) -> list[float]:
    """`adam_update`'s arguments after ``(w, g, m, v)`` for ``step`` (1-based): ``lr, beta1, beta2,
    eps, decay, l2, bias_correction1, bias_correction2_sqrt``. ``decoupled``: AdamW's weight decay,
    else Adam's L2 penalty."""
    beta1, beta2 = betas
    decay, l2 = (1 - lr * weight_decay, 0.0) if decoupled else (1.0, weight_decay)
    return [lr, beta1, beta2, eps, decay, l2, 1 - beta1**step, math.sqrt(1 - beta2**step)]


def adam_ratio_bound(beta1: float, beta2: float, step: int) -> float:
    """The largest ``|m_hat| / sqrt(v_hat)`` Adam reaches at ``step`` (1-based) for any gradients, in
    exact arithmetic; ``inf`` where there is none (``beta2 = 0 < beta1``).

    Cauchy-Schwarz on ``m_t = (1-b1) sum_k b1^k g_(t-k)`` against ``v_t = (1-b2) sum_k b2^k g_(t-k)^2``
    gives ``m_t^2 <= (1-b1)^2 / (1-b2) * S_t * v_t`` with ``S_t = sum_(k<t) (b1^2/b2)^k``, reached by
    gradients proportional to ``(b1/b2)^k``; bias correction multiplies the ratio by
    ``sqrt(1 - b2^t) / (1 - b1^t)``. For the default betas it grows from 1 (step 1) to about 7.3.
    """
    if beta1 == 0.0:
        series = 1.0
    elif beta2 == 0.0:
        series = 1.0 if step == 1 else math.inf
    else:
        r = beta1 * beta1 / beta2
        try:
            series = step if r == 1.0 else (1.0 - r**step) / (1.0 - r)
        except OverflowError:
            series = math.inf
    return (1 - beta1) / math.sqrt(1 - beta2) * math.sqrt(series) * math.sqrt(1 - beta2**step) / (1 - beta1**step)


def amax_bounds(amaxes: torch.Tensor, hyperparams: torch.Tensor, max_ratio: torch.Tensor) -> torch.Tensor:
    """Bounds on the amaxes of the new weight, first and second moment (n, 3), from the amaxes of the
    current weight, first moment, second moment and gradient (n, 4, dequantized), the
    `adam_hyperparams` (n, 8) and a bound on ``|m / denom|`` (n,):

    ``|m'| <= b1 |m| + (1-b1) |g|``, ``v' <= b2 v + (1-b2) g^2``, ``|w'| <= decay |w| + lr / bc1 * r``
    with ``g`` including the L2 term, and ``r`` the smaller of ``max_ratio`` and ``|m'| / eps`` (finite
    even without Adam's bound, ``beta2 = 0``). Each is widened by `BOUND_SLACK` for rounding.
    """
    a_w, a_m, a_v, a_g = amaxes.unbind(1)
    lr, beta1, beta2, eps, decay, l2, bc1, _ = hyperparams.unbind(1)
    g_bound = a_g + l2 * a_w
    m_bound = (beta1 * a_m + (1 - beta1) * g_bound) * BOUND_SLACK
    v_bound = (beta2 * a_v + (1 - beta2) * g_bound * g_bound) * BOUND_SLACK
    eps_ratio = torch.where(eps > 0, m_bound / eps, math.inf)
    ratio = torch.minimum(max_ratio, eps_ratio)
    w_bound = (decay * a_w + lr / bc1 * ratio) * BOUND_SLACK
    return torch.stack([w_bound, m_bound, v_bound], dim=1)
