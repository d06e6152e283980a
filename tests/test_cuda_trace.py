"""benchmarks/cuda_trace.py keeps running: the CUDA path traced on fake tensors, with sensible counts."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "cuda_trace.py"


def run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env)


def on_fake_cuda(code: str) -> str:
    """The stdout of ``code`` run in a fresh process, with `cuda_trace` imported as ``ct`` and
    ``FakeTensorMode`` imported."""
    preamble = (
        "import sys, torch; sys.path.insert(0, sys.argv[1]); import cuda_trace as ct\n"
        "from torch._subclasses.fake_tensor import FakeTensorMode\n"
    )
    proc = subprocess.run([sys.executable, "-c", preamble + code, str(SCRIPT.parent)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


@pytest.fixture(scope="module")
def quick() -> dict:
    proc = run("--quick", "--recipes", "rowwise,nvfp4")
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)


def test_bf16_linear_is_three_gemms_and_five_other_kernels(quick):
    bf16 = quick["variants"]["bf16"]["linear"][0]
    # forward: weight and bias cast to BF16, addmm; backward: two mm, bias-gradient sum, two casts to FP32
    assert bf16["total"]["gemms"] == 3 and bf16["total"]["fp8_gemms"] == 0
    assert bf16["total"]["launches"] == 8 and bf16["total"]["syncs"] == 0
    assert bf16["forward"]["gemm"]["ops"] == ["addmm"] and bf16["backward"]["gemm"]["ops"] == ["mm"]
    m, k, n = (quick["shapes"][0][d] for d in "mkn")
    assert bf16["total"]["gemm_gflop"] == round(3 * 2 * m * k * n / 1e9, 1)


@pytest.mark.parametrize("variant", ["fp8lm_eager", "fp8lm_compiled", "torchao"])
def test_fp8_variants_run_three_scaled_mm(quick, variant):
    result = quick["variants"][variant]
    if variant == "torchao" and "skipped" in result:
        pytest.skip(f"torchao: {result['skipped']}")
    linear = result["linear"][0]["total"]
    assert linear["gemms"] == linear["fp8_gemms"] == 3
    if variant == "torchao":
        assert linear["syncs"] == 0  # fp8lm's are reported (ScalingMeta reads its step on the host)
    assert linear["launches"] > quick["variants"]["bf16"]["linear"][0]["total"]["launches"]
    block = result["block"]
    assert block["total"]["fp8_gemms"] == 12  # four linear layers of the block
    assert block["forward"]["attention"]["launches"] == block["backward"]["attention"]["launches"] == 1


def test_compiled_casts_are_fewer_launches_and_bytes_than_eager(quick):
    eager, compiled = (quick["variants"][v]["linear"][0] for v in ("fp8lm_eager", "fp8lm_compiled"))
    assert "compiled_cast" in compiled["forward"]["cast"]["ops"]
    assert "compiled_cast" not in eager["forward"]["cast"]["ops"]
    assert compiled["total"]["launches"] < eager["total"]["launches"]
    assert compiled["total"]["mb_outside_gemm"] < eager["total"]["mb_outside_gemm"]


def test_the_attention_override_runs_the_attention_projections_in_bf16(quick):
    attn_bf16, compiled = (quick["variants"][v] for v in ("fp8lm_attn_bf16", "fp8lm_compiled"))
    assert attn_bf16["linear"][0]["total"] == compiled["linear"][0]["total"]  # no attention layer there
    layers = attn_bf16["block"]["layers"]
    assert attn_bf16["block"]["total"]["fp8_gemms"] == 6  # the MLP's two layers

    def fp8_gemms(name):
        return sum(layers[name][phase]["fp8_gemms"] for phase in ("forward", "backward"))

    assert [fp8_gemms(n) for n in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")] == [0, 0, 3, 3]


def test_layers_add_up_to_the_totals_and_the_ratio_is_modelled(quick):
    block = quick["variants"]["fp8lm_compiled"]["block"]
    layers = block["layers"]
    assert {"attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"} <= set(layers)
    launches = sum(layer[phase]["launches"] for layer in layers.values() for phase in ("forward", "backward"))
    assert launches == block["total"]["launches"]
    ratios = quick["block_step_ratio_vs_bf16"]
    assert ratios["bf16"] == 1.0 and ratios["fp8lm_compiled"] > 0 and 0 < ratios["ideal_fp8"]
    assert quick["shapes"][0]["ideal_fp8"]["launches"] == 8


def test_compiled_casts_copy_no_operand_and_cast_the_weight_once_per_step(quick):
    """The casts write the transposed payloads the backward GEMMs read (no transpose copies); the
    weight's amax comes from the optimizer step, which measured it as it wrote the weight; a further
    micro-batch with unchanged weights casts no weight (fewer launches and bytes)."""
    compiled = quick["variants"]["fp8lm_compiled"]["linear"][0]
    assert "transpose_copy" not in compiled["forward"] and "transpose_copy" not in compiled["backward"]
    step, microbatch = compiled["total"], compiled["next_microbatch"]
    assert step["launches"] <= 16  # docs/performance.md's target
    assert microbatch["launches"] == step["launches"] - 2  # the weight's scale (1) and cast (1)
    assert microbatch["mb_outside_gemm"] < step["mb_outside_gemm"]
    bf16 = quick["variants"]["bf16"]["linear"][0]
    assert bf16["next_microbatch"]["launches"] == bf16["total"]["launches"]


def test_fp32_weights_cost_the_weight_amax_every_micro_batch(quick):
    """O1's default plain FP32 weights: no optimizer records their amax and no FP8 copy is kept
    between micro-batches, so each forward reads the 4-byte weight for its amax and again for
    its cast (one launch and the weight's bytes more than scaled FP16 weights)."""
    fp32, fp16 = (quick["variants"][v]["linear"][0] for v in ("fp8lm_fp32_weights", "fp8lm_compiled"))
    assert fp32["total"]["launches"] == fp16["total"]["launches"] + 1
    assert fp32["total"]["mb_outside_gemm"] > fp16["total"]["mb_outside_gemm"]
    assert fp32["next_microbatch"] == fp32["total"]
    assert fp32["total"]["fp8_gemms"] == 3 and fp32["total"]["syncs"] == 0


@pytest.mark.parametrize(
    "args, match",
    [(["--block", "64x100"], "--block wants WIDTHxTOKENSxSEQ"), (["--block", "64x100x64"], "TOKENS a multiple of SEQ")],
)
def test_bad_block_is_one_clear_error(args, match):
    proc = run(*args)
    assert proc.returncode == 2 and match in proc.stderr.strip().splitlines()[-1]
    assert "Traceback" not in proc.stderr and proc.stdout == ""


def test_host_synchronisations_are_counted():
    stdout = on_fake_cuda(
        "ct.load_fake_cuda_guard(); log = ct.OpLog()\n"
        "with FakeTensorMode(), log:\n"
        "    x = torch.randn(64, device='cuda'); log.recording = True\n"
        "    values = (x.amax().item(), bool(x.sum() > 0), (x > 0).sum().item(), x.amax().tolist())\n"
        "print(sum(r['category'] == 'sync' for r in log.records), values)\n"
    )
    assert stdout.split()[0] == "4"


def test_fine_grained_recipes_trace_on_the_cuda_path(quick):
    """rowwise multiplies with torch._scaled_mm (row-wise scales); nvfp4 has no FP4 tensor cores on
    9.0: GEMMs of the dequantized operands, or with Triton installed its Triton GEMM on BF16 tensor
    cores, plus the Hadamard transforms of the weight-gradient GEMM's two inputs. Both quantize
    each operand in one compiled function, with no host sync."""
    rowwise, nvfp4 = (quick["variants"][v]["linear"][0]["total"] for v in ("fp8lm_rowwise", "fp8lm_nvfp4"))
    assert rowwise["gemms"] == rowwise["fp8_gemms"] == 3
    assert nvfp4["gemms"] == 5 and nvfp4["fp8_gemms"] == 0
    assert rowwise["syncs"] == nvfp4["syncs"] == 0
    assert quick["variants"]["fp8lm_rowwise"]["block"]["total"]["fp8_gemms"] == 12


def test_fine_grained_weights_are_quantized_once_per_step_on_the_cuda_path(quick):
    """A further micro-batch (weights unchanged) reuses the weight operands kept since the step:
    rowwise's two quantizations of the weight (two kernels each: a split reduction) and nvfp4's one
    are gone, and their bytes; the first step is as it was."""
    for variant, launches in (("fp8lm_rowwise", 4), ("fp8lm_nvfp4", 2)):
        linear = quick["variants"][variant]["linear"][0]
        step, microbatch = linear["total"], linear["next_microbatch"]
        assert microbatch["launches"] == step["launches"] - launches, variant
        assert microbatch["mb_outside_gemm"] < step["mb_outside_gemm"], variant
        assert microbatch["gemms"] == step["gemms"] and microbatch["syncs"] == 0, variant


def test_fine_grained_operands_are_quantized_into_the_layout_their_gemm_reads(quick):
    """rowwise's operands quantized along dim 0 (the weight for the input gradient, both operands
    of the weight gradient) are written column-major by their compiled quantization: no transpose
    copy before a GEMM. The stored weight is read by the quantization itself: the forward has
    only compiled quantizations and the GEMM, no float32 copy of the weight."""
    linear = quick["variants"]["fp8lm_rowwise"]["linear"][0]
    for phase in ("forward", "backward"):
        assert "transpose_copy" not in linear[phase], phase
    forward_ops = {op for kind, part in linear["forward"].items() if kind != "total" for op in part["ops"]}
    assert forward_ops == {"compiled_cast", "_scaled_mm", "_to_copy"}  # _to_copy: the bias to BF16
    # x and W each quantized for two GEMMs (two kernels each: a split reduction), the bias cast
    assert linear["forward"]["total"]["launches_outside_gemm"] == 4 * 2 + 1


def test_nvfp4_multiplies_in_fp4_on_compute_capability_10():
    """On a B200 (capability 10.0) nvfp4's three GEMMs are FP4 ``scaled_mm`` calls (the packed
    elements, E4M3 block scales and tensor scales pass torch's shape checks), the Hadamard
    transforms of the weight-gradient GEMM's inputs the other two; no host sync."""
    proc = run("--quick", "--recipes", "nvfp4", "--capability", "10.0")
    assert proc.returncode == 0, proc.stderr[-2000:]
    linear = json.loads(proc.stdout)["variants"]["fp8lm_nvfp4"]["linear"][0]
    assert linear["total"]["gemms"] == 5 and linear["total"]["fp8_gemms"] == 3
    assert linear["total"]["syncs"] == 0
    assert "_scaled_mm_v2" in linear["forward"]["gemm"]["ops"] and "_scaled_mm_v2" in linear["backward"]["gemm"]["ops"]
    # the bias is added to the FP32 product and rounded to BF16 by one compiled function
    assert linear["forward"]["bias"]["ops"] == ["compiled_bias"] and linear["forward"]["bias"]["launches"] == 1


def test_nvfp4_takes_the_triton_gemm_on_compute_capability_9_with_triton():
    pytest.importorskip("triton")
    proc = run("--quick", "--recipes", "nvfp4")
    assert proc.returncode == 0, proc.stderr[-2000:]
    linear = json.loads(proc.stdout)["variants"]["fp8lm_nvfp4"]["linear"][0]
    assert linear["total"]["gemms"] == 5 and linear["total"]["syncs"] == 0
    for phase in ("forward", "backward"):
        assert "triton_nvfp4_mm" in linear[phase]["gemm"]["ops"], phase


def test_fp8_saved_attention_runs_the_flash_kernels_on_the_cuda_path():
    """`FP8SavedAttention` on fake CUDA tensors: the flash kernel forward, and in the backward its
    forward again (at the dequantized q, k, v) and its backward; no host sync; CUDA gradients."""
    stdout = on_fake_cuda(
        "from fp8lm.nn.saved import FP8SavedAttention\n"
        "ct.load_fake_cuda_guard(); log = ct.OpLog()\n"
        "with FakeTensorMode(), log:\n"
        "    q, k, v = (torch.randn(2, 4, 128, 64, device='cuda', dtype=torch.bfloat16, requires_grad=True)"
        " for _ in range(3))\n"
        "    log.recording = True\n"
        "    out = FP8SavedAttention()(q, k, v, is_causal=True)\n"
        "    ct.run_backward(out, torch.ones_like(out), log, {})\n"
        "    grads = [t.grad for t in (q, k, v)]\n"
        "ops = [r['op'] for r in log.records if 'attention' in r['op']]\n"
        "print(sum(r['category'] == 'sync' for r in log.records), ','.join(ops),"
        " all(g.is_cuda and g.dtype == torch.bfloat16 for g in grads))\n"
    )
    syncs, ops, cuda_grads = stdout.split()
    forward, backward = "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward"
    assert syncs == "0" and ops.split(",") == [forward, forward, backward] and cuda_grads == "True"


def test_the_hadamard_transform_multiplies_bf16_as_it_is_on_cuda():
    """On CUDA nvfp4's Hadamard transform reads a BF16 operand as it is (``torch.bmm`` with FP32
    accumulation and output): no float32 copy of it; the matrix is made in BF16 (exact: +-1/4)."""
    stdout = on_fake_cuda(
        "from fp8lm.ops.hadamard import random_hadamard\n"
        "ct.load_fake_cuda_guard(); log = ct.OpLog()\n"
        "with FakeTensorMode(), log:\n"
        "    x = torch.randn(100, 64, device='cuda', dtype=torch.bfloat16); log.recording = True\n"
        "    y = random_hadamard(x, seed=3)\n"
        "big = [r['op'] for r in log.records if r['launches'] and r['read'] + r['written'] > 1024]\n"
        "print(y.dtype, 'x'.join(map(str, y.shape)), ','.join(big))\n"
    )
    dtype, shape, ops = stdout.split(maxsplit=2)
    # 100 rows padded to 112 (7 groups of 16): the pad and the product, nothing converted
    assert dtype == "torch.float32" and shape == "112x64"
    assert ops.strip().split(",") == ["constant_pad_nd", "bmm"]


def test_a_weight_in_its_gemm_format_is_saved_as_it_is_on_cuda():
    """An FP8Linear whose weight payload is already E4M3 (an O3 weight; under FSDP2, the FP8
    all-gather's gathered parameter) saves that payload for the backward, not a transposed copy
    made in the forward, and keeps no copy between steps: FSDP2 frees a gathered weight after the
    forward and gathers it again for the backward, which a saved copy would defeat. The backward
    transposes it for the input-gradient GEMM (one copy); an FP16-stored weight is cast with its
    transpose in the forward, as before."""
    stdout = on_fake_cuda(
        "from fp8lm.nn import FP8Linear\n"
        "ct.load_fake_cuda_guard(); ct.pretend_hopper()\n"
        "for fmt in ('E4M3', 'FP16'):\n"
        "    log = ct.OpLog()\n"
        "    with FakeTensorMode(), log:\n"
        "        layer = FP8Linear(256, 128, weight_format=fmt, device='cuda')\n"
        "        x = torch.randn(64, 256, device='cuda', requires_grad=True)\n"
        "        saved = []\n"
        "        log.recording = True\n"
        "        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):\n"
        "            y = layer(x)\n"
        "        log.phase = 'backward'\n"
        "        ct.run_backward(y, torch.ones_like(y), log, {})\n"
        "        weights = [t for t in saved if tuple(t.shape) == (128, 256)]\n"
        "        (kept,) = layer._weight_operand._entry[2].values()\n"
        "        copies = [r['phase'] for r in log.records if r['category'] == 'transpose_copy']\n"
        "        print(fmt, len(weights), weights[0] is layer.weight.payload, kept._relaid is not None,"
        " ','.join(copies) or '-', len(x.grad.shape))\n"
    )
    e4m3, fp16 = (line.split() for line in stdout.splitlines())
    assert e4m3 == ["E4M3", "1", "True", "False", "backward", "2"]
    assert fp16 == ["FP16", "1", "False", "True", "-", "2"]
