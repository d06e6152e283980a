"""The run behind `fp8lm dpo`: DPO of a pretrained GPT against a frozen reference copy of it.

The policy trains like `fp8lm train` at its level (bf16 autocast, ``fp8lm.initialize`` from O1,
FP8AdamW from O2); the reference is the starting checkpoint frozen: in E4M3 (`fp8lm.nn.freeze_fp8`,
about one byte per parameter) at the FP8 levels, in BF16 at ``bf16``. Same conventions as
``train``: ``metrics.jsonl``, atomic checkpoints (they hold the reference too, so ``--resume`` needs
no ``--init-from``), a bit-for-bit resume, ``summary.json`` written last. One process only.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from ..amp import initialize
from ..grad import clip_grad_norm_
from ..memory import memory_report
from ..nn import freeze_fp8, load_scaling_state_dict, scaling_state_dict
from .checkpoint import CheckpointError, atomic_write_bytes, load_checkpoint, save_checkpoint
from .config import FP8_LEVELS, RunError, TrainConfig, default_device
from .data import pack, path_documents, stdlib_documents
from .dpo_loss import dpo_loss, sequence_logprobs, token_kl
from .loop import check_output, lr_at
from .model import GPT, GPTConfig
from .preference import PairBatch, PairSampler, builtin_pairs, encode_pairs, read_pairs, split_pairs
from .run import BF16Autocast

__all__ = ["DPOConfig", "dpo", "SUMMARY_KEYS"]

CHECKPOINT_FORMAT = "fp8lm.dpo/1"
BUILTIN_TRAIN_PAIRS, BUILTIN_HELD_OUT_PAIRS = 8192, 256
SUMMARY_KEYS = ("dpo_loss", "reward_accuracy", "reward_margin", "kl_to_reference", "policy_bytes_per_param",
                "reference_bytes_per_param", "tokens_per_s")


@dataclass
class DPOConfig(TrainConfig):
    """`TrainConfig` with DPO's defaults: ``data`` is a JSON Lines file of pairs (None: the built-in
    set), ``batch_size`` counts pairs, the model comes from ``init_from``."""

    beta: float = 0.1
    opt_level: str = "O2"
    steps: int = 200
    lr: float = 3e-4
    warmup_steps: int | None = 10
    weight_decay: float = 0.0
    eval_every: int = 50
    out: str = "runs/dpo"
    telemetry_every: int = 0

    def validate(self) -> None:
        super().validate()
        if not self.beta > 0:
            raise RunError(f"--beta must be > 0, got {self.beta}")
        if not (self.init_from or self.resume):
            raise RunError("fp8lm dpo starts from a trained model: pass --init-from CHECKPOINT (a step_*.pt or a run folder)")
        if self.hf_dataset or self.telemetry_every or self.fallback or self.grad_accum != 1:
            raise RunError("fp8lm dpo does not take --hf-dataset, --telemetry-every, --fallback or --grad-accum")
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise RunError("fp8lm dpo runs in one process; launch it without torchrun")


def _autocast(cfg: DPOConfig, device: torch.device):
    return contextlib.nullcontext() if cfg.opt_level == "fp32" else BF16Autocast(device.type)


def _preferences(cfg: DPOConfig, mcfg: GPTConfig, out: Path):
    """(training pairs, held-out pairs, description of the data)."""
    if cfg.data:
        if Path(cfg.data).is_dir():
            raise RunError(f"--data {cfg.data!r} is a folder; fp8lm dpo reads a JSON Lines file of pairs")
        train, held_out = split_pairs(read_pairs(cfg.data), cfg.val_fraction)
        return train, held_out, {"source": f"jsonl:{Path(cfg.data).resolve()}"}
    splits = pack(*stdlib_documents(), cfg.cache_dir or out / "cache", 0.05)
    prompt, answer = mcfg.block_size // 2, mcfg.block_size // 4
    train = builtin_pairs(splits.train, BUILTIN_TRAIN_PAIRS, prompt, answer, seed=0)
    held_out = builtin_pairs(splits.val, BUILTIN_HELD_OUT_PAIRS, prompt, answer, seed=1)
    return train, held_out, {"source": "builtin:" + splits.info["source"], "prompt_bytes": prompt, "answer_bytes": answer}


def _reference(mcfg: GPTConfig, weights: dict, opt_level: str, device: torch.device) -> GPT:
    """The frozen reference: E4M3 at the FP8 levels, BF16 at bf16, FP32 at fp32."""
    model = GPT(mcfg)
    model.load_state_dict(weights)
    model.to(device)
    if opt_level in FP8_LEVELS:
        return freeze_fp8(model)
    if opt_level == "bf16":
        model.to(torch.bfloat16)
    return model.requires_grad_(False).eval()


def _policy(cfg: DPOConfig, mcfg: GPTConfig, weights: dict, device: torch.device):
    torch.manual_seed(cfg.seed)
    model = GPT(mcfg)
    model.load_state_dict(weights)
    model.to(device)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=1e-8)
    if cfg.opt_level in FP8_LEVELS:
        model, optimizer = initialize(model, optimizer, cfg.opt_level, **cfg.initialize_options())
    return model, optimizer


def _pair_logps(model, batch: PairBatch, autocast):
    with autocast:
        logits = model(batch.inputs)[0]
    return logits, sequence_logprobs(logits, batch.targets, batch.mask)


@torch.no_grad()
def _evaluate(policy, reference, pairs, cfg: DPOConfig, autocast, device) -> dict:
    """DPO loss, reward accuracy and margin, and per-token KL to the reference on held-out pairs."""
    policy.eval()
    sums = dict.fromkeys(("dpo_loss", "reward_accuracy", "reward_margin", "kl_to_reference"), 0.0)
    for start in range(0, len(pairs), cfg.batch_size):
        chunk = pairs[start : start + cfg.batch_size]
        batch = encode_pairs(chunk, policy.config.block_size).to(device)
        logits, logps = _pair_logps(policy, batch, autocast)
        ref_logits, ref_logps = _pair_logps(reference, batch, autocast)
        n = batch.pairs
        terms = dpo_loss(logps[:n], logps[n:], ref_logps[:n], ref_logps[n:], cfg.beta)
        sums["dpo_loss"] += float(terms.loss) * n
        sums["reward_accuracy"] += float(terms.accuracy) * n
        sums["reward_margin"] += float(terms.margins.sum())
        sums["kl_to_reference"] += float(token_kl(logits, ref_logits, batch.mask)) * n
    policy.train()
    return {k: v / len(pairs) for k, v in sums.items()}


class _Metrics:
    """metrics.jsonl; on resume the lines past the checkpoint's step are dropped."""

    def __init__(self, path: Path, keep_until_step: int | None) -> None:
        lines = path.read_text().splitlines() if keep_until_step is not None and path.exists() else []
        self.records = [r for r in map(json.loads, filter(str.strip, lines)) if r["step"] <= keep_until_step]
        atomic_write_bytes(path, "".join(json.dumps(r) + "\n" for r in self.records).encode())
        self.file = open(path, "a")

    def write(self, record: dict) -> None:
        self.records.append(record)
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()


def _check_resume(cfg: DPOConfig, state: dict) -> None:
    if state.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(f"checkpoint {state['path']!r} is not a DPO checkpoint (format {state.get('format')!r}); "
                              "resume it with the command that wrote it")
    if int(state["step"]) >= cfg.steps:
        raise RunError(f"the run in {cfg.out!r} already reached step {state['step']}; pass --steps larger than that to continue it")
    for name in ("opt_level", "beta", "batch_size", "lr", "seed", "data"):
        if state["config"][name] != getattr(cfg, name):
            flag = "--" + name.replace("_", "-")
            raise CheckpointError(f"checkpoint {state['path']!r} was trained with {flag} {state['config'][name]}, "
                                  f"not {getattr(cfg, name)}; resume with the same {flag}")


class _DPORun:
    """Policy, optimizer, frozen reference and pair sampler of one run, and their checkpoint."""

    def __init__(self, cfg: DPOConfig, state: dict, resuming: bool, device: torch.device) -> None:
        self.cfg, self.device = cfg, device
        if "model_config" not in state:
            raise CheckpointError(f"checkpoint {state['path']!r} has no model_config; pass one written by fp8lm train")
        self.mcfg = GPTConfig.from_dict(state["model_config"])
        self.train_pairs, self.held_out, self.data_info = _preferences(cfg, self.mcfg, Path(cfg.out))
        self.reference = _reference(self.mcfg, state["reference"] if resuming else state["model"], cfg.opt_level, device)
        self.policy, self.optimizer = _policy(cfg, self.mcfg, state["model"], device)
        self.sampler = PairSampler(self.train_pairs, cfg.batch_size, cfg.seed)
        self.autocast = _autocast(cfg, device)
        self.step_count = 0
        if resuming:
            self.optimizer.load_state_dict(state["optimizer"])
            load_scaling_state_dict(self.policy, state["scaling"])
            self.sampler.load_state_dict(state["sampler"])
            torch.set_rng_state(state["rng"])
            self.step_count = int(state["step"])

    def step(self, lr: float) -> tuple[dict, int]:
        """One optimizer step on a batch of pairs: its metrics and the tokens it ran through the policy."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        batch = encode_pairs(self.sampler.next(), self.mcfg.block_size).to(self.device)
        _, logps = _pair_logps(self.policy, batch, self.autocast)
        with torch.no_grad():
            _, ref_logps = _pair_logps(self.reference, batch, self.autocast)
        n = batch.pairs
        terms = dpo_loss(logps[:n], logps[n:], ref_logps[:n], ref_logps[n:], self.cfg.beta)
        terms.loss.backward()
        max_norm = self.cfg.grad_clip if self.cfg.grad_clip > 0 else math.inf
        grad_norm = float(clip_grad_norm_(self.policy.parameters(), max_norm))
        if math.isfinite(grad_norm):  # an inf/NaN gradient: skip the update rather than poison the weights
            self.optimizer.step()
        self.step_count += 1
        if self.step_count == self.cfg.steps:  # training state at its fullest, gradients included
            self.memory = memory_report(self.policy, self.optimizer)
        self.optimizer.zero_grad(set_to_none=True)
        record = {"step": self.step_count, "dpo_loss": float(terms.loss.detach()), "reward_accuracy": float(terms.accuracy),
                  "reward_margin": float(terms.margins.mean()), "lr": lr, "grad_norm": grad_norm}
        return record, batch.inputs.numel()

    def evaluate(self) -> dict:
        return _evaluate(self.policy, self.reference, self.held_out, self.cfg, self.autocast, self.device)

    def save(self, directory: Path) -> None:
        state = {
            "format": CHECKPOINT_FORMAT, "step": self.step_count, "opt_level": self.cfg.opt_level,
            "model_config": self.mcfg.to_dict(), "model": self.policy.state_dict(),
            "reference": self.reference.state_dict(),  # plain tensors, exact: they load back into the same formats
            "optimizer": self.optimizer.state_dict(), "scaling": scaling_state_dict(self.policy),
            "sampler": self.sampler.state_dict(), "rng": torch.get_rng_state(),
            "config": {k: v for k, v in self.cfg.to_dict().items() if k != "amp_options"},
        }
        save_checkpoint(state, directory, self.step_count, self.cfg.keep_checkpoints)


def dpo(cfg: DPOConfig) -> dict:
    """Run DPO as ``cfg`` says; returns the summary (also written to ``<out>/summary.json``, last).
    Everything that can be wrong with the inputs is checked before anything is written."""
    cfg.validate()
    out = Path(cfg.out)
    resuming = check_output(cfg)
    device = torch.device(cfg.device or default_device())
    state = load_checkpoint(out / "checkpoints" if resuming else cfg.init_from)
    if resuming:
        _check_resume(cfg, state)
    run = _DPORun(cfg, state, resuming, device)
    (out / "checkpoints").mkdir(parents=True, exist_ok=True)
    (out / "summary.json").unlink(missing_ok=True)
    metrics = _Metrics(out / "metrics.jsonl", run.step_count if resuming else None)
    bar = tqdm(total=cfg.steps, initial=run.step_count, disable=not cfg.progress, desc=f"dpo {cfg.opt_level}",
               unit="step", dynamic_ncols=True)
    warmup = cfg.steps // 10 if cfg.warmup_steps is None else cfg.warmup_steps
    start, train_time, timed_tokens = run.step_count, 0.0, 0
    try:
        while run.step_count < cfg.steps:
            t0 = time.perf_counter()
            record, tokens = run.step(lr_at(run.step_count, cfg.lr, warmup, cfg.steps, cfg.min_lr_ratio))
            if run.step_count > start + 1 or run.step_count == cfg.steps:  # the first step warms up: not timed
                train_time += time.perf_counter() - t0
                timed_tokens += tokens
            done = run.step_count
            if done % cfg.eval_every == 0 or done == cfg.steps:
                record.update({f"val_{k}": v for k, v in run.evaluate().items()})
                bar.write(f"step {done}: dpo loss {record['dpo_loss']:.4f}, held-out reward accuracy "
                          f"{record['val_reward_accuracy']:.3f}, margin {record['val_reward_margin']:.3f}", )
            metrics.write(record)
            bar.set_postfix(loss=f"{record['dpo_loss']:.3f}", refresh=False)
            bar.update(1)
            if (cfg.save_every and done % cfg.save_every == 0) or done == cfg.steps:
                run.save(out / "checkpoints")
    finally:
        bar.close()
        metrics.file.close()
    summary = _summary(cfg, run, metrics.records, timed_tokens / train_time if train_time else None)
    atomic_write_bytes(out / "summary.json", json.dumps(summary, indent=1, default=repr).encode())
    return summary


def _summary(cfg: DPOConfig, run: _DPORun, records: list[dict], tokens_per_s: float | None) -> dict:
    final = records[-1]
    reference_memory = memory_report(run.reference)
    policy_bytes = run.memory["bytes_per_param"]
    return {
        "dpo_loss": final["val_dpo_loss"],  # held-out pairs, after the last step
        "reward_accuracy": final["val_reward_accuracy"],
        "reward_margin": final["val_reward_margin"],
        "kl_to_reference": final["val_kl_to_reference"],  # nats per answer token
        "policy_bytes_per_param": policy_bytes,  # weights, gradients, optimizer state
        "reference_bytes_per_param": reference_memory["bytes_per_param"],
        "total_bytes_per_param": policy_bytes + reference_memory["bytes_per_param"],
        "tokens_per_s": tokens_per_s,  # through the policy, training steps after the first
        "train_dpo_loss": sum(r["dpo_loss"] for r in records[-10:]) / len(records[-10:]),
        "opt_level": cfg.opt_level,
        "steps": cfg.steps,
        "beta": cfg.beta,
        "pairs": {"train": len(run.train_pairs), "held_out": len(run.held_out), **run.data_info},
        "policy_memory": run.memory,
        "reference_memory": reference_memory,
        "model_config": run.mcfg.to_dict(),
        "device": str(run.device),
        "config": cfg.to_dict(),
    }
