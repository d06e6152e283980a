"""FastPath: a fast path that cannot be built warns once in one line, turns itself off and falls
back with the same results, without touching the other paths; any other error propagates. The casts
and the optimizer step use it."""

import subprocess
import warnings

import pytest
import torch
from torch import nn

import fp8lm
from fp8lm.nn import scale_math
from fp8lm.ops import cast, fastpath, native
from fp8lm.ops.fastpath import FastPath, NativeBuildError, Switch
from fp8lm.optim import FP8AdamW, fused


def _boom(*args, **kwargs):
    raise NativeBuildError("cc failed: no compiler here")


def _compile_failure(inner: Exception) -> Exception:
    from torch._dynamo.exc import BackendCompilerFailed

    return BackendCompilerFailed(lambda: None, inner, None)


def test_a_path_that_cannot_be_built_warns_one_line_and_falls_back():
    path = FastPath("test path", fallback="the plain one")
    calls = []

    def fast():
        calls.append("fast")
        raise NativeBuildError("cc failed: broken\nsecond line of the compiler's output")

    with pytest.warns(UserWarning) as record:
        assert path.run(fast, lambda: 42) == 42
    (warning,) = record
    assert str(warning.message) == (
        "fp8lm: test path unavailable (NativeBuildError: cc failed: broken); using the plain one"
    )
    assert not path.enabled and path.failed == "NativeBuildError: cc failed: broken"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second warning would raise here
        assert path.run(fast, lambda: 43) == 43
    assert calls == ["fast"]  # never retried


@pytest.mark.parametrize(
    "error",
    [
        OSError("libfp8lm.so: cannot open shared object file"),
        subprocess.CalledProcessError(1, ["cc"]),
        _compile_failure(RuntimeError("InvalidCxxCompiler: no working C++ compiler found")),
    ],
    ids=["load", "subprocess", "torch.compile backend"],
)
def test_build_and_compile_errors_fall_back(error):
    path = FastPath("test path", fallback="plain")

    def fast():
        raise error

    with pytest.warns(UserWarning, match=f"test path unavailable \\({type(error).__name__}"):
        assert path.run(fast, lambda: "plain") == "plain"
    assert not path.enabled


@pytest.mark.parametrize(
    "error",
    [
        torch.OutOfMemoryError("CUDA out of memory"),
        MemoryError("fp8lm: a native CPU kernel could not allocate its work buffers"),
        RuntimeError("mat1 and mat2 shapes cannot be multiplied"),
        ValueError("scale must be one finite positive number"),
        _compile_failure(torch.OutOfMemoryError("out of memory while autotuning")),
    ],
    ids=["oom", "host oom", "runtime", "value", "oom while compiling"],
)
def test_other_errors_propagate_and_leave_the_path_on(error):
    path = FastPath("test path", fallback="plain")

    def fast():
        raise error

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning
        with pytest.raises(type(error)):
            path.run(fast, lambda: "plain")
    assert path.enabled and path.failed is None


def test_one_failing_path_leaves_the_others_on():
    switch = Switch("FP8LM_TEST_UNSET_SWITCH")
    first, second = FastPath("first", "plain", switch), FastPath("second", "plain", switch)
    with pytest.warns(UserWarning, match="first unavailable"):
        first.run(_boom, lambda: None)
    assert not first.enabled and second.enabled and switch.on
    assert second.run(lambda: "fast", lambda: "plain") == "fast"


def test_one_environment_variable_is_one_switch(monkeypatch):
    assert cast.FUSED_CAST.switch is scale_math.SCALE_MATH.switch is fastpath.COMPILED_CASTS
    assert native.KERNELS.switch is fastpath.NATIVE
    monkeypatch.setattr(fastpath.COMPILED_CASTS, "on", False)
    assert not cast.FUSED_CAST.enabled and not scale_math.SCALE_MATH.enabled
    assert cast.FUSED_CAST.run(_boom, lambda: "plain") == "plain"  # off: the fast path is not tried
    monkeypatch.setenv("FP8LM_TEST_SWITCH", "0")
    assert not Switch("FP8LM_TEST_SWITCH").on
    monkeypatch.setenv("FP8LM_TEST_SWITCH", "1")
    assert Switch("FP8LM_TEST_SWITCH").on


def test_a_compiler_that_fails_turns_the_native_kernels_off_with_one_line(monkeypatch, tmp_path):
    compiler = tmp_path / "cc"
    compiler.write_text("#!/bin/sh\necho 'fatal error: codec.h: No such file'>&2\nexit 1\n")
    compiler.chmod(0o755)
    monkeypatch.setenv("CC", str(compiler))
    monkeypatch.setenv("FP8LM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(native, "_library", None)
    monkeypatch.setattr(native.KERNELS.switch, "on", True)
    monkeypatch.setattr(native.KERNELS, "failed", None)
    with pytest.warns(UserWarning, match=r"native CPU kernels unavailable \(NativeBuildError: .* failed"):
        assert not native.available()
    assert native.KERNELS.failed is not None and cast.FUSED_CAST.failed is None


def test_cast_falls_back_to_eager_ops_with_the_same_bits(monkeypatch):
    monkeypatch.setattr(native.KERNELS.switch, "on", False)  # the compiled cast serves where the C kernels do not
    monkeypatch.setattr(cast.FUSED_CAST.switch, "on", True)
    monkeypatch.setattr(cast.FUSED_CAST, "failed", None)

    def fails_to_compile(*args, **kwargs):
        raise _compile_failure(RuntimeError("CppCompileError: C++ compile error"))

    monkeypatch.setattr(cast, "_fused", fails_to_compile)
    x = torch.randn(cast.FUSED_MIN_NUMEL) * 300
    expected = (x * 2.0).clamp(-448, 448).to(torch.float8_e4m3fn)
    with pytest.warns(UserWarning, match="fused cast unavailable"):
        out = cast.saturating_cast(x, torch.tensor(2.0), fp8lm.E4M3)
    assert not cast.FUSED_CAST.enabled
    assert torch.equal(out.view(torch.uint8), expected.view(torch.uint8))


def _trained(kernel):
    torch.manual_seed(0)
    params = [nn.Parameter(fp8lm.quantize(torch.randn(64, 32) * 0.1, fp8lm.FP16)), nn.Parameter(torch.randn(32))]
    opt = FP8AdamW(params, lr=1e-2, kernel=kernel)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen) * 1e-2
        opt.step()
    return params, opt


def test_optimizer_step_falls_back_to_eager_ops_with_the_same_results(monkeypatch):
    monkeypatch.setattr(fused.COMPILED_STEP, "failed", None)

    def fails_to_compile(fn):
        raise _compile_failure(RuntimeError("CppCompileError: C++ compile error"))

    monkeypatch.setattr(fused, "_compiled", fails_to_compile)
    with pytest.warns(UserWarning, match="compiled optimizer step unavailable"):
        params, opt = _trained("compile")
    assert not fused.COMPILED_STEP.enabled
    ref_params, ref_opt = _trained("eager")
    assert torch.equal(params[0].payload, ref_params[0].payload) and torch.equal(params[0].scale, ref_params[0].scale)
    assert torch.equal(params[1], ref_params[1])
    for key in ("exp_avg", "exp_avg_sq", "exp_avg_scale", "exp_avg_sq_scale"):
        assert torch.equal(opt.state[params[0]][key].float(), ref_opt.state[ref_params[0]][key].float()), key


@pytest.mark.parametrize("name", ["TorchRuntimeError", "InternalTorchDynamoError"])
def test_a_function_torch_compile_cannot_trace_falls_back_where_the_plain_path_runs(name):
    """torch.compile failing while it traces (on fake tensors, or inside itself): where the plain
    path runs the same call, the fast path is turned off with its warning and the plain result is
    returned; where the plain path fails too, the arguments were at fault: its error propagates
    and the fast path stays on."""
    import torch._dynamo.exc as dynamo_exc

    error = getattr(dynamo_exc, name)("SymIntArrayRef expected to contain only concrete integers")

    def fast():
        raise error

    path = FastPath("test path", fallback="plain")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning: the call was at fault
        with pytest.raises(ValueError, match="bad argument"):
            path.run(fast, lambda: (_ for _ in ()).throw(ValueError("bad argument")))
    assert path.enabled
    with pytest.warns(UserWarning, match=f"test path unavailable \\({name}"):
        assert path.run(fast, lambda: "plain") == "plain"
    assert not path.enabled
