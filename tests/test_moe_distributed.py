"""A mixture of experts trained data-parallel on 2 gloo ranks: O2 (FP8DataParallel, the experts'
FP8 gradients all-reduced like every other) and O3 (FP8 ZeRO over the experts' weights too)."""

import json
import math
import subprocess

import pytest

from test_train_distributed import ENV, TIMEOUT_S, check, run_options, torchrun

pytestmark = pytest.mark.slow  # 2-rank training processes


def test_two_rank_moe_trains_at_o2_and_o3(tmp_path):
    out = tmp_path / "moe"
    args = ["-m", "fp8lm.cli", "compare", "--levels", "O2,O3", "--moe-experts", "4", "--moe-top-k", "2"]
    check(
        subprocess.run(
            torchrun(*args, *run_options(out, tmp_path / "cache")),
            env=ENV,
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
        )
    )
    for level in ("O2", "O3"):
        s = json.loads((out / level / "summary.json").read_text())
        assert s["world_size"] == 2 and math.isfinite(s["val_loss"])
        records = [json.loads(line) for line in (out / level / "metrics.jsonl").read_text().splitlines()]
        assert records[-1]["train_loss"] < records[0]["train_loss"] - 0.5
        # rank 0's tokens: 4 of the 8 sequences of 32 tokens, top-2, in each of the 2 blocks
        assert all(sum(r["moe_tokens_per_expert"]) == 4 * 32 * 2 * 2 for r in records)
        assert s["moe"]["load_max_over_mean"] >= 1.0
        assert s["comm_bytes_per_step"] > 0
