"""The output head's output gradient under mxfp8's scale rounding: the OCP spec's floor against
RCEIL (the round-up cuBLAS uses), with rowwise for comparison.

A mean cross-entropy over N tokens gives the head the output gradient ``(softmax - onehot) / N``:
in each token's row the largest magnitude is the target's ``(1 - p) / N``. With N a power of two
(the main job's 16 x 128 = 2048) that value's mantissa is ``2 (1 - p)``, above 1.75 whenever
``p < 0.125``. MX v1.0's shared scale ``2**(floor(log2(amax)) - 8)`` maps such a block amax to
(448, 512), and E4M3 saturates at 448: the target's gradient shrinks by up to 12.5 %, in the
same direction on every such token. RCEIL scales the amax to at most 448 and loses nothing there.

The main job's GPT (``--preset``, ``small``) trains ``--steps`` BF16 steps (as
``benchmarks/recipes.py``), then one batch keeps the head's output gradient. Reported per
rounding: SQNR, the share of tokens whose target gradient the quantization shrinks by more than
5 %, the mean relative change of the target gradient, and the share of tokens with ``p < 0.125``.

    python benchmarks/mx_head_gradient.py --results benchmarks/results/mx_head_gradient_cpu.json
"""

from __future__ import annotations

import argparse
import sys

import torch
from common import emit, machine
from recipes import capture, sqnr_db, train_bf16, training_arguments

import fp8lm


def target_changes(grad: torch.Tensor, targets: torch.Tensor, recipe: fp8lm.Recipe) -> dict:
    """How ``recipe``'s quantization of the head's output gradient ``grad`` (tokens, vocabulary)
    treats each token's target entry."""
    q = fp8lm.fake_quantize(grad, recipe, "grad_output")
    rows = torch.arange(len(targets))
    change = q[rows, targets] / grad[rows, targets] - 1
    return {
        "sqnr_db": round(sqnr_db(grad, q), 2),
        "target_shrunk_over_5pct": round((change < -0.05).float().mean().item(), 4),
        "target_mean_change": round(change.mean().item(), 5),
    }


def main(argv=None) -> dict:
    parser = training_arguments(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    model, sampler = train_bf16(args)
    x, y = sampler.next()
    grad = capture(model, (x, y))["lm_head"]["grad_output"]
    targets = y.reshape(-1)
    # the target's entry of (softmax - onehot) / N is (p - 1) / N: the probability without a second forward
    p = 1 + len(targets) * grad[torch.arange(len(targets)), targets]
    mxfp8 = fp8lm.Recipe.from_name("mxfp8")
    recipes = {
        "mxfp8": mxfp8,
        "mxfp8-rceil": mxfp8.replace(mx_rounding="rceil"),
        "rowwise": fp8lm.Recipe.from_name("rowwise"),
    }
    result = {
        "benchmark": "mx_head_gradient",
        "command": "python benchmarks/mx_head_gradient.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "preset": args.preset,
        "bf16_steps": args.steps,
        "tokens": len(targets),
        "machine": machine(),
        "share_p_target_below_0.125": round((p < 0.125).float().mean().item(), 4),
        "head_grad_output": {name: target_changes(grad, targets, r) for name, r in recipes.items()},
    }
    emit(result, args.results)
    return result


if __name__ == "__main__":
    main()
