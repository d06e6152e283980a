"""FP8Linear and a GPT block on the CUDA code path, traced on fake CUDA tensors: kernel launches,
bytes and host synchronisations per op category, layer and pass, printed as JSON.

Every aten op of one training step (forward, then backward) is logged by a ``TorchDispatchMode``
over ``FakeTensorMode`` CUDA tensors: nothing is computed or allocated, so this runs on any machine
and at the shapes of a ~1B GPT. Compared: fp8lm's FP8 linear layers (FP8Linear's and O2's scaled
FP16 weights) with eager casts (its fused-cast switch off, as ``FP8LM_FUSED_CAST=0`` sets it) and
with the ``torch.compile``-d casts, torchao float8 tensorwise (eager) and ``nn.Linear`` under BF16
autocast. Two variants of the compiled casts: ``fp8lm_attn_bf16``, the policy override
``{"*attn*": {"fp8_gemm": False}}`` (the attention projections' GEMMs in BF16; only the block
differs), and ``fp8lm_fp32_weights``, O1's default plain FP32 weights. The traced step is the second (steady state: delayed
scaling has a history), after an optimizer step (AdamW, not traced) changed the weights; a third step
without that change (``next_microbatch``: a further micro-batch of gradient accumulation) shows
what is made once per optimizer step. A modelled H200 step time turns the counts into a ratio
against BF16.

    python benchmarks/cuda_trace.py [--shapes 8192x4096x4096] [--block 2048x8192] [--quick]

How the CUDA path is reached without a GPU (all inside this process, never in the library):
- a CPU-only torch has no CUDA device guard, which autograd needs for CUDA tensors: a four-line
  C++ file registering c10's ``FakeGuardImpl`` for CUDA is compiled once (cached, like fp8lm's C
  kernels) and loaded;
- the backward pass runs the autograd graph's nodes in topological order from Python, because the
  C++ engine asks for the current stream of an accelerator that a CPU-only build does not have;
- ``torch.cuda.get_device_capability`` answers (9, 0) (an H100/H200; ``--capability 10.0``: a
  B200, where mxfp8 takes the MX ``torch._scaled_mm``), so ``backend="auto"`` picks
  ``torch._scaled_mm`` as it would there; CUDA autocast is switched on with
  ``torch.set_autocast_enabled``, which needs no device;
- ``torch.compile`` cannot generate CUDA kernels here: for the compiled casts it is replaced by a
  marker that runs the function's ops as one fused kernel (launches: 1, plus 1 when it reduces to
  a scalar, as Inductor splits a full reduction in two; bytes: the tensors it reads and writes);
- ``scaled_dot_product_attention`` would take its math path (a CPU-only build cannot choose a
  CUDA kernel): it is routed to the flash-attention ops, one kernel forward, one backward;
- with Triton installed, nvfp4 on 9.0 takes fp8lm's Triton GEMM (`fp8lm.ops.triton_nvfp4`), a
  custom op logged as one GEMM at BF16's rate (it multiplies on BF16 tensor cores); without it,
  the emulation.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import os
import re
import subprocess
import sys
import warnings
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F
from common import machine
from gemm import parse_shapes
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

# Triton kernels are traced, never run: its interpreter would try to run them on the fake tensors.
os.environ.pop("TRITON_INTERPRET", None)

CATEGORIES = ("gemm", "cast", "amax_scale", "nonfinite", "transpose_copy", "bias", "attention", "other")
# Ops that copy a value to the host and wait for it (``.item()``, ``bool(t)``, ``torch.equal``);
# copies of CUDA tensors to the host count too (`to_host`).
SYNC_OPS = {"_local_scalar_dense", "is_nonzero", "equal"}
# Python functions whose ops belong to a category, found on the stack (fp8lm's and torchao's names).
STACK_CATEGORIES = {
    "_propagate_nonfinite": "nonfinite",
    "_carry_nonfinite": "nonfinite",
    "scale_and_record_": "amax_scale",
    "scale_for_amax_": "amax_scale",
    "record_": "amax_scale",
    "traceable_amax": "amax_scale",
    "_stream_scales": "amax_scale",
    "_weight_scales": "amax_scale",
    "_grad_scale": "amax_scale",
    "_recorded_scale_inv": "amax_scale",
    "traceable_cast": "cast",
    "traceable_cast_dequantized": "cast",
    "traceable_upcast": "cast",
    "compute_scale": "amax_scale",
    "pow2_scale": "amax_scale",
    "record": "amax_scale",
    "scale_for": "amax_scale",
    "amax": "amax_scale",
    "tensor_to_amax": "amax_scale",
    "amax_to_scale": "amax_scale",
    "tensor_to_scale": "amax_scale",
    "saturating_cast": "cast",
    "saturating_cast_with_amax": "cast",
    "saturating_cast_dequantized": "cast",
    "saturating_cast_transposed": "cast",
    "upcast": "cast",
    "to_fp8_saturated": "cast",
    "hp_tensor_and_scale_to_float8": "cast",
    "_add_bias": "bias",
}
GEMM_OPS = {
    "mm",
    "addmm",
    "_scaled_mm",
    "_scaled_mm_v2",
    "triton_nvfp4_mm",
    "bmm",
    "baddbmm",
    "_grouped_mm",
    "_scaled_grouped_mm",
}
ATTENTION_OPS = {"_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward"}
ALLOC_OPS = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "set_", "lift_fresh"}
TINY = 64  # elements: an op whose tensors are all this small is scale arithmetic on a few scalars
REDUCTION_OPS = {"amax", "aminmax", "max", "sum"}
# A compiled reduction of more elements than this to fewer outputs than that counts two launches
# (see split_reductions; Inductor's rule: no split from 2 x 32 outputs per SM, 132 SMs on an H200).
SPLIT_REDUCTION_NUMEL = 4096
SPLIT_REDUCTION_OUTPUTS = 132 * 2 * 32

# Modelled H200 (SXM): per-kernel launch cost, HBM bandwidth, dense GEMM rates.
MODEL = {"launch_us": 5.0, "hbm_tb_s": 4.8, "bf16_tflop_s": 990.0, "fp8_tflop_s": 1980.0}

GUARD_SOURCE = """#include <c10/core/impl/FakeGuardImpl.h>
// Register c10's no-op device guard for CUDA, which a CPU-only torch lacks.
C10_REGISTER_GUARD_IMPL(CUDA, c10::impl::FakeGuardImpl<c10::DeviceType::CUDA>);
"""


# -- the CUDA path without a GPU ---------------------------------------------------------------
def load_fake_cuda_guard() -> None:
    """Register a no-op CUDA device guard in a CPU-only torch (compiled once, cached)."""
    if torch.version.cuda is not None or torch.version.hip is not None:
        return  # a CUDA build has its guard; FakeTensorMode makes it a no-op without devices
    torch_dir = Path(torch.__file__).resolve().parent
    key = hashlib.sha256(f"{torch.__version__}{torch_dir}{GUARD_SOURCE}".encode()).hexdigest()[:16]
    cache = Path(os.environ.get("FP8LM_CACHE_DIR") or Path.home() / ".cache" / "fp8lm")
    lib = cache / f"fake_cuda_guard_{key}.so"
    if not lib.exists():
        cache.mkdir(parents=True, exist_ok=True)
        build_guard(lib, torch_dir)
    ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)


def build_guard(lib: Path, torch_dir: Path) -> None:
    """Compile `GUARD_SOURCE` into ``lib`` against torch's c10 (written under a temporary name)."""
    src = lib.with_suffix(".cpp")
    src.write_text(GUARD_SOURCE)
    tmp = lib.with_name(f".{lib.name}.{os.getpid()}")
    lib_dir = torch_dir / "lib"
    compiler = os.environ.get("CXX", "c++")
    cmd = [compiler, "-O1", "-shared", "-fPIC", "-std=c++17", f"-I{torch_dir / 'include'}", str(src), "-o", str(tmp)]
    cmd += [f"-L{lib_dir}", "-Wl,--no-as-needed", "-lc10", f"-Wl,-rpath,{lib_dir}"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True)
        error = None if proc.returncode == 0 else (proc.stderr.strip().splitlines() or ["no output"])[-1]
    except OSError as err:
        error = str(err)
    if error is not None:
        raise SystemExit(
            f"cuda_trace: cannot compile the fake CUDA device guard a CPU-only torch needs with {compiler} "
            f"({error}); set CXX to a working C++ compiler"
        )
    os.replace(tmp, lib)


def pretend_hopper(capability: tuple[int, int] = (9, 0)) -> None:
    """``torch.cuda.get_device_capability`` answers ``capability`` ((9, 0): an H100/H200) where no
    GPU can be asked."""
    if not torch.cuda.is_available():
        torch.cuda.get_device_capability = lambda device=None: capability


@contextmanager
def cuda_autocast(dtype: torch.dtype = torch.bfloat16):
    """BF16 autocast for CUDA (``torch.autocast("cuda")`` refuses without a device)."""
    before = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
    torch.set_autocast_enabled("cuda", True)
    torch.set_autocast_dtype("cuda", dtype)
    try:
        yield
    finally:
        torch.clear_autocast_cache()  # as torch.autocast does: weights are cast again next step
        torch.set_autocast_enabled("cuda", before[0])
        torch.set_autocast_dtype("cuda", before[1])


class FlashAttention(torch.autograd.Function):
    """Causal SDPA through the flash-attention ops (one kernel each way, as on an H100/H200)."""

    @staticmethod
    def forward(ctx, q, k, v):
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, True
        )
        ctx.save_for_backward(q, k, v, out, lse, cum_q, cum_k, seed, offset)
        ctx.max_q, ctx.max_k = max_q, max_k
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse, cum_q, cum_k, seed, offset = ctx.saved_tensors
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            grad, q, k, v, out, lse, cum_q, cum_k, ctx.max_q, ctx.max_k, 0.0, True, seed, offset
        )
        return dq, dk, dv


REAL_SDPA = F.scaled_dot_product_attention


def flash_sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kwargs):
    if kwargs.get("scale", 0) is None:
        del kwargs["scale"]  # the default scale, passed explicitly
    if q.is_cuda and attn_mask is None and dropout_p == 0.0 and is_causal and not kwargs:
        return FlashAttention.apply(q, k, v)
    return REAL_SDPA(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, **kwargs)


# -- the op log ------------------------------------------------------------------------------
def nbytes(t) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def to_host(name: str, args, kwargs) -> bool:
    """Whether an op copies a CUDA tensor to the host (``.cpu()``, ``.to("cpu")``, ``copy_`` into a
    CPU tensor): the host waits for the device, as for ``.item()``."""
    if name == "_to_copy" and isinstance(args[0], torch.Tensor):
        target = kwargs.get("device")
        return args[0].device.type == "cuda" and target is not None and torch.device(target).type == "cpu"
    if name == "copy_" and len(args) > 1 and isinstance(args[1], torch.Tensor):
        return args[0].device.type == "cpu" and args[1].device.type == "cuda"
    return False


def tensors_in(tree) -> list[torch.Tensor]:
    return [t for t in torch.utils._pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


def stack_category() -> str | None:
    """The category of the innermost fp8lm/torchao function on the stack that has one."""
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        module = frame.f_globals.get("__name__", "")
        if code.co_name in STACK_CATEGORIES and module.startswith(("fp8lm.", "torchao.")):
            return STACK_CATEGORIES[code.co_name]
        frame = frame.f_back
    return None


def categorize(name: str, inputs: list[torch.Tensor], outputs: list[torch.Tensor]) -> str:
    """Which kind of work one (non-view) aten op is, from the op, its tensors and the stack."""
    if name in GEMM_OPS:
        return "gemm"
    if name in ATTENTION_OPS:
        return "attention"
    by_stack = stack_category()
    if by_stack:
        return by_stack
    if max(t.numel() for t in inputs + outputs) <= TINY:
        return "amax_scale"
    if name in ("amax", "aminmax", "max", "abs"):
        return "amax_scale"
    if name in ("add", "add_") and len(inputs) == 2 and inputs[1].dim() == 1 and inputs[0].dim() == 2:
        return "bias"  # a bias added after a GEMM
    if name == "sum" and len(outputs) == 1 and outputs[0].dim() == 1 and inputs[0].dim() == 2:
        return "bias"  # the bias gradient
    if name == "_to_copy" and inputs and outputs and inputs[0].dtype != outputs[0].dtype:
        return "cast"
    if name in ("clone", "copy_", "_to_copy", "contiguous", "t_copy", "transpose_copy"):
        return "transpose_copy"
    return "other"


class OpLog(TorchDispatchMode):
    """Logs every aten op on fake tensors: launches, bytes read and written, by category, layer and
    pass. Ops on tensor subclasses are not kernels (they re-dispatch to their payloads' ops, which
    are logged); views and allocations launch nothing."""

    def __init__(self):
        super().__init__()
        self.records: list[dict] = []
        self.phase = "forward"
        self.layer = "-"
        self.fused: list | None = None  # ops of a compiled region being traced
        self.recording = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name in SYNC_OPS or to_host(name, args, kwargs):
            if name not in SYNC_OPS:  # a copy to the host: the data is waited for
                if self.recording:
                    self.records.append(self.record(name, "sync", 0, 0, 0))
                return func(*args, **kwargs)
            if self.recording:
                self.records.append(self.record(name, "sync", 0, 0, 0))
            # A fake tensor has no value to give: answer as a finite, non-zero tensor would.
            if name == "_local_scalar_dense":
                return 1.0 if args[0].is_floating_point() else 1
            return True
        if any(t is not FakeTensor for t in types):
            return NotImplemented  # a tensor subclass: its own dispatch runs the ops on its payloads
        out = func(*args, **kwargs)
        if not self.recording:
            return out
        # _unsafe_view is a view without autograd's view tracking (matmul's reshapes): no copy either
        views = func.is_view or name in ("detach", "alias", "_unsafe_view")
        if self.fused is not None and views:  # a view of a tensor the region makes is not a read
            self.fused.append((name, tensors_in((args, kwargs)), tensors_in(out)))
        if views or name in ALLOC_OPS or name == "device":
            return out
        inputs, outputs = tensors_in((args, kwargs)), tensors_in(out)
        mutated = {id(a) for a, arg in zip(args, func._schema.arguments) if arg.is_write}
        read = sum(nbytes(t) for t in inputs if not (name == "copy_" and id(t) in mutated))
        written = sum(nbytes(t) for t in outputs)
        if self.fused is not None:
            self.fused.append((name, inputs, outputs))
            return out
        category = categorize(name, inputs, outputs)
        self.records.append(self.record(name, category, 1, read, written, *gemm_flops(name, inputs)))
        return out

    def record(self, op, category, launches, read, written, flops=0.0, fp8=False) -> dict:
        return {
            "op": op,
            "category": category,
            "launches": launches,
            "read": read,
            "written": written,
            "flops": flops,
            "fp8": fp8,
            "phase": self.phase,
            "layer": self.layer,
        }

    def fused_region(self, fn):
        """``fn`` run as one compiled kernel would: its ops are collected, then logged as one."""

        def run(*args, **kwargs):
            if not self.recording or self.fused is not None:
                return fn(*args, **kwargs)
            self.fused = []
            try:
                out = fn(*args, **kwargs)
            finally:
                ops, self.fused = self.fused, None
            produced = {id(t) for _, _, outs in ops for t in outs}  # views of them included
            read = sum(
                nbytes(t) for t in {id(t): t for _, ins, _ in ops for t in ins if id(t) not in produced}.values()
            )
            written = sum(nbytes(t) for t in tensors_in(out))
            # fp8lm names each compiled copy of a function NAME_<n> (`fp8lm.ops.finegrained._compiled_fn`)
            base = re.sub(r"_\d+$", "", getattr(fn, "__name__", ""))
            category = STACK_CATEGORIES.get(base, "cast")  # a cast, scale arithmetic or a bias
            name = {"cast": "compiled_cast", "bias": "compiled_bias"}.get(category, "compiled_scale")
            self.records.append(self.record(name, category, 1 + split_reductions(ops), read, written))
            return out

        return run


def split_reductions(ops: list) -> int:
    """Reductions of a compiled region that Inductor splits in two kernels (the first fused with
    the region's pass over the tensor, the second a launch of its own, which also takes the
    scalar arithmetic after it): those to fewer values than an H200 has threads to spread them
    over (`SPLIT_REDUCTION_OUTPUTS`), of more than a few elements each. Reductions of a few values
    (an amax history) stay inside a kernel."""
    return sum(
        name in REDUCTION_OPS
        and outs[0].numel() < SPLIT_REDUCTION_OUTPUTS
        and max(t.numel() for t in ins) > SPLIT_REDUCTION_NUMEL
        for name, ins, outs in ops
    )


def gemm_flops(name: str, inputs: list[torch.Tensor]) -> tuple[float, bool]:
    """FLOPs of a GEMM or attention op and whether it runs in FP8."""
    if name in ("mm", "_scaled_mm", "_scaled_mm_v2"):
        (m, k), n = inputs[0].shape, inputs[1].shape[1]
        if inputs[0].dtype == torch.float4_e2m1fn_x2:  # two elements per byte along K
            k *= 2
        return 2.0 * m * k * n, name != "mm"
    if name == "triton_nvfp4_mm":  # (M, K / 2) and (N, K / 2) packed E2M1, multiplied in BF16
        (m, half_k), n = inputs[0].shape, inputs[2].shape[0]
        return 2.0 * m * 2 * half_k * n, False
    if name == "addmm":
        (m, k), n = inputs[1].shape, inputs[2].shape[1]
        return 2.0 * m * k * n, False
    if name in ("_grouped_mm", "_scaled_grouped_mm"):  # 2-D x 3-D: (T, K) x (E, K, N); 2-D x 2-D: (M, T) x (T, N)
        a, b = inputs[0], inputs[1]
        n = b.shape[-1]
        return 2.0 * a.shape[0] * a.shape[1] * n, name == "_scaled_grouped_mm"
    if name in ("bmm", "baddbmm"):
        (b, m, k), n = inputs[-2].shape, inputs[-1].shape[2]
        return 2.0 * b * m * k * n, False
    if name in ATTENTION_OPS:
        b, h, t, d = inputs[1].shape if name.endswith("backward") else inputs[0].shape
        causal_fwd = 2.0 * b * h * t * t * d  # QK^T and PV, half of each under the causal mask
        return causal_fwd * (2.5 if name.endswith("backward") else 1.0), False
    return 0.0, False


# -- running a step ------------------------------------------------------------------------------
def walk(roots) -> list:
    """Autograd nodes reachable from ``roots``, each after every node that feeds it a gradient."""
    order, seen, stack = [], set(), [(r, False) for r in roots if r is not None]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            order.append(node)
            continue
        if node in seen:
            continue
        seen.add(node)
        stack.append((node, True))
        stack.extend((n, False) for n, _ in node.next_functions if n is not None and n not in seen)
    return order[::-1]


def accumulate(param: torch.Tensor, grad: torch.Tensor) -> None:
    """What autograd's AccumulateGrad does with the only reference to a fresh gradient: keep it
    (called as a node from Python it would see a second reference and copy)."""
    param.grad = grad if param.grad is None else param.grad + grad


def run_backward(output: torch.Tensor, grad: torch.Tensor, log: OpLog, labels: dict) -> None:
    """``output.backward(grad)``, node by node from Python (see the module docstring)."""
    pending: dict = defaultdict(dict)
    pending[output.grad_fn][0] = grad
    for node in walk([output.grad_fn]):
        grads = pending.pop(node, {})
        if not grads:
            continue
        log.layer = labels.get(node, "-")
        args = [grads.get(i) for i in range(max(grads) + 1)]
        if type(node).__name__ == "AccumulateGrad":
            accumulate(node.variable, *args)
            continue
        outs = node.apply(*args) if hasattr(node, "_forward_cls") else node(*args)
        outs = (outs,) if not isinstance(outs, (tuple, list)) else outs
        for (nxt, slot), g in zip(node.next_functions, outs):
            if nxt is not None and g is not None:
                expected = nxt._input_metadata[slot]  # as the engine does: reduce broadcasts, cast
                if g.shape != expected.shape:
                    g = g.sum_to_size(expected.shape)
                if g.dtype != expected.dtype:
                    g = g.to(expected.dtype)
                seen = pending[nxt]
                seen[slot] = g if slot not in seen else seen[slot] + g


def label_layers(model: nn.Module, log: OpLog, labels: dict) -> list:
    """Forward hooks that name the innermost running module in ``log.layer`` and give the autograd
    nodes each module creates its name in ``labels`` (for the backward pass)."""
    stack, handles = [], []

    def pre(name):
        def hook(module, inputs):
            stack.append((log.layer, {id(n) for n in walk([t.grad_fn for t in tensors_in(inputs)])}))
            log.layer = name

        return hook

    def post(name):
        def hook(module, inputs, output):
            log.layer, before = stack.pop()
            for node in walk([t.grad_fn for t in tensors_in(output)]):
                if id(node) not in before:
                    labels.setdefault(node, name)

        return hook

    for name, module in model.named_modules():
        name = name or type(module).__name__
        handles += [module.register_forward_pre_hook(pre(name)), module.register_forward_hook(post(name))]
    return handles


def trace_step(model: nn.Module, optimizer, x: torch.Tensor, log: OpLog) -> tuple[list[dict], list[dict]]:
    """One warm-up training step, then two traced: forward under BF16 autocast, backward. Before
    the first traced step ``optimizer`` steps (not traced), as in training: the weights change and
    what is derived from them is made anew (fp8lm takes the weights' amaxes from that step); before
    the second it does not, as for a further micro-batch of gradient accumulation. Returns the
    records of both."""
    labels: dict = {}
    handles = label_layers(model, log, labels)
    traced = []
    try:
        for recording, new_weights in ((False, False), (True, True), (True, False)):
            if new_weights:
                optimizer.step()
            model.zero_grad(set_to_none=True)
            x.grad = None
            labels.clear()
            log.records, log.recording, log.phase = [], recording, "forward"
            with cuda_autocast():
                y = model(x)
            log.phase, log.recording = "backward", False
            grad = torch.ones_like(y)
            log.recording = recording
            run_backward(y, grad, log, labels)
            log.recording = False
            traced.append(log.records)
    finally:
        for h in handles:
            h.remove()
    return traced[1], traced[2]


def fp8lm_model(
    model: nn.Module, attention_bf16: bool = False, fp32_weights: bool = False, recipe: str | None = None
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """O1's FP8 GEMMs and E4M3 weight gradients on every linear layer (none of these models has an
    output head, which O1 would give a BF16 one), with its optimizer (torch's AdamW, kept). The
    weights are stored as FP8Linear's and O2's (scaled FP16, whose amax the optimizer step records
    as it writes them), or with ``fp32_weights`` as O1's default (plain FP32: the forward measures
    their amax); ``attention_bf16``: the attention projections' GEMMs in BF16 (a policy override);
    ``recipe``: a named `fp8lm.Recipe` (default: tensorwise-delayed)."""
    import fp8lm
    from fp8lm.policy import preset

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    policy = preset("O1", output_head=False)
    if not fp32_weights:
        policy = policy.with_linear(weight=fp8lm.FP16)
    if attention_bf16:
        policy = policy.override("*attn*", fp8_gemm=False)
    model, optimizer = fp8lm.initialize(model, optimizer, opt_level="O1", policy=policy, recipe=recipe)
    assert optimizer is not None  # one was given
    return model, optimizer


def torchao_model(model: nn.Module) -> nn.Module:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig.from_recipe_name("tensorwise")
    return convert_to_float8_training(model, config=config)


# -- summaries and the model ---------------------------------------------------------------------
def kernel_seconds(r: dict) -> float:
    """Modelled time of one logged kernel: the longer of its launch and its work (GEMMs and
    attention at the peak rate, everything else at HBM bandwidth)."""
    if r["category"] in ("gemm", "attention"):
        work = r["flops"] / (MODEL["fp8_tflop_s" if r["fp8"] else "bf16_tflop_s"] * 1e12)
    else:
        work = (r["read"] + r["written"]) / (MODEL["hbm_tb_s"] * 1e12)
    return max(r["launches"] * MODEL["launch_us"] * 1e-6, work)


def totals(records: list[dict]) -> dict:
    outside = [r for r in records if r["category"] not in ("gemm", "attention")]
    return {
        "launches": sum(r["launches"] for r in records),
        "launches_outside_gemm": sum(r["launches"] for r in outside),
        "mb_outside_gemm": round(sum(r["read"] + r["written"] for r in outside) / 1e6, 1),
        "gemms": sum(r["category"] == "gemm" for r in records),
        "fp8_gemms": sum(r["fp8"] for r in records),
        "gemm_gflop": round(sum(r["flops"] for r in records) / 1e9, 1),
        "syncs": sum(r["category"] == "sync" for r in records),
        "modelled_ms": round(sum(kernel_seconds(r) for r in records) * 1e3, 4),
    }


def summarize(records: list[dict]) -> dict:
    """Launches and MB per pass and category, per layer, totals, and the ops of each category."""
    out: dict = {"total": totals(records)}
    for phase in ("forward", "backward"):
        mine = [r for r in records if r["phase"] == phase]
        out[phase] = {"total": totals(mine)}
        for cat in CATEGORIES + ("sync",):
            rs = [r for r in mine if r["category"] == cat]
            if rs:
                out[phase][cat] = {
                    "launches": sum(r["launches"] for r in rs),
                    "mb": round(sum(r["read"] + r["written"] for r in rs) / 1e6, 1),
                    "ops": sorted({r["op"] for r in rs}),
                }
    layers = dict.fromkeys(r["layer"] for r in records)
    out["layers"] = {
        name: {
            phase: totals([r for r in records if r["layer"] == name and r["phase"] == phase])
            for phase in ("forward", "backward")
        }
        for name in layers
    }
    return out


def ideal_fp8(m: int, k: int, n: int) -> dict:
    """A fused FP8 linear layer (BF16 activations, FP16 stored weight): each cast one kernel that
    writes the FP8 copy and the transposed one the GEMM needs, the bias inside the forward GEMM,
    its gradient inside the output gradient's cast, the weight gradient written as FP8 by its
    GEMM, one scale update per pass: 3 casts + 3 GEMMs + 2 = 8 launches."""
    gemm = {"category": "gemm", "launches": 1, "flops": 2.0 * m * k * n, "fp8": True, "read": 0, "written": 0}
    kernels = [
        {"category": "cast", "launches": 1, "read": 2 * m * k, "written": 2 * m * k},  # input, bf16 -> 2x fp8
        {"category": "cast", "launches": 1, "read": 2 * n * k, "written": 2 * n * k},  # weight, fp16 -> 2x fp8
        {"category": "cast", "launches": 1, "read": 2 * m * n, "written": 2 * m * n},  # output gradient (+ bias grad)
        {"category": "gemm_epilogue", "launches": 0, "read": 0, "written": n * k},  # weight gradient as fp8
        *({"category": "amax_scale", "launches": 1, "read": 0, "written": 0} for _ in range(2)),
        gemm,
        gemm,
        gemm,
    ]
    seconds = sum(kernel_seconds({"flops": 0.0, "fp8": False, **r}) for r in kernels)
    outside = sum(r["read"] + r["written"] for r in kernels)
    return {"launches": 8, "mb_outside_gemm": round(outside / 1e6, 1), "modelled_ms": round(seconds * 1e3, 4)}


def block_linears(width: int, tokens: int) -> dict:
    """The FP8 layers of a GPT block (GELU MLP of 4x width): name -> (M, K, N)."""
    return {
        "attn.c_attn": (tokens, width, 3 * width),
        "attn.c_proj": (tokens, width, width),
        "mlp.c_fc": (tokens, width, 4 * width),
        "mlp.c_proj": (tokens, 4 * width, width),
    }


def step_ratios(variants: dict, width: int, tokens: int) -> dict:
    """Modelled GPT-block step time of each variant over BF16's (a block is a fixed share of a GPT's
    step: this is the model's ratio without embedding, head, loss and optimizer), and of BF16's
    block with its four linear layers replaced by `ideal_fp8` ones."""
    bf16 = variants["bf16"]["block"]
    base = bf16["total"]["modelled_ms"]
    ratios = {name: round(v["block"]["total"]["modelled_ms"] / base, 3) for name, v in variants.items() if "block" in v}
    ideal = base
    for name, (m, k, n) in block_linears(width, tokens).items():
        layer = bf16["layers"][name]
        ideal += ideal_fp8(m, k, n)["modelled_ms"] - layer["forward"]["modelled_ms"] - layer["backward"]["modelled_ms"]
    ratios["ideal_fp8"] = round(ideal / base, 3)
    return ratios


# -- the cases -----------------------------------------------------------------------------------
def convert(variant: str, model: nn.Module) -> tuple[nn.Module, torch.optim.Optimizer]:
    """``model`` as ``variant`` trains it, with its optimizer."""
    if variant.startswith("fp8lm"):
        from fp8lm.recipe import RECIPES

        recipe = variant.removeprefix("fp8lm_")
        return fp8lm_model(
            model,
            attention_bf16=variant == "fp8lm_attn_bf16",
            fp32_weights=variant == "fp8lm_fp32_weights",
            recipe=recipe if recipe in RECIPES else None,
        )
    if variant == "torchao":
        model = torchao_model(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def linear_case(variant: str, m: int, k: int, n: int, log: OpLog) -> dict:
    with torch.device("cuda"):  # the default device: where FP8Linear creates its scaling state
        model, optimizer = convert(variant, nn.Sequential(nn.Linear(k, n)))
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    step, microbatch = trace_step(model, optimizer, x, log)
    return {**summarize(step), "next_microbatch": totals(microbatch)}


def block_case(variant: str, width: int, tokens: int, seq: int, log: OpLog) -> dict:
    from fp8lm.train.model import Block, GPTConfig

    config = GPTConfig(block_size=seq, n_layer=1, n_head=max(width // 128, 1), n_embd=width)
    with torch.device("cuda"):
        model, optimizer = convert(variant, Block(config))
    x = torch.randn(tokens // seq, seq, width, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    step, microbatch = trace_step(model, optimizer, x, log)
    return {**summarize(step), "next_microbatch": totals(microbatch)}


def run_variant(variant: str, args, log: OpLog) -> dict:
    """Every case of one variant: ``{"linear": [...], "block": ...}``, or why it cannot run."""
    try:
        if variant == "torchao":
            import torchao.float8  # noqa: F401
        if variant.startswith("fp8lm"):
            from fp8lm.ops.fastpath import COMPILED_CASTS

            # The switch FP8LM_FUSED_CAST=0 sets (an eager-only run) or leaves on: compiled casts and scale arithmetic.
            COMPILED_CASTS.on = variant != "fp8lm_eager" and os.environ.get("FP8LM_FUSED_CAST") != "0"
        out = {"linear": [linear_case(variant, m, k, n, log) for m, k, n in args.shapes]}
        width, tokens, seq = args.block
        out["block"] = block_case(variant, width, tokens, seq, log)
        return out
    except Exception as err:  # one variant that cannot run is reported, the others still are
        return {"skipped": f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"}


def run_variants(args, variants: list[str]) -> dict:
    log = OpLog()
    real_compile = torch.compile
    torch.compile = lambda fn=None, **_: log.fused_region(fn)  # see the module docstring
    F.scaled_dot_product_attention = flash_sdpa
    try:
        with FakeTensorMode(), log:
            return {v: run_variant(v, args, log) for v in variants}
    finally:
        torch.compile, F.scaled_dot_product_attention = real_compile, REAL_SDPA


def parse_block(text: str) -> tuple[int, int, int]:
    """``WIDTHxTOKENSxSEQ`` of the GPT block (MLP 4x width, heads of 128)."""
    try:
        width, tokens, seq = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--block wants WIDTHxTOKENSxSEQ, e.g. 2048x8192x2048, got {text!r}") from None
    if min(width, tokens, seq) < 1 or tokens % seq:
        raise argparse.ArgumentTypeError(f"--block {text!r}: sizes must be positive and TOKENS a multiple of SEQ")
    return width, tokens, seq


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", type=parse_shapes, default=[(8192, 4096, 4096)], help="linear layers MxKxN")
    parser.add_argument("--block", type=parse_block, default=(2048, 8192, 2048), help="GPT block WIDTHxTOKENSxSEQ")
    parser.add_argument("--quick", action="store_true", help="small shapes, for tests")
    parser.add_argument(
        "--recipes",
        default="",
        help="also trace fp8lm (compiled casts) with these named recipes, comma-separated: variants fp8lm_NAME",
    )
    parser.add_argument(
        "--capability", default="9.0", help="the compute capability to pretend (default: %(default)s, an H200)"
    )
    args = parser.parse_args()
    if args.quick:
        args.shapes, args.block = [(1024, 512, 512)], (256, 1024, 256)
    warnings.filterwarnings("ignore", message=".*CUDA is not available.*")
    load_fake_cuda_guard()
    major, minor = (int(v) for v in args.capability.split("."))
    pretend_hopper((major, minor))
    recipes = [f"fp8lm_{name}" for name in args.recipes.split(",") if name]
    variants = run_variants(
        args, ["bf16", "fp8lm_eager", "fp8lm_compiled", "fp8lm_attn_bf16", "fp8lm_fp32_weights", "torchao", *recipes]
    )
    print(
        json.dumps(
            {
                "benchmark": "cuda_trace",
                "machine": machine(),
                "model": MODEL,
                "shapes": [{"m": m, "k": k, "n": n, "ideal_fp8": ideal_fp8(m, k, n)} for m, k, n in args.shapes],
                "block": dict(zip(("width", "tokens", "seq"), args.block)),
                "block_step_ratio_vs_bf16": step_ratios(variants, *args.block[:2])
                if "block" in variants["bf16"]
                else None,
                "variants": variants,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
