"""All settings of a titan-grpo run as dataclasses, parsed as `--section.field value` (tyro).

Sections mirror torchtitan where they overlap; defaults follow verl's GSM8K GRPO recipe. `data.task`, `model.family`,
`rollout.name` and the algorithm's estimator and loss name plug-in modules (plugins.py loads them); the task's
`Settings` is the `reward` section. `validate` rejects bad input with a one-line `SettingError` before any heavy work
(`python loop.py --check FLAGS` runs the checks alone).
"""

import argparse
import dataclasses
import importlib.util
import json
import os
from dataclasses import dataclass, field
from typing import Literal

import torch

import lora
import offpolicy
from plugins import (BUILT_IN, SettingError, UnsupportedSetting, algorithm_function,  # noqa: F401 (re-exported)
                     algorithm_settings, importable, load_plugin, sampler_class)

ATTN_TYPES = ("flex", "flex_flash", "varlen", "sdpa")
AC_MODES = ("selective", "full", "none")
SPMD_BACKENDS = ("spmd_types", "partial_dtensor", "full_dtensor")
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KL_TYPES = tuple(name + plus for name in ("k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl") for plus in ("", "+"))
FLASH_PACKAGES = {"FA3": "flash_attn_interface", "FA4": "flash_attn.cute"}  # what torch imports for each kernel set
@dataclass
class ModelConfig:
    path: str = "Qwen/Qwen3-0.6B"  # HF model dir (config.json + safetensors + tokenizer) or hub id
    family: str = "qwen3"  # model-family module (config.json -> torchtitan model): a module name or a .py path
    attn_type: str = "flex"  # flex | flex_flash (Hopper+) | varlen (FlashAttention) | sdpa (dense mask, CPU)
    dtype: Literal["bfloat16", "float32"] = "bfloat16"  # compute dtype (FSDP mixed precision)
    random_init: bool = False  # skip loading safetensors, keep torchtitan's random init (benchmarks)
    lora_rank: int = 0  # LoRA rank (verl's name); 0: off (all weights train). torchtitan's LoRAConverter
    lora_alpha: float = 16.0  # LoRA scale: the adapters add alpha / rank x B A (verl default)
    target_modules: tuple[str, ...] = ("all-linear",)  # HF linear names (q_proj ... down_proj) or all-linear


@dataclass
class DataConfig:
    task: str = "gsm8k"  # task module (problems, prompt, reward): a module name or a .py path
    train_files: str = "openai/gsm8k"  # what the task loads: jsonl / parquet path or hub dataset (its train split)
    val_files: str = "openai/gsm8k"  # same forms as train_files (a hub dataset's test split)
    train_batch_size: int = 256  # prompts per step (verl recipe)
    val_batch_size: int = 256  # prompts per validation generate call
    max_val_samples: int = -1  # cap on validation prompts (-1: all)
    max_prompt_length: int = 512  # tokens; longer prompts are dropped and counted
    max_response_length: int = 256  # tokens generated per response
    enable_thinking: bool = False  # Qwen3 chat template switch
    seed: int = 1  # shuffling seed


@dataclass
class RolloutConfig:
    # vllm: colocated engine in this process; vllm_process: its engine core in processes of its own (one per rank,
    # CUDA IPC sync; the one-step off-policy mode needs it); native: the trainer's own model; or a module / .py path
    name: str = "vllm"
    n: int = 5  # responses per prompt (GRPO group size)
    temperature: float = 1.0  # sampling temperature (also applied to training log-probs)
    top_p: float = 1.0  # nucleus sampling mass (1.0: off)
    top_k: int = -1  # -1: off
    gpu_memory_utilization: float = 0.4  # vLLM share of GPU memory (KV cache + weights)
    max_num_seqs: int = 1024  # vLLM concurrent sequences (verl's default); its CUDA graphs cover batches up to this
    # share a prompt's KV cache among its n responses (verl: on); off skips vLLM's per-token block bookkeeping (faster)
    enable_prefix_caching: bool = False
    max_model_len: int | None = None  # default: max_prompt_length + max_response_length
    enforce_eager: bool = False  # True disables CUDA graphs in vLLM (always True on CPU)
    tensor_parallel_size: int = 1  # vLLM TP group size (external_launcher when > 1)
    free_cache_engine: bool = True  # sleep vLLM during the actor update, wake at the sync (verl; run.sh: False on GPU)
    seed: int = 0  # sampling seed


@dataclass
class ParallelismConfig:
    """Same names and meanings as torchtitan's ParallelismConfig."""

    data_parallel_replicate_degree: int = 1  # HSDP replicas
    data_parallel_shard_degree: int = -1  # FSDP2 shards; -1: whatever the other degrees leave
    tensor_parallel_degree: int = 1  # shards heads / MLP / vocab; with SP also the sequence between blocks
    context_parallel_degree: int = 1  # shards each packed sequence (load-balanced 128-token blocks)
    expert_parallel_degree: int = 1  # shards MoE experts (borrows from the FSDP and TP ranks)
    pipeline_parallel_degree: int = 1  # accepted, not implemented
    enable_sequence_parallel: bool = True  # with TP
    # free the gathered params after each forward (torchtitan's); a one-rank shard group keeps them per block instead
    fsdp_reshard_after_forward: Literal["default", "always", "never"] = "default"
    spmd_backend: str = "auto"  # spmd_types (torch >= 2.14) | partial_dtensor | full_dtensor; auto picks


@dataclass
class ActivationCheckpointConfig:
    mode: str = "selective"  # selective | full | none


@dataclass
class CompileConfig:
    enable: bool = False  # torch.compile per transformer block (torchtitan)


@dataclass
class OptimizerConfig:
    name: str = "AdamW"  # a torch.optim class name, built by torchtitan
    lr: float = 1e-6  # verl recipe
    weight_decay: float = 0.01  # verl default
    betas: tuple[float, float] = (0.9, 0.999)  # AdamW defaults (torch, verl)
    eps: float = 1e-8  # AdamW default
    # torch.optim kernel choice; fused (torchtitan's default): one kernel per step (benchmarks/)
    implementation: Literal["for-loop", "foreach", "fused"] = "fused"


@dataclass
class LRSchedulerConfig:
    """torchtitan's LR schedule: linear warmup, optional decay over the last `decay_ratio` of steps."""

    warmup_steps: int = 0  # optimizer steps of linear warmup
    # share of steps, at the end, that decay; 0: constant (verl); None: all after warmup
    decay_ratio: float | None = 0.0
    decay_type: Literal["linear", "sqrt", "cosine"] = "linear"  # shape of the decay (torchtitan)
    min_lr_factor: float = 0.0  # the decay ends at lr x this


@dataclass
class ActorConfig:
    ppo_mini_batch_size: int = 64  # prompts per optimizer step (x n responses)
    ppo_epochs: int = 1  # passes over each batch (verl recipe: 1)
    max_tokens_per_micro_batch: int = 16384  # packed tokens per forward on one rank
    max_norm: float = 1.0  # grad clipping
    use_rollout_logprobs: bool = False  # use the sampler's log-probs as old log-probs (skips a pass)
    enable_cpu_offload: bool = False  # FSDP2 CPU offload of params, grads and optimizer states
    logprob_chunk_tokens: int = 4096  # tokens per fp32 chunk of the log-prob/entropy pass (eager; compiled fuses all)


@dataclass
class AlgorithmConfig:
    norm_adv_by_std: bool = True  # False: Dr.GRPO (no std division)
    adv_epsilon: float = 1e-6  # added to the group std before dividing
    clip_ratio_low: float = 0.2  # PPO clip: ratio >= 1 - low (verl recipe)
    clip_ratio_high: float = 0.2  # PPO clip: ratio <= 1 + high (DAPO raises it)
    clip_ratio_c: float = 3.0  # dual clip for negative advantages
    loss_agg_mode: str = "token-mean"  # token-mean | seq-mean-token-sum | seq-mean-token-mean | seq-mean-token-sum-norm
    use_kl_loss: bool = False  # KL to a frozen reference copy in the loss (builds a second engine)
    kl_loss_coef: float = 0.001  # weight of that KL term (verl default)
    kl_loss_type: str = "low_var_kl"  # verl's: k1/kl, abs, k2/mse, k3/low_var_kl; "+": k2 gradient (e.g. k3+)
    entropy_coeff: float = 0.0  # entropy bonus weight (verl recipe: 0)
    tis_cap: float | None = None  # truncated importance sampling cap C (rollout vs trainer); None: off
    adv_estimator: str = "grpo"  # grpo | rloo (verl's algorithm.adv_estimator) | a module / .py path
    loss_mode: str = "vanilla"  # vanilla (PPO clip + dual clip) | gspo (verl's policy_loss.loss_mode) | module / .py
    filter_groups: bool = False  # DAPO dynamic sampling: train only on groups whose rewards differ (verl's .enable)
    max_num_gen_batches: int = 10  # generation batches a step may take to fill its batch (verl's filter_groups)
    # at max_num_gen_batches: False trains on the groups found (none: no update); True stops the run (as verl)
    stop_at_max_gen_batches: bool = False
    overlong_buffer_len: int = 0  # DAPO overlong shaping over the last tokens before the limit (verl's len); 0: off
    overlong_penalty_factor: float = 1.0  # the penalty at the limit (verl's overlong_buffer.penalty_factor)


@dataclass
class CheckpointConfig:
    save_freq: int = -1  # steps between DCP checkpoints, and one after the last step; -1: none
    keep_latest_k: int = 2  # DCP checkpoints kept (0: all)
    resume: bool = True  # resume from the latest checkpoint in output_dir
    export_hf: bool = True  # write HF safetensors of the final weights


@dataclass
class TrainerConfig:
    total_training_steps: int = 100  # GRPO steps (one batch of prompts each)
    test_freq: int = -1  # steps between validations (-1: only before and after training)
    output_dir: str = "outputs/run"  # metrics.jsonl, checkpoints, export
    device: Literal["auto", "cuda", "cpu"] = "auto"  # auto: cuda when torch sees a GPU
    seed: int = 42  # model init (random_init) and torch RNG
    val_before_train: bool = True  # a step-0 validation row
    # verl's one-step off-policy recipe: vLLM generates step t+1's groups (from the weights before step t's update)
    # while step t computes log-probs and updates; needs rollout.free_cache_engine=False
    one_step_off_policy: bool = False
    logger: tuple[Literal["console", "tensorboard", "wandb"], ...] = ("console",)  # verl's trainer.logger; jsonl always
    project_name: str = "titan-grpo"  # wandb project (verl's name)
    experiment_name: str = "gsm8k_grpo"  # wandb run name; TensorBoard writes to output_dir/tensorboard


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    activation_checkpoint: ActivationCheckpointConfig = field(default_factory=ActivationCheckpointConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    lr_scheduler: LRSchedulerConfig = field(default_factory=LRSchedulerConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    reward: object = None  # the task's Settings (`--reward.*`); None: the task's defaults

    def __post_init__(self):
        if self.reward is None:
            self.reward = load_plugin("data.task", self.data.task).Settings()


def parse_cli(args: list[str] | None = None) -> Config:
    """Parse `--section.field value` arguments into a Config; the `reward` section is data.task's Settings."""
    import tyro

    first = argparse.ArgumentParser(add_help=False, allow_abbrev=False)  # the plug-ins first: they define flags
    for setting, default in (("data.task", DataConfig.task), ("algorithm.adv_estimator", AlgorithmConfig.adv_estimator),
                             ("algorithm.loss_mode", AlgorithmConfig.loss_mode)):
        first.add_argument(f"--{setting}", dest=setting, default=default)
    named = vars(first.parse_known_args(args)[0])
    settings = load_plugin("data.task", named["data.task"]).Settings
    own = [f for setting in BUILT_IN for f in algorithm_settings(setting, named[setting])]
    algorithm = dataclasses.make_dataclass("AlgorithmConfig", own, bases=(AlgorithmConfig,))
    with_plugins = dataclasses.make_dataclass("Config", [("reward", settings, field(default_factory=settings)),
                                                         ("algorithm", algorithm, field(default_factory=algorithm))],
                                              bases=(Config,))
    return tyro.cli(with_plugins, args=args, config=(tyro.conf.FlagConversionOff,))


def resolve_device(cfg: Config) -> str:
    """'cuda' or 'cpu' for trainer.device=auto."""
    if cfg.trainer.device != "auto":
        return cfg.trainer.device
    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_spmd_backend(cfg: Config) -> str:
    """spmd_types on torch >= 2.14, partial_dtensor before (spmd_types needs 2.14)."""
    if cfg.parallelism.spmd_backend != "auto":
        return cfg.parallelism.spmd_backend
    return "spmd_types" if TORCH_2_14 else "partial_dtensor"


TORCH_2_14 = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 14)


def dp_shard_degree(p: ParallelismConfig, world_size: int) -> int:
    """FSDP degree, resolving -1 to what the other degrees leave."""
    if p.data_parallel_shard_degree != -1:
        return p.data_parallel_shard_degree
    others = p.data_parallel_replicate_degree * p.tensor_parallel_degree
    return max(world_size // (others * p.context_parallel_degree * p.pipeline_parallel_degree), 1)


def validate(cfg: Config, world_size: int) -> None:
    """Raise SettingError (UnsupportedSetting) with one line naming the setting and the fix."""
    p, device, a = cfg.parallelism, resolve_device(cfg), cfg.actor
    _validate_ranges(cfg)
    if p.pipeline_parallel_degree > 1:
        raise UnsupportedSetting("parallelism.pipeline_parallel_degree > 1: pipeline parallelism is not implemented "
                                 "in titan-grpo; use FSDP/TP/CP/EP (set it to 1)")
    dp = p.data_parallel_replicate_degree * dp_shard_degree(p, world_size)
    model_parallel = p.tensor_parallel_degree * p.context_parallel_degree
    if dp * model_parallel != world_size:
        raise SettingError(f"parallelism: data_parallel_replicate_degree x data_parallel_shard_degree x "
                           f"tensor_parallel_degree x context_parallel_degree = {dp * model_parallel} != world size "
                           f"{world_size}; make the product equal the number of processes")
    if sampler_class(cfg).uses_rollout_tp and model_parallel % cfg.rollout.tensor_parallel_size:
        raise SettingError(f"rollout.tensor_parallel_size={cfg.rollout.tensor_parallel_size} must divide "
                           f"tensor_parallel_degree x context_parallel_degree = {model_parallel}: a vLLM TP group must "
                           "hold only ranks that share one batch; set it to a divisor of that product")
    if not sampler_class(cfg).uses_rollout_tp and cfg.rollout.tensor_parallel_size > 1:
        raise SettingError(f"rollout.name={cfg.rollout.name} runs no rollout TP groups; set "
                           "rollout.tensor_parallel_size=1 (or use --rollout.name vllm)")
    if p.context_parallel_degree > 1 and cfg.model.attn_type == "varlen":
        raise SettingError("parallelism.context_parallel_degree > 1 does not support attn_type=varlen "
                           "(torchtitan has no varlen CP); use flex")
    if resolve_spmd_backend(cfg) == "spmd_types" and not TORCH_2_14:
        raise SettingError(f"parallelism.spmd_backend=spmd_types needs torch >= 2.14 (have {torch.__version__}); "
                           "use --parallelism.spmd_backend partial_dtensor")
    _validate_attention(cfg.model.attn_type, device)
    if device == "cuda" and not torch.cuda.is_available():
        raise SettingError("trainer.device=cuda but torch sees no CUDA GPU; use --trainer.device cpu (or auto)")
    family = load_plugin("model.family", cfg.model.family)
    _validate_model_dir(cfg.model.path, family.MODEL_TYPES)
    lora.lora_targets(cfg.model, family.LORA_TARGETS)
    for clash, fix, why in offpolicy.clashes(cfg, sampler_class(cfg)) if cfg.trainer.one_step_off_policy else ():
        if clash:
            raise SettingError(f"trainer.one_step_off_policy=True needs {fix} ({why})")
    if cfg.algorithm.overlong_buffer_len >= cfg.data.max_response_length:
        raise SettingError(f"algorithm.overlong_buffer_len={cfg.algorithm.overlong_buffer_len} must be smaller than "
                           f"data.max_response_length={cfg.data.max_response_length}")
    longest = cfg.data.max_prompt_length + cfg.data.max_response_length
    if a.max_tokens_per_micro_batch < longest:
        raise SettingError(f"actor.max_tokens_per_micro_batch={a.max_tokens_per_micro_batch} is smaller than one "
                           f"sequence (max_prompt_length + max_response_length = {longest}); raise it to >= {longest}")
    if a.enable_cpu_offload and device == "cpu":
        raise SettingError("actor.enable_cpu_offload=True needs a GPU (FSDP offloads from GPU memory); set it False")
    if cfg.data.train_batch_size % a.ppo_mini_batch_size:
        raise SettingError(f"data.train_batch_size={cfg.data.train_batch_size} is not a multiple of "
                           f"actor.ppo_mini_batch_size={a.ppo_mini_batch_size}; make it one")
    if a.ppo_mini_batch_size % dp:
        raise SettingError(f"actor.ppo_mini_batch_size={a.ppo_mini_batch_size} prompts do not split over {dp} data-"
                           f"parallel ranks; make it (and data.train_batch_size) a multiple of {dp}")
    _validate_output_dir(cfg.trainer.output_dir)
    for logger in ("tensorboard", "wandb"):
        if logger in cfg.trainer.logger and importlib.util.find_spec(logger) is None:
            raise SettingError(f"trainer.logger has {logger} but the {logger} package is not installed; "
                               f"pip install {logger} or drop it from trainer.logger")


# string settings tyro leaves free (a Literal would fail with tyro's usage text, not one line)
CHOICES = (
    ("model.attn_type", ATTN_TYPES), ("activation_checkpoint.mode", AC_MODES),
    ("parallelism.spmd_backend", ("auto",) + SPMD_BACKENDS), ("algorithm.loss_agg_mode", LOSS_AGG_MODES),
    ("algorithm.kl_loss_type", KL_TYPES),
)
AT_LEAST_ONE = (
    "data.train_batch_size", "data.val_batch_size", "data.max_prompt_length", "data.max_response_length",
    "rollout.n", "rollout.max_num_seqs", "rollout.tensor_parallel_size", "actor.ppo_mini_batch_size",
    "actor.ppo_epochs", "actor.max_tokens_per_micro_batch", "actor.logprob_chunk_tokens",
    "trainer.total_training_steps", "parallelism.data_parallel_replicate_degree",
    "parallelism.tensor_parallel_degree", "parallelism.context_parallel_degree",
    "parallelism.expert_parallel_degree", "parallelism.pipeline_parallel_degree", "algorithm.max_num_gen_batches",
)
# (setting, test, what a valid value is)
RANGES = (
    ("rollout.temperature", lambda v: v > 0, "> 0 (GRPO samples a group; validation is greedy already)"),
    ("rollout.top_p", lambda v: 0 < v <= 1, "in (0, 1]"),
    ("rollout.gpu_memory_utilization", lambda v: 0 < v < 1, "in (0, 1)"),
    ("model.lora_rank", lambda v: v >= 0, ">= 0 (0: off)"),
    ("model.lora_alpha", lambda v: v > 0, "> 0"),
    ("optimizer.lr", lambda v: v >= 0, ">= 0"),
    ("optimizer.weight_decay", lambda v: v >= 0, ">= 0"),
    ("actor.max_norm", lambda v: v > 0, "> 0"),
    ("algorithm.clip_ratio_low", lambda v: 0 <= v < 1, "in [0, 1)"),
    ("algorithm.clip_ratio_high", lambda v: v >= 0, ">= 0"),
    ("algorithm.clip_ratio_c", lambda v: v > 1, "> 1 (verl: 3.0)"),
    ("algorithm.kl_loss_coef", lambda v: v >= 0, ">= 0"),
    ("algorithm.tis_cap", lambda v: v is None or v > 0, "> 0 (or unset)"),
    ("algorithm.overlong_buffer_len", lambda v: v >= 0, ">= 0 (0: off)"),
    ("algorithm.overlong_penalty_factor", lambda v: v >= 0, ">= 0"),
    ("parallelism.data_parallel_shard_degree", lambda v: v == -1 or v >= 1, ">= 1, or -1 for what the others leave"),
    ("checkpoint.keep_latest_k", lambda v: v == 0 or v >= 2,
     "0 (keep all) or >= 2 (the newest may still be being written)"),
)


def _setting(cfg: Config, name: str):
    section, field_name = name.split(".")
    return getattr(getattr(cfg, section), field_name)


def _validate_ranges(cfg: Config) -> None:
    for setting in BUILT_IN:
        algorithm_function(setting, _setting(cfg, setting))
    for name, choices in CHOICES:
        if _setting(cfg, name) not in choices:
            raise SettingError(f"{name}={_setting(cfg, name)!r} is unknown; use one of {choices}")
    for name in AT_LEAST_ONE:
        if _setting(cfg, name) < 1:
            raise SettingError(f"{name}={_setting(cfg, name)} must be >= 1")
    for name, valid, wanted in RANGES:
        if not valid(_setting(cfg, name)):
            raise SettingError(f"{name}={_setting(cfg, name)} must be {wanted}")


def _validate_output_dir(path: str) -> None:
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing) or not os.access(existing, os.W_OK):
        raise SettingError(f"trainer.output_dir={path} cannot be written ({existing} is no writable dir); pick another")


def _validate_attention(attn_type: str, device: str) -> None:
    if device == "cpu" and attn_type != "sdpa":
        raise SettingError(f"model.attn_type={attn_type} has no CPU kernel (flex: no CPU backward, varlen: CUDA only); "
                           "use --model.attn_type sdpa on CPU")
    capability = torch.cuda.get_device_capability() if torch.cuda.is_available() else (0, 0)
    if attn_type == "varlen" and capability < (8, 0):
        raise SettingError("model.attn_type=varlen needs FlashAttention: a CUDA GPU of capability >= 8.0; use flex")
    if attn_type == "flex_flash" and capability < (9, 0):
        raise SettingError("model.attn_type=flex_flash needs a CUDA GPU of capability >= 9.0 (Hopper); use flex")
    if attn_type == "flex_flash" and not importable(FLASH_PACKAGES["FA4"]):  # no registry wheel in the pinned set
        raise SettingError("model.attn_type=flex_flash needs flash-attn-4 (FA4's CuTe kernels), which is not "
                           "installed; use flex")


def _validate_model_dir(path: str, model_types: tuple[str, ...]) -> None:
    if not os.path.isdir(path):
        looks_local = os.path.isabs(path) or path.startswith(".") or path.count("/") != 1
        if looks_local or os.path.isdir(path.split("/")[0]):  # "models/x" beside a local models/ is a typo
            raise SettingError(f"model.path={path} does not exist; give an HF model dir or a hub id (org/name)")
        return  # a hub id: run.sh / load_model_dir downloads it
    config_file = os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
        raise SettingError(f"model.path={path} has no config.json; point it at an HF model dir")
    with open(config_file) as f:
        model_type = json.load(f).get("model_type")
    if model_type not in model_types:
        raise SettingError(f"model.path={path} is model_type={model_type!r}; model.family supports {model_types}")
