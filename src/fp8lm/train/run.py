"""`TrainingRun`: one training run's state (model, optimizer, data, telemetry, logs, counters) and
what is done with it: `~TrainingRun.step`, `~TrainingRun.evaluate`, `~TrainingRun.save`,
`~TrainingRun.restore`, `~TrainingRun.summary`, driven by `~TrainingRun.fit`.

Other objectives subclass it and override the pieces that differ: `build_model`,
`build_optimizer`, `load_data`, `next_batch`, `loss` (and `evaluate`, `summary`). How the state
is spread over ranks (replicated, FP8 ZeRO, FSDP2, tensor or pipeline parallel) is the layout that
`layouts.parallelize` returns, not a branch here.
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch import nn

from ..distributed import ddp_bytes, reset_comm_stats
from ..fallback import PrecisionFallback
from ..memory import PeakMemory, memory_report
from ..nn import FP8GroupedLinear, FP8Linear, MoE, load_scaling_state_dict, scaling_state_dict
from ..nn.moe import load_balance
from ..ops.gemm import CPUBF16Linear
from ..optim import SkipsNonFiniteSteps
from ..telemetry import Telemetry, worst
from . import progress
from .amp_record import record_amp_options
from .checkpoint import (
    atomic_write_bytes,
    checkpoint_weights,
    load_checkpoint,
    reading_shards,
    remove_stale_temporaries,
    save_checkpoint,
)
from .config import FP8_LEVELS, RunError, TrainConfig, default_device
from .data import BatchSampler, describe, eval_batches, pack, run_documents
from .hf_model import build_model
from .layouts import LayoutSpec, PipelineShape, parallelize
from .logs import RunLogs, strict_json
from .measure import saved_tensor_bytes
from .ranks import barrier, broadcast_from_main, gather_to_main, join, mean_over_ranks
from .reshard import NEW_STREAM, Reshard, full_state_from_file, load_resharded, merged_scaling, plan_reshard
from .resume import (
    CHECKPOINT_FORMAT,
    OutputLock,
    check_output,
    check_resume,
    check_state_fits,
    claim_output,
    layout_options,
    resume_config,
)
from .telemetry_report import telemetry_line
from .tokenizer import bits_per_byte, recorded_tokenizer, tokenize

__all__ = ["TrainingRun", "BF16Autocast", "lr_at"]

# a replica's stream of torch's generator (nvfp4's stochastic rounding): seed + NOISE_STREAM x
# replica, + NEW_STREAM x step when a resharded resume starts it anew
NOISE_STREAM = 7_919


def lr_at(step: int, lr: float, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """Learning rate of 0-based ``step``: linear warmup over ``warmup_steps``, then cosine decay
    from ``lr`` to ``lr * min_lr_ratio`` at step ``total_steps`` (the schedule's length, `--decay-steps`),
    constant after it (a run extended past its schedule keeps the final lr)."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    decay_steps = max(total_steps - 1 - warmup_steps, 1)
    progress = min((step - warmup_steps) / decay_steps, 1.0)
    return lr * (min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


class BF16Autocast:
    """``torch.autocast(bfloat16)``, reusable, with ``F.linear`` computed by
    `fp8lm.ops.gemm.CPUBF16Linear` on CPUs without BF16 GEMM instructions (same rounding points,
    FP32 GEMM speed)."""

    def __init__(self, device_type: str) -> None:
        self.device_type = device_type
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> BF16Autocast:
        self._stack.enter_context(torch.autocast(self.device_type, dtype=torch.bfloat16))
        self._stack.enter_context(CPUBF16Linear())
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()


class TrainingRun:
    """A GPT trained as ``cfg`` says, on this process's rank (see `parallel`).

    Constructing it checks everything that can be wrong with the inputs before anything is
    written, builds the model, optimizer and data, and restores the checkpoint when resuming.
    `fit` then trains; rank 0 writes the logs, checkpoints and, last and atomically,
    ``summary.json``, so a failed run never looks complete.
    """

    NAME = "train"  # what the progress bar calls the run
    LOSS_NAMES = ("train loss", "val loss")  # the losses the evaluation lines print

    def __init__(self, cfg: TrainConfig) -> None:
        cfg.validate()
        self.cfg = cfg
        self.ranks = join(cfg.tp, cfg.pp, shard=cfg.fsdp or cfg.opt_level == "O3")
        if cfg.batch_size % (self.ranks.dp * (cfg.pp_microbatches if cfg.pp > 1 else 1)):
            raise RunError(
                f"--batch-size {cfg.batch_size} (sequences per step, all ranks together) must divide by the "
                f"{self.ranks.dp} data-parallel replicas (world / (tp x pp))"
                + (f" x {cfg.pp_microbatches} pipeline micro-batches" if cfg.pp > 1 else "")
            )
        self.out = Path(cfg.out)
        # Rank 0 holds OUT/.lock from here to the end of fit: no other run checks or writes OUT meanwhile.
        self.lock: OutputLock | None = claim_output(self.out, self.ranks)
        try:
            self._prepare(cfg)
        except BaseException:
            if self.lock is not None:
                self.lock.release(failed=True)
            raise

    def _prepare(self, cfg: TrainConfig) -> None:
        resuming = check_output(cfg)
        self.resuming = resuming  # the checkpoint's weights replace the ones built: no pretrained ones read
        self.device = self._device()
        self.model_config = cfg.model_config()
        torch.manual_seed(cfg.seed)
        model = self.build_model()
        cfg.check_policy_names(model)
        self._checkpoint_blocks(model)
        resume = load_checkpoint(self.out / "checkpoints") if resuming else None
        self.reshard: Reshard | None = None  # set when resuming in another layout or rank count
        if resume is not None:
            check_resume(cfg, resume, model, self.ranks)
            self.reshard = plan_reshard(resume, self.ranks)
        model.to(self.device)
        self.num_params = sum(p.numel() for p in model.parameters())  # the whole model's, before any split
        self.autocast = contextlib.nullcontext() if cfg.opt_level == "fp32" else BF16Autocast(self.device.type)
        pipeline = PipelineShape(cfg.batch_size // self.ranks.dp, cfg.pp_microbatches, self.autocast)
        spec = LayoutSpec(
            cfg.opt_level,
            cfg.opt_level in FP8_LEVELS,
            cfg.initialize_options(),
            grad_sync_scaling=cfg.grad_sync_scaling,
            fsdp=cfg.fsdp,
            pipeline=pipeline if cfg.pp > 1 else None,
            ep=cfg.ep,
            autocast_dtype=None if cfg.opt_level == "fp32" else torch.bfloat16,  # self.autocast's
        )
        # the one mesh of the run, built once (every rank creates its process groups)
        self.mesh = self.ranks.dims.build_mesh(self.device.type) if self.ranks.distributed else None
        self.model, self.optimizer, self.layout = parallelize(
            model, self.build_optimizer(model), spec, self.ranks, self.mesh
        )
        self.core = self.layout.core(self.model)  # the model itself (this rank's stage): evaluation, memory, telemetry
        self._own_noise(0)
        self.load_data()
        self._check_tokenizer(resume)
        self.telemetry = self._telemetry()
        self.fallback = self._fallback() if cfg.fallback else None
        # --final-bf16-fraction: the layers its BF16 steps switch (this rank's, computing in FP8)
        self.bf16_from = cfg.bf16_from_step()
        self.fp8_layers = [
            m for m in self.core.modules() if isinstance(m, (FP8Linear, FP8GroupedLinear)) and m.fp8_enabled
        ]
        self.start_step, self.torch_skipped_steps = 0, 0
        self.train_time, self.timed_steps = 0.0, 0  # the first step compiles and warms up: not timed
        self.memory: dict | None = None
        self.peak_step_bytes: int | None = None  # measured during the last step (or restored with it)
        self.resumed = resume is not None
        if resume is not None:
            self.restore(resume)
        self.tokens_per_step = cfg.batch_size * cfg.grad_accum * self.model_config.block_size
        self.logs: RunLogs | None = None
        self.act_bytes_per_token: float | None = None  # measured after the last step

    # -- pieces a subclass may override -------------------------------------------------------

    def build_model(self) -> nn.Module:
        """The plain model, on the CPU, its weights from ``--init-from`` when given (a ``--model``
        folder's safetensors when it has them, the run starts fresh and not from a checkpoint)."""
        folder = self.cfg.model_folder() if not (self.resuming or self.cfg.init_from) else None
        model = build_model(self.model_config, folder)
        self.init_tokenizer: dict | None = None  # the tokenizer of --init-from's run
        if self.cfg.init_from:
            init = load_checkpoint(self.cfg.init_from)
            self.init_tokenizer = init.get("tokenizer")
            init["model"] = checkpoint_weights(init)  # any layout's: from its shard folder
            check_state_fits(model, init, repr(init["path"]))
            model.load_state_dict({k: init["model"][k] for k in model.state_dict()})
        return model

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        """AdamW as nanoGPT sets it up: weight decay on matrices (and embeddings), none on norms
        and biases; `wrap_for_level` then makes it the level's optimizer."""
        cfg = self.cfg
        decay = [p for p in model.parameters() if p.dim() >= 2]
        no_decay = [p for p in model.parameters() if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=1e-8)

    def load_data(self) -> None:
        """Sets ``sampler`` (this rank's training batches, with ``state_dict``), ``val_batches``
        (the fixed validation set), ``tokenizer`` (the run's `RunTokenizer`) and ``data_info``
        (for the summary)."""
        cfg, ranks = self.cfg, self.ranks
        source, docs = run_documents(cfg.data, cfg.hf_dataset)
        if not ranks.main:
            barrier(ranks)  # rank 0 packs (and tokenizes) the token cache; the others then read it
        cache = cfg.cache_dir or self.out / "cache"
        splits = pack(source, docs, cache, cfg.val_fraction)
        splits, self.tokenizer = tokenize(splits, cfg.tokenizer_spec(), cfg.vocab_size, cache)
        if ranks.main:
            barrier(ranks)
        seq_len = self.model_config.block_size
        # the ranks of one model replica (tensor- or pipeline-parallel) draw the same batches
        self.sampler = BatchSampler(splits.train, cfg.batch_size // ranks.dp, seq_len, cfg.seed + ranks.dp_rank)
        self.val_batches = eval_batches(splits.val, cfg.eval_batches, cfg.batch_size, seq_len)
        token_bytes = self.tokenizer.token_bytes()
        self.val_bytes = sum(float(token_bytes[y.numpy()].sum()) for _, y in self.val_batches)
        self.data_info = splits.info
        if ranks.main:
            progress.write_once(describe(splits.info))

    def next_batch(self):
        """This rank's next training micro-batch."""
        return self.sampler.next()

    def loss(self, model: nn.Module, batch) -> torch.Tensor:
        """The loss of one micro-batch under ``model`` (the wrapped model in training, the plain
        one in evaluation), computed in the level's autocast."""
        x, y = batch
        with self.autocast:
            return model(x.to(self.device), y.to(self.device))[1]

    def _own_noise(self, step: int) -> None:
        """Give each data-parallel replica but the first its own stream of torch's generator from
        step ``step`` on. Every rank seeds it alike, so that all build the same model; then nvfp4's
        stochastic rounding of output gradients draws from it, and replicas rounding their own
        batches' gradients with the same noise would not average it away as one process averages
        its rows' (the ranks of one replica, which round the same tensors, keep one stream)."""
        if self.ranks.dp_rank:
            torch.manual_seed(self.cfg.seed + NOISE_STREAM * self.ranks.dp_rank + NEW_STREAM * step)

    def batch_tokens(self, batch) -> int:
        """Tokens in a micro-batch (the denominator of activation bytes per token)."""
        return batch[0].numel()

    # -- one step -----------------------------------------------------------------------------

    def step(self, step: int) -> dict:
        """Optimizer step ``step`` (0-based) with its micro-batches; returns its metrics record."""
        cfg, t0 = self.cfg, time.perf_counter()
        lr = lr_at(step, cfg.lr, *cfg.schedule(), cfg.min_lr_ratio)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        reset_comm_stats()
        bf16 = self.set_final_bf16(step)
        done = step + 1
        peak = self._peak_memory() if done == cfg.steps else None  # the last step's, measured
        with peak if peak is not None else contextlib.nullcontext():
            with self.telemetry.step(step) if self.telemetry else contextlib.nullcontext():
                loss_sum = self.forward_backward()
            records = self.telemetry.after_backward() if self.telemetry else []
            grad_norm = self.optimizer_step()
        if peak is not None:
            self.peak_step_bytes = peak.total
        if self.telemetry:
            records += self.telemetry.after_optimizer_step()
        step_bytes = self.layout.comm_bytes(self.model, self.num_params)
        counted = self.layout.counted_comm(self.model)
        if done == cfg.steps:  # training state at its fullest: weights, gradients, moments
            self.memory = memory_report(self.core, self.layout.local_optimizer(self.optimizer))
        self.optimizer.zero_grad(set_to_none=True)
        train_loss = float(mean_over_ranks(loss_sum, self.ranks)) / cfg.grad_accum
        # the first step compiles and warms up; a step measured off the GPU runs slower
        slowed = peak is not None and self.device.type != "cuda" and self.timed_steps > 0
        if (step > self.start_step or done == cfg.steps) and not slowed:
            self.timed_steps += 1
            self.train_time += time.perf_counter() - t0
        record = {
            "step": done,
            "train_loss": train_loss,
            "lr": lr,
            "grad_norm": grad_norm,
            "tokens": done * self.tokens_per_step,
        }
        record.update(self.moe_metrics())
        if bf16:
            record["bf16_gemms"] = True
        if self.ranks.distributed:
            record["comm_bytes"] = step_bytes
            record.update(counted or {})
            if cfg.grad_sync_scaling == "shared":  # the all-reduce's automatic scaling factor, per bucket
                record["grad_sync_mu"] = [b["mu"] for b in self.model.autoscale_stats()]
        if self.telemetry is not None and self.telemetry.sampled(step):
            self.log_telemetry(records, record)
        return record

    def set_final_bf16(self, step: int) -> bool:
        """Whether step ``step`` is one of ``--final-bf16-fraction``'s BF16 steps; the FP8 layers'
        ``high_precision`` flags set to match (from the step number alone, so a resumed run agrees)."""
        if self.bf16_from is None:
            return False
        bf16 = step >= self.bf16_from
        switched = [m for m in self.fp8_layers if m.high_precision != bf16]
        for m in switched:
            m.high_precision = bf16
        self.layout.set_final_bf16(bf16)
        if switched and bf16 and self.ranks.main:
            progress.say(f"step {step + 1}: the last {self.cfg.steps - step} steps run the FP8 layers' GEMMs in BF16")
        return bf16

    def moe_metrics(self) -> dict:
        """A mixture of experts' step (none for a dense model): its load-balancing loss (the last
        micro-batch's, before the coefficient), the load balance of each block's routing this step
        (this rank's tokens; under --tp its sequences', every slice's) averaged over the blocks,
        the tokens routed to each expert, summed over the blocks, and with a capacity the share of
        routed slots dropped."""
        layers = [m for m in self.core.modules() if isinstance(m, MoE)]
        if not layers:
            return {}
        aux = getattr(self.core, "moe_aux_loss", None)
        dropped = torch.stack([m.dropped for m in layers]).sum().double()
        routed = torch.stack([m.take_routed() for m in layers])  # (blocks, experts); clears dropped too
        aux_or_nan = aux.double() if aux is not None else torch.full_like(dropped, float("nan"))
        mine = torch.cat([torch.stack([aux_or_nan, dropped]), routed.flatten().double()])
        # under --pp every stage's blocks, stage by stage (each holds n_layer / pp of them)
        stages = self.layout.gather_stages(mine).cpu()
        dropped, aux_mean = int(stages[:, 1].sum()), float(stages[:, 0].mean())
        counts = list(stages[:, 2:].reshape(-1, routed.shape[1]).long())
        balance = [load_balance(c) for c in counts]
        capacity = {"moe_dropped": dropped / max(int(sum(c.sum() for c in counts)), 1)}
        return {
            **(capacity if any(m.capacity_factor is not None for m in layers) else {}),
            "moe_aux_loss": None if aux is None else aux_mean,
            "moe_load_max_over_mean": sum(b["max_over_mean"] for b in balance) / len(balance),
            "moe_load_cv": sum(b["cv"] for b in balance) / len(balance),
            "moe_tokens_per_expert": torch.stack(counts).sum(0).tolist(),
        }

    def forward_backward(self) -> torch.Tensor:
        """The step's micro-batches, forward and backward (gradients sync on the last one);
        returns the sum of their losses."""
        batches = [self.next_batch() for _ in range(self.cfg.grad_accum)]
        return self.layout.forward_backward(self.model, batches, self.loss)

    def optimizer_step(self) -> float:
        """Clip, then step unless the gradients are not finite; returns the norm before clipping."""
        max_norm = self.cfg.grad_clip if self.cfg.grad_clip > 0 else math.inf
        grad_norm, skipped = self.layout.clip_and_step(self.core, self.optimizer, max_norm)
        self.count_skipped(skipped)
        return grad_norm

    def count_skipped(self, skipped: bool) -> None:
        """Count a step skipped for non-finite gradients, unless the optimizer counts it itself."""
        if not isinstance(self.optimizer, SkipsNonFiniteSteps):
            self.torch_skipped_steps += int(skipped)

    @property
    def skipped_steps(self) -> int:
        """Steps skipped for non-finite gradients (checkpointed, summarized): one counter, the
        optimizer's own for fp8lm's optimizers (saved in their state), the run's for torch's."""
        if isinstance(self.optimizer, SkipsNonFiniteSteps):
            return self.optimizer.skipped_steps
        return self.torch_skipped_steps

    def log_telemetry(self, records: list[dict], record: dict) -> None:
        """A sampled step: telemetry records to telemetry.jsonl, their worst values to the metrics
        record and the output; the fallback policy judges them on rank 0, every rank applies it."""
        done = record["step"]
        for r in records:
            r["step"] = done  # the step count, as in metrics.jsonl (Telemetry numbers steps from 0)
        if self.ranks.model_spread:  # the first copy's ranks hold the layers and their shards: all of theirs judged
            gathered = gather_to_main(records if self.ranks.first_copy else [], self.ranks)
            records = merge_shard_records(gathered) if gathered is not None else []
        if self.ranks.main and records:
            for r in records:
                self.logs.telemetry.write(r)
            under, sat = worst(records, "underflow", 1)[0], worst(records, "saturation", 1)[0]
            record["telemetry_underflow"], record["telemetry_saturation"] = under["underflow"], sat["saturation"]
            progress.say(telemetry_line(records, done, str(self.out)))
        if self.fallback is None:
            return
        events = self.fallback.update(records) if self.ranks.main else []
        switched = broadcast_from_main({n: m.high_precision for n, m in self.fallback.layers.items()}, self.ranks)
        for name, on in switched.items():
            if name in self.fallback.layers:  # under tensor or pipeline parallelism: the layers this rank holds
                self.fallback.layers[name].high_precision = on
        if events:
            record["fallback"] = events
            for e in events:
                progress.say(f"step {done}: fallback: {e['layer']} -> {e['to']} ({e['reason']})")
        sys.stdout.flush()

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Validation metrics of the model as it is now (the mean loss over the validation set)."""
        self.core.eval()
        total = 0.0
        for batch in self.val_batches:
            total += self.layout.eval_loss(self.core, batch, self.loss).item()
        self.core.train()
        val_loss = total / len(self.val_batches)
        tokens = sum(y.numel() for _, y in self.val_batches)
        # bits per byte of the text the targets stand for: comparable across tokenizers
        return {"val_loss": val_loss, "val_bits_per_byte": bits_per_byte(val_loss, tokens, self.val_bytes)}

    # -- the run ------------------------------------------------------------------------------

    def fit(self) -> dict | None:
        """Train from the first (or the restored) step to ``cfg.steps``: validate every
        ``eval_every`` steps and at the end, checkpoint every ``save_every`` steps and at the end.
        Returns the summary on rank 0, None on the other ranks. Rank 0 holds ``OUT/.lock``
        (taken when the run was built) throughout, so a second run on the same folder is refused."""
        try:
            self._open_logs()
            return self._train_and_summarize()
        finally:
            if self.lock is not None:
                self.lock.release()

    def _train_and_summarize(self) -> dict | None:
        cfg = self.cfg
        name = f"{self.NAME} {progress.run_name() or cfg.opt_level}"
        bar = progress.bar(cfg.steps, self.start_step, name, cfg.progress and self.ranks.main)
        try:
            for step in range(self.start_step, cfg.steps):
                record = self.step(step)
                done = record["step"]
                evaluates = self.ranks.main or self.layout.collective_forward  # FSDP2: every rank takes part
                if (done % cfg.eval_every == 0 or done == cfg.steps) and evaluates:
                    record.update(self.evaluate())
                    if self.ranks.main:
                        progress.say(  # flushed: seen at once also when piped to a file
                            f"step {done}: {self.LOSS_NAMES[0]} {record['train_loss']:.4f}, "
                            f"{self.LOSS_NAMES[1]} {record['val_loss']:.4f}"
                        )
                if self.ranks.main:
                    self.logs.metrics.write(record)
                if self.timed_steps:
                    bar.set_postfix(
                        loss=f"{record['train_loss']:.3f}",
                        refresh=False,
                        tok_s=f"{self.timed_steps * self.tokens_per_step / self.train_time:,.0f}",
                    )
                bar.update(1)
                if (cfg.save_every and done % cfg.save_every == 0) or done == cfg.steps:
                    self.save(done)
        finally:
            bar.close()
            if self.logs is not None:
                self.logs.close()
        if self.ranks.main or self.layout.collective_forward:
            self.act_bytes_per_token = self.activation_bytes_per_token()
        if not self.ranks.main:
            return None
        summary = self.summary()
        atomic_write_bytes(self.out / "summary.json", strict_json(summary, indent=1).encode())
        return summary

    def save(self, step: int) -> None:
        """A checkpoint of every rank's state. Rank 0 writes ``step_<step>.pt`` last, so its
        presence means the checkpoint is complete: the model, the optimizer (or the name of the
        folder of its shards) and, per rank, the batch generator, RNG and FP8 scaling state."""
        directory = self.out / "checkpoints"
        own = {
            "scaling": scaling_state_dict(self.core),  # FP8 amax histories: part of an exact resume
            "sampler": self.sampler.state_dict(),
            "rng": {
                "torch": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state_all() if self.device.type == "cuda" else [],
            },
        }
        shards = self.layout.save_shards(directory, step, self.core, self.optimizer)
        model_state = self.layout.model_state(self.core)
        every_rank = gather_to_main(own, self.ranks)
        if not self.ranks.main:
            return
        state = {
            "format": CHECKPOINT_FORMAT,
            "step": step,
            "opt_level": self.cfg.opt_level,
            "model_config": self.model_config.to_dict(),
            "model": model_state,
            "optimizer": self.layout.optimizer_state(self.optimizer),
            "optimizer_shards": shards,
            "data_parallel": self.layout.data_parallel_state(self.model),
            "ranks": every_rank,
            "fallback": self.fallback.state_dict() if self.fallback is not None else None,
            "skipped_steps": self.skipped_steps,
            "config": resume_config(self.cfg),
            "tokenizer": self.tokenizer.record(),
            "options": self.cfg.options(),  # what --resume takes when the command does not say it
            "amp_options": record_amp_options(self.cfg.amp_options, self.cfg.opt_level),  # set from code
            "layout": layout_options(self.cfg),
            # what the summary needs besides the logs, so that --resume can finish a run killed
            # between its final checkpoint and summary.json
            "memory": self.memory,
            "peak_step_bytes": self.peak_step_bytes,  # the last step's: a resume that only writes the summary
            "timing": {"train_time": self.train_time, "timed_steps": self.timed_steps},
        }
        save_checkpoint(state, directory, step, self.cfg.keep_checkpoints)

    def restore(self, state: dict) -> None:
        """Continue from checkpoint ``state`` (checked by `check_resume`): weights, optimizer,
        gradient sync state and this rank's scaling, batch and RNG state; resharded when the
        checkpoint is of another layout or rank count (`fp8lm.train.reshard`)."""
        with reading_shards(state):  # any failure to load: one CheckpointError line
            if self.reshard is None:
                self.layout.load(self.out / "checkpoints", state, self.core, self.optimizer)
            else:
                self._restore_resharded(state)
        if self.reshard is None:
            own = state["ranks"][self.ranks.rank]
            load_scaling_state_dict(self.core, own["scaling"])
            self.sampler.load_state_dict(own["sampler"])
        else:
            own = state["ranks"][0]
        self.layout.load_data_parallel_state(self.model, state["data_parallel"])
        torch.set_rng_state(own["rng"]["torch"])
        if self.device.type == "cuda" and len(own["rng"]["cuda"]) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(own["rng"]["cuda"])
        if self.reshard is not None:  # rank 0's generator restored: the other replicas' own streams anew
            self._own_noise(int(state["step"]))
        if self.fallback is not None and state["fallback"] is not None:
            saved = state["fallback"]
            held = {n: on for n, on in saved["high_precision"].items() if n in self.fallback.layers}
            self.fallback.load_state_dict({**saved, "high_precision": held})
        self.start_step, self.torch_skipped_steps = int(state["step"]), int(state["skipped_steps"])
        self.memory = state.get("memory")
        self.peak_step_bytes = state.get("peak_step_bytes")
        timing = state.get("timing") or {"train_time": 0.0, "timed_steps": 0}
        self.train_time, self.timed_steps = float(timing["train_time"]), int(timing["timed_steps"])

    def _restore_resharded(self, state: dict) -> None:
        """`restore` from a checkpoint of another layout or rank count (`fp8lm.train.reshard`)."""
        plan, step = self.reshard, int(state["step"])
        assert plan is not None
        if self.ranks.main:
            progress.write(f"resuming step {step} resharded: {plan.describe()}")
        directory = self.out / "checkpoints"
        load_resharded(directory, state, self.core, self.optimizer, lambda: self._full_state_from_file(state))
        own_scaling = scaling_state_dict(self.core)
        load_scaling_state_dict(self.core, merged_scaling(state["ranks"], self.core, own_scaling))
        if plan.same_batches:  # the saved rank of this replica continues its stream
            saved = next(r for r in range(plan.saved.world) if plan.saved.dp_rank(r) == self.ranks.dp_rank)
            self.sampler.load_state_dict(state["ranks"][saved]["sampler"])
        else:
            self.sampler.generator.manual_seed(self.cfg.seed + self.ranks.dp_rank + NEW_STREAM * step)
            self.sampler.batches_drawn = step * self.cfg.grad_accum

    def _full_state_from_file(self, state: dict) -> dict:
        """A checkpoint file's state by parameter name (the names of a plain model's optimizer)."""
        model = self.build_model()
        return full_state_from_file(state, model, self.build_optimizer(model))

    def summary(self) -> dict:
        """The run's results (rank 0, after the last step), as written to ``summary.json``."""
        cfg, ranks, records = self.cfg, self.ranks, self.logs.metrics.records
        last = [r["train_loss"] for r in records[-10:]]
        return {
            "opt_level": cfg.opt_level,
            "steps": cfg.steps,
            "tokens": cfg.steps * self.tokens_per_step,
            "train_loss": sum(last) / len(last),  # mean of the last (up to) 10 steps
            "val_loss": records[-1]["val_loss"],
            "val_bits_per_byte": records[-1].get("val_bits_per_byte"),
            "tokens_per_s": self.timed_steps * self.tokens_per_step / self.train_time,  # steps after the first
            "act_bytes_per_token": self.act_bytes_per_token,
            "peak_step_bytes": self.peak_step_bytes,  # rank 0's
            "bytes_per_param": self.memory["bytes_per_param"],
            "memory": self.memory,  # rank 0's share under O3
            "skipped_steps": self.skipped_steps,
            "num_params": self.num_params,
            "world_size": ranks.world,
            "backend": str(dist.get_backend()) if ranks.distributed else None,
            "layout": self.layout.name,
            "comm_bytes_per_step": sum(r.get("comm_bytes", 0.0) for r in records) / len(records),
            **_counted_comm_per_step(records),
            "ddp_fp32_bytes_per_step": ddp_bytes(self.num_params, 4, ranks.world),
            "ddp_bf16_bytes_per_step": ddp_bytes(self.num_params, 2, ranks.world),
            "fallback_events": self.fallback.events if self.fallback else [],
            "bf16_from_step": self.bf16_from,  # --final-bf16-fraction's first BF16 step (0-based), or None
            **_moe_summary(records),
            "model_config": self.model_config.to_dict(),
            "data": self.data_info,
            "device": str(self.device),
            "config": cfg.to_dict(),  # amp_options may hold callables: written as their repr
            "amp_options": record_amp_options(cfg.amp_options, cfg.opt_level),  # as checkpoints record them
        }

    def activation_bytes_per_token(self) -> float:
        """Bytes autograd saves per token, measured after the final checkpoint on the first
        validation batch (this forward pass changes FP8 scaling histories, which no longer matters)."""
        batch = self.val_batches[0]
        saved = saved_tensor_bytes(
            lambda: self.layout.eval_loss(self.core, batch, self.loss), exclude=self.core.parameters()
        )
        return saved / self.batch_tokens(batch)

    # -- helpers ------------------------------------------------------------------------------

    def _checkpoint_blocks(self, model: nn.Module) -> None:
        """--activation-checkpointing on the model's blocks."""
        mode = self.cfg.activation_checkpointing
        if hasattr(model, "checkpoint_blocks"):
            model.checkpoint_blocks(mode)
        elif mode != "none":
            raise RunError(
                f"--activation-checkpointing {mode} checkpoints fp8lm's GPT blocks; this model "
                f"({type(model).__name__}) has none: drop the option"
            )

    def _peak_memory(self) -> PeakMemory:
        """The measurement of a step's peak memory: on the GPU the allocator's; elsewhere the
        training state before the step (`memory_report`: weights, optimizer state, buffers) plus
        the most that the step's tensors hold at once (`fp8lm.memory.PeakMemory`)."""
        before = memory_report(self.core, self.layout.local_optimizer(self.optimizer))["total"]
        return PeakMemory(self.device, baseline=before)

    def _device(self) -> torch.device:
        device = torch.device(self.cfg.device or default_device())
        if device.type == "cuda" and self.ranks.distributed:
            device = torch.device("cuda", torch.cuda.current_device())  # setup() picked LOCAL_RANK's GPU
        return device

    def _check_tokenizer(self, resume: dict | None) -> None:
        """Refuse to continue a checkpoint (``--resume``, ``--init-from``) of another tokenizer:
        the same ids would stand for other text."""
        recorded = {"--resume": resume.get("tokenizer")} if resume is not None else {}
        if self.cfg.init_from:
            recorded["--init-from"] = self.init_tokenizer
        for how, record in recorded.items():
            theirs = recorded_tokenizer(record)  # checkpoints of older versions record none: bytes
            if theirs.json != self.tokenizer.json:
                raise RunError(
                    f"{how}: the checkpoint's tokenizer ({theirs.describe()}) is not this run's "
                    f"({self.tokenizer.describe()}); pass the --tokenizer and --vocab-size it was trained with"
                )

    def _telemetry(self) -> Telemetry | None:
        cfg = self.cfg
        if not cfg.telemetry_interval() or cfg.opt_level not in FP8_LEVELS:
            return None
        return Telemetry(self.core, self.layout.local_optimizer(self.optimizer), cfg.telemetry_interval())

    @property
    def _model_parallel(self) -> bool:
        """Whether the ranks of a replica hold different parts of the model (tensor or pipeline)."""
        return self.ranks.tp > 1 or self.ranks.pp > 1

    def _fallback(self) -> PrecisionFallback:
        """The fallback policy over the FP8 layers; under tensor or pipeline parallelism rank 0
        judges every layer of the model (stand-ins for those other ranks hold) and broadcasts."""
        assert self.telemetry is not None
        layers: dict = dict(self.telemetry.layers)
        if self._model_parallel:
            names = gather_to_main(sorted(layers), self.ranks)
            for name in sorted({n for held in names or [] for n in held} - layers.keys()):
                layers[name] = SimpleNamespace(high_precision=False)  # held by other ranks
        return PrecisionFallback(layers)

    def _open_logs(self) -> None:
        """Rank 0 deletes what saves killed midway left and opens the logs, truncated to the
        restored step when resuming; no summary until the end."""
        (self.out / "checkpoints").mkdir(parents=True, exist_ok=True)
        if not self.ranks.main:
            return
        for folder in (self.out, self.out / "checkpoints"):
            remove_stale_temporaries(folder)
        (self.out / "summary.json").unlink(missing_ok=True)
        if self.tokenizer.json is not None:  # the run's tokenizer, next to its checkpoints
            atomic_write_bytes(self.out / "tokenizer.json", self.tokenizer.json.encode("utf-8"))
        keep = self.start_step if self.resumed else None
        self.logs = RunLogs.open(self.out, keep, telemetry=self.telemetry is not None)


def merge_shard_records(per_rank: list[list[dict]]) -> list[dict]:
    """Telemetry records of the ranks that hold one model replica, one per layer and kind: a
    layer's shards (tensor-parallel; FSDP2's and FP8 ZeRO's gradient and optimizer-state shards)
    and the data-parallel shards' own batches merged to their worst (largest amax, underflow,
    saturation, smallest scale): a fraction is the worst shard's, not the whole tensor's."""
    merged: dict[tuple, dict] = {}
    for records in per_rank:
        for r in records:
            key = (r["layer"], r["kind"])
            if key not in merged:
                merged[key] = dict(r)
                continue
            for stat in ("amax", "underflow", "saturation"):
                if stat in r:
                    merged[key][stat] = max(merged[key][stat], r[stat])
            if "scale" in r:  # the finest shard's scale goes with the largest amax
                merged[key]["scale"] = min(merged[key]["scale"], r["scale"])
    return list(merged.values())


def _counted_comm_per_step(records: list[dict]) -> dict:
    """The mean per step of the counted bytes (`parallel.counted_comm`), when the records have them."""
    counted = [r for r in records if "comm_handed_bytes" in r]
    if not counted:
        return {}
    kinds = sorted({kind for r in counted for kind in r["comm_bytes_by_kind"]})
    return {
        "comm_handed_bytes_per_step": sum(r["comm_handed_bytes"] for r in counted) / len(counted),
        "comm_bytes_by_kind_per_step": {
            kind: sum(r["comm_bytes_by_kind"].get(kind, 0.0) for r in counted) / len(counted) for kind in kinds
        },
    }


def _moe_summary(records: list[dict]) -> dict:
    """A mixture of experts' routing over the run (from its steps' records): the load balance
    averaged over the steps, the tokens each expert took in all, the last load-balancing loss."""
    routed = [r for r in records if "moe_tokens_per_expert" in r]
    if not routed:
        return {}
    tokens = [sum(col) for col in zip(*(r["moe_tokens_per_expert"] for r in routed))]
    return {
        "moe": {
            "load_max_over_mean": sum(r["moe_load_max_over_mean"] for r in routed) / len(routed),
            "load_cv": sum(r["moe_load_cv"] for r in routed) / len(routed),
            "tokens_per_expert": tokens,
            "run_balance": load_balance(torch.tensor(tokens)),
            "aux_loss": routed[-1]["moe_aux_loss"],
        }
    }
