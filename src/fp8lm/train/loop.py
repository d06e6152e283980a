"""The training loop behind `fp8lm train`: one GPT run at one precision level (see `config`)."""

from __future__ import annotations

import contextlib
import json
import math
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from ..amp import initialize
from ..grad import clip_grad_norm_
from ..memory import memory_report
from ..nn import load_scaling_state_dict, scaling_state_dict
from .checkpoint import CheckpointError, atomic_write_bytes, list_checkpoints, load_checkpoint, save_checkpoint
from .config import FP8_LEVELS, RunError, TrainConfig, default_device
from .data import BatchSampler, eval_batches, hf_documents, pack, path_documents, stdlib_documents
from .measure import saved_tensor_bytes
from .model import GPT

__all__ = ["train", "check_output", "lr_at"]

CHECKPOINT_FORMAT = "fp8lm.train/1"


def lr_at(step: int, lr: float, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """Learning rate of 0-based ``step``: linear warmup over ``warmup_steps``, then cosine decay
    from ``lr`` to ``lr * min_lr_ratio`` at the last step."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    decay_steps = max(total_steps - 1 - warmup_steps, 1)
    progress = min((step - warmup_steps) / decay_steps, 1.0)
    return lr * (min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def _documents(cfg: TrainConfig):
    if cfg.hf_dataset:
        return hf_documents(cfg.hf_dataset)
    if cfg.data:
        return path_documents(cfg.data)
    return stdlib_documents()


def _check_state_fits(model: GPT, state: dict, where: str) -> None:
    """Raise one clear line when a checkpoint's weights do not fit ``model`` (a plain GPT)."""
    own, theirs = model.state_dict(), state["model"]
    wrong = [k for k in own if k in theirs and tuple(theirs[k].shape) != tuple(own[k].shape)]
    missing = [k for k in own if k not in theirs]
    if not (wrong or missing):
        return
    first = (wrong or missing)[0]
    detail = f"has shape {tuple(theirs[first].shape)}, this model needs {tuple(own[first].shape)}" if wrong else "is missing"
    saved = state.get("model_config") or {}
    diff = ", ".join(f"{k}={v} (here {getattr(model.config, k)})" for k, v in saved.items()
                     if hasattr(model.config, k) and getattr(model.config, k) != v)
    raise CheckpointError(
        f"checkpoint {where} does not fit this model: {first!r} {detail}"
        + (f"; it was trained with {diff}" if diff else "")
        + "; pass --model/--n-layer/--n-head/--n-embd/--mlp/--seq-len to match it"
    )


def _autocast(cfg: TrainConfig, device: torch.device):
    if cfg.opt_level == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16)


def _build_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    # nanoGPT: weight decay on matrices (and embeddings), none on norms and biases.
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=1e-8)


class _Metrics:
    """metrics.jsonl, one line per step; on resume the lines past the checkpoint are dropped."""

    def __init__(self, path: Path, keep_until_step: int | None) -> None:
        self.path = path
        self.records: list[dict] = []
        if keep_until_step is not None and path.exists():
            lines = (json.loads(line) for line in path.read_text().splitlines() if line.strip())
            self.records = [r for r in lines if r["step"] <= keep_until_step]
        atomic_write_bytes(path, "".join(json.dumps(r) + "\n" for r in self.records).encode())
        self.file = open(path, "a")
        self.writer = _tensorboard_writer(path.parent)

    def write(self, record: dict) -> None:
        self.records.append(record)
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.writer is not None:
            for k, v in record.items():
                if k != "step" and isinstance(v, float):
                    self.writer.add_scalar(k, v, record["step"])

    def close(self) -> None:
        self.file.close()
        if self.writer is not None:
            self.writer.close()


def _tensorboard_writer(logdir: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # tensorboard is optional
        return None
    return SummaryWriter(str(logdir / "tensorboard"))


@torch.no_grad()
def _evaluate(model, batches, autocast, device) -> float:
    model.eval()
    total = 0.0
    for x, y in batches:
        with autocast:
            _, loss = model(x.to(device), y.to(device))
        total += loss.item()
    model.train()
    return total / len(batches)


def check_output(cfg: TrainConfig) -> None:
    """Refuse to start over a finished or checkpointed run (unless resuming), or to resume nothing."""
    out = Path(cfg.out)
    if not cfg.resume and ((out / "summary.json").exists() or list_checkpoints(out / "checkpoints")):
        raise RunError(f"{str(out)!r} already holds a training run; pass --resume to continue it or choose another --out")
    if cfg.resume and not list_checkpoints(out / "checkpoints"):
        raise RunError(f"--resume: no checkpoint in {str(out / 'checkpoints')!r}; run without --resume to start training")


def train(cfg: TrainConfig) -> dict:
    """Train one GPT as ``cfg`` says; returns the summary (also written to ``<out>/summary.json``).

    Everything that can be wrong with the inputs is checked before anything is written, and
    ``summary.json`` is written last, atomically, so a failed run never looks complete.
    """
    cfg.validate()
    out = Path(cfg.out)
    check_output(cfg)
    device = torch.device(cfg.device or default_device())
    mcfg = cfg.model_config()
    source, docs = _documents(cfg)

    torch.manual_seed(cfg.seed)
    model = GPT(mcfg)
    if cfg.init_from:
        init = load_checkpoint(cfg.init_from)
        _check_state_fits(model, init, repr(init["path"]))
        model.load_state_dict({k: init["model"][k] for k in model.state_dict()})
    resume = None
    if cfg.resume:
        resume = load_checkpoint(out / "checkpoints")
        _check_state_fits(model, resume, repr(resume["path"]))
        if int(resume["step"]) >= cfg.steps:
            raise RunError(f"the run in {str(out)!r} already reached step {resume['step']}; pass --steps larger than that to continue it")
        if resume.get("opt_level") != cfg.opt_level:
            raise CheckpointError(
                f"checkpoint {resume['path']!r} was trained at opt level {resume.get('opt_level')}, "
                f"not {cfg.opt_level}; resume with --opt-level {resume.get('opt_level')}"
            )
    model.to(device)
    optimizer = _build_optimizer(model, cfg)
    if cfg.opt_level in FP8_LEVELS:
        model, optimizer = initialize(model, optimizer, opt_level=cfg.opt_level, **cfg.initialize_options())

    splits = pack(source, docs, cfg.cache_dir or out / "cache", cfg.val_fraction)
    seq_len = mcfg.block_size
    sampler = BatchSampler(splits.train, cfg.batch_size, seq_len, cfg.seed)
    val_set = eval_batches(splits.val, cfg.eval_batches, cfg.batch_size, seq_len)

    start_step, skipped = 0, 0
    if resume is not None:
        _restore(resume, model, optimizer, sampler, device)
        start_step, skipped = int(resume["step"]), int(resume["skipped_steps"])

    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").unlink(missing_ok=True)
    metrics = _Metrics(out / "metrics.jsonl", keep_until_step=start_step if resume is not None else None)
    autocast = _autocast(cfg, device)
    tokens_per_step = cfg.batch_size * cfg.grad_accum * seq_len
    train_time, timed_steps = 0.0, 0
    warmup = cfg.steps // 10 if cfg.warmup_steps is None else cfg.warmup_steps
    bar = _progress(cfg, start_step)
    try:
        for step in range(start_step, cfg.steps):
            t0 = time.perf_counter()
            lr = lr_at(step, cfg.lr, warmup, cfg.steps, cfg.min_lr_ratio)
            for group in optimizer.param_groups:
                group["lr"] = lr
            loss_sum = torch.zeros((), device=device)
            for _ in range(cfg.grad_accum):
                x, y = sampler.next()
                with autocast:
                    _, loss = model(x.to(device), y.to(device))
                (loss / cfg.grad_accum).backward()
                loss_sum += loss.detach()
            grad_norm = float(clip_grad_norm_(model.parameters(), cfg.grad_clip if cfg.grad_clip > 0 else math.inf))
            if math.isfinite(grad_norm):
                optimizer.step()
            else:  # an inf/NaN gradient: skip the update rather than poison the weights
                skipped += 1
            if step + 1 == cfg.steps:  # training state at its fullest: weights, gradients, moments
                mem = memory_report(model, optimizer)
            optimizer.zero_grad(set_to_none=True)
            train_loss = loss_sum.item() / cfg.grad_accum
            done = step + 1
            if step > start_step or done == cfg.steps:  # the first step compiles and warms up: not timed
                timed_steps += 1
                train_time += time.perf_counter() - t0
            record = {"step": done, "train_loss": train_loss, "lr": lr, "grad_norm": grad_norm,
                      "tokens": done * tokens_per_step}
            if done % cfg.eval_every == 0 or done == cfg.steps:
                record["val_loss"] = _evaluate(model, val_set, autocast, device)
                bar.write(f"step {done}: train loss {train_loss:.4f}, val loss {record['val_loss']:.4f}")
                sys.stdout.flush()  # seen at once also when piped to a file
            metrics.write(record)
            if timed_steps:
                bar.set_postfix(loss=f"{train_loss:.3f}", tok_s=f"{timed_steps * tokens_per_step / train_time:,.0f}",
                                refresh=False)
            bar.update(1)
            if (cfg.save_every and done % cfg.save_every == 0) or done == cfg.steps:
                _save(cfg, mcfg, out, done, skipped, model, optimizer, sampler, device)
    finally:
        bar.close()
        metrics.close()

    # Measured after the final checkpoint, on the first validation batch: this forward pass
    # changes FP8 scaling histories, which no longer matters.
    x, y = val_set[0]
    act_bytes = saved_tensor_bytes(lambda: _forward_loss(model, x.to(device), y.to(device), autocast),
                                   exclude=model.parameters())
    last = [r["train_loss"] for r in metrics.records[-10:]]
    summary = {
        "opt_level": cfg.opt_level,
        "steps": cfg.steps,
        "tokens": cfg.steps * tokens_per_step,
        "train_loss": sum(last) / len(last),  # mean of the last (up to) 10 steps
        "val_loss": metrics.records[-1]["val_loss"],
        "tokens_per_s": timed_steps * tokens_per_step / train_time,  # training steps after the first
        "act_bytes_per_token": act_bytes / x.numel(),
        "bytes_per_param": mem["bytes_per_param"],
        "memory": mem,
        "skipped_steps": skipped,
        "num_params": sum(p.numel() for p in model.parameters()),
        "model_config": mcfg.to_dict(),
        "data": splits.info,
        "device": str(device),
        "config": cfg.to_dict(),  # amp_options may hold callables: written as their repr
    }
    atomic_write_bytes(out / "summary.json", json.dumps(summary, indent=1, default=repr).encode())
    return summary


def _forward_loss(model, x, y, autocast):
    with autocast:
        return model(x, y)[1]


def _progress(cfg: TrainConfig, start_step: int):
    return tqdm(total=cfg.steps, initial=start_step, disable=not cfg.progress, desc=f"train {cfg.opt_level}",
                unit="step", dynamic_ncols=True)


def _restore(state: dict, model, optimizer, sampler: BatchSampler, device: torch.device) -> None:
    model.load_state_dict(state["model"])
    load_scaling_state_dict(model, state["scaling"])
    optimizer.load_state_dict(state["optimizer"])
    sampler.load_state_dict(state["sampler"])
    torch.set_rng_state(state["rng"]["torch"])
    if device.type == "cuda" and state["rng"]["cuda"]:
        torch.cuda.set_rng_state_all(state["rng"]["cuda"])


def _save(cfg, mcfg, out, step, skipped, model, optimizer, sampler, device) -> None:
    state = {
        "format": CHECKPOINT_FORMAT,
        "step": step,
        "opt_level": cfg.opt_level,
        "model_config": mcfg.to_dict(),
        "model": model.state_dict(),
        "scaling": scaling_state_dict(model),  # FP8 amax histories: part of an exact resume
        "optimizer": optimizer.state_dict(),
        "sampler": sampler.state_dict(),
        "rng": {"torch": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state_all() if device.type == "cuda" else []},
        "skipped_steps": skipped,
    }
    save_checkpoint(state, out / "checkpoints", step, cfg.keep_checkpoints)
