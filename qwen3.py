"""HF Qwen3 / Qwen3-MoE `config.json` -> torchtitan model: a model-family module (`--model.family`), the file a
fork copies for another model. Its interface: `MODEL_TYPES`, `model_spec(hf_config, attn_type)` (torchtitan's
ModelSpec), `training_flops(model_config, parameters, sequence_lengths)` and `LORA_TARGETS`.

torchtitan's Qwen3 builders and `Qwen3StateDictAdapter` do the work; the module swaps below make torchtitan 0.3.0
compute what HF computes (`DenseMaskAttention` for CPU, `ExpertsInInputDtype`, MoE without the load-balancing bias)
and let varlen run on the flash kernels that are installed (`VarlenOnInstalledFlash`).
"""

import dataclasses
import functools
import logging

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.nn.attention import activate_flash_attention_impl, current_flash_attention_impl
from torch.nn.attention.flex_attention import BlockMask, create_mask
from torchtitan.models.common import CosSinRoPE, Embedding, Linear
from torchtitan.models.common.attention import FlexAttention, VarlenAttention
from torchtitan.models.common.moe import GroupedExperts, MoE
from torchtitan.models.common.nn_modules import RMSNorm
from torchtitan.models.qwen3 import (
    _EMBEDDING_INIT, _EMBEDDING_SKIP_INIT, _LINEAR_INIT, _build_qwen3_layers, _build_qwen3_moe_layers, _qwen3_norm,
    parallelize_qwen3,
)
from torchtitan.models.qwen3.model import Qwen3Model
from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter
from torchtitan.protocols.model_spec import ModelSpec
from torchtitan.protocols.module import Module
from torchtitan.tools.utils import get_cuda_flash_attention_impl

from config import FLASH_PACKAGES, importable

MODEL_TYPES = ("qwen3", "qwen3_moe")
# model.target_modules: HF linear name -> torchtitan's (q/k/v are one fused linear; MoE experts are no Linear)
LORA_TARGETS = {"q_proj": "wqkv", "k_proj": "wqkv", "v_proj": "wqkv", "o_proj": "wo", "gate_proj": "w1",
                "up_proj": "w3", "down_proj": "w2"}


def model_spec(hf: dict, attn_type: str) -> ModelSpec:
    """torchtitan's ModelSpec of the HF config.json dict `hf` (no load-balancing hook: HF Qwen3-MoE has none)."""
    return ModelSpec(name="qwen3", flavor="hf", model=qwen3_model_config(hf, attn_type),
                     parallelize_fn=parallelize_keeping_tied_head, pipelining_fn=None, post_optimizer_build_fn=None,
                     state_dict_adapter=Qwen3StateDictAdapter)


def training_flops(model: Qwen3Model.Config, parameters: int, sequence_lengths: list[int]) -> float:
    """FLOPs of one forward + backward: 6 N T + 6 L h d sum(len^2) (causal attention); N without the embedding."""
    attention = model.layers[0].attention
    embedding = model.vocab_size * model.dim if not model.enable_weight_tying else 0
    attended = sum(n * n for n in sequence_lengths)
    return 6.0 * (parameters - embedding) * sum(sequence_lengths) + 6.0 * len(model.layers) * attention.n_heads * \
        attention.head_dim * attended


class DenseMaskAttention(FlexAttention):
    """SDPA with a dense document-causal mask, taking the same BlockMask as Flex (the CPU path)."""

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(FlexAttention.Config):
        pass

    def forward(self, q_BLNH, k_BLNH, v_BLNH, *, attention_masks: BlockMask, scale=None, enable_gqa=False, **_):
        B, q_len, kv_len = q_BLNH.shape[0], q_BLNH.shape[1], k_BLNH.shape[1]  # CP: K/V are gathered
        mask = create_mask(attention_masks.mask_mod, B, None, q_len, kv_len, device=q_BLNH.device)
        out = F.scaled_dot_product_attention(
            q_BLNH.transpose(1, 2), k_BLNH.transpose(1, 2), v_BLNH.transpose(1, 2),
            attn_mask=mask, scale=scale, enable_gqa=enable_gqa,
        )
        return out.transpose(1, 2)


class VarlenOnInstalledFlash(VarlenAttention):
    """torchtitan's varlen attention on the flash kernels that are installed: torchtitan 0.3.0 switches torch to
    FA3 (Hopper) or FA4 (Blackwell) unconditionally, and neither has a registry wheel; without them torch's
    built-in FlashAttention-2 varlen kernels run (what torchtitan uses on Ampere)."""

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(VarlenAttention.Config):
        pass

    def __init__(self, config: Config) -> None:
        Module.__init__(self)  # not VarlenAttention's, which would activate a missing FA3 / FA4 and fail
        self.window_size = config.window_size
        use_installed_flash()


@functools.cache  # once per process, not per layer
def use_installed_flash() -> None:
    """Switch torch to the flash kernels torchtitan picks for this GPU (FA3 / FA4) where installed, else say
    that torch's built-in FlashAttention-2 runs."""
    impl = get_cuda_flash_attention_impl()
    if impl is None or current_flash_attention_impl() == impl:
        return
    if importable(FLASH_PACKAGES[impl]):
        activate_flash_attention_impl(impl)
    else:
        logging.getLogger(__name__).warning("attn_type=varlen: %s (%s) is not installed; using torch's built-in "
                                            "FlashAttention-2", impl, FLASH_PACKAGES[impl])


class ExpertsInInputDtype(GroupedExperts):
    """torchtitan's GroupedExperts computing in its input's dtype: its forward casts everything to
    bfloat16, so a float32 model (CPU, parity tests) was not float32 in its experts."""

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(GroupedExperts.Config):
        pass

    def forward(self, x_RD, num_tokens_per_expert_E):
        if x_RD.dtype == torch.bfloat16:
            return super().forward(x_RD, num_tokens_per_expert_E)
        w1, w2, w3 = (w.to_local() if isinstance(w, DTensor) else w for w in (self.w1_EFD, self.w2_EDF, self.w3_EFD))
        offsets = torch.cumsum(num_tokens_per_expert_E, dim=0, dtype=torch.int32)
        hidden = F.silu(self._grouped_mm(A=x_RD, B_t=w1.transpose(-2, -1), offs=offsets))
        hidden = hidden * self._grouped_mm(A=x_RD, B_t=w3.transpose(-2, -1), offs=offsets)
        return self._grouped_mm(A=hidden, B_t=w2.transpose(-2, -1), offs=offsets)


def as_hf_qwen3_moe(model: Qwen3Model.Config) -> None:
    """Qwen3-MoE as HF computes it: routing without torchtitan's load-balancing bias (an extra buffer
    that would change at every step and that neither the HF export nor vLLM carries), experts in the
    model's dtype."""
    for _, moe, _, _ in model.traverse(MoE.Config):
        moe.load_balance_coeff = None
    for _, experts, parent, attr in list(model.traverse(GroupedExperts.Config)):
        fields = {f.name: getattr(experts, f.name) for f in dataclasses.fields(experts)}
        parent.__setattr__(attr, ExpertsInInputDtype.Config(**fields))


def qwen3_model_config(hf: dict, attn_type: str) -> Qwen3Model.Config:
    """torchtitan Qwen3Model.Config from an HF Qwen3 / Qwen3-MoE config.json dict."""
    dim, n_heads = hf["hidden_size"], hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or dim // n_heads
    rope_params = hf.get("rope_parameters") or {}
    theta = hf.get("rope_theta") or rope_params.get("rope_theta", 1e6)
    if (hf.get("rope_scaling") or {}).get("rope_type", "default") != "default":
        raise ValueError("model.path: rope_scaling is not supported; use a model without it")
    layer_args = dict(
        n_layers=hf["num_hidden_layers"], dim=dim, n_heads=n_heads,
        n_kv_heads=hf.get("num_key_value_heads") or n_heads, head_dim=head_dim,
        attn_backend="flex" if attn_type == "sdpa" else attn_type,
        rope=CosSinRoPE.Config(dim=head_dim, max_seq_len=hf["max_position_embeddings"], theta=theta),
    )
    num_experts = hf.get("num_experts") or hf.get("num_local_experts")  # transformers 5 renamed it
    if num_experts:
        if hf.get("mlp_only_layers") or hf.get("decoder_sparse_step", 1) != 1 or not hf.get("norm_topk_prob", True):
            raise ValueError("model.path: Qwen3-MoE with dense layers or norm_topk_prob=false is not supported")
        layers = _build_qwen3_moe_layers(
            **layer_args, moe_hidden_dim=hf["moe_intermediate_size"], num_experts=num_experts,
            top_k=hf["num_experts_per_tok"], moe_comm_backend="standard",
        )
    else:
        layers = _build_qwen3_layers(**layer_args, hidden_dim=hf["intermediate_size"])
    tied, vocab = bool(hf.get("tie_word_embeddings", False)), hf["vocab_size"]
    model = Qwen3Model.Config(
        vocab_size=vocab, dim=dim, norm=_qwen3_norm(dim), enable_weight_tying=tied,
        tok_embeddings=Embedding.Config(
            num_embeddings=vocab, embedding_dim=dim, param_init=_EMBEDDING_SKIP_INIT if tied else _EMBEDDING_INIT
        ),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=_LINEAR_INIT),
        layers=layers,
    )
    for _, norm, _, _ in model.traverse(RMSNorm.Config):
        norm.eps = hf.get("rms_norm_eps", 1e-6)
    if num_experts:
        as_hf_qwen3_moe(model)
    if attn_type == "sdpa":
        for _, _, parent, attr in list(model.traverse(FlexAttention.Config)):
            parent.__setattr__(attr, DenseMaskAttention.Config())
    for _, varlen, parent, attr in list(model.traverse(VarlenAttention.Config)):
        parent.__setattr__(attr, VarlenOnInstalledFlash.Config(window_size=varlen.window_size))
    return model


def parallelize_keeping_tied_head(model, **kwargs):
    """torchtitan's parallelize_qwen3, re-tying lm_head and embedding between TP and FSDP: TP distributes the two
    weights separately, which unties them, and the embedding would train on a stale copy.
    Both are Shard(0) over the vocab under TP, so one parameter serves both."""
    if model.enable_weight_tying:
        tensor_parallelize = model.parallelize

        def parallelize_then_retie(*args, **kw):
            result = tensor_parallelize(*args, **kw)
            model.tok_embeddings.weight = model.lm_head.weight
            return result

        model.parallelize = parallelize_then_retie
    return parallelize_qwen3(model, **kwargs)
