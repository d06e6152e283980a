"""``fp8lm export``: a training run's checkpoint as a Hugging Face model folder.

The checkpoint is read through the run's own trust checks (`load_checkpoint`: regular files,
finite numbers, a shard folder that fits its metadata; the checkpoint format; weights that fit the
recorded model), its full weights taken from the file or, for a run that keeps them sharded
(any distributed layout), resharded from its DCP folder (`fp8lm.train.checkpoint.checkpoint_weights`).
The GPT becomes the standard architecture it is equal to (`hf_model`: ``GPT2LMHeadModel`` for arch
gpt, ``LlamaForCausalLM`` for arch llama) and
the library (`fp8lm.export.save_pretrained`) writes the folder. `run_model` is fp8lm's own model
of a checkpoint, as the run evaluates it, for comparisons and ``fp8lm generate``.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch
from torch import nn

from ..export import ExportError, require_hf, save_pretrained
from ..export.fp8 import weight_scheme
from ..nn import load_scaling_state_dict, scaling_state_dict
from ..recipe import DEFAULT_RECIPE, Recipe
from .amp_record import recorded_model_options
from .checkpoint import CheckpointError, checkpoint_weights, list_checkpoints, load_checkpoint
from .config import FP8_LEVELS, first_bf16_step, policy_rules
from .hf_model import HFCausalLM, HFModelConfig, build_model, model_config_from_dict
from .model import GPTConfig
from .reshard import merged_scaling
from .resume import CHECKPOINT_FORMAT, check_state_fits, saved_options
from .tokenizer import RunTokenizer, byte_tokenizer, recorded_tokenizer

__all__ = [
    "read_run_checkpoint",
    "full_weights",
    "gpt2_config",
    "gpt2_state_dict",
    "gpt2_model",
    "llama_config",
    "llama_state_dict",
    "hf_model",
    "byte_tokenizer",
    "run_tokenizer",
    "run_recipe",
    "run_initialize_options",
    "fused_layers",
    "export_run",
    "run_model",
    "run_high_precision",
    "run_autocast",
]

_TRANSPOSED = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def read_run_checkpoint(path: str | os.PathLike, step: int | None = None) -> dict:
    """The checkpoint at ``path`` (a ``step_*.pt`` file, a run folder or its ``checkpoints``
    folder; ``step``: that step's checkpoint of the folder, else the newest), trust-checked."""
    p = Path(path)
    if step is not None:
        if not p.is_dir():
            raise CheckpointError(f"--step {step} picks a checkpoint of a run folder; {str(p)!r} is not a folder")
        folder = p / "checkpoints" if (p / "checkpoints").is_dir() else p
        found = {int(c.name[5:-3]): c for c in list_checkpoints(folder)}
        if step not in found:
            have = ", ".join(map(str, sorted(found))) or "none"
            raise CheckpointError(
                f"no checkpoint of step {step} in {str(folder)!r} (steps there: {have}); pass one of those"
            )
        p = found[step]
    state = load_checkpoint(p)
    if state.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(
            f"checkpoint {state['path']!r} has format {state.get('format')!r}, this version reads {CHECKPOINT_FORMAT!r}"
        )
    if not isinstance(state.get("model_config"), dict):
        raise CheckpointError(f"checkpoint {state['path']!r} has no model_config; pass one written by fp8lm train")
    try:
        state["model_config"] = model_config_from_dict(state["model_config"])
    except (ValueError, TypeError) as e:
        raise CheckpointError(f"checkpoint {state['path']!r} records an invalid model: {e}") from None
    return state


def full_weights(state: dict) -> dict[str, torch.Tensor]:
    """The whole model's weights (float32, the GPT's names) of checkpoint ``state``: from the file,
    or from its shard folder (a distributed run's)."""
    weights = checkpoint_weights(state)
    with torch.device("meta"):
        shape = build_model(state["model_config"])
    check_state_fits(shape, {"model": weights}, repr(state["path"]))
    return {name: weights[name].float() for name in shape.state_dict()}


def gpt2_config(cfg: GPTConfig):
    """The ``transformers.GPT2Config`` that computes what ``GPT(cfg)`` (arch gpt) computes: exact
    (erf) GELU, the run's LayerNorm eps, learned positions, an untied head, the same MLP width."""
    if cfg.mlp != "gelu":
        raise ExportError(
            f"a GPT with --mlp {cfg.mlp} has no Hugging Face equivalent (GPT-2 has a GELU MLP, Llama rotary "
            "positions and RMSNorm); export runs trained with --mlp gelu or --arch llama"
        )
    require_hf()
    from transformers import GPT2Config

    return GPT2Config(
        vocab_size=cfg.vocab_size,
        n_positions=cfg.block_size,
        n_embd=cfg.n_embd,
        n_layer=cfg.n_layer,
        n_head=cfg.n_head,
        n_inner=cfg.mlp_hidden,
        activation_function="gelu",
        resid_pdrop=cfg.dropout,
        embd_pdrop=cfg.dropout,
        attn_pdrop=cfg.dropout,
        layer_norm_epsilon=cfg.norm_eps,
        scale_attn_weights=True,
        scale_attn_by_inverse_layer_idx=False,
        reorder_and_upcast_attn=False,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )


def gpt2_state_dict(weights: dict[str, torch.Tensor], cfg: GPTConfig) -> dict[str, torch.Tensor]:
    """``GPT`` weights under ``GPT2LMHeadModel``'s names: its ``Conv1D`` layers hold (in, out)
    weights (transposed); a GPT without biases gets zero biases (what it adds)."""
    out = {}
    for name, value in weights.items():
        if name == "lm_head.weight":
            out[name] = value
            continue
        hf = name.replace("blocks.", "h.", 1) if name.startswith("blocks.") else name
        out["transformer." + hf] = value.t().contiguous() if name.endswith(_TRANSPOSED) else value
    if not cfg.bias:
        widths = {"ln_1": cfg.n_embd, "ln_2": cfg.n_embd, "attn.c_attn": 3 * cfg.n_embd}
        widths |= {"attn.c_proj": cfg.n_embd, "mlp.c_fc": cfg.mlp_hidden, "mlp.c_proj": cfg.n_embd}
        for i in range(cfg.n_layer):
            for layer, width in widths.items():
                out[f"transformer.h.{i}.{layer}.bias"] = torch.zeros(width)
        out["transformer.ln_f.bias"] = torch.zeros(cfg.n_embd)
    return out


def gpt2_model(weights: dict[str, torch.Tensor], cfg: GPTConfig) -> nn.Module:
    """A ``transformers.GPT2LMHeadModel`` (float32, eval mode) holding ``GPT(cfg)``'s ``weights``."""
    from transformers import GPT2LMHeadModel

    model = GPT2LMHeadModel(gpt2_config(cfg))
    model.load_state_dict(gpt2_state_dict(weights, cfg), strict=True)
    return model.eval()


def llama_config(cfg: GPTConfig):
    """The ``transformers.LlamaConfig`` that computes what ``GPT(cfg)`` (arch llama) computes:
    RMSNorm, rotary positions ("rotate half", base ``rope_theta``), grouped-query attention with
    ``n_kv_head`` heads, a SwiGLU MLP, no biases, an untied head."""
    require_hf()
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.n_embd,
        intermediate_size=cfg.mlp_hidden,
        num_hidden_layers=cfg.n_layer,
        num_attention_heads=cfg.n_head,
        num_key_value_heads=cfg.n_kv_head,
        head_dim=cfg.head_dim,
        max_position_embeddings=cfg.block_size,
        rms_norm_eps=cfg.norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        hidden_act="silu",
        attention_bias=False,
        attention_dropout=cfg.dropout,
        mlp_bias=False,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )


def llama_state_dict(weights: dict[str, torch.Tensor], cfg: GPTConfig) -> dict[str, torch.Tensor]:
    """``GPT`` (arch llama) weights under ``LlamaForCausalLM``'s names: the fused k/v layer split
    into ``k_proj`` and ``v_proj``, the fused SwiGLU layer into ``gate_proj`` and ``up_proj``
    (the order in which the GPT's forward chunks their outputs)."""
    out = {
        "model.embed_tokens.weight": weights["wte.weight"],
        "model.norm.weight": weights["ln_f.weight"],
        "lm_head.weight": weights["lm_head.weight"],
    }
    for i in range(cfg.n_layer):
        ours, theirs = f"blocks.{i}.", f"model.layers.{i}."
        k, v = weights[ours + "attn.c_kv.weight"].chunk(2, dim=0)
        gate, up = weights[ours + "mlp.c_fc.weight"].chunk(2, dim=0)
        out |= {
            theirs + "input_layernorm.weight": weights[ours + "ln_1.weight"],
            theirs + "post_attention_layernorm.weight": weights[ours + "ln_2.weight"],
            theirs + "self_attn.q_proj.weight": weights[ours + "attn.c_q.weight"],
            theirs + "self_attn.k_proj.weight": k.contiguous(),
            theirs + "self_attn.v_proj.weight": v.contiguous(),
            theirs + "self_attn.o_proj.weight": weights[ours + "attn.c_proj.weight"],
            theirs + "mlp.gate_proj.weight": gate.contiguous(),
            theirs + "mlp.up_proj.weight": up.contiguous(),
            theirs + "mlp.down_proj.weight": weights[ours + "mlp.c_proj.weight"],
        }
    return out


def llama_model(weights: dict[str, torch.Tensor], cfg: GPTConfig) -> nn.Module:
    """A ``transformers.LlamaForCausalLM`` (float32, eval mode) holding ``GPT(cfg)``'s ``weights``."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM(llama_config(cfg))
    model.load_state_dict(llama_state_dict(weights, cfg), strict=True)
    return model.eval()


def hf_model(weights: dict[str, torch.Tensor], cfg: GPTConfig) -> nn.Module:
    """The Hugging Face model equal to ``GPT(cfg)`` with ``weights``: `gpt2_model` or `llama_model`;
    a ``--model`` folder's run: its own ``transformers`` model (float32, eval mode)."""
    if isinstance(cfg, HFModelConfig):
        model = HFCausalLM(cfg)
        model.load_state_dict(weights, strict=True)
        return model.hf.eval()
    if cfg.moe_experts:
        return mixtral_model(weights, cfg)
    return llama_model(weights, cfg) if cfg.arch == "llama" else gpt2_model(weights, cfg)


def check_mixtral(cfg: GPTConfig) -> None:
    """Refuse, in one line, a mixture that ``MixtralForCausalLM`` does not compute: Mixtral is the
    llama architecture with softmax top-k routing (weights renormalized), SwiGLU experts, no shared
    expert and no token dropping."""
    differences = [
        (cfg.arch != "llama", f"--arch {cfg.arch} (Mixtral is the llama architecture)"),
        (cfg.moe_router != "softmax", f"--moe-router {cfg.moe_router} (Mixtral routes by softmax)"),
        (cfg.moe_top_k < 2, "--moe-top-k 1 (Mixtral renormalizes the chosen weights: 1 for one expert)"),
        (cfg.moe_shared_expert, "--moe-shared-expert (Mixtral has none)"),
        (cfg.moe_capacity_factor is not None, "--moe-capacity-factor (Mixtral drops no token)"),
    ]
    given = [text for differs, text in differences if differs]
    if given:
        raise ExportError(
            f"fp8lm export writes a mixture of experts as transformers' MixtralForCausalLM, which does not have "
            f"this run's {', '.join(given)}; fp8lm generate runs its checkpoint"
        )


def mixtral_config(cfg: GPTConfig):
    """The ``transformers.MixtralConfig`` that computes what ``GPT(cfg)`` (arch llama with
    ``moe_experts``) computes: `llama_config`'s attention and norms, ``moe_experts`` SwiGLU experts
    of ``mlp_hidden``, ``moe_top_k`` of them per token."""
    check_mixtral(cfg)
    from transformers import MixtralConfig

    llama = llama_config(cfg).to_dict()
    keep = [
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "rope_parameters",
        "hidden_act", "attention_dropout", "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id",
    ]  # fmt: skip
    return MixtralConfig(
        **{k: llama[k] for k in keep},
        num_local_experts=cfg.moe_experts,
        num_experts_per_tok=cfg.moe_top_k,
        router_aux_loss_coef=cfg.moe_aux_loss_coef,
        router_jitter_noise=0.0,
        sliding_window=None,
    )


def mixtral_state_dict(weights: dict[str, torch.Tensor], cfg: GPTConfig) -> dict[str, torch.Tensor]:
    """``GPT`` (arch llama, ``moe_experts``) weights under ``MixtralForCausalLM``'s names: the
    attention and norms as `llama_state_dict` names them, the router as ``mlp.gate``, each block's
    experts stacked: ``experts.gate_up_proj`` (E, 2 hidden, dim; gate first, as the GPT's SwiGLU
    chunks) and ``experts.down_proj`` (E, dim, hidden)."""
    out = {
        "model.embed_tokens.weight": weights["wte.weight"],
        "model.norm.weight": weights["ln_f.weight"],
        "lm_head.weight": weights["lm_head.weight"],
    }
    for i in range(cfg.n_layer):
        ours, theirs = f"blocks.{i}.", f"model.layers.{i}."
        k, v = weights[ours + "attn.c_kv.weight"].chunk(2, dim=0)
        experts = range(cfg.moe_experts)
        out |= {
            theirs + "input_layernorm.weight": weights[ours + "ln_1.weight"],
            theirs + "post_attention_layernorm.weight": weights[ours + "ln_2.weight"],
            theirs + "self_attn.q_proj.weight": weights[ours + "attn.c_q.weight"],
            theirs + "self_attn.k_proj.weight": k.contiguous(),
            theirs + "self_attn.v_proj.weight": v.contiguous(),
            theirs + "self_attn.o_proj.weight": weights[ours + "attn.c_proj.weight"],
            theirs + "mlp.gate.weight": weights[ours + "mlp.router.weight"],
            theirs + "mlp.experts.gate_up_proj": torch.stack([weights[f"{ours}mlp.c_fc.weight.{e}"] for e in experts]),
            theirs + "mlp.experts.down_proj": torch.stack([weights[f"{ours}mlp.c_proj.weight.{e}"] for e in experts]),
        }
    return out


def mixtral_model(weights: dict[str, torch.Tensor], cfg: GPTConfig) -> nn.Module:
    """A ``transformers.MixtralForCausalLM`` (float32, eval mode) holding ``GPT(cfg)``'s ``weights``."""
    from transformers import MixtralForCausalLM

    model = MixtralForCausalLM(mixtral_config(cfg))
    model.load_state_dict(mixtral_state_dict(weights, cfg), strict=True)
    return model.eval()


def run_tokenizer(state: dict) -> RunTokenizer:
    """The tokenizer checkpoint ``state`` records (bytes for checkpoints that record none)."""
    return recorded_tokenizer(state.get("tokenizer"))


def export_run(
    path: str | os.PathLike,
    out: str | os.PathLike,
    format: str = "hf",
    step: int | None = None,
    overwrite: bool = False,
    input_activations: str = "bf16",
) -> Path:
    """Export the checkpoint of a run (see `read_run_checkpoint`) to the folder ``out`` in
    ``format`` (``"hf"`` or ``"hf-fp8"``, `fp8lm.export.save_pretrained`, as its
    ``input_activations``)."""
    state = read_run_checkpoint(path, step)
    cfg = state["model_config"]
    recipe = run_recipe(state)
    if format == "hf-fp8":
        weight_scheme(recipe)  # a recipe without an exact FP8 format is refused before the conversion
    model = hf_model(full_weights(state), cfg)
    tokenizer = run_tokenizer(state)
    return save_pretrained(
        model,
        out,
        format=format,
        tokenizer=tokenizer.hf,
        readme=_readme(state, format, input_activations),
        overwrite=overwrite,
        recipe=recipe,
        fused=fused_layers(cfg),
        input_activations=input_activations,
    )


def run_recipe(state: dict) -> Recipe | None:
    """The recipe checkpoint ``state``'s FP8 layers computed with (None at the levels without FP8
    GEMMs: their weights were never FP8 operands)."""
    if state.get("opt_level") not in FP8_LEVELS:
        return None
    return run_initialize_options(state)["recipe"]


def run_initialize_options(state: dict) -> dict:
    """The `fp8lm.initialize` options that built checkpoint ``state``'s model (FP8 levels): its
    ``--recipe`` and ``--policy``, or what the run passed from code (`TrainConfig.amp_options`,
    as the checkpoint records them)."""
    options = recorded_model_options(state)
    if "recipe" not in options:
        options["recipe"] = Recipe.from_name((state.get("config") or {}).get("recipe") or DEFAULT_RECIPE)
    rules = policy_rules(saved_options(state).get("policy"))
    if rules:  # a run has --policy or the policy option, never both (TrainConfig refuses it)
        options["policy"] = rules
    return options


def fused_layers(cfg: GPTConfig | HFModelConfig) -> list[tuple[str, ...]]:
    """The Hugging Face linear layers that are one layer of ``GPT(cfg)``, stacked along the output
    rows (`fp8lm.export.save_pretrained`'s ``fused``): a Llama's or Mixtral's ``k_proj``/``v_proj``
    (fp8lm's ``c_kv``) and a Llama's ``gate_proj``/``up_proj`` (``c_fc``)."""
    if isinstance(cfg, HFModelConfig) or cfg.arch != "llama":
        return []
    groups: list[tuple[str, ...]] = []
    for i in range(cfg.n_layer):
        layer = f"model.layers.{i}."
        groups.append((layer + "self_attn.k_proj", layer + "self_attn.v_proj"))
        if not cfg.moe_experts:
            groups.append((layer + "mlp.gate_proj", layer + "mlp.up_proj"))
    return groups


def _readme(state: dict, format: str, input_activations: str = "bf16") -> str:
    cfg: GPTConfig | HFModelConfig = state["model_config"]
    checkpoint = Path(state["path"])
    run = checkpoint.parent.parent if checkpoint.parent.name == "checkpoints" else checkpoint.parent
    weights = "BF16"
    if format == "hf-fp8":
        scheme = weight_scheme(run_recipe(state))
        weights = (
            f"E4M3 weights of the linear layers, {scheme.describe()} (compressed-tensors {scheme.format}), "
            "output head and the rest in BF16"
        )
        if input_activations == "fp8":
            weights += "; the linear layers' inputs E4M3, scaled per batch in the recipe's blocks (W8A8)"
    recipe = _recipe_name(run_recipe(state))
    if isinstance(cfg, HFModelConfig):
        architecture = ", ".join(cfg.hf_config.get("architectures") or [cfg.model_type])
    else:
        architecture = "LlamaForCausalLM" if cfg.arch == "llama" else "GPT2LMHeadModel"
        architecture = "MixtralForCausalLM" if cfg.moe_experts else architecture
    return "\n".join(
        [
            f"# {run.name} (step {state['step']})",
            "",
            f"A GPT trained with fp8lm at opt level {state.get('opt_level')} (recipe {recipe}), exported from "
            f"the run `{run.name}`, checkpoint `{checkpoint.name}`, as `{architecture}`.",
            "",
            f"- model: {cfg.n_layer} layers, {cfg.n_head} heads, width {cfg.n_embd}, context {cfg.block_size}, "
            f"vocabulary {cfg.vocab_size} ({run_tokenizer(state).describe()})",
            f"- format `{format}`: {weights}",
            "",
            "```python",
            "from transformers import AutoModelForCausalLM, AutoTokenizer",
            'model = AutoModelForCausalLM.from_pretrained("THIS_FOLDER")',
            'tokenizer = AutoTokenizer.from_pretrained("THIS_FOLDER")',
            "```",
            "",
        ]
    )


def _recipe_name(recipe: Recipe | None) -> str:
    if recipe is None:
        return "none: no FP8 GEMMs"
    return recipe.name or "custom: " + ", ".join(f"{k}={v}" for k, v in recipe.to_dict().items())


def run_model(state: dict, weights: dict[str, torch.Tensor] | None = None) -> nn.Module:
    """fp8lm's own model of checkpoint ``state`` as the run evaluates it: the GPT at the run's opt
    level (FP8 layers with the run's recipe, ``--policy`` and saved scaling state; in high
    precision where the run's last step computed them so: `run_high_precision`), in eval mode.
    Use it under `run_autocast`."""
    cfg = state["model_config"]
    model = build_model(cfg)
    model.load_state_dict(full_weights(state) if weights is None else weights)
    level = state.get("opt_level")
    if level in FP8_LEVELS:
        from ..amp import initialize

        model, _ = initialize(model, None, level, **run_initialize_options(state))
        own = scaling_state_dict(model)
        load_scaling_state_dict(model, merged_scaling(state["ranks"], model, own))
        high = run_high_precision(state)
        for name, layer in model.named_modules():
            if hasattr(layer, "high_precision") and (high is True or name in high):
                layer.high_precision = True
    return model.eval()


def run_high_precision(state: dict) -> bool | set[str]:
    """The FP8 layers checkpoint ``state``'s last step computed in high precision: True for all
    of them (a step of ``--final-bf16-fraction``'s last ones), else the names ``--fallback`` had
    moved (none without it)."""
    options = saved_options(state)
    fraction, steps = options.get("final_bf16_fraction") or 0.0, options.get("steps") or 0
    first = first_bf16_step(steps, fraction)
    if first is not None and int(state["step"]) > first:  # the checkpoint's last step, 0-based, is step - 1
        return True
    fallback = state.get("fallback") or {}
    return {name for name, on in (fallback.get("high_precision") or {}).items() if on}


def run_autocast(state: dict):
    """The autocast the run evaluated in: BF16 at every level but fp32."""
    from .run import BF16Autocast

    return contextlib.nullcontext() if state.get("opt_level") == "fp32" else BF16Autocast("cpu")
