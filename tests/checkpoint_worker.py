"""Run in one process: engine log-probs vs HF transformers, and the checkpoint round trip; saves what
the test compares.

    python tests/checkpoint_worker.py parity OUT.pt MODEL_DIR            # engine vs HF log-probs and entropy
    python tests/checkpoint_worker.py first OUT.pt MODEL_DIR RUN_DIR [FLAGS]   # step, save, step, export
    python tests/checkpoint_worker.py resume OUT.pt MODEL_DIR RUN_DIR [FLAGS]  # load the checkpoint, one step
    python tests/checkpoint_worker.py hf OUT.pt EXPORT_DIR                     # HF log-probs of the export
    python tests/checkpoint_worker.py peft OUT.pt MODEL_DIR ADAPTER_DIR        # same, base + PEFT adapter
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from config import parse_cli  # noqa: E402
from engine import TorchTitanEngineWithLMHead  # noqa: E402
from engine_worker import fixed_batch, packed  # noqa: E402


def build_engine(model_dir: str, out_dir: str, *extra: str) -> TorchTitanEngineWithLMHead:
    return TorchTitanEngineWithLMHead(parse_cli([
        "--model.path", model_dir, "--model.attn_type", "sdpa", "--model.dtype", "float32", "--trainer.device", "cpu",
        "--trainer.output_dir", out_dir, *extra]))


def hf_logprobs(hf, seqs, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's per-sequence log-probs (0 at each sequence end, as packed) and entropies, concatenated."""
    logprobs, entropies = [], []
    with torch.no_grad():
        for s in seqs:
            logp = torch.log_softmax(hf(s[None]).logits[0].float() / temperature, -1)
            logprobs.append(torch.cat([logp[:-1].gather(-1, s[1:, None])[:, 0], torch.zeros(1)]))
            entropies.append(-(logp.exp() * logp).sum(-1))
    return torch.cat(logprobs), torch.cat(entropies)


def parity(out: str, model_dir: str) -> dict:
    from transformers import AutoModelForCausalLM

    engine = build_engine(model_dir, out + "_run")
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    seqs = fixed_batch(hf.config.vocab_size)
    with engine.eval_mode():
        logprobs, entropy = engine.forward(*packed(seqs), temperature=0.7, with_entropy=True)
    want_logprobs, want_entropy = hf_logprobs(hf, seqs, 0.7)
    return {"logprobs": logprobs, "entropy": entropy, "hf_logprobs": want_logprobs, "hf_entropy": want_entropy}


def one_step(engine, seqs) -> float:
    with engine.train_mode():
        logprobs, _ = engine.forward(*packed(seqs))
        loss = -logprobs.mean()
        engine.backward(loss)
        engine.optimizer_step()
        engine.lr_scheduler_step()
    return loss.item()


def first(out: str, model_dir: str, run_dir: str, *flags: str) -> dict:
    engine = build_engine(model_dir, run_dir, "--optimizer.lr", "1e-2", *flags)
    seqs = fixed_batch(engine.trainer.model_config.vocab_size)
    losses = [one_step(engine, seqs)]
    engine.save_checkpoint(1)
    losses.append(one_step(engine, seqs))
    with engine.eval_mode():
        final = engine.forward(*packed(seqs))[0]
    return {"losses": losses, "final": final, "export": engine.export_hf(2)}


def resume(out: str, model_dir: str, run_dir: str, *flags: str) -> dict:
    engine = build_engine(model_dir, run_dir, "--optimizer.lr", "1e-2", *flags)
    return {"loaded_step": engine.loaded_step, "loss": one_step(engine, fixed_batch(engine.trainer.model_config.vocab_size))}


def hf(out: str, export_dir: str) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(export_dir, dtype=torch.float32)
    return {"logprobs": hf_logprobs(model, fixed_batch(model.config.vocab_size))[0]}


def peft(out: str, model_dir: str, adapter_dir: str) -> dict:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), adapter_dir)
    return {"logprobs": hf_logprobs(model, fixed_batch(model.config.vocab_size))[0]}


if __name__ == "__main__":
    case, out, *args = sys.argv[1:]
    torch.save({"parity": parity, "first": first, "resume": resume, "hf": hf, "peft": peft}[case](out, *args), out)
