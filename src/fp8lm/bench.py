"""`fp8lm bench`: the scripts under ``benchmarks/`` of a source checkout, each run with this
interpreter in its own process; each prints one JSON object, which is echoed and saved as
``OUT/<name>.json``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

__all__ = ["BENCHMARKS", "DEFAULT", "BenchError", "scripts_dir", "command", "run_benchmark"]

# name -> ranks it runs on (scripts that need torchrun are launched through torch.distributed.run)
BENCHMARKS = {
    "quantize": 1,
    "gemm": 1,
    "fp8_linear": 1,
    "fp8_linear_accuracy": 1,
    "train_step": 1,
    "optimizer_step": 1,
    "fallback": 1,
    "telemetry": 1,
    "comm": 2,
    "dist_train": 2,
    "cuda_trace": 1,
    "activation_memory": 1,
    "recipes": 1,
}
DEFAULT = ("quantize", "gemm", "train_step", "optimizer_step", "telemetry", "fallback", "comm")


class BenchError(ValueError):
    """A benchmark cannot run, or did not produce its JSON."""


def scripts_dir(override: str | os.PathLike | None = None) -> Path:
    """``benchmarks/`` of the source checkout this package is imported from (src/fp8lm/../../),
    or ``override``."""
    d = Path(override) if override else Path(__file__).resolve().parents[2] / "benchmarks"
    if not (d / "common.py").is_file():
        raise BenchError(
            f"no benchmark scripts in {str(d)!r}: fp8lm bench runs them from a source checkout "
            "(git clone, then pip install -e .), or pass --scripts DIR"
        )
    return d


def command(name: str, scripts: Path, extra: list[str]) -> list[str]:
    """The command line that runs benchmark ``name``."""
    if name not in BENCHMARKS:
        raise BenchError(f"unknown benchmark {name!r}: choose from {', '.join(BENCHMARKS)}")
    script = scripts / f"{name}.py"
    if not script.is_file():
        raise BenchError(f"benchmark script {str(script)!r} is missing")
    ranks = BENCHMARKS[name]
    launch = [sys.executable]
    if ranks > 1:
        launch += ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks)]
    return [*launch, str(script), *extra]


def _json_in(output: str) -> dict:
    """The JSON object a benchmark printed (other lines, e.g. warnings, around it are ignored)."""
    start, end = output.find("{"), output.rfind("}")
    if start < 0 or end < start:
        raise ValueError("no JSON object in its output")
    return json.loads(output[start : end + 1])


def run_benchmark(name: str, scripts: Path, out: Path, extra: list[str]) -> dict:
    """Run benchmark ``name`` (its stderr passes through), save its JSON as ``out/<name>.json``."""
    proc = subprocess.run(command(name, scripts, extra), stdout=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise BenchError(f"benchmark {name} failed with exit status {proc.returncode} (its errors are above)")
    try:
        result = _json_in(proc.stdout)
    except ValueError as e:
        raise BenchError(
            f"benchmark {name} printed no valid JSON ({e}); its output began: {proc.stdout[:200]!r}"
        ) from None
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    os.replace(tmp, path)
    return result
