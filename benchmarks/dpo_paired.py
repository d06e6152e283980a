"""Paired comparison of two `fp8lm dpo` runs on the same held-out pairs (e.g. bf16 against O2).

Each finished run is reopened as it ended (`fp8lm.train.dpo.finished_run`: its final policy, its
reference as ``fp8lm dpo`` builds it, its held-out pairs) and every held-out pair's reward margin
is computed (`DPORun.held_out_rewards`). Both policies face the same pairs, so their accuracies
are compared pair by pair: the difference's standard error is the paired one, from the pairs only
one policy ranks correctly (McNemar's discordant pairs), much smaller than the unpaired one when
the two policies mostly agree.

    python benchmarks/dpo_paired.py --baseline runs/dpo100_bf16 --candidate runs/dpo100_O2

With several seeds (``--baseline A0 A1 --candidate B0 B1``, matched by position) each seed is
reported on its own and pooled: the pooled difference is the mean over seeds, its standard error
that of the per-pair differences averaged over the seeds (pairs are the unit; the seeds' own
spread is in the per-seed rows). Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch
from common import machine

from fp8lm.cli import USER_ERRORS
from fp8lm.train.data import DataError
from fp8lm.train.dpo import finished_run

Z95 = 1.959964  # two-sided 95 % quantile of the standard normal


def mcnemar_exact_p(baseline_only: int, candidate_only: int) -> float:
    """Two-sided exact McNemar p-value: the chance, with discordant pairs equally likely to fall
    either way, of a split at least as uneven as the one seen."""
    n, k = baseline_only + candidate_only, min(baseline_only, candidate_only)
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2**n
    return min(1.0, 2 * tail)


def paired_difference(baseline_margins: torch.Tensor, candidate_margins: torch.Tensor, target: float) -> dict:
    """Accuracy and margin of the candidate against the baseline on the same pairs.

    Margins are (seeds, pairs) or (pairs,): chosen minus rejected implicit reward, a pair ranked
    correctly when its margin is > 0 (as `DPOTerms.accuracy` counts). The standard error is that of
    the mean over pairs of each pair's candidate-minus-baseline correctness (averaged over seeds),
    with the population variance: for one seed ``sqrt(b + c - (c - b)**2 / n) / n``.
    """
    if baseline_margins.shape != candidate_margins.shape or baseline_margins.numel() == 0:
        raise ValueError(
            f"margins of shapes {tuple(baseline_margins.shape)} and {tuple(candidate_margins.shape)}: "
            "need the same, non-empty, shape (the same held-out pairs)"
        )
    base = baseline_margins.double().reshape(-1, baseline_margins.shape[-1])
    cand = candidate_margins.double().reshape(base.shape)
    base_correct, cand_correct = (base > 0).double(), (cand > 0).double()
    per_pair = (cand_correct - base_correct).mean(0)  # averaged over seeds
    pairs = per_pair.numel()
    difference = float(per_pair.mean())
    paired_se = math.sqrt(float(per_pair.var(correction=0)) / pairs)
    base_acc, cand_acc = float(base_correct.mean()), float(cand_correct.mean())
    unpaired_se = math.sqrt((base_acc * (1 - base_acc) + cand_acc * (1 - cand_acc)) / base.numel())
    interval = [difference - Z95 * paired_se, difference + Z95 * paired_se]
    margin_difference = cand - base
    return {
        "pairs": pairs,
        "seeds": base.shape[0],
        "baseline_accuracy": base_acc,
        "candidate_accuracy": cand_acc,
        "accuracy_difference": difference,  # candidate minus baseline
        "paired_standard_error": paired_se,
        "interval_95": interval,
        "unpaired_standard_error": unpaired_se,
        "discordant": {
            "baseline_only": int(((base_correct == 1) & (cand_correct == 0)).sum()),
            "candidate_only": int(((base_correct == 0) & (cand_correct == 1)).sum()),
        },
        "margin_difference": {"mean": float(margin_difference.mean()), "std": float(margin_difference.std())},
        "target": target,
        "interval_within_target": -target < interval[0] and interval[1] < target,
    }


def run_margins(folder: str) -> tuple[torch.Tensor, list, dict]:
    """(per-pair margins, held-out pairs, what the run's summary and the re-evaluation say)."""
    run = finished_run(folder)
    terms = run.held_out_rewards()
    with open(os.path.join(folder, "summary.json")) as f:
        summary = json.load(f)
    info = {
        "run": folder,
        "opt_level": run.cfg.opt_level,
        "seed": run.cfg.seed,
        "steps": summary["steps"],
        "reward_accuracy": float(terms.accuracy),
        "dpo_loss": float(terms.loss),
        "reward_margin": float(terms.margins.mean()),
        "summary_reward_accuracy": summary["reward_accuracy"],  # the run's own evaluation, for a check
        "summary_dpo_loss": summary["dpo_loss"],
    }
    return terms.margins, run.held_out, info


def compare(baselines: list[str], candidates: list[str], target: float) -> dict:
    """Per seed (position in the lists) and pooled paired comparisons; refuses runs whose
    held-out pairs differ."""
    base_margins, cand_margins, runs, per_seed = [], [], [], []
    first_pairs: list | None = None
    for base_dir, cand_dir in zip(baselines, candidates, strict=True):
        (base, base_pairs, base_info), (cand, cand_pairs, cand_info) = run_margins(base_dir), run_margins(cand_dir)
        first_pairs = base_pairs if first_pairs is None else first_pairs
        if base_pairs != first_pairs or cand_pairs != first_pairs:
            raise DataError(
                f"{base_dir} and {cand_dir}: held-out pairs differ from {baselines[0]}'s; compare runs on the same pairs"
            )
        result = paired_difference(base, cand, target)
        result["mcnemar_exact_p"] = mcnemar_exact_p(**result["discordant"])
        per_seed.append({"baseline": base_dir, "candidate": cand_dir, **result})
        runs += [base_info, cand_info]
        base_margins.append(base)
        cand_margins.append(cand)
    pooled = paired_difference(torch.stack(base_margins), torch.stack(cand_margins), target)
    return {"runs": runs, "per_seed": per_seed, "pooled": pooled}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", nargs="+", required=True, help="finished fp8lm dpo run folders, one per seed")
    parser.add_argument(
        "--candidate", nargs="+", required=True, help="the runs to compare, same seeds in the same order"
    )
    parser.add_argument("--target", type=float, default=0.02, help="largest accuracy gap that counts as a match")
    args = parser.parse_args()
    if len(args.baseline) != len(args.candidate):
        parser.error(
            f"{len(args.baseline)} --baseline runs and {len(args.candidate)} --candidate runs: pass one of each per seed"
        )
    try:
        result = compare(args.baseline, args.candidate, args.target)
    except USER_ERRORS as e:
        parser.exit(2, f"dpo_paired.py: {e}\n")
    json.dump({"command": " ".join(sys.argv[1:]), "machine": machine(), **result}, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
