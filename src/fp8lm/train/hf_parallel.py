"""A ``--model`` folder's tensor-parallel plan: the one ``transformers`` declares for its
architecture (the config class's ``base_model_tp_plan``, as ``from_pretrained(tp_plan="auto")``
reads it), with fp8lm's FP8 styles, and its pipeline stages.

- ``"colwise"``: `FP8ColwiseParallel`, the weight's rows (and bias) sharded; the replicated
  input's gradient summed over the ranks with the FP8 all-reduce; the local output (this rank's
  heads, its slice of the MLP's hidden features).
- ``"rowwise"``: `FP8RowwiseParallel`, the weight's columns sharded; the partial outputs summed
  with the FP8 all-reduce, replicated.
- ``"replicated_with_grad_allreduce"``: torch's `SequenceParallel` on the heads dimension. A norm
  over each head's features (qwen3's q and k norms) runs on this rank's heads with its whole
  weight, whose partial gradient is summed over the ranks after backward
  (`fp8lm.distributed.grad_sync`, as the sequence-parallel norms' are).
- ``lm_head``: `FP8ColwiseParallel` ``use_local_output=False``, vocabulary-sharded logits as a
  DTensor, the loss under torch's ``loss_parallel()`` (never gathered); a head tied to the input
  embedding stays whole on every rank, as the embedding does.

At bf16 and fp32 torch's own ``ColwiseParallel`` / ``RowwiseParallel`` (the activations and
reductions in the level's dtype). This is Megatron-LM's tensor parallelism without sequence
parallelism: embeddings, norms and the residual stream stay whole on every rank (their gradients
are equal on every rank: nothing to sum), so the model's own forward (its attention mask, its
rotary embeddings) runs unchanged; each attention layer computes its rank's heads, as
``transformers``' own tensor parallelism does. Where one input feeds several column-wise layers
(an attention layer's q, k and v, an MLP's gate and up: `shared_inputs`), the module hands it to
them as one replicated DTensor (`fp8lm.distributed.tensor_parallel.SharedReplicatedInput`), so
their input gradients are added first and summed over the ranks once: two sums of the input
gradient per decoder layer rather than five.

**Pipeline stages** (`HFPipelineStage`, ``--pp N``): stage ``s`` of ``n`` holds an equal run of the
decoder layers; the first also the token embedding, the last also the final norm and the head. Each
stage runs the model's own backbone forward from ``inputs_embeds`` (the embedded tokens, or the
hidden states the previous stage sent), so its attention mask and rotary embeddings are the
model's; the backbone then holds this stage's layers only. This fits the decoders whose backbone
is a token embedding, a list of layers and a norm, with positions applied inside the layers
(`PIPELINE_MODEL_TYPES`: llama, mistral, qwen2, qwen3; not GPT-2, which adds a position embedding
to ``inputs_embeds``, nor Gemma, which scales it). A head tied to the input embedding would be one
weight on two stages and is refused. The boundaries are
`fp8lm.train.gpt_parallel.PipelineStageModule`'s: FP8 carriers at the FP8 levels.
"""

from __future__ import annotations

import fnmatch

import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, SequenceParallel

from ..distributed.tensor_parallel import FP8ColwiseParallel, FP8RowwiseParallel, SharedReplicatedInput
from .gpt_parallel import PipelineStageModule, stage_blocks
from .hf_model import HFCausalLM

__all__ = [
    "declared_plan",
    "check_tensor_split",
    "hf_tensor_parallel_plan",
    "shared_inputs",
    "plan_sizes",
    "PLAN_STYLES",
    "HFPipelineStage",
    "check_pipeline_split",
    "pipeline_backbone",
    "PIPELINE_MODEL_TYPES",
]

PLAN_STYLES = ("colwise", "rowwise", "replicated_with_grad_allreduce")  # those fp8lm maps; others are refused


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
    if kind == "replicated_with_grad_allreduce":
        # a norm over each head's features (qwen3's q_norm, k_norm), on (batch, seq, heads, head_dim):
        # this rank's heads, the weight whole, its gradient partial until GradientSync sums it
        return SequenceParallel(sequence_dim=2, use_local_output=True)
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
    _check_head_norms(hf, declared)
    prefix = f"hf.{hf.base_model_prefix}."
    plan: dict[str, ParallelStyle] = {
        prefix + p: SharedReplicatedInput(fp8=fp8) for p in shared_inputs(model, declared)
    }
    plan |= {prefix + pattern: _style(kind, fp8) for pattern, kind in declared.items()}
    if hf.get_output_embeddings().weight is not hf.get_input_embeddings().weight:
        plan["hf.lm_head"] = _style("colwise", fp8, head=True)  # a tied head stays whole, as its embedding
    return plan


def check_tensor_split(hf_config) -> None:
    """One-line ValueErrors for a model whose declared plan ``--tp`` does not split (`declared_plan`,
    and each ``"replicated_with_grad_allreduce"`` module a norm over each head's features: checked on
    a model built on the meta device)."""
    from transformers import AutoModelForCausalLM

    declared = declared_plan(hf_config)
    if "replicated_with_grad_allreduce" in declared.values():
        with torch.device("meta"):
            _check_head_norms(AutoModelForCausalLM.from_config(hf_config, trust_remote_code=False), declared)


def _check_head_norms(hf: nn.Module, declared: dict[str, str]) -> None:
    """A one-line ValueError unless each ``"replicated_with_grad_allreduce"`` module of ``hf`` is
    what its style assumes: a norm over each head's features (one weight of ``head_dim`` values)."""
    config = hf.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    modules = dict(hf.base_model.named_modules())
    for pattern, kind in declared.items():
        if kind != "replicated_with_grad_allreduce":
            continue
        for name, module in modules.items():
            if fnmatch.fnmatchcase(name, pattern):
                shapes = [tuple(p.shape) for p in module.parameters()]
                if shapes != [(head_dim,)]:
                    raise ValueError(
                        f"--tp splits {pattern} (replicated_with_grad_allreduce) as a norm over each head's "
                        f"{head_dim} features, but its weights are {shapes}: train this model with --fsdp or data parallelism"
                    )
                break


def shared_inputs(model: HFCausalLM, declared: dict[str, str]) -> list[str]:
    """The modules (as patterns of ``declared``) whose input feeds two or more of their column-wise
    layers: an attention layer's q, k and v, an MLP's gate and up. Their input gradient is summed
    over the ranks once (`SharedReplicatedInput`). Only where every child holding weights is in the
    plan, so that nothing else in the module meets the replicated DTensor (a module with more, a
    norm on the projections' outputs say, keeps one sum per column-wise layer)."""
    children: dict[str, dict[str, str]] = {}  # parent pattern -> {child: declared style}
    for pattern, kind in declared.items():
        parent, _, child = pattern.rpartition(".")
        if parent:
            children.setdefault(parent, {})[child] = kind
    modules = dict(model.hf.base_model.named_modules())
    shared = []
    for parent, kinds in children.items():
        if sum(kind == "colwise" for kind in kinds.values()) < 2:
            continue
        instance = next((m for name, m in modules.items() if fnmatch.fnmatchcase(name, parent)), None)
        if instance is None:
            continue
        weighted = {name for name, m in instance.named_children() if any(True for _ in m.parameters())}
        if weighted <= set(kinds):
            shared.append(parent)
    return shared


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


# the backbone's modules that hold weights, when a pipeline can split it: the rest (a rotary
# embedding) is computed from positions on every stage
_BACKBONE_PARTS = ("embed_tokens", "layers", "norm")
# the model types whose backbone forward takes inputs_embeds as they are (no scaling, no position
# embedding added) and whose head's logits are the head's output (no soft-capping or scale):
# checked against the whole model at fp32 (tests/test_train_hf_model.py, by hand for the others)
PIPELINE_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def pipeline_backbone(hf: nn.Module) -> nn.Module:
    """The backbone of the ``transformers`` causal LM ``hf`` that `HFPipelineStage` splits (module
    docstring); a one-line ValueError naming what does not fit."""
    base = hf.base_model
    kind = getattr(hf.config, "model_type", type(hf).__name__)
    weighted = sorted(name for name, m in base.named_children() if any(True for _ in m.parameters()))
    fits = isinstance(getattr(base, "layers", None), nn.ModuleList) and not set(weighted) - set(_BACKBONE_PARTS)
    if kind not in PIPELINE_MODEL_TYPES or not fits:
        raise _not_split(kind)
    return base


def _not_split(kind: str) -> ValueError:
    return ValueError(
        f"--pp splits --model folders of model_type {', '.join(PIPELINE_MODEL_TYPES)} (a backbone of embed_tokens, "
        f"layers and norm), not {kind!r}: train it with --tp, --fsdp or data parallelism"
    )


def check_pipeline_split(hf_config, pp: int) -> None:
    """One-line ValueErrors for a model ``--pp pp`` cannot split: a model type other than
    `PIPELINE_MODEL_TYPES`, a layer count it does not divide, a head tied to the input embedding, a
    backbone other than `pipeline_backbone`'s (checked on a model built on the meta device)."""
    from transformers import AutoModelForCausalLM

    kind = getattr(hf_config, "model_type", type(hf_config).__name__)
    if kind not in PIPELINE_MODEL_TYPES:
        raise _not_split(kind)
    layers = int(getattr(hf_config, "num_hidden_layers", 0) or 0)
    if layers % pp:
        raise ValueError(
            f"--pp {pp} splits the {layers} decoder layers of --model, which it does not divide: pick a divisor"
        )
    if getattr(hf_config, "tie_word_embeddings", False):
        raise ValueError(
            "--pp would hold the --model head on the last stage and the input embedding it is tied to on the first "
            "(tie_word_embeddings): set it false in config.json, or train with --tp, --fsdp or data parallelism"
        )
    with torch.device("meta"):
        pipeline_backbone(AutoModelForCausalLM.from_config(hf_config, trust_remote_code=False))


class HFPipelineStage(PipelineStageModule):
    """Stage ``stage`` of ``n_stages`` of the ``--model`` folder's ``model`` (module docstring), with
    `PipelineStageModule`'s boundaries. Its parameters keep ``model``'s names (``hf.model.layers.5...``),
    so its checkpoints load into any other layout."""

    def __init__(
        self,
        model: HFCausalLM,
        stage: int,
        n_stages: int,
        micro_batch: int,
        wire_dtype: torch.dtype | None = None,
        seq_shards: int = 1,
    ) -> None:
        nn.Module.__init__(self)
        if seq_shards != 1:
            raise ValueError(
                "a --model folder's stages carry whole sequences: its tensor parallelism has no sequence split"
            )
        cfg, hf = model.config, model.hf
        base = pipeline_backbone(hf)
        self.first, self.last = stage == 0, stage == n_stages - 1
        self.boundary = (micro_batch, cfg.block_size, cfg.n_embd)
        layers = nn.ModuleList()
        for i in stage_blocks(len(base.layers), stage, n_stages):
            # keyed by the whole model's indices (the parameters' names); the backbone's own loop
            # (``self.layers[: num_hidden_layers]``) goes by insertion order: this stage's layers
            layers.add_module(str(i), base.layers[i])
        base.layers = layers
        if not self.first:
            base.embed_tokens = None  # the backbone runs from inputs_embeds
        if not self.last:
            base.norm, hf.lm_head = nn.Identity(), None
        self.hf = hf
        self.set_wire(wire_dtype)
        self.moe_aux_weight, self.moe_aux_loss = 0.0, None
        self._aux_added: list[torch.Tensor] = []

    @property
    def blocks(self) -> nn.ModuleList:  # type: ignore[override]
        """This stage's decoder layers (FSDP2 wraps them one by one)."""
        return self.hf.base_model.layers

    @property
    def lm_head(self) -> nn.Module | None:  # type: ignore[override]
        return self.hf.lm_head if self.last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = self.hf.base_model
        h = base.embed_tokens(x) if self.entry is None else self.entry(x)
        h = base(inputs_embeds=h, use_cache=False).last_hidden_state
        if self.exit is not None:
            return self.exit(h)
        return self.hf.lm_head(h)
