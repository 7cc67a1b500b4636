"""Run in one process: the native sampler against HF transformers, or the HF export served by vLLM;
saves what the test compares.

    python tests/sampler_worker.py native OUT.pt MODEL_DIR    # greedy vs HF generate; sampled log-probs vs engine
    python tests/sampler_worker.py export OUT.pt MODEL_DIR [FLAGS]  # after one step: chat template, HF vs vLLM greedy
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from config import parse_cli  # noqa: E402
from engine import TorchTitanEngineWithLMHead  # noqa: E402
from rollout import build_rollout  # noqa: E402
from rollout_worker import EOS, PROMPTS, TEMPERATURE, mismatch, train_one_step  # noqa: E402

MAX_TOKENS = 6


def native(engine, sampler, model_dir: str) -> dict:
    """Greedy responses of the native sampler and of HF generate; sampled responses' checks and mismatch."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    greedy = sampler.generate(PROMPTS, 4, greedy=True)
    hf_greedy = [hf.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=EOS,
                             pad_token_id=0)[0, len(p):].tolist() for p in PROMPTS]
    checks = []
    sampled_mismatch = mismatch(engine, sampler, 3, checks)
    return {"greedy": greedy.response_ids, "hf_greedy": hf_greedy, "mismatch": sampled_mismatch,
            "well_formed": all(checks)}


def export(engine, sampler, model_dir: str) -> dict:
    """After one step, the export's chat-templated prompt greedy-decoded by HF and by vLLM (CPU); with LoRA also by
    vLLM's own LoRA path: the base model with the PEFT adapter."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    train_one_step(engine)
    path = engine.export_hf(1)
    chat = AutoTokenizer.from_pretrained(path).apply_chat_template([{"role": "user", "content": "What is 2+3?"}],
                                                                   add_generation_prompt=True, tokenize=True)
    prompt = list(chat["input_ids"] if hasattr(chat, "keys") else chat)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    want = hf.generate(torch.tensor([prompt]), max_new_tokens=5, do_sample=False, eos_token_id=-1)[0, len(prompt):]
    greedy = dict(prompts=[TokensPrompt(prompt_token_ids=prompt)],
                  sampling_params=SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    rank = engine.cfg.model.lora_rank
    if rank:  # vLLM's LoRA path first: its own instance, shut down before the merged model's
        adapter = LLM(model=model_dir, dtype="float32", enforce_eager=True, gpu_memory_utilization=0.1,
                      max_model_len=64, enable_lora=True, max_lora_rank=max(rank, 8))
        lora_dir = os.path.join(engine.cfg.trainer.output_dir, "lora", "step-1")
        with_adapter = adapter.generate(**greedy, lora_request=LoRARequest("adapter", 1, lora_dir))
        adapter.llm_engine.engine_core.shutdown()
    llm = LLM(model=path, dtype="float32", enforce_eager=True, gpu_memory_utilization=0.1, max_model_len=64)
    got = llm.generate(**greedy)[0].outputs[0].token_ids
    result = {"served": list(got), "hf": want.tolist()}
    if rank:
        result["served_with_adapter"] = list(with_adapter[0].outputs[0].token_ids)
    return result


def main():
    case, out, model_dir, *flags = sys.argv[1:]
    cfg = parse_cli(["--model.path", model_dir, "--model.attn_type", "sdpa", "--model.dtype", "float32",
                     "--trainer.device", "cpu", "--trainer.output_dir", out + "_run", "--rollout.name", "native",
                     "--data.max_response_length", str(MAX_TOKENS), "--rollout.temperature", str(TEMPERATURE),
                     "--optimizer.lr", "5e-2", *flags])
    engine = TorchTitanEngineWithLMHead(cfg)
    sampler = build_rollout(cfg, engine, [EOS])
    torch.save({"native": native, "export": export}[case](engine, sampler, model_dir), out)


if __name__ == "__main__":
    main()
