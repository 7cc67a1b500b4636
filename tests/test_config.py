"""config.validate: each bad input gives its one-line error before any heavy work."""

import os
import re

import pytest

from config import TORCH_2_14, parse_cli, validate

MODEL_DIR = os.path.join(os.environ.get("TMPDIR", "/tmp"), "titan_grpo_config_model")
os.makedirs(MODEL_DIR, exist_ok=True)
with open(os.path.join(MODEL_DIR, "config.json"), "w") as f:
    f.write('{"model_type": "qwen3"}')
GOOD = ["--model.attn_type", "sdpa", "--trainer.device", "cpu", "--model.path", MODEL_DIR]


@pytest.mark.parametrize("flags,world,message", [
    (["--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "2"], 2, "!= world size"),
    (["--parallelism.pipeline_parallel_degree", "2"], 2, "pipeline parallelism is not implemented"),
    (["--model.attn_type", "flash"], 1, "model.attn_type='flash' is unknown"),
    (["--model.attn_type", "flex"], 1, "use --model.attn_type sdpa on CPU"),
    (["--activation_checkpoint.mode", "some"], 1, "activation_checkpoint.mode='some' is unknown"),
    (["--parallelism.spmd_backend", "magic"], 1, "spmd_backend='magic' is unknown"),
    (["--model.path", "/no/such/dir"], 1, "does not exist"),
    (["--actor.max_tokens_per_micro_batch", "100"], 1, "smaller than one sequence"),
    (["--algorithm.loss_agg_mode", "mean"], 1, "loss_agg_mode='mean' is unknown"),
    (["--algorithm.kl_loss_type", "k9"], 1, "kl_loss_type='k9' is unknown"),
    (["--data.train_batch_size", "10", "--actor.ppo_mini_batch_size", "4"], 1, "not a multiple of"),
    (["--actor.enable_cpu_offload", "True"], 1, "enable_cpu_offload=True needs a GPU"),
    (["--parallelism.context_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1",
      "--model.attn_type", "varlen"], 2, "does not support attn_type=varlen"),
    (["--trainer.device", "cuda", "--model.attn_type", "flex_flash"], 1, "capability >= 9.0"),
    (["--parallelism.data_parallel_shard_degree", "2", "--rollout.tensor_parallel_size", "2"], 2,
     "rollout.tensor_parallel_size=2 must divide tensor_parallel_degree x context_parallel_degree = 1"),
    (["--rollout.n", "0"], 1, "rollout.n=0 must be >= 1"),
    (["--data.max_response_length", "0"], 1, "data.max_response_length=0 must be >= 1"),
    (["--optimizer.lr", "-1e-3"], 1, "optimizer.lr=-0.001 must be >= 0"),
    (["--rollout.temperature", "0"], 1, "rollout.temperature=0.0 must be > 0"),
    (["--rollout.top_p", "1.5"], 1, "rollout.top_p=1.5 must be in (0, 1]"),
    (["--checkpoint.keep_latest_k", "1"], 1, "checkpoint.keep_latest_k=1 must be 0 (keep all) or >= 2"),
    (["--rollout.tensor_parallel_size", "0"], 1, "rollout.tensor_parallel_size=0 must be >= 1"),
    (["--parallelism.data_parallel_shard_degree", "0"], 1, "data_parallel_shard_degree=0 must be >= 1, or -1"),
    (["--trainer.device", "cuda"], 1, "trainer.device=cuda but torch sees no CUDA GPU"),
    (["--parallelism.data_parallel_shard_degree", "2", "--actor.ppo_mini_batch_size", "1",
      "--data.train_batch_size", "4"], 2, "ppo_mini_batch_size=1 prompts do not split over 2 data-parallel ranks"),
    (["--parallelism.data_parallel_shard_degree", "2", "--actor.ppo_mini_batch_size", "3",
      "--data.train_batch_size", "6"], 2, "ppo_mini_batch_size=3 prompts do not split over 2"),
    (["--trainer.output_dir", "/etc/hostname/run"], 1, "trainer.output_dir=/etc/hostname/run cannot be written"),
    (["--algorithm.loss_mode", "ppo"], 1, "algorithm.loss_mode='ppo' is unknown; use one of ('vanilla', 'gspo')"),
    (["--algorithm.adv_estimator", "gae"], 1, "algorithm.adv_estimator='gae' is unknown; use one of ('grpo', 'rloo')"),
    (["--algorithm.max_num_gen_batches", "0"], 1, "algorithm.max_num_gen_batches=0 must be >= 1"),
    (["--algorithm.overlong_buffer_len", "256"], 1, "overlong_buffer_len=256 must be smaller than data.max_response"),
    (["--model.lora_rank", "-1"], 1, "model.lora_rank=-1 must be >= 0 (0: off)"),
    (["--model.lora_rank", "8", "--model.target_modules", "q_proj", "o_proj"], 1,
     "k_proj, q_proj, v_proj are one fused linear in torchtitan; name all or none"),
    (["--model.lora_rank", "8", "--model.target_modules", "lm_head"], 1,
     "model.target_modules has ['lm_head']; use all-linear or names of"),
    (["--trainer.one_step_off_policy", "True", "--rollout.name", "vllm_process"], 1,
     "one_step_off_policy=True needs rollout.free_cache_engine=False"),
    (["--trainer.one_step_off_policy", "True", "--rollout.name", "native"], 1, "needs rollout.name=vllm_process"),
    (["--trainer.one_step_off_policy", "True", "--rollout.free_cache_engine", "False"], 1,
     "needs rollout.name=vllm_process (rollout.name=vllm cannot generate beside the update)"),
    (["--rollout.name", "vllm_process", "--parallelism.data_parallel_shard_degree", "1",
      "--parallelism.tensor_parallel_degree", "2", "--rollout.tensor_parallel_size", "2"], 2,
     "rollout.name=vllm_process runs no rollout TP groups; set rollout.tensor_parallel_size=1"),
    (["--trainer.one_step_off_policy", "True", "--rollout.free_cache_engine", "False",
      "--rollout.name", "vllm_process", "--algorithm.filter_groups",
      "True"], 1, "needs algorithm.filter_groups=False"),
    (["--trainer.one_step_off_policy", "True", "--rollout.free_cache_engine", "False",
      "--rollout.name", "vllm_process", "--actor.use_rollout_logprobs",
      "True"], 1, "needs actor.use_rollout_logprobs=False"),
])
def test_bad_input_message(flags, world, message):
    cfg = parse_cli(GOOD + flags)
    with pytest.raises((ValueError, NotImplementedError), match=re.escape(message)):
        validate(cfg, world)


@pytest.mark.parametrize("task,message", [
    ("nosuchtask", "data.task=nosuchtask cannot be loaded"),
    ("tiny", "data.task=tiny lacks load_problems, build_prompt, score, VAL_METRIC, Settings"),
])
def test_a_bad_task_module_is_named_before_anything_is_built(task, message):
    from config import SettingError

    with pytest.raises(SettingError, match=message):
        parse_cli(GOOD + ["--data.task", task])


@pytest.mark.skipif(TORCH_2_14, reason="this env has torch >= 2.14")
def test_spmd_types_needs_torch_2_14():
    with pytest.raises(ValueError, match="spmd_types needs torch >= 2.14"):
        validate(parse_cli(GOOD + ["--parallelism.spmd_backend", "spmd_types"]), 1)


def test_model_dir_without_config_json(tmp_path):
    cfg = parse_cli(GOOD + ["--model.path", str(tmp_path)])
    with pytest.raises(ValueError, match="has no config.json"):
        validate(cfg, 1)


def test_relative_model_path_typo_is_not_taken_for_a_hub_id(tmp_path, monkeypatch):
    (tmp_path / "models").mkdir()
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="model.path=models/x does not exist"):
        validate(parse_cli(GOOD + ["--model.path", "models/x"]), 1)
    validate(parse_cli(GOOD + ["--model.path", "Qwen/Qwen3-0.6B"]), 1)  # a hub id passes (downloaded later)


def fake_gpu(monkeypatch, capability: tuple[int, int]) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_: capability)


@pytest.mark.parametrize("attn,capability,message", [
    ("varlen", (7, 5), "model.attn_type=varlen needs FlashAttention: a CUDA GPU of capability >= 8.0"),
    ("flex_flash", (8, 0), "model.attn_type=flex_flash needs a CUDA GPU of capability >= 9.0"),
    ("flex_flash", (9, 0), "model.attn_type=flex_flash needs flash-attn-4"),
])
def test_attention_without_its_kernels_is_refused(monkeypatch, attn, capability, message):
    """On a GPU (faked here) without the kernels an attention type needs, validate() names what is missing."""
    fake_gpu(monkeypatch, capability)
    with pytest.raises(ValueError, match=re.escape(message)):
        validate(parse_cli(GOOD + ["--trainer.device", "cuda", "--model.attn_type", attn]), 1)


@pytest.mark.parametrize("capability", [(8, 0), (9, 0), (10, 0)])
def test_varlen_is_accepted_from_ampere_on(monkeypatch, capability):
    """Without FA3 / FA4 installed varlen still runs, on torch's built-in FlashAttention-2 (qwen3.py)."""
    fake_gpu(monkeypatch, capability)
    validate(parse_cli(GOOD + ["--trainer.device", "cuda", "--model.attn_type", "varlen"]), 1)
