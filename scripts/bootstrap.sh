#!/usr/bin/env bash
# Creates .venv and installs fp8lm with its test tools. Set FP8LM_TORCH to choose the torch
# requirement (default: torch==2.13.0, the CPU wheel; on a GPU machine e.g. FP8LM_TORCH=torch).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/python -c "import torch" 2>/dev/null || .venv/bin/pip install -q "${FP8LM_TORCH:-torch==2.13.0}"
.venv/bin/pip install -q -e ".[dev]"
