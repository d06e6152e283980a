"""The mixture of experts in FP8: bytes per parameter at O2, the experts' grouped FP8 GEMMs against
one FP8Linear per expert, the expert-parallel all-to-all's bytes, and (from an ``fp8lm compare``
of a mixture) each level's gap to bf16 and the router's load balance; printed as JSON.

- ``bytes_per_param``: `fp8lm.memory_report` of a GPT with ``--experts`` experts per block after
  one O2 step (weights, FP8 gradients, FP8AdamW moments, scales), and the share of its parameters
  that are experts';
- ``grouped_vs_loop``: one forward + backward of `FP8GroupedLinear` (``--experts`` experts,
  ``--tokens`` rows routed top-2 by a random router) against the same rows through one
  `FP8Linear` per expert (the same FP8 GEMMs), milliseconds on this machine's CPU, and whether
  their outputs are equal;
- ``all_to_all_vs_bf16``: bytes of the expert-parallel rows (`pack_rows`: an E4M3 payload and one
  exponent byte per 128 features) over BF16 rows, per width;
- ``cuda_trace`` (with ``--trace``, or alone with ``--trace-only``): one training step of
  `FP8GroupedLinear` and of one `FP8Linear` per expert, and of a whole `MoE` layer at O1 and bf16,
  on fake CUDA tensors (`benchmarks/cuda_trace.py`'s machinery: the H200 code path, nothing
  computed): kernel launches, GEMMs, MB read and written outside them, and host syncs;
- ``compare`` (with ``--compare DIR``, the ``--out`` of ``fp8lm compare --seeds ...``): per level
  the mean gap to bf16 over the seeds and, per seed, the router's load balance
  (``summary.json``'s ``moe``: busiest expert over the mean, coefficient of variation).

    python benchmarks/moe.py [--preset small] [--experts 8] [--tokens 8192] [--compare runs/moe]
    python benchmarks/moe.py --compare-only --compare runs/moe   # the summary alone, no timing
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
from common import emit, machine, median_time
from torch import nn

import fp8lm
from fp8lm.distributed.expert_parallel import pack_rows
from fp8lm.nn import FP8GroupedLinear, FP8Linear, GroupedLinear, MoE
from fp8lm.train.model import GPT, preset


def bytes_per_param(preset_name: str, experts: int, top_k: int) -> dict:
    torch.manual_seed(0)
    cfg = preset(preset_name, moe_experts=experts, moe_top_k=top_k)
    model = GPT(cfg)
    n = sum(p.numel() for p in model.parameters())
    expert_params = sum(
        p.numel() for name, p in model.named_parameters() if ".c_fc.weight." in name or ".c_proj.weight." in name
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = fp8lm.initialize(model, opt, "O2")
    idx = torch.randint(0, cfg.vocab_size, (2, cfg.block_size))
    model(idx, idx)[1].backward()
    opt.step()
    report = fp8lm.memory_report(model, opt)
    return {
        "preset": preset_name,
        "experts": experts,
        "top_k": top_k,
        "num_params": n,
        "expert_share": expert_params / n,
        "bytes_per_param": report["bytes_per_param"],
        "memory": report,
    }


def grouped_vs_loop(experts: int, tokens: int, width: int, hidden: int, reps: int) -> dict:
    torch.manual_seed(1)
    plain = GroupedLinear(experts, width, hidden)
    grouped = FP8GroupedLinear.from_grouped(plain)
    loop = []
    for w in grouped.weight:
        layer = FP8Linear(width, hidden, bias=False, recipe="tensorwise-current")
        layer.weight = torch.nn.Parameter(fp8lm.quantize(w.dequantize(), fp8lm.FP16))
        loop.append(layer)
    chosen = torch.randn(tokens, experts).topk(2).indices.reshape(-1)
    counts = torch.bincount(chosen, minlength=experts).tolist()
    x = torch.randn(len(chosen), width)
    g = torch.randn(len(chosen), hidden)

    def run_grouped():
        xi = x.clone().requires_grad_()
        y = grouped(xi, counts)
        y.backward(g)
        return y

    def run_loop():
        xi = x.clone().requires_grad_()
        y = torch.cat([layer(rows) for layer, rows in zip(loop, xi.split(counts))])
        y.backward(g)
        return y

    same = torch.equal(run_grouped().detach(), run_loop().detach())
    return {
        "experts": experts,
        "rows": len(chosen),
        "width": width,
        "hidden": hidden,
        "grouped_ms": median_time(run_grouped, reps) * 1e3,
        "loop_of_fp8linear_ms": median_time(run_loop, reps) * 1e3,
        "outputs_equal": same,
    }


class _Grouped(nn.Module):
    """The experts' layer over fixed token groups (the trace's model), the counts on the device."""

    def __init__(self, experts: int, width: int, hidden: int, counts: list[int]) -> None:
        super().__init__()
        self.experts = GroupedLinear(experts, width, hidden)
        self.register_buffer("counts", torch.tensor(counts))

    def forward(self, x):
        return self.experts(x, self.counts)


class _Loop(nn.Module):
    """One linear layer per expert over the same groups (sizes known on the host)."""

    def __init__(self, experts: int, width: int, hidden: int, counts: list[int]) -> None:
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(width, hidden, bias=False) for _ in range(experts))
        self.counts = counts

    def forward(self, x):
        return torch.cat([layer(rows) for layer, rows in zip(self.experts, x.split(self.counts))])


class _Mixture(nn.Module):
    """A whole mixture-of-experts layer (router, top-2, the experts' two layers, combine)."""

    def __init__(self, experts: int, width: int, hidden: int, counts: list[int]) -> None:
        super().__init__()
        self.moe = MoE(width, hidden, experts, top_k=2)

    def forward(self, x):
        return self.moe(x)


TRACED = {
    "grouped": (_Grouped, "O1"),
    "grouped_rowwise": (_Grouped, "O1-rowwise"),
    "loop_of_fp8linear": (_Loop, "O1"),
    "moe_layer": (_Mixture, "O1"),
    "moe_layer_bf16": (_Mixture, None),
}


def cuda_trace(experts: int, tokens: int, width: int, hidden: int, models: list[str] | None = None) -> dict:
    """One training step of the models on fake CUDA tensors (benchmarks/cuda_trace.py's machinery:
    an H200's code path, nothing computed): kernel launches, bytes outside the GEMMs and host
    syncs, forward and backward, and (``next_microbatch``) a further step with the weights
    unchanged, as in gradient accumulation. ``grouped`` and ``loop_of_fp8linear``: one experts' layer over
    ``tokens`` rows routed top-2 at random, O1 storage with FP16 weights and current scaling (as the
    grouped layer scales its groups), ``grouped_rowwise`` the same layer under the rowwise recipe;
    ``moe_layer``: a whole `MoE` layer (``tokens`` tokens, top-2)
    the same way, and ``moe_layer_bf16`` at bf16."""
    import cuda_trace as ct
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fp8lm.policy import preset

    ct.load_fake_cuda_guard()
    ct.pretend_hopper()
    torch.manual_seed(0)  # the same random routing every run
    chosen = torch.randn(tokens, experts).topk(2).indices.reshape(-1)
    counts = torch.bincount(chosen, minlength=experts).tolist()
    log = ct.OpLog()
    real_compile = torch.compile
    torch.compile = lambda fn=None, **_: log.fused_region(fn)
    out: dict = {"experts": experts, "tokens": tokens, "rows": len(chosen), "width": width, "hidden": hidden}
    try:
        with FakeTensorMode(), log:
            for name in models or list(TRACED):
                cls, variant = TRACED[name]
                with torch.device("cuda"):
                    model = cls(experts, width, hidden, counts)
                    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
                    if variant is not None:
                        level, _, recipe = variant.partition("-")
                        policy = preset(level, output_head=False).with_linear(weight=fp8lm.FP16)
                        model, optimizer = fp8lm.initialize(
                            model, optimizer, level, policy=policy, recipe=recipe or "tensorwise-current"
                        )
                rows = tokens if cls is _Mixture else len(chosen)
                x = torch.randn(rows, width, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                step, microbatch = ct.trace_step(model, optimizer, x, log)
                summary = ct.summarize(step)
                out[name] = {phase: summary[phase]["total"] for phase in ("forward", "backward")}
                out[name]["total"] = summary["total"]
                out[name]["next_microbatch"] = ct.totals(microbatch)  # the weights unchanged since
                out[name]["gemm_ops"] = sorted({r["op"] for r in step if r["category"] == "gemm"})
    finally:
        torch.compile = real_compile
    return out


def all_to_all_ratio(widths: list[int]) -> dict:
    out = {}
    for c in widths:
        wire = pack_rows(torch.randn(4, c), fp8lm.E4M3)
        out[str(c)] = wire[0].numel() / (2 * c)
    return out


def compare_summary(folder: Path) -> dict:
    result = json.loads((folder / "compare.json").read_text())
    levels = result["levels"]
    balance: dict[str, dict] = {}
    for seed in result.get("seeds", []):
        for level in levels:
            summary = json.loads((folder / f"seed{seed}" / level / "summary.json").read_text())
            moe = summary["moe"]
            balance.setdefault(level, {})[str(seed)] = {
                "max_over_mean": moe["load_max_over_mean"],
                "cv": moe["load_cv"],
                "final_val_loss": summary["val_loss"],
            }
    means = {
        level: {
            "max_over_mean": statistics.fmean(b["max_over_mean"] for b in per_seed.values()),
            "cv": statistics.fmean(b["cv"] for b in per_seed.values()),
        }
        for level, per_seed in balance.items()
    }
    return {
        "gap_vs_bf16": {level: row["rel_gap_vs_bf16"] for level, row in levels.items()},
        "gap_std": {level: row.get("gap_std") for level, row in levels.items()},
        "gaps_vs_bf16": {level: row.get("gaps_vs_bf16") for level, row in levels.items()},
        # each level's gap minus fp32's, paired by seed (fp8lm compare's; only with fp32 among the levels)
        "minus_fp32": {level: row["minus_fp32"] for level, row in levels.items() if "minus_fp32" in row},
        "bytes_per_param": {level: row["bytes_per_param"] for level, row in levels.items()},
        "load_balance_mean": means,
        "load_balance_per_seed": balance,
        "steps": result["steps"],
        "num_params": result["num_params"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--trace", action="store_true", help="also trace both on fake CUDA tensors")
    parser.add_argument("--trace-shape", default="8x8192x2048x8192", help="EXPERTSxTOKENSxWIDTHxHIDDEN of the trace")
    parser.add_argument("--compare", type=Path, default=None, help="an fp8lm compare --seeds output folder")
    parser.add_argument("--results", type=Path, default=None, help="also write the JSON here")
    parser.add_argument("--trace-only", action="store_true", help="only the fake-CUDA trace (no CPU timing)")
    parser.add_argument("--compare-only", action="store_true", help="only --compare's summary (no CPU timing)")
    args = parser.parse_args()
    if args.compare_only:
        if args.compare is None:
            parser.error("--compare-only needs --compare DIR (an fp8lm compare --seeds output folder)")
        emit({"machine": machine(), "compare": compare_summary(args.compare)}, args.results)
        return
    if args.trace_only:
        e, t, w, h = (int(v) for v in args.trace_shape.split("x"))
        emit({"machine": machine(), "cuda_trace": cuda_trace(e, t, w, h)}, args.results)
        return
    out = {
        "machine": machine(),
        "bytes_per_param": bytes_per_param(args.preset, args.experts, args.top_k),
        "grouped_vs_loop": grouped_vs_loop(args.experts, args.tokens, args.width, args.hidden, args.reps),
        "all_to_all_vs_bf16": all_to_all_ratio([32, 128, 768, 4096]),
    }
    if args.trace:
        e, t, w, h = (int(v) for v in args.trace_shape.split("x"))
        out["cuda_trace"] = cuda_trace(e, t, w, h)
    if args.compare is not None:
        out["compare"] = compare_summary(args.compare)
    emit(out, args.results)


if __name__ == "__main__":
    main()
