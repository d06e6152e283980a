"""A broken sharded checkpoint under 2 ranks (`benchmarks/inject_inputs.py`'s cases): every rank
ends with the same one ``fp8lm train: error:`` line, none with a traceback, none hangs."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import inject_inputs  # noqa: E402

pytestmark = pytest.mark.slow  # 2-rank training processes


@pytest.fixture(scope="module")
def zero_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("sharded")
    return root, inject_inputs.trained(root, "zero", inject_inputs.LAYOUTS["O3 (FP8 ZeRO)"], 2)


@pytest.mark.parametrize("case", ["random shard of rank 1", "FIFO shard of rank 0", "missing step_N.dcp folder"])
def test_a_broken_shard_folder_is_one_line_on_every_rank(zero_run, case):
    root, run = zero_run
    out = inject_inputs.copy_run(run, root / "case")
    inject_inputs.SHARD_BREAKS[case](inject_inputs.newest_shards(out))
    args = inject_inputs.resume_args(out, root, inject_inputs.LAYOUTS["O3 (FP8 ZeRO)"])
    results = inject_inputs.fp8lm(args, ranks=2)
    assert inject_inputs.outcome(results, should_run=False)["held"], results
    lines = [err.strip() for _, err in results]
    assert lines[0].startswith("fp8lm train: error: rank 0: ") and lines[1].startswith("fp8lm train: error: rank 1: ")
