"""Injected non-finite values and outliers during training: nothing passes silently.

For each level (O1 with torch's AdamW and the README's skip, O2 and O3 with fp8lm's FP8AdamW, in
one process: O3 is O2 with FP8 weights there), a small GPT trains twice on the same batches: a
clean run, then a run where ``--injections`` steps (random, at least ``--gap`` steps apart) get one
value (NaN, inf, -inf or 1e30) written into one random element of a random layer's output (in the
forward pass) or of the gradient arriving at that output (in the backward pass). Each injected
step is checked:

- ``skipped``: a non-finite value must skip the step (1e30 may or may not: it is finite);
- ``untouched``: on a skipped step every weight byte and every optimizer state byte (moments,
  step counts, master weights, scales) is what it was before the step;
- ``count``: the skip counter (the optimizer's ``skipped_steps`` at O2/O3, the loop's at O1) equals
  the steps seen skipped, and no step without an injection is skipped;
- ``recovered``: within ``--gap`` steps the training loss is back within ``--tolerance``
  (relative) of the clean run's at the same step, and the weights stay finite.

    python benchmarks/inject.py --injections 100 --seed 0 > benchmarks/results/inject_cpu.json

Prints one JSON object: per level the totals, the checks and every injection.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

import fp8lm
from fp8lm import ScalingMeta
from fp8lm.optim import SkipsNonFiniteSteps
from fp8lm.train.model import GPT, preset
from fp8lm.train.run import BF16Autocast

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine  # noqa: E402

LEVELS = ("O1", "O2", "O3")
VALUES = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf, "1e30": 1e30}
SITES = ("activation", "gradient")
CORPUS = Path(sysconfig.get_paths()["stdlib"]) / "email"  # real text, the same on every machine


@dataclass(frozen=True)
class Injection:
    step: int
    layer: str
    site: str
    value: str
    element: float  # where in the tensor, as a fraction of its size


def corpus_tokens() -> torch.Tensor:
    text = b"".join(p.read_bytes() for p in sorted(CORPUS.rglob("*.py")))
    return torch.frombuffer(bytearray(text), dtype=torch.uint8).long()


def batches(tokens: torch.Tensor, steps: int, batch: int, block: int, seed: int) -> list[tuple]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        starts = torch.randint(0, len(tokens) - block - 1, (batch,), generator=g)
        x = torch.stack([tokens[s : s + block] for s in starts.tolist()])
        y = torch.stack([tokens[s + 1 : s + block + 1] for s in starts.tolist()])
        out.append((x, y))
    return out


def injection_sites(model: nn.Module) -> list[str]:
    """The layers a value can be injected into: every linear layer and embedding table (named as
    in the plain model; `fp8lm.initialize` keeps the names)."""
    return [name for name, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Embedding))]


def plan(n: int, steps_before: int, gap: int, layers: list[str], seed: int) -> list[Injection]:
    rng = random.Random(seed)
    return [
        Injection(
            step=steps_before + i * gap + rng.randrange(gap // 2),
            layer=rng.choice(layers),
            site=rng.choice(SITES),
            value=rng.choice(list(VALUES)),
            element=rng.random(),
        )
        for i in range(n)
    ]


def _poisoned(t: torch.Tensor, inj: Injection) -> torch.Tensor:
    out = t.clone()
    out.view(-1)[int(inj.element * out.numel())] = VALUES[inj.value]
    return out


def arm(model: nn.Module, inj: Injection):
    """Hook ``inj`` into its layer for one forward/backward; returns the handle to remove."""

    def hook(module, args, output):
        if inj.site == "activation":
            return _poisoned(output, inj)
        output.register_hook(lambda grad: _poisoned(grad, inj))
        return output

    return dict(model.named_modules())[inj.layer].register_forward_hook(hook)


def _flat(obj) -> list[torch.Tensor]:
    """Every tensor in a (nested) state, the inner tensors of FP8 ones, in a fixed order."""
    if isinstance(obj, fp8lm.ScalingTensor):
        names, _ = obj.__tensor_flatten__()
        return [getattr(obj, n) for n in names]
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for k in sorted(obj, key=str) for t in _flat(obj[k])]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _flat(v)]
    return []


def snapshot(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[bytes]:
    """The bytes of every weight and optimizer state tensor, and the optimizer's other numbers."""
    state = optimizer.state_dict()
    tensors = _flat([list(model.parameters()), state])
    # the skip counter is meant to change on a skipped step; it is checked on its own
    scalars = json.dumps(
        {k: v for k, v in state.items() if k not in ("state", "skipped_steps")}, default=repr, sort_keys=True
    )
    return [t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes() for t in tensors] + [scalars.encode()]


def build(level: str, seed: int):
    torch.manual_seed(seed)
    model = GPT(preset("tiny"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.1)
    return fp8lm.initialize(model, optimizer, opt_level=level)


def rescales(model: nn.Module) -> int:
    return sum(int(m.rescales) for m in model.modules() if isinstance(m, ScalingMeta))


def train(level: str, data: list[tuple], injections: dict[int, Injection], seed: int) -> dict:
    """One run; returns per step the loss, grad norm, whether it was skipped and whether the
    weights and optimizer state were left as they were."""
    model, optimizer = build(level, seed)
    counts_own = not isinstance(optimizer, SkipsNonFiniteSteps)
    own_skips, steps = 0, []
    autocast = BF16Autocast("cpu")
    for step, (x, y) in enumerate(data):
        inj = injections.get(step)
        handle = arm(model, inj) if inj else None
        with autocast:
            loss = model(x, y)[1]
        loss.backward()
        if handle:
            handle.remove()
        before = snapshot(model, optimizer) if inj else None
        norm = float(fp8lm.clip_grad_norm_(model.parameters(), 1.0))
        if counts_own:  # the README's loop with a torch optimizer
            skipped = not math.isfinite(norm)
            if skipped:
                own_skips += 1
            else:
                optimizer.step()
        else:
            optimizer.step()
            skipped = optimizer.last_step_skipped
        untouched = before == snapshot(model, optimizer) if inj else None
        fp8lm.zero_grad(model)
        finite = all(bool(torch.isfinite(t.float()).all()) for t in _flat(list(model.parameters())))
        steps.append(
            {
                "loss": float(loss.detach()),
                "grad_norm": norm,
                "skipped": skipped,
                "untouched": untouched,
                "finite": finite,
            }
        )
    counter = own_skips if counts_own else optimizer.skipped_steps
    return {"steps": steps, "skip_counter": counter, "rescales": rescales(model)}


def judge(inj: Injection, run: dict, clean: dict, gap: int, tolerance: float) -> dict:
    s = run["steps"][inj.step]
    must_skip = inj.value != "1e30"
    after = range(inj.step + 1, min(inj.step + 1 + gap, len(run["steps"])))
    back = [
        k
        for k in after
        if abs(run["steps"][k]["loss"] - clean["steps"][k]["loss"]) <= tolerance * clean["steps"][k]["loss"]
    ]
    return {
        **inj.__dict__,
        "loss": s["loss"],
        "grad_norm": s["grad_norm"],
        "skipped": s["skipped"],
        "skip_right": s["skipped"] or not must_skip,
        "untouched": s["untouched"] if s["skipped"] else None,
        "recovered_after": back[0] - inj.step if back else None,
        "weights_finite": all(run["steps"][k]["finite"] for k in range(inj.step, after.stop)),
    }


def level_report(level: str, data, plan_: list[Injection], gap: int, tolerance: float, seed: int) -> dict:
    t0 = time.perf_counter()
    clean = train(level, data, {}, seed)
    run = train(level, data, {i.step: i for i in plan_}, seed)
    rows = [judge(i, run, clean, gap, tolerance) for i in plan_]
    injected = {i.step for i in plan_}
    skipped_steps = [k for k, s in enumerate(run["steps"]) if s["skipped"]]
    skipped_rows = [r for r in rows if r["skipped"]]
    tail = slice(-10, None)
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    return {
        "injections": len(rows),
        "by_value": {v: sum(r["value"] == v for r in rows) for v in VALUES},
        "by_site": {s: sum(r["site"] == s for r in rows) for s in SITES},
        "skipped": len(skipped_rows),
        "skipped_by_value": {v: sum(r["skipped"] and r["value"] == v for r in rows) for v in VALUES},
        "nonfinite_not_skipped": sum(not r["skip_right"] for r in rows),
        "skipped_with_states_untouched": sum(bool(r["untouched"]) for r in skipped_rows),
        "skip_counter": run["skip_counter"],
        "skipped_without_injection": sorted(set(skipped_steps) - injected),
        "counts_right": run["skip_counter"] == len(skipped_steps) and set(skipped_steps) <= injected,
        "recovered": sum(r["recovered_after"] is not None for r in rows),
        "recovered_after_max_steps": max((r["recovered_after"] or 0) for r in rows),
        "weights_always_finite": all(r["weights_finite"] for r in rows),
        "rescales": {"clean": clean["rescales"], "injected": run["rescales"]},
        "clean_skips": sum(s["skipped"] for s in clean["steps"]),
        "final_loss": {
            "clean": mean([s["loss"] for s in clean["steps"][tail]]),
            "injected": mean([s["loss"] for s in run["steps"][tail]]),
        },
        "seconds": time.perf_counter() - t0,
        "rows": rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--injections", type=int, default=100, help="injected steps per level")
    parser.add_argument("--levels", default=",".join(LEVELS))
    parser.add_argument("--gap", type=int, default=6, help="steps between injections (recovery window)")
    parser.add_argument("--warmup", type=int, default=40, help="clean steps before the first injection")
    parser.add_argument("--tolerance", type=float, default=0.05, help="relative loss gap counted as recovered")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    steps = args.warmup + args.injections * args.gap + args.gap
    data = batches(corpus_tokens(), steps, args.batch_size, args.seq_len, args.seed)
    layers = injection_sites(GPT(preset("tiny")))
    injections = plan(args.injections, args.warmup, args.gap, layers, args.seed)
    levels = {
        level: level_report(level, data, injections, args.gap, args.tolerance, args.seed)
        for level in args.levels.split(",")
    }
    result = {
        "benchmark": "inject",
        "config": {**vars(args), "steps": steps, "model": "tiny", "layers": layers, "values": list(VALUES)},
        "machine": machine(),
        "levels": levels,
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
