"""FP8 numerics telemetry: how well each tensor fits the format it is cast to.

Per tensor: its amax, the scale it is (or was) cast with, the fraction of its non-zero values
that underflow to zero, and the fraction that saturate at the format's max. `quantization_stats`
measures a high-precision tensor about to be cast; `stored_stats` an already quantized one
(where the lost values can no longer be seen, zeros stand in for underflow).

The experts of a mixture (`fp8lm.nn.FP8GroupedLinear`) are recorded one by one, as layers named
``<layer>.expert<e>``: each expert's tokens, weight, output gradient, weight gradient and moments
have scales of their own, and a rarely routed expert is where a scale fails first.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch.distributed.tensor import DTensor

from .formats import E4M3, E5M2, Format
from .nn.checkpoint import is_recomputing
from .nn.grouped import group_counts
from .ops.blocks import block_amax, from_blocks, per_block, to_blocks
from .ops.cast import amax
from .ops.finegrained import operand_block, quantize_operand
from .optim.dtensor import local_tensor
from .recipe import Recipe, recipe_from
from .scaling import compute_scale
from .tensor import ScalingTensor

__all__ = [
    "TensorStats",
    "quantization_stats",
    "block_stats",
    "block_amax_spread",
    "stored_stats",
    "Telemetry",
    "KINDS",
    "worst",
]


@dataclass(frozen=True)
class TensorStats:
    amax: float
    scale: float
    underflow: float  # fraction of non-zero values that become zero
    saturation: float  # fraction of values beyond the format's max after scaling (clipped)

    def as_dict(self) -> dict:
        return asdict(self)


def quantization_stats(x: torch.Tensor, fmt: Format, scale: torch.Tensor | float) -> TensorStats:
    """Stats of casting ``x`` to ``fmt`` with ``scale`` (``payload = cast(x * scale)``)."""
    scale = torch.as_tensor(scale, dtype=torch.float32, device=x.device)
    scaled = x.detach().abs().to(torch.float32) * scale
    nonzero = int(torch.count_nonzero(x))
    # Round-to-nearest-even sends everything at or below half the smallest subnormal to zero.
    lost = int(torch.count_nonzero((scaled <= fmt.min_subnormal / 2) & (scaled > 0))) if nonzero else 0
    saturated = int(torch.count_nonzero(scaled > fmt.max))
    return TensorStats(
        amax=float(scaled.max() / scale) if x.numel() else 0.0,
        scale=float(scale),
        underflow=lost / nonzero if nonzero else 0.0,
        saturation=saturated / max(x.numel(), 1),
    )


def block_stats(x: torch.Tensor, recipe: Recipe, role: str) -> TensorStats:
    """Stats of ``x`` quantized as the ``role`` operand of a fine-grained ``recipe`` (along its
    last dimension, as its first GEMM reads it), block by block: ``underflow`` the non-zero values
    that quantize to zero, ``saturation`` the values beyond the elements' max (6 for nvfp4's E2M1)
    after their block's scale, ``scale`` that of the block holding the amax."""
    x2 = x.detach().reshape(-1, x.shape[-1]).to(torch.float32)
    # nvfp4 rounds output gradients stochastically: its noise comes from a generator of this call,
    # so that observing a run does not move torch's global generator, which the training GEMMs draw on
    generator = None
    if recipe.granularity == "nvfp4" and role == "grad_output":
        generator = torch.Generator(device=x2.device).manual_seed(0)
    operand = quantize_operand(x2, recipe, role, generator=generator)
    nonzero = int(torch.count_nonzero(x2))
    lost = int(torch.count_nonzero((operand.dequantize() == 0) & (x2 != 0)))
    fmt = {"input": recipe.input_format, "weight": recipe.weight_format, "grad_output": recipe.grad_output_format}
    fmax = 6.0 if recipe.granularity == "nvfp4" else fmt[role].max
    scaled = from_blocks(to_blocks(x2.abs(), operand.block) / per_block(operand.d), x2.shape)
    return TensorStats(
        amax=float(x2.abs().max()) if x2.numel() else 0.0,
        scale=float(operand.d.max().reciprocal()) if x2.numel() else 1.0,
        underflow=lost / nonzero if nonzero else 0.0,
        saturation=int(torch.count_nonzero(scaled > fmax)) / max(x2.numel(), 1),
    )


def block_amax_spread(x: torch.Tensor, recipe: Recipe | str, role: str) -> float:
    """Binades between the largest and the smallest non-zero block amax of ``x`` in the blocks of
    the ``role`` operand of a fine-grained ``recipe`` (as `block_stats` blocks it): ``log2(max /
    min)``, 0 for a tensor with fewer than two non-zero blocks, inf where a block holds inf, NaN
    where one holds NaN. Next to one tensor-wide scale's range (E4M3: 17.8 binades from the
    largest value to the smallest subnormal) it says how much of it the tensor's blocks would need.
    ``recipe``: an `fp8lm.Recipe` or its name."""
    recipe = recipe_from(recipe, "block_amax_spread")
    x2 = x.detach().reshape(-1, x.shape[-1]).to(torch.float32)
    if x2.numel() == 0:
        return 0.0
    block = operand_block(recipe, role, x2.shape, 1)
    amaxes = block_amax(to_blocks(x2, block)).flatten()
    if bool(amaxes.isnan().any()):
        return float("nan")
    positive = amaxes > 0  # no boolean indexing: a tensor-parallel layer's tensors are DTensors
    if int(positive.sum()) < 2:
        return 0.0
    smallest = torch.where(positive, amaxes, torch.full_like(amaxes, float("inf"))).amin()
    return float(torch.log2(amaxes.amax().double() / smallest.double()))


def _local(grad: torch.Tensor | None) -> torch.Tensor | None:
    """This rank's part of a gradient (or weight): the local shard of a DTensor's (FSDP2, tensor
    parallel), an FP8 `ScalingTensor` where the gradient is stored in FP8. Its records describe the shard: a
    training loop merges those of one layer's shards (the app takes each figure's worst)."""
    return grad._local_tensor if isinstance(grad, DTensor) else grad


def stored_stats(t: ScalingTensor) -> TensorStats:
    """Stats of a quantized tensor: zeros stand in for underflow, values at +-max for saturation
    (an upper bound: values that rounded up to the max count too)."""
    mags = t.payload.to(torch.float32).abs()
    n = max(t.numel(), 1)
    return TensorStats(
        amax=float(mags.max() / t.scale) if t.numel() else 0.0,
        scale=float(t.scale),
        underflow=int(torch.count_nonzero(mags == 0)) / n,
        saturation=int(torch.count_nonzero(mags >= t.fmt.max)) / n,
    )


# -- recording during training ------------------------------------------------------------------

KINDS = ("input", "weight", "grad_output", "weight_grad", "exp_avg", "exp_avg_sq")


class Telemetry:
    """Records `TensorStats` of every FP8 layer's tensors every ``every`` steps.

    Usage in a training loop::

        telemetry = Telemetry(model, optimizer, every=50)
        for step in range(steps):
            with telemetry.step(step):      # forward and backward of this step
                loss = model(x).loss
                loss.backward()
            records = telemetry.after_backward()   # weight gradients; [] on unsampled steps
            optimizer.step()
            records += telemetry.after_optimizer_step()  # optimizer moments

    Hooks are attached only for the sampled steps, so unsampled steps cost nothing. Each record
    is a dict: step, layer, kind (one of `KINDS`), fmt and the `TensorStats` fields.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, every: int = 100):
        from .nn.grouped import FP8GroupedLinear  # telemetry sits above nn: it observes FP8 layers
        from .nn.linear import FP8Linear

        if every < 1:
            raise ValueError(f"telemetry interval must be >= 1 step, got {every}")
        self.every = every
        self.optimizer = optimizer
        self.layers = {name: m for name, m in model.named_modules() if isinstance(m, FP8Linear)}
        self._names = {id(m.weight): name for name, m in self.layers.items()}
        self.grouped = {name: m for name, m in model.named_modules() if isinstance(m, FP8GroupedLinear)}
        self._counts: dict[str, list[int]] = {}  # a grouped layer's tokens per expert in this step's forwards
        self._step: int | None = None
        self._pending: list[dict] = []

    def sampled(self, step: int) -> bool:
        return step % self.every == 0

    def rescales(self) -> dict[str, int]:
        """How many times each delayed-scaled stream met an outlier (a spike, or the drop after
        one) and was scaled from its own amax instead (`fp8lm.ScalingMeta`), keyed
        ``"<layer>.input"`` / ``"<layer>.grad_output"``; streams with none are left out. Counted
        on every step, not only sampled ones."""
        counts = {}
        for name, layer in self.layers.items():
            for kind, meta in (("input", layer.input_meta), ("grad_output", layer.grad_output_meta)):
                n = int(meta.rescales)
                if n:
                    counts[f"{name}.{kind}"] = n
        return counts

    def step(self, step: int):
        """Context manager around a step's forward and backward; records on sampled steps."""
        return _RecordingWindow(self, step)

    def _record(self, layer: str, kind: str, fmt: Format, stats: TensorStats, **extra: float) -> None:
        """One record; ``extra``: more figures of it (a fine-grained layer's ``amax_spread``)."""
        record = {"step": self._step, "layer": layer, "kind": kind, "fmt": fmt.name, **stats.as_dict(), **extra}
        self._pending.append(record)

    def _attach(self) -> list:
        handles = []
        for name, layer in self.layers.items():

            def on_input(module, args, name=name):
                if is_recomputing():  # activation checkpointing's second forward: recorded once already
                    return
                x = _local(args[0])
                w = _local(module.weight)  # this rank's shard of a tensor-parallel layer's weight
                if module.recipe.fine_grained:
                    self._record_blocks(name, module, {"input": x, "weight": _weight_value(w)})
                    return
                meta = module.input_meta
                scale = _scale_in_use(module, meta, x, E4M3)
                self._record(name, "input", E4M3, quantization_stats(x, E4M3, scale))
                value = w.dequantize() if isinstance(w, ScalingTensor) else w.detach()
                self._record(
                    name, "weight", E4M3, quantization_stats(value, E4M3, compute_scale(value.abs().amax(), E4M3))
                )

            def on_grad_output(module, grad_output, name=name):
                # this rank's part, as its layer quantizes it: a tensor-parallel head's logits are
                # a DTensor sharded over the vocabulary (`_local`)
                g = _local(grad_output[0])
                if module.recipe.fine_grained:
                    self._record_blocks(name, module, {"grad_output": g})
                    return
                meta = module.grad_output_meta
                scale = _scale_in_use(module, meta, g, E5M2)
                self._record(name, "grad_output", E5M2, quantization_stats(g, E5M2, scale))

            handles.append(layer.register_forward_pre_hook(on_input))
            handles.append(layer.register_forward_hook(_on_output_gradient(on_grad_output)))
        for name, experts in self.grouped.items():
            handles.append(experts.register_forward_pre_hook(self._on_grouped_input(name)))
            handles.append(experts.register_forward_hook(self._on_grouped_output(name)))
        return handles

    def _record_blocks(self, name: str, layer, tensors: dict[str, torch.Tensor]) -> None:
        """`block_stats` of a fine-grained layer's tensors, keyed by role."""
        recipe = layer.recipe
        formats = {
            "input": recipe.input_format,
            "weight": recipe.weight_format,
            "grad_output": recipe.grad_output_format,
        }
        for role, x in tensors.items():
            spread = block_amax_spread(x, recipe, role)
            self._record(name, role, formats[role], block_stats(x, recipe, role), amax_spread=spread)

    def _on_grouped_input(self, name: str):
        def hook(module, args):
            if is_recomputing():
                return
            x = args[0].detach()
            counts = group_counts(args[1], module.num_experts, x.shape[0])
            step = self._counts.setdefault(name, [0] * len(counts))
            self._counts[name] = [a + b for a, b in zip(step, counts)]
            for e, (rows, w) in enumerate(zip(x.split(counts), module.weight)):
                if w is None:  # held by another rank
                    continue
                expert = f"{name}.expert{e}"
                if rows.shape[0]:  # each group of tokens is scaled from its own amax
                    scale = compute_scale(amax(rows), E4M3, module.recipe.margin)
                    self._record(expert, "input", E4M3, quantization_stats(rows, E4M3, scale))
                value = w.dequantize() if isinstance(w, ScalingTensor) else w.detach()
                self._record(expert, "weight", E4M3, quantization_stats(value, E4M3, compute_scale(amax(value), E4M3)))

        return hook

    def _on_grouped_output(self, name: str):
        """A forward hook: the gradient of this forward's output, split by this forward's counts
        (a pipeline schedule runs every micro-batch's forward before their backwards)."""

        def hook(module, args, output):
            if not (isinstance(output, torch.Tensor) and output.requires_grad):
                return
            counts = group_counts(args[1], module.num_experts, output.shape[0])

            def on_grad(grad: torch.Tensor) -> None:
                for e, rows in enumerate(grad.detach().split(counts)):
                    if rows.shape[0]:
                        scale = compute_scale(amax(rows), E5M2, module.recipe.margin)
                        self._record(f"{name}.expert{e}", "grad_output", E5M2, quantization_stats(rows, E5M2, scale))

            output.register_hook(on_grad)

        return hook

    def after_backward(self) -> list[dict]:
        """Weight-gradient stats of a sampled step; returns the step's records so far."""
        if self._step is None:
            return []
        for name, layer in self.layers.items():
            grad = _local(layer.weight.grad)
            if isinstance(grad, ScalingTensor):
                self._record(name, "weight_grad", grad.fmt, stored_stats(grad))
            elif grad is not None and layer.high_precision and layer.weight_grad_format.is_fp8:
                # kept in high precision by the fallback: measured as FP8 would store it (its own
                # amax's scale), so that the fallback can tell when it may return to FP8
                fmt = layer.weight_grad_format
                scale = compute_scale(grad.detach().abs().amax().float(), fmt)
                self._record(name, "weight_grad", fmt, quantization_stats(grad, fmt, scale))
        for name, experts in self.grouped.items():
            counts = self._counts.get(name, [])
            for e, w in experts.held_weights():
                # an expert without tokens this step has an all-zero gradient: nothing was lost
                grad = _local(w.grad)
                if isinstance(grad, ScalingTensor) and e < len(counts) and counts[e] > 0:
                    self._record(f"{name}.expert{e}", "weight_grad", grad.fmt, stored_stats(grad))
        self._counts.clear()
        return self._flush()

    def after_optimizer_step(self) -> list[dict]:
        """Stats of the FP8 optimizer's stored moments on a sampled step (FP8Adam/FP8AdamW)."""
        if self._step is None or self.optimizer is None:
            return []
        weights = [(name, layer.weight) for name, layer in self.layers.items()]
        weights += [(f"{n}.expert{e}", w) for n, layer in self.grouped.items() for e, w in layer.held_weights()]
        for name, weight in weights:
            state = self.optimizer.state.get(weight, {})
            for kind in ("exp_avg", "exp_avg_sq"):
                if kind + "_scale" in state:
                    # this rank's shard, as for the gradients: a DTensor's stats would reduce over
                    # its whole mesh (a collective per figure, and a host sync) on every rank
                    stored = ScalingTensor(local_tensor(state[kind]), local_tensor(state[kind + "_scale"]))
                    self._record(name, kind, stored.fmt, stored_stats(stored))
        self._step = None
        return self._flush()

    def _flush(self) -> list[dict]:
        out, self._pending = self._pending, []
        return out


def _weight_value(w: torch.Tensor) -> torch.Tensor:
    return w.dequantize() if isinstance(w, ScalingTensor) else w.detach()


def _scale_in_use(layer, meta, x: torch.Tensor, fmt: Format) -> torch.Tensor:
    """The scale the layer casts ``x`` with: the delayed scale once it has history; just in time
    otherwise, and for a layer running in high precision (what FP8 would do if switched back)."""
    if layer.fp8_enabled and not layer.high_precision and meta.delayed and meta.step > 0:
        return meta.scale
    return compute_scale(x.detach().abs().amax(), fmt)


class _RecordingWindow:
    def __init__(self, telemetry: Telemetry, step: int):
        self.telemetry = telemetry
        self.step = step
        self.handles: list = []

    def __enter__(self):
        sampled = self.telemetry.sampled(self.step)
        self.telemetry._step = self.step if sampled else None
        if sampled:
            self.handles = self.telemetry._attach()
        return self.telemetry

    def __exit__(self, *exc):
        for handle in self.handles:
            handle.remove()
        return False


def _on_output_gradient(on_grad_output):
    """A forward hook that has ``on_grad_output(module, (grad,))`` called with the gradient of the
    module's output, by a hook on the output tensor. Why not a module's full backward hook: it
    returns the output as a view (``BackwardHookFunction``), which an in-place op on it refuses and
    which FSDP2 warns about when it is the model's own output (the head's logits). Under activation
    checkpointing only the forward whose output the loss reaches fires: once per step."""

    def hook(module, args, output):
        if isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(lambda grad: on_grad_output(module, (grad,)))

    return hook


def worst(records: list[dict], key: str = "underflow", top: int = 10) -> list[dict]:
    """The ``top`` records with the largest ``key`` (underflow or saturation)."""
    return sorted(records, key=lambda r: r[key], reverse=True)[:top]
