"""Activation memory of `fp8lm train`'s GPT: saved-activation bytes per token and the peak memory of
a training step, at bf16 and O2 with and without FP8-saved activations (`--activations fp8`), with
none / selective / full activation checkpointing; and the largest batch whose training step fits a
fixed memory budget at bf16 and at O2 with FP8 activations.

    python benchmarks/activation_memory.py                       # both presets
    python benchmarks/activation_memory.py --presets small --budget-mib 64

Presets: ``small`` (the default model: GPT-2 blocks, LayerNorm and GELU, 4 blocks of width 128)
and ``llama12`` (``--arch llama``: RMSNorm and SwiGLU, 12 blocks of width 128); sequences of 128
tokens, bytes vocabulary. Per configuration:

- ``act_bytes_per_token``: the bytes of the distinct storages autograd saves in one forward of a
  batch of ``--batch`` sequences under BF16 autocast, parameters not counted (what ``fp8lm train``
  reports as ``act_bytes_per_token``), and its ratio to bf16 without checkpointing;
- ``peak_step_bytes``: a training step (forward, backward, optimizer step) measured as ``fp8lm
  train`` measures its last one (`fp8lm.memory.PeakMemory`: on the CPU, the training state before
  the step plus the most bytes the step's tensors hold at once), after one step that created the
  optimizer's state;
- the budget search: the largest batch (sequences of 128 tokens) whose ``peak_step_bytes`` is at
  most ``--budget-mib``, for bf16 and O2 with FP8 activations, each without checkpointing and with
  full checkpointing. Peak bytes grow linearly with the batch: two batches fix the line, and the
  batches around its crossing are measured until the largest that fits is found.

Every figure is a byte count from the shapes and dtypes of the tensors (no timing): the same on
every machine for the same torch version. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine  # noqa: E402

import fp8lm  # noqa: E402
from fp8lm.memory import PeakMemory, memory_report  # noqa: E402
from fp8lm.train.measure import saved_tensor_bytes  # noqa: E402
from fp8lm.train.model import GPT, preset  # noqa: E402

MIB = 1 << 20
SEQ = 128
PRESETS = {
    "small": dict(name="small", arch="gpt"),
    "llama12": dict(name="small", arch="llama", n_layer=12),
}
# (level, activations): the baseline, O2 as it was, O2 with FP8-saved activations
CONFIGS = (("bf16", "bf16"), ("O2", "bf16"), ("O2", "fp8"))
MODES = ("none", "selective", "full")


def build(spec: dict, level: str, activations: str, mode: str):
    torch.manual_seed(0)
    cfg = preset(spec["name"], arch=spec["arch"], n_layer=spec.get("n_layer"), vocab_size=256, block_size=SEQ)
    model = GPT(cfg)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}], lr=1e-3)
    if level != "bf16":
        model, opt = fp8lm.initialize(model, opt, level, activations=activations)
    model.checkpoint_blocks(mode)
    return model, opt


def batch(size: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (size, SEQ), generator=torch.Generator().manual_seed(seed))


def train_step(model, opt, idx: torch.Tensor) -> None:
    with torch.autocast("cpu", torch.bfloat16):
        loss = model(idx, idx)[1]
    loss.backward()
    fp8lm.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)


def act_bytes_per_token(model, idx: torch.Tensor) -> float:
    def forward():
        with torch.autocast("cpu", torch.bfloat16):
            model(idx, idx)

    return saved_tensor_bytes(forward, exclude=model.parameters()) / idx.numel()


def peak_step_bytes(spec: dict, level: str, activations: str, mode: str, size: int) -> int:
    model, opt = build(spec, level, activations, mode)
    train_step(model, opt, batch(size, seed=1))  # the optimizer's state exists from here on
    with PeakMemory("cpu", baseline=memory_report(model, opt)["total"]) as peak:
        train_step(model, opt, batch(size, seed=2))
    return peak.total


def largest_batch(spec: dict, level: str, activations: str, mode: str, budget: int) -> dict:
    """The largest batch whose step's peak is within ``budget`` (module docstring)."""
    measured: dict[int, int] = {}

    def peak(size: int) -> int:
        if size not in measured:
            measured[size] = peak_step_bytes(spec, level, activations, mode, size)
        return measured[size]

    a, b = 1, 4
    per_sequence = max((peak(b) - peak(a)) / (b - a), 1.0)
    size = max(1, int((budget - peak(a)) / per_sequence) + a)
    while size > 1 and peak(size) > budget:
        size -= 1
    while peak(size + 1) <= budget:
        size += 1
    fits = peak(size) <= budget
    return {
        "batch": size if fits else 0,
        "tokens": (size if fits else 0) * SEQ,
        "peak_step_bytes": peak(size) if fits else None,
        "next_batch_peak_step_bytes": peak(size + 1),
        "measured": {str(k): v for k, v in sorted(measured.items())},
    }


def run_preset(key: str, spec: dict, size: int, budget: int) -> dict:
    rows = []
    for level, activations in CONFIGS:
        for mode in MODES:
            model, _ = build(spec, level, activations, mode)
            rows.append(
                {
                    "level": level,
                    "activations": activations,
                    "checkpointing": mode,
                    "act_bytes_per_token": act_bytes_per_token(model, batch(size)),
                    "peak_step_bytes": peak_step_bytes(spec, level, activations, mode, size),
                }
            )
    base = next(r for r in rows if r["level"] == "bf16" and r["checkpointing"] == "none")
    for r in rows:
        r["act_vs_bf16"] = r["act_bytes_per_token"] / base["act_bytes_per_token"]
        r["peak_vs_bf16"] = r["peak_step_bytes"] / base["peak_step_bytes"]
    budget_rows = {}
    for level, activations in (("bf16", "bf16"), ("O2", "fp8")):
        for mode in ("none", "full"):
            name = f"{level}{'+fp8_activations' if activations == 'fp8' else ''}, checkpointing {mode}"
            budget_rows[name] = largest_batch(spec, level, activations, mode, budget)
    model, _ = build(spec, "bf16", "bf16", "none")
    return {
        "preset": key,
        "model_config": model.config.to_dict(),
        "num_params": model.num_params(),
        "batch": size,
        "seq_len": SEQ,
        "rows": rows,
        "budget_bytes": budget,
        "largest_batch_within_budget": budget_rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", default=",".join(PRESETS), help=f"comma-separated: {', '.join(PRESETS)}")
    parser.add_argument("--batch", type=int, default=16, help="sequences of the per-token measurements")
    parser.add_argument("--budget-mib", type=int, default=128, help="memory budget of the batch search")
    args = parser.parse_args()
    keys = [k.strip() for k in args.presets.split(",") if k.strip()]
    unknown = [k for k in keys if k not in PRESETS]
    if unknown or not keys:
        parser.error(f"unknown preset(s) {unknown}: use {', '.join(PRESETS)}")
    torch.set_num_threads(1)
    result = {
        "benchmark": "activation_memory",
        "presets": [run_preset(k, PRESETS[k], args.batch, args.budget_mib * MIB) for k in keys],
        "machine": machine(),
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
