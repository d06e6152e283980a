"""The training loop behind `fp8lm train`: one GPT run at one precision level (see `config`)."""

from __future__ import annotations

import contextlib
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from ..distributed import FP8DataParallel, ddp_bytes, reset_comm_stats
from ..distributed import load_checkpoint as load_sharded
from ..distributed import save_checkpoint as save_sharded
from ..fallback import PrecisionFallback
from ..grad import clip_grad_norm_
from ..memory import memory_report
from ..nn import load_scaling_state_dict, scaling_state_dict
from ..ops.gemm import CPUBF16Linear
from ..telemetry import Telemetry, worst
from .checkpoint import CheckpointError, atomic_write_bytes, list_checkpoints, load_checkpoint, save_checkpoint, shards_name
from .config import FP8_LEVELS, RunError, TrainConfig, default_device
from .data import BatchSampler, eval_batches, hf_documents, pack, path_documents, stdlib_documents
from .measure import saved_tensor_bytes
from .model import GPT
from .parallel import (Ranks, accumulating, barrier, broadcast_from_main, comm_bytes, gather_to_main, is_sharded, join,
                       mean_over_ranks, restarts_allowed, unwrap, wrap_for_level)

__all__ = ["train", "check_output", "lr_at"]

CHECKPOINT_FORMAT = "fp8lm.train/2"


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


class _BF16Autocast:
    """``torch.autocast(bfloat16)``, reusable, with ``F.linear`` computed by
    `fp8lm.ops.gemm.CPUBF16Linear` on CPUs without BF16 GEMM instructions (same rounding points,
    FP32 GEMM speed)."""

    def __init__(self, device_type: str) -> None:
        self.device_type = device_type
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> "_BF16Autocast":
        self._stack.enter_context(torch.autocast(self.device_type, dtype=torch.bfloat16))
        self._stack.enter_context(CPUBF16Linear())
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()


def _autocast(cfg: TrainConfig, device: torch.device):
    if cfg.opt_level == "fp32":
        return contextlib.nullcontext()
    return _BF16Autocast(device.type)


def _build_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    # nanoGPT: weight decay on matrices (and embeddings), none on norms and biases.
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=1e-8)


class _JsonLines:
    """A run's JSON-lines log (metrics.jsonl, telemetry.jsonl); on resume the lines past the
    checkpoint's step are dropped."""

    def __init__(self, path: Path, keep_until_step: int | None, tensorboard: bool = False) -> None:
        self.path = path
        self.records: list[dict] = []
        if keep_until_step is not None and path.exists():
            lines = (json.loads(line) for line in path.read_text().splitlines() if line.strip())
            self.records = [r for r in lines if r["step"] <= keep_until_step]
        atomic_write_bytes(path, "".join(json.dumps(r) + "\n" for r in self.records).encode())
        self.file = open(path, "a")
        self.writer = _tensorboard_writer(path.parent) if tensorboard else None

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


@dataclass
class _Logs:
    """What rank 0 writes during training."""

    metrics: _JsonLines
    telemetry: _JsonLines | None

    def close(self) -> None:
        self.metrics.close()
        if self.telemetry is not None:
            self.telemetry.close()


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


def check_output(cfg: TrainConfig) -> bool:
    """Refuse to start over a finished or checkpointed run (unless resuming), or to resume nothing.
    Returns whether the run resumes: under ``torchrun --max-restarts N`` the same command line
    serves the first attempt and the restarts, so there ``--resume`` starts a run that has no
    checkpoint yet."""
    out = Path(cfg.out)
    has_checkpoint = bool(list_checkpoints(out / "checkpoints"))
    if not cfg.resume and ((out / "summary.json").exists() or has_checkpoint):
        raise RunError(f"{str(out)!r} already holds a training run; pass --resume to continue it or choose another --out")
    if cfg.resume and not has_checkpoint and not restarts_allowed():
        raise RunError(f"--resume: no checkpoint in {str(out / 'checkpoints')!r}; run without --resume to start training")
    return cfg.resume and has_checkpoint


def _check_resume(cfg: TrainConfig, state: dict, model: GPT, ranks: Ranks) -> None:
    _check_state_fits(model, state, repr(state["path"]))
    if int(state["step"]) >= cfg.steps:
        raise RunError(f"the run in {cfg.out!r} already reached step {state['step']}; pass --steps larger than that to continue it")
    if state.get("opt_level") != cfg.opt_level:
        raise CheckpointError(
            f"checkpoint {state['path']!r} was trained at opt level {state.get('opt_level')}, "
            f"not {cfg.opt_level}; resume with --opt-level {state.get('opt_level')}"
        )
    if state.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(f"checkpoint {state['path']!r} has format {state.get('format')!r}, this version reads {CHECKPOINT_FORMAT!r}")
    saved_scaling = (state.get("data_parallel") or {}).get("scaling")
    if saved_scaling is not None and saved_scaling != cfg.grad_sync_scaling:
        raise CheckpointError(
            f"checkpoint {state['path']!r} was trained with --grad-sync-scaling {saved_scaling}, not "
            f"{cfg.grad_sync_scaling}; resume with --grad-sync-scaling {saved_scaling}"
        )
    saved_world = len(state["ranks"])
    if saved_world != ranks.world:
        launch = f"torchrun --nproc_per_node {saved_world}" if saved_world > 1 else "one process (no torchrun)"
        raise CheckpointError(
            f"checkpoint {state['path']!r} was written by {saved_world} rank(s), this run has {ranks.world}: "
            f"each rank's batches and FP8 scaling histories continue exactly only at the same count; resume with {launch}"
        )


def train(cfg: TrainConfig) -> dict | None:
    """Train one GPT as ``cfg`` says; returns the summary (also written to ``<out>/summary.json``).

    Under ``torchrun`` every rank trains on its own batches of ``batch_size / world`` sequences
    (see `parallel`); rank 0 writes the files and gets the summary, the other ranks get None.
    Everything that can be wrong with the inputs is checked before anything is written, and
    ``summary.json`` is written last, atomically, so a failed run never looks complete.
    """
    cfg.validate()
    ranks = join()
    if cfg.batch_size % ranks.world:
        raise RunError(f"--batch-size {cfg.batch_size} (sequences per step, all ranks together) must divide by the {ranks.world} ranks")
    out = Path(cfg.out)
    resuming = check_output(cfg)
    device = torch.device(cfg.device or default_device())
    if device.type == "cuda" and ranks.distributed:
        device = torch.device("cuda", torch.cuda.current_device())  # setup() picked LOCAL_RANK's GPU
    mcfg = cfg.model_config()
    source, docs = _documents(cfg)

    torch.manual_seed(cfg.seed)
    model = GPT(mcfg)
    if cfg.init_from:
        init = load_checkpoint(cfg.init_from)
        _check_state_fits(model, init, repr(init["path"]))
        model.load_state_dict({k: init["model"][k] for k in model.state_dict()})
    resume = None
    if resuming:
        resume = load_checkpoint(out / "checkpoints")
        _check_resume(cfg, resume, model, ranks)
    model.to(device)
    optimizer = _build_optimizer(model, cfg)
    model, optimizer = wrap_for_level(model, optimizer, cfg.opt_level, FP8_LEVELS, ranks, cfg.initialize_options(),
                                      grad_sync_scaling=cfg.grad_sync_scaling)
    core = unwrap(model)
    sharded = is_sharded(optimizer)

    if not ranks.main:
        barrier(ranks)  # rank 0 packs the token cache; the others then read it
    splits = pack(source, docs, cfg.cache_dir or out / "cache", cfg.val_fraction)
    if ranks.main:
        barrier(ranks)
    seq_len = mcfg.block_size
    sampler = BatchSampler(splits.train, cfg.batch_size // ranks.world, seq_len, cfg.seed + ranks.rank)
    val_set = eval_batches(splits.val, cfg.eval_batches, cfg.batch_size, seq_len)
    telemetry = Telemetry(core, optimizer.shard if sharded else optimizer, cfg.telemetry_every) \
        if cfg.telemetry_every and cfg.opt_level in FP8_LEVELS else None
    fallback = PrecisionFallback(telemetry.layers) if cfg.fallback else None

    start_step, skipped = 0, 0
    if resume is not None:
        _restore(resume, out / "checkpoints", model, optimizer, sampler, fallback, device, ranks)
        start_step, skipped = int(resume["step"]), int(resume["skipped_steps"])

    (out / "checkpoints").mkdir(parents=True, exist_ok=True)
    logs = None
    if ranks.main:
        (out / "summary.json").unlink(missing_ok=True)
        keep = start_step if resume is not None else None
        logs = _Logs(_JsonLines(out / "metrics.jsonl", keep, tensorboard=True),
                     _JsonLines(out / "telemetry.jsonl", keep) if telemetry else None)
    autocast = _autocast(cfg, device)
    tokens_per_step = cfg.batch_size * cfg.grad_accum * seq_len
    num_params = sum(p.numel() for p in core.parameters())
    train_time, timed_steps = 0.0, 0
    warmup = cfg.steps // 10 if cfg.warmup_steps is None else cfg.warmup_steps
    bar = _progress(cfg, start_step, ranks)
    try:
        for step in range(start_step, cfg.steps):
            t0 = time.perf_counter()
            lr = lr_at(step, cfg.lr, warmup, cfg.steps, cfg.min_lr_ratio)
            for group in optimizer.param_groups:
                group["lr"] = lr
            reset_comm_stats()
            loss_sum = torch.zeros((), device=device)
            with telemetry.step(step) if telemetry else contextlib.nullcontext():
                for micro in range(cfg.grad_accum):
                    x, y = sampler.next()
                    with autocast:
                        _, loss = model(x.to(device), y.to(device))
                    with accumulating(model, micro == cfg.grad_accum - 1):
                        (loss / cfg.grad_accum).backward()
                    loss_sum += loss.detach()
            records = telemetry.after_backward() if telemetry else []
            max_norm = cfg.grad_clip if cfg.grad_clip > 0 else math.inf
            if sharded:  # clips by the global norm of the reduced gradients, skips a non-finite step itself
                grad_norm = float(optimizer.clip_grad_norm_(max_norm))
                optimizer.step()
                skipped += optimizer.last_step_skipped
            else:
                grad_norm = float(clip_grad_norm_(core.parameters(), max_norm))
                if math.isfinite(grad_norm):
                    optimizer.step()
                else:  # an inf/NaN gradient: skip the update rather than poison the weights
                    skipped += 1
            if telemetry:
                records += telemetry.after_optimizer_step()
            step_bytes = comm_bytes(model, num_params, ranks)
            if step + 1 == cfg.steps:  # training state at its fullest: weights, gradients, moments
                mem = memory_report(core, optimizer.shard if sharded else optimizer)
            optimizer.zero_grad(set_to_none=True)
            train_loss = float(mean_over_ranks(loss_sum, ranks)) / cfg.grad_accum
            done = step + 1
            if step > start_step or done == cfg.steps:  # the first step compiles and warms up: not timed
                timed_steps += 1
                train_time += time.perf_counter() - t0
            record = {"step": done, "train_loss": train_loss, "lr": lr, "grad_norm": grad_norm,
                      "tokens": done * tokens_per_step}
            if ranks.distributed:
                record["comm_bytes"] = step_bytes
                if cfg.grad_sync_scaling == "shared":  # the all-reduce's automatic scaling factor, per bucket
                    record["grad_sync_mu"] = [b["mu"] for b in model.autoscale_stats()]
            if telemetry is not None and telemetry.sampled(step):
                _telemetry_step(done, records, fallback, telemetry, record, logs, bar, ranks)
            if done % cfg.eval_every == 0 or done == cfg.steps:
                if ranks.main:
                    record["val_loss"] = _evaluate(core, val_set, autocast, device)
                    bar.write(f"step {done}: train loss {train_loss:.4f}, val loss {record['val_loss']:.4f}")
                    sys.stdout.flush()  # seen at once also when piped to a file
            if ranks.main:
                logs.metrics.write(record)
            if timed_steps:
                bar.set_postfix(loss=f"{train_loss:.3f}", tok_s=f"{timed_steps * tokens_per_step / train_time:,.0f}",
                                refresh=False)
            bar.update(1)
            if (cfg.save_every and done % cfg.save_every == 0) or done == cfg.steps:
                _save(cfg, mcfg, out / "checkpoints", done, skipped, model, optimizer, sampler, fallback, device, ranks)
    finally:
        bar.close()
        if logs is not None:
            logs.close()
    if not ranks.main:
        return None

    # Measured after the final checkpoint, on the first validation batch: this forward pass
    # changes FP8 scaling histories, which no longer matters.
    x, y = val_set[0]
    act_bytes = saved_tensor_bytes(lambda: _forward_loss(core, x.to(device), y.to(device), autocast),
                                   exclude=core.parameters())
    records = logs.metrics.records
    last = [r["train_loss"] for r in records[-10:]]
    summary = {
        "opt_level": cfg.opt_level,
        "steps": cfg.steps,
        "tokens": cfg.steps * tokens_per_step,
        "train_loss": sum(last) / len(last),  # mean of the last (up to) 10 steps
        "val_loss": records[-1]["val_loss"],
        "tokens_per_s": timed_steps * tokens_per_step / train_time,  # training steps after the first
        "act_bytes_per_token": act_bytes / x.numel(),
        "bytes_per_param": mem["bytes_per_param"],
        "memory": mem,  # rank 0's share under O3
        "skipped_steps": skipped,
        "num_params": num_params,
        "world_size": ranks.world,
        "comm_bytes_per_step": sum(r.get("comm_bytes", 0.0) for r in records) / len(records),
        "ddp_fp32_bytes_per_step": ddp_bytes(num_params, 4, ranks.world),
        "ddp_bf16_bytes_per_step": ddp_bytes(num_params, 2, ranks.world),
        "fallback_events": fallback.events if fallback else [],
        "model_config": mcfg.to_dict(),
        "data": splits.info,
        "device": str(device),
        "config": cfg.to_dict(),  # amp_options may hold callables: written as their repr
    }
    atomic_write_bytes(out / "summary.json", json.dumps(summary, indent=1, default=repr).encode())
    return summary


def _telemetry_step(done, records, fallback, telemetry, record, logs, bar, ranks) -> None:
    """A sampled step: telemetry records to telemetry.jsonl, their worst values to the metrics line
    and the progress output; the fallback policy judges them on rank 0, every rank applies it."""
    for r in records:
        r["step"] = done  # the step count, as in metrics.jsonl (Telemetry numbers steps from 0)
    if ranks.main and records:
        for r in records:
            logs.telemetry.write(r)
        under, sat = worst(records, "underflow", 1)[0], worst(records, "saturation", 1)[0]
        record["telemetry_underflow"], record["telemetry_saturation"] = under["underflow"], sat["saturation"]
        bar.write(f"step {done}: telemetry: worst underflow {under['underflow']:.2%} ({under['layer']} {under['kind']}), "
                  f"worst saturation {sat['saturation']:.2%} ({sat['layer']} {sat['kind']})")
    if fallback is None:
        return
    events = fallback.update(records) if ranks.main else []
    switched = broadcast_from_main({n: m.high_precision for n, m in fallback.layers.items()}, ranks)
    for name, on in switched.items():
        fallback.layers[name].high_precision = on
    if events:
        record["fallback"] = events
        for e in events:
            bar.write(f"step {done}: fallback: {e['layer']} -> {e['to']} ({e['reason']})")
    sys.stdout.flush()


def _forward_loss(model, x, y, autocast):
    with autocast:
        return model(x, y)[1]


def _progress(cfg: TrainConfig, start_step: int, ranks: Ranks):
    return tqdm(total=cfg.steps, initial=start_step, disable=not (cfg.progress and ranks.main),
                desc=f"train {cfg.opt_level}", unit="step", dynamic_ncols=True)


def _restore(state: dict, directory: Path, model, optimizer, sampler: BatchSampler, fallback,
             device: torch.device, ranks: Ranks) -> None:
    core = unwrap(model)
    if state["optimizer_shards"] is not None:  # FP8 ZeRO: model and this rank's optimizer shard
        load_sharded(directory / state["optimizer_shards"], core, optimizer)
    else:
        core.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    if state["data_parallel"] is not None:
        model.set_extra_state(state["data_parallel"])
    own = state["ranks"][ranks.rank]
    load_scaling_state_dict(core, own["scaling"])
    sampler.load_state_dict(own["sampler"])
    torch.set_rng_state(own["rng"]["torch"])
    if device.type == "cuda" and own["rng"]["cuda"]:
        torch.cuda.set_rng_state_all(own["rng"]["cuda"])
    if fallback is not None and state["fallback"] is not None:
        fallback.load_state_dict(state["fallback"])


def _save(cfg, mcfg, directory: Path, step, skipped, model, optimizer, sampler, fallback, device, ranks: Ranks) -> None:
    """A checkpoint of every rank's state. Rank 0 writes ``step_<step>.pt`` last, so its presence
    means the checkpoint is complete: the model, the optimizer (under O3 each rank first writes its
    shard to ``step_<step>.dcp/``) and, per rank, the batch generator, RNG and FP8 scaling state."""
    core = unwrap(model)
    own = {
        "scaling": scaling_state_dict(core),  # FP8 amax histories: part of an exact resume
        "sampler": sampler.state_dict(),
        "rng": {"torch": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state_all() if device.type == "cuda" else []},
    }
    shards = None
    if is_sharded(optimizer):
        shards = shards_name(step)
        save_sharded(directory / shards, core, optimizer)
    every_rank = gather_to_main(own, ranks)
    if not ranks.main:
        return
    state = {
        "format": CHECKPOINT_FORMAT,
        "step": step,
        "opt_level": cfg.opt_level,
        "model_config": mcfg.to_dict(),
        "model": core.state_dict(),
        "optimizer": None if shards else optimizer.state_dict(),
        "optimizer_shards": shards,
        "data_parallel": model.get_extra_state() if isinstance(model, FP8DataParallel) else None,
        "ranks": every_rank,
        "fallback": fallback.state_dict() if fallback is not None else None,
        "skipped_steps": skipped,
    }
    save_checkpoint(state, directory, step, cfg.keep_checkpoints)
