#!/usr/bin/env bash
# GRPO on GSM8K with TorchTitan + vLLM. Documented runs:
#   NUM_GPUS=4 FSDP_SIZE=2 TP_SIZE=2 bash run.sh
#   NUM_GPUS=4 FSDP_SIZE=4 bash run.sh
#   2 nodes x 8 GPUs, HSDP (replicas across nodes, FSDP inside), on each node with its NODE_RANK:
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 NUM_GPUS=8 DP_REPLICATE=2 FSDP_SIZE=8 bash run.sh
# With no GPU (and no MODEL_PATH) it runs a short CPU demo on a tiny random Qwen3, in as many processes
# as FSDP_SIZE x TP_SIZE x CP_SIZE ask for. Extra args (--section.field value) pass through to loop.py.
set -euo pipefail
cd "$(dirname "$0")"
source scripts_env.sh

GPUS_PRESENT=$(command -v nvidia-smi >/dev/null && nvidia-smi -L 2>/dev/null | wc -l || echo 0)
NUM_GPUS=${NUM_GPUS:-$GPUS_PRESENT}
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON  # an environment of your own, with the pinned set
elif [ "$NUM_GPUS" -gt 0 ]; then ensure_gpu_env; PY=.venv/bin/python
else ensure_cpu_env; PY=.venv/bin/python; fi

FSDP_SIZE=${FSDP_SIZE:--1} TP_SIZE=${TP_SIZE:-1} EP_SIZE=${EP_SIZE:-1} CP_SIZE=${CP_SIZE:-1} DP_REPLICATE=${DP_REPLICATE:-1}
ATTN_TYPE=${ATTN_TYPE:-flex} AC_MODE=${AC_MODE:-selective} SPMD_BACKEND=${SPMD_BACKEND:-auto}
COMPILE=${COMPILE:-$([ "$NUM_GPUS" -gt 0 ] && echo True || echo False)}  # per-block torch.compile (bench.py)
TRAIN_FILES=${TRAIN_FILES:-openai/gsm8k} VAL_FILES=${VAL_FILES:-openai/gsm8k}  # hub: its train / test split
TOTAL_TRAIN_STEPS=${TOTAL_TRAIN_STEPS:-100} SAVE_FREQ=${SAVE_FREQ:-20} TEST_FREQ=${TEST_FREQ:-10}
MAX_PROMPT_LENGTH=${MAX_PROMPT_LENGTH:-512} MAX_RESPONSE_LENGTH=${MAX_RESPONSE_LENGTH:-256}
NNODES=${NNODES:-1} NODE_RANK=${NODE_RANK:-0} MASTER_ADDR=${MASTER_ADDR:-127.0.0.1} MASTER_PORT=${MASTER_PORT:-29500}
# processes per node: one per GPU; on CPU, the parallel sizes' product (FSDP_SIZE -1 counts as 1) over the nodes
NPROC=$(( NUM_GPUS > 0 ? NUM_GPUS : DP_REPLICATE * (FSDP_SIZE > 0 ? FSDP_SIZE : 1) * TP_SIZE * CP_SIZE / NNODES ))
PARALLEL_ARGS=(--parallelism.data_parallel_replicate_degree "$DP_REPLICATE"
  --parallelism.data_parallel_shard_degree "$FSDP_SIZE" --parallelism.tensor_parallel_degree "$TP_SIZE"
  --parallelism.expert_parallel_degree "$EP_SIZE" --parallelism.context_parallel_degree "$CP_SIZE"
  --parallelism.spmd_backend "$SPMD_BACKEND")
if [ "$NNODES" -gt 1 ]; then  # static rendezvous: node NODE_RANK holds global ranks NODE_RANK*NPROC ...
  LAUNCH=(--nnodes "$NNODES" --node_rank "$NODE_RANK" --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT")
else
  LAUNCH=(--standalone)
fi
export VLLM_ENABLE_V1_MULTIPROCESSING=0  # vLLM's engine in the trainer's process: the sync copies weights in place

# torchrun, ending without its traceback where a rank refused its input (the rank has said why in one line)
TORCHRUN='import os, sys
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import main
try:
    main(sys.argv[1:])
except ChildFailedError as error:
    sys.exit(1 if os.path.getsize(os.environ["TITAN_GRPO_REFUSAL"]) else str(error))'

launch() {  # one process: loop.py itself; several: check what a rank would refuse at start once, then start them
  if [ $(( NPROC * NNODES )) -eq 1 ]; then exec "$PY" loop.py "$@"; fi
  # settings, model dir, data, output dir (writable, not locked: on the first node only) -> one line, exit 2
  WORLD_SIZE=$(( NPROC * NNODES )) RANK=$(( NODE_RANK * NPROC )) "$PY" loop.py --check "$@" >/dev/null || exit $?
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}  # torchrun's own default, set here so that it prints no banner about it
  TITAN_GRPO_REFUSAL=$(mktemp); export TITAN_GRPO_REFUSAL; trap 'rm -f "$TITAN_GRPO_REFUSAL"' EXIT
  local status=0
  "$PY" -c "$TORCHRUN" "${LAUNCH[@]}" --nproc_per_node="$NPROC" loop.py "$@" || status=$?
  if [ -s "$TITAN_GRPO_REFUSAL" ]; then head -n 1 "$TITAN_GRPO_REFUSAL" >&2; exit 2; fi  # the refusal, last
  exit $status
}

if [ "$NUM_GPUS" -eq 0 ] && [ -z "${MODEL_PATH:-}" ]; then
  echo "[titan-grpo] no GPU and no MODEL_PATH: the CPU DEMO in $NPROC process(es): a tiny random Qwen3 (2 layers,"
  echo "[titan-grpo] a 50-word tokenizer) learns the 9 sums a+b (a, b < 3) from GSM8K's reward alone, one answer token"
  echo "[titan-grpo] per response; the mean reward rises from ~0.05 to ~0.9 (plot: python plot.py OUTPUT_DIR/metrics.jsonl)"
  DEMO_DIR=outputs/demo_sums_model
  [ -f $DEMO_DIR/config.json ] || $PY -c "import transformers; transformers.utils.logging.disable_progress_bar(); \
from tiny import make_tiny_qwen3; make_tiny_qwen3('$DEMO_DIR', layers=2)" >/dev/null
  launch --model.path $DEMO_DIR --model.attn_type sdpa --model.dtype float32 --trainer.device cpu \
    "${PARALLEL_ARGS[@]}" --rollout.name native --data.task arithmetic --data.train_files sums \
    --data.val_files sums --reward.method flexible --data.train_batch_size 8 --actor.ppo_mini_batch_size 4 \
    --rollout.n 16 --data.max_prompt_length 64 --data.max_response_length 1 --optimizer.lr 3e-3 \
    --algorithm.entropy_coeff 0.03 --algorithm.filter_groups True --algorithm.max_num_gen_batches 4 \
    --activation_checkpoint.mode none --trainer.total_training_steps 60 \
    --trainer.test_freq 10 --checkpoint.save_freq 60 --trainer.output_dir "${OUTPUT_DIR:-outputs/demo}" "$@"
fi

MODEL_PATH=${MODEL_PATH:-Qwen/Qwen3-0.6B}
if [ ! -d "$MODEL_PATH" ]; then  # a hub id: download once
  MODEL_PATH=$($PY -c "from engine import load_model_dir; print(load_model_dir('$MODEL_PATH'))")
fi
# on a GPU vLLM stays awake through the update: Qwen3-0.6B's trainer fits beside it and a sleep/wake cycle costs time
# every step (benchmarks/); for a model that does not fit, pass --rollout.free_cache_engine True (vLLM frees its
# memory during the update)
DEVICE_ARGS=(--rollout.free_cache_engine False)
[ "$NUM_GPUS" -eq 0 ] && DEVICE_ARGS=(--trainer.device cpu --model.attn_type sdpa --model.dtype float32
  --rollout.enforce_eager True --rollout.gpu_memory_utilization 0.15)  # vLLM CPU: KV cache = 0.15 x RAM
# verl's GSM8K GRPO recipe: 256 prompts x 5, mini-batch 64, lr 1e-6 constant, clip 0.2, no KL, entropy 0
launch \
  --model.path "$MODEL_PATH" --model.attn_type "$ATTN_TYPE" "${PARALLEL_ARGS[@]}" \
  --activation_checkpoint.mode "$AC_MODE" --compile.enable "$COMPILE" \
  --data.train_files "$TRAIN_FILES" --data.val_files "$VAL_FILES" \
  --data.max_prompt_length "$MAX_PROMPT_LENGTH" --data.max_response_length "$MAX_RESPONSE_LENGTH" \
  --data.train_batch_size 256 --rollout.n 5 --actor.ppo_mini_batch_size 64 --optimizer.lr 1e-6 \
  --algorithm.clip_ratio_low 0.2 --algorithm.clip_ratio_high 0.2 --algorithm.use_kl_loss False \
  --algorithm.entropy_coeff 0 --trainer.total_training_steps "$TOTAL_TRAIN_STEPS" \
  --trainer.test_freq "$TEST_FREQ" --checkpoint.save_freq "$SAVE_FREQ" \
  --trainer.output_dir "${OUTPUT_DIR:-outputs/gsm8k_grpo}" "${DEVICE_ARGS[@]}" "$@"
