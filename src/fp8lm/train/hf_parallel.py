"""A ``--model`` folder's tensor-parallel plan: the one ``transformers`` declares for its
architecture (the config class's ``base_model_tp_plan``: ``"colwise"`` and ``"rowwise"`` layers,
as ``from_pretrained(tp_plan="auto")`` reads it), with fp8lm's FP8 styles.

=====================  =============================================================================
declared               style
=====================  =============================================================================
``"colwise"``          `FP8ColwiseParallel`: the weight's rows (and bias) sharded; the replicated
                       input's gradient summed over the ranks with the FP8 all-reduce; the local
                       output (this rank's heads, its slice of the MLP's hidden features)
``"rowwise"``          `FP8RowwiseParallel`: the weight's columns sharded; the partial outputs
                       summed with the FP8 all-reduce, replicated
``lm_head``            `FP8ColwiseParallel` ``use_local_output=False``: vocabulary-sharded logits
                       as a DTensor, the loss under torch's ``loss_parallel()`` (never gathered);
                       a head tied to the input embedding stays whole on every rank, as the
                       embedding does
=====================  =============================================================================

At bf16 and fp32 torch's own ``ColwiseParallel`` / ``RowwiseParallel`` (the activations and
reductions in the level's dtype). This is Megatron-LM's tensor parallelism without sequence
parallelism: embeddings, norms and the residual stream stay whole on every rank (their gradients
are equal on every rank: nothing to sum), so the model's own forward (its attention mask, its
rotary embeddings) runs unchanged; each attention layer computes its rank's heads, as
``transformers``' own tensor parallelism does. Each column-wise layer reduces its input's gradient
itself: a layer's q, k and v projections send three all-reduces where a fused one would send one.
"""

from __future__ import annotations

from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from ..distributed.tensor_parallel import FP8ColwiseParallel, FP8RowwiseParallel
from .hf_model import HFCausalLM

__all__ = ["declared_plan", "hf_tensor_parallel_plan", "plan_sizes", "PLAN_STYLES"]

PLAN_STYLES = ("colwise", "rowwise")  # the declared styles fp8lm maps; others are refused


def declared_plan(hf_config) -> dict[str, str]:
    """The tensor-parallel plan a ``transformers`` config declares for its base model; a one-line
    ValueError when it declares none or styles other than `PLAN_STYLES`."""
    plan = dict(getattr(hf_config, "base_model_tp_plan", None) or {})
    kind = getattr(hf_config, "model_type", type(hf_config).__name__)
    if not plan:
        raise ValueError(
            f"--tp splits a --model folder by the tensor-parallel plan transformers declares for its architecture, "
            f"and model_type {kind!r} declares none: train it with --fsdp or data parallelism"
        )
    odd = sorted({style for style in plan.values() if style not in PLAN_STYLES})
    if odd:
        raise ValueError(
            f"model_type {kind!r} declares {', '.join(odd)} tensor-parallel layers, which fp8lm does not split (only "
            f"{', '.join(PLAN_STYLES)}): train it with --fsdp or data parallelism"
        )
    return plan


def _style(kind: str, fp8: bool, head: bool = False) -> ParallelStyle:
    if kind == "colwise":
        if fp8:
            return FP8ColwiseParallel(use_local_output=not head)
        return ColwiseParallel(use_local_output=not head)
    return FP8RowwiseParallel() if fp8 else RowwiseParallel()


def hf_tensor_parallel_plan(model: HFCausalLM, fp8: bool) -> dict[str, ParallelStyle]:
    """The plan of the module docstring for ``model`` (FP8 styles with ``fp8``: after
    `fp8lm.initialize`), by module names of ``model``."""
    hf = model.hf
    declared = declared_plan(hf.config)
    prefix = f"hf.{hf.base_model_prefix}."
    plan = {prefix + pattern: _style(kind, fp8) for pattern, kind in declared.items()}
    if hf.get_output_embeddings().weight is not hf.get_input_embeddings().weight:
        plan["hf.lm_head"] = _style("colwise", fp8, head=True)  # a tied head stays whole, as its embedding
    return plan


def plan_sizes(hf_config) -> dict[str, int]:
    """The sizes the declared plan splits over the tensor-parallel ranks: heads, key/value heads,
    the MLP's hidden features and the vocabulary (those the config names)."""
    names = {
        "attention heads": "num_attention_heads",
        "key/value heads": "num_key_value_heads",
        "MLP features (intermediate_size)": "intermediate_size",
        "vocabulary": "vocab_size",
    }
    return {what: int(v) for what, key in names.items() if isinstance(v := getattr(hf_config, key, None), int)}
