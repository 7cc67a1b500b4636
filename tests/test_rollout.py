"""rollout.py: vLLM log-probs equal the engine's before and after a weight sync; native sampler
greedy equals HF generate; grouping, truncation and finish reasons."""

import os
import subprocess
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [ROOT, HERE]

from tiny import make_tiny_qwen3  # noqa: E402

PRELUDE = """
import sys, torch
sys.path[:0] = [{root!r}, {here!r}]
from config import parse_cli
from engine import TorchTitanEngineWithLMHead
from loop import Sample, forward_backward_batch
from rollout import build_rollout
cfg = parse_cli(["--model.path", {model!r}, "--model.attn_type", "sdpa", "--model.dtype", "float32",
                 "--trainer.device", "cpu", "--trainer.output_dir", {out!r}, "--rollout.name", {name!r},
                 "--data.max_response_length", "6", "--rollout.temperature", "0.8", "--optimizer.lr", "5e-2"])
engine = TorchTitanEngineWithLMHead(cfg)
sampler = build_rollout(cfg, engine, [2])
prompts = [[1, 4, 6, 9, 12], [1, 4, 6, 15, 11, 16, 17]]

def engine_logprobs(rollout):
    samples = [Sample(p, r, lp) for p, r, lp in zip(rollout.prompt_ids, rollout.response_ids, rollout.logprobs)]
    got, _ = forward_backward_batch(engine, samples, None, True, 0.8)
    return torch.cat(got), torch.tensor([x for lp in rollout.logprobs for x in lp])

def train_one_step():
    with engine.train_mode():
        lp, _ = engine.forward(torch.tensor([[1, 4, 6, 9, 12, 3, 5]]), torch.arange(7)[None],
                               torch.tensor([[4, 6, 9, 12, 3, 5, -100]]))
        engine.backward(-lp.sum())
        engine.optimizer_step()
"""


def run(code, port):
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900, cwd=ROOT,
                            env={**os.environ, "MASTER_PORT": str(port), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-5000:]
    return result.stdout


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_qwen3(str(tmp_path_factory.mktemp("rollout")), layers=2, hidden=128, heads=2, kv_heads=1)  # vLLM CPU: head_dim 64


def test_vllm_logprobs_match_engine_and_weight_sync(model_dir, tmp_path):
    pytest.importorskip("vllm")
    out = run(PRELUDE.format(root=ROOT, here=HERE, model=model_dir, out=str(tmp_path / "o"), name="vllm") + """
rollout = sampler.generate(prompts, 3, seed=1)
assert rollout.prompt_ids == [p for p in prompts for _ in range(3)]  # n per prompt, consecutive
assert len(set(map(tuple, rollout.response_ids))) > 1  # sampled, not greedy
for response, reason in zip(rollout.response_ids, rollout.finish_reasons):
    assert 0 < len(response) <= 6 and (reason == "stop" or len(response) == 6), (response, reason)
got, want = engine_logprobs(rollout)
print("INIT", (got - want).abs().max().item())
train_one_step()
stale = sampler.generate(prompts, 3, seed=2)
got, want = engine_logprobs(stale)
print("STALE", (got - want).abs().max().item())
print("SYNC_S", sampler.sync_weights())
synced = sampler.generate(prompts, 3, seed=2)
got, want = engine_logprobs(synced)
print("SYNCED", (got - want).abs().max().item())
""", 29571)
    values = {line.split()[0]: float(line.split()[1]) for line in out.splitlines()
              if line.split()[:1] and line.split()[0] in ("INIT", "STALE", "SYNCED", "SYNC_S")}
    assert values["INIT"] < 1e-4
    assert values["STALE"] > 1e-2  # a stale engine is caught by this comparison
    assert values["SYNCED"] < 1e-4


@pytest.fixture(scope="module")
def tp_model_dir(tmp_path_factory):  # two KV heads: the trainer's TP=2 splits them
    return make_tiny_qwen3(str(tmp_path_factory.mktemp("rollout_tp")), layers=2, hidden=128, heads=2, kv_heads=2)


@pytest.fixture(scope="module")
def moe_model_dir(tmp_path_factory):  # Qwen3-MoE, 4 experts top-2
    return make_tiny_qwen3(str(tmp_path_factory.mktemp("rollout_moe")), layers=2, hidden=128, heads=2, kv_heads=2,
                           moe=True)


@pytest.mark.parametrize("layout", [
    ["--parallelism.data_parallel_shard_degree", "2"],
    ["--parallelism.data_parallel_shard_degree", "1", "--parallelism.tensor_parallel_degree", "2"],
    ["--parallelism.data_parallel_shard_degree", "1", "--parallelism.tensor_parallel_degree", "2",
     "--rollout.tensor_parallel_size", "2"],
], ids=["fsdp2", "tp2", "tp2_rollout_tp2"])
def test_vllm_on_every_rank_matches_engine_before_and_after_sync(tp_model_dir, tmp_path, layout):
    """torchrun, 2 processes: each rank's vLLM (or one vLLM TP group) samples what the trainer computes."""
    assert_rollout_worker_matches(tp_model_dir, tmp_path, layout, port=29601 + len(layout))


def test_vllm_moe_matches_engine_before_and_after_sync(moe_model_dir, tmp_path):
    """Qwen3-MoE under FSDP=2 x EP=2: vLLM takes the gathered experts (vLLM CPU needs its MoE kernels reset)."""
    assert_rollout_worker_matches(moe_model_dir, tmp_path, ["--parallelism.data_parallel_shard_degree", "2",
                                                            "--parallelism.expert_parallel_degree", "2"], port=29611)


def assert_rollout_worker_matches(model_dir, tmp_path, layout, port):
    pytest.importorskip("vllm")
    out = str(tmp_path / "result.pt")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port", str(port),
           os.path.join(HERE, "rollout_worker.py"), out, model_dir, *layout]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT,
                            env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-5000:]
    assert "Traceback" not in result.stderr, result.stderr[-5000:]  # the run ends cleanly, vLLM shut down
    got = torch.load(out)
    assert got["init"] < 1e-4  # the engine started from dummy weights and took the trainer's
    assert got["stale"] > 1e-2  # a stale sampler is caught
    assert got["synced"] < 1e-4


def test_native_sampler_greedy_matches_hf_and_its_logprobs_match_engine(model_dir, tmp_path):
    out = run(PRELUDE.format(root=ROOT, here=HERE, model=model_dir, out=str(tmp_path / "o"), name="native") + f"""
from transformers import AutoModelForCausalLM
hf = AutoModelForCausalLM.from_pretrained({model_dir!r}, dtype=torch.float32)
greedy = sampler.generate(prompts, 4, greedy=True)
assert len(greedy.response_ids) == len(prompts)
for prompt, response in zip(prompts, greedy.response_ids):
    want = hf.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, eos_token_id=2,
                       pad_token_id=0)[0, len(prompt):].tolist()
    assert response == want, (response, want)
sampled = sampler.generate(prompts, 4, seed=3)
assert sampled.prompt_ids == [prompts[0]] * 4 + [prompts[1]] * 4  # n per prompt, consecutive
for response, reason in zip(sampled.response_ids, sampled.finish_reasons):
    assert len(response) <= 6
    assert reason == ("stop" if response[-1] == 2 else "length") and (reason == "stop" or len(response) == 6)
got, want = engine_logprobs(sampled)
print("NATIVE", (got - want).abs().max().item())
""", 29572)
    assert float(out.split("NATIVE")[1].split()[0]) < 1e-5


def test_hf_export_chats_and_serves_in_vllm(model_dir, tmp_path):
    """After a training step, the exported dir keeps the chat template, and vLLM (CPU) greedy-decodes it
    as HF transformers does."""
    pytest.importorskip("vllm")
    out = run(PRELUDE.format(root=ROOT, here=HERE, model=model_dir, out=str(tmp_path / "o"), name="native") + """
train_one_step()
export = engine.export_hf(1)
from transformers import AutoModelForCausalLM, AutoTokenizer
chat = AutoTokenizer.from_pretrained(export).apply_chat_template([{"role": "user", "content": "What is 2+3?"}],
                                                                 add_generation_prompt=True, tokenize=True)
prompt = list(chat["input_ids"] if hasattr(chat, "keys") else chat)
hf = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)
want = hf.generate(torch.tensor([prompt]), max_new_tokens=5, do_sample=False, eos_token_id=-1)[0, len(prompt):]
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
llm = LLM(model=export, dtype="float32", enforce_eager=True, gpu_memory_utilization=0.1, max_model_len=64)
got = llm.generate([TokensPrompt(prompt_token_ids=prompt)], SamplingParams(temperature=0, max_tokens=5,
                   ignore_eos=True))[0].outputs[0].token_ids
print("SERVED", list(got), want.tolist())
""", 29573)
    served, want = out.split("SERVED ")[1].splitlines()[0].split("] [")
    assert served + "]" == "[" + want, (served, want)
