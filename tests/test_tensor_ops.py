"""ScalingTensor's explicit op table: the ops it lists work, any other raises one clear error
naming the op (in place too, leaving the tensor unchanged), `allow_dequantize_fallback` opts in to
the dequantizing fallback, and docs/api.md lists exactly the table."""

from pathlib import Path

import pytest
import torch

import fp8lm
from fp8lm.tensor import OP_KINDS, SUPPORTED_OPS, ScalingTensor, allow_dequantize_fallback, quantize

DOC = Path(__file__).resolve().parents[1] / "docs" / "api.md"


def ops_table_markdown() -> str:
    """The op table as docs/api.md shows it, generated from `SUPPORTED_OPS`."""
    rows = ["| kind | what happens | ops |", "|---|---|---|"]
    for kind, what in OP_KINDS.items():
        names = ", ".join(f"`{name}`" for name in sorted(SUPPORTED_OPS[kind]))
        rows.append(f"| {kind} | {what} | {names} |")
    return "\n".join(rows) + "\n"


def test_the_docs_list_exactly_the_supported_ops():
    expected = ops_table_markdown()
    assert expected in DOC.read_text(), "docs/api.md's op table is stale; replace it with:\n" + expected


def test_every_listed_op_is_a_real_op_of_one_kind():
    assert set(SUPPORTED_OPS) == set(OP_KINDS)
    names = [name for ops in SUPPORTED_OPS.values() for name in ops]
    assert len(names) == len(set(names))  # one kind per op
    import torch.distributed._functional_collectives  # noqa: F401  (defines the _c10d_functional ops)
    import torch.distributed.fsdp  # noqa: F401  (defines fsdp.chunk_cat)

    for name in names:
        namespace, op, overload = name.split(".")
        getattr(getattr(getattr(torch.ops, namespace), op), overload)


def _q():
    return quantize(torch.randn(8, 8), fp8lm.E4M3)


@pytest.mark.parametrize(
    "call, op",
    [
        (torch.sin, "aten.sin.default"),
        (lambda t: torch.softmax(t, -1), "aten._softmax.default"),
        (lambda t: t.sort(), "aten.sort.default"),
    ],
    ids=["sin", "softmax", "sort"],
)
def test_an_op_not_in_the_table_raises_naming_it(call, op):
    t = _q()
    with pytest.raises(NotImplementedError, match=rf"ScalingTensor does not support {op} .*allow_dequantize_fallback"):
        call(t)


@pytest.mark.parametrize(
    "call, op",
    [(lambda t: t.sin_(), "aten.sin_.default"), (lambda t: t.exp_(), "aten.exp_.default")],
    ids=["sin_", "exp_"],
)
def test_an_inplace_op_not_in_the_table_raises_and_changes_nothing(call, op):
    t = _q()
    payload, scale = t.payload.clone(), t.scale.clone()
    with pytest.raises(NotImplementedError, match=rf"does not support {op} .*requantize in place"):
        call(t)
    assert torch.equal(t.payload.view(torch.uint8), payload.view(torch.uint8)) and torch.equal(t.scale, scale)


def test_the_opt_in_fallback_computes_with_dequantized_values_and_requantizes_in_place():
    t = _q()
    values = t.dequantize()
    with allow_dequantize_fallback():
        out = torch.sin(t)
        assert type(out) is torch.Tensor and torch.equal(out, torch.sin(values))
        assert t.exp_() is t and isinstance(t, ScalingTensor)
        with allow_dequantize_fallback(False), pytest.raises(NotImplementedError):
            torch.cos(t)
    torch.testing.assert_close(t.dequantize(), values.exp(), rtol=2.0**-3, atol=0)
    with pytest.raises(NotImplementedError):  # off again outside the context
        torch.sin(t)

    @allow_dequantize_fallback()
    def foreign(x):
        return torch.tanh(x)

    assert torch.equal(foreign(t), torch.tanh(t.dequantize()))
    assert fp8lm.allow_dequantize_fallback is allow_dequantize_fallback


def test_listed_inplace_and_metadata_ops_work_without_opting_in():
    t = quantize(torch.randn(8, 8), fp8lm.FP16)
    values = t.dequantize()
    t.add_(1.0).lerp_(torch.zeros(8, 8), 0.5)
    torch.testing.assert_close(t.dequantize(), (values + 1) * 0.5, rtol=2.0**-10, atol=1e-6)
    empty = torch.empty_like(t)
    assert type(empty) is torch.Tensor and empty.shape == t.shape and empty.dtype == t.dtype
