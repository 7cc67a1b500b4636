"""The trainer side: torchtitan's `Trainer`, wrapped as verl's TorchTitan engine.

`TorchTitanEngine` builds a `torchtitan.trainer.Trainer` (as verl does) and reuses what it
builds: `model_parts`, `optimizers`, `lr_schedulers`, `parallel_dims`, `checkpointer`.
The Trainer is handed a no-op dataloader (the GRPO loop feeds it), the HF tokenizer of the
model dir, and a Qwen3 model config read from the dir's `config.json` (any size, dense or
MoE); torchtitan's checkpointer loads the HF safetensors and writes DCP checkpoints.
`TorchTitanEngineWithLMHead` adds the causal-LM head: per-token log-probs (and entropy)
of packed micro-batches, with the vocab sharded under TP and the tokens under CP (gathered
back into packed order).

CPU (tests, laptops): torchtitan assumes CUDA, so `use_cpu_device()` points its device
globals at the CPU; gloo has no PREMUL_SUM, so FSDP is set to plain sum reduction; and
`attn_type=sdpa` runs SDPA with a dense document mask, since Flex has no CPU backward
and varlen no CPU kernel.
"""

import contextlib
import dataclasses
import functools
import json
import os
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Shard
from torch.nn.attention.flex_attention import BlockMask, create_mask

from config import Config, dp_shard_degree, resolve_device, resolve_spmd_backend

IGNORE_INDEX = -100


# ----------------------------------------------------------------------------- device


class _CpuDeviceModule:
    """torch.cpu plus the torch.cuda-style calls torchtitan makes (names, memory stats)."""

    def __getattr__(self, name):
        return getattr(torch.cpu, name)

    def get_device_name(self, *_):
        return "cpu"

    def get_device_properties(self, *_):
        return type("CpuProperties", (), {"total_memory": 1, "name": "cpu"})()

    def memory_stats(self, *_):
        return {"active_bytes.all.peak": 0, "reserved_bytes.all.peak": 0, "num_alloc_retries": 0, "num_ooms": 0}

    def reset_peak_memory_stats(self, *_):
        pass

    def empty_cache(self):
        pass


def use_cpu_device() -> None:
    """Point torchtitan's module-level device globals (CUDA by default) at the CPU."""
    import importlib

    for name in (
        "torchtitan.tools.utils",
        "torchtitan.distributed.utils",
        "torchtitan.distributed.parallel_dims",
        "torchtitan.components.metrics",
        "torchtitan.models.common.token_dispatcher",
        "torchtitan.tools.profiler",
    ):
        module = importlib.import_module(name)
        if hasattr(module, "device_type"):
            module.device_type = "cpu"
        if hasattr(module, "device_module"):
            module.device_module = _CpuDeviceModule()


def init_process_group(device: str) -> None:
    """Init torch.distributed (nccl on GPU, gloo on CPU); works without torchrun too."""
    if dist.is_initialized():
        return
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    if device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    # gloo beside nccl: small bookkeeping collectives (counts, flags, objects) run on CPU tensors
    dist.init_process_group("cpu:gloo,cuda:nccl" if device == "cuda" else "gloo")


# ----------------------------------------------------------------------------- model


def _dense_mask_attention_class():
    """SDPA with a dense document-causal mask, taking the same BlockMask as Flex (CPU path)."""
    from torchtitan.models.common.attention import FlexAttention

    class DenseMaskAttention(FlexAttention):
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

    return DenseMaskAttention


def _experts_in_input_dtype_class():
    """torchtitan's GroupedExperts computing in its input's dtype: its forward casts everything to
    bfloat16, so a float32 model (CPU, parity tests) was not float32 in its experts (1e-2 off HF)."""
    from torchtitan.models.common.moe import GroupedExperts

    class ExpertsInInputDtype(GroupedExperts):
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

    return ExpertsInInputDtype


def _as_hf_qwen3_moe(model) -> None:
    """Qwen3-MoE as HF computes it: routing without torchtitan's load-balancing bias (an extra buffer
    that would change at every step and that neither the HF export nor vLLM carries), experts in the
    model's dtype."""
    from torchtitan.models.common.moe import GroupedExperts, MoE

    for _, moe, _, _ in model.traverse(MoE.Config):
        moe.load_balance_coeff = None
    experts_class = _experts_in_input_dtype_class()
    for _, experts, parent, attr in list(model.traverse(GroupedExperts.Config)):
        fields = {f.name: getattr(experts, f.name) for f in dataclasses.fields(experts)}
        parent.__setattr__(attr, experts_class.Config(**fields))


def qwen3_model_config(hf: dict, attn_type: str):
    """torchtitan Qwen3Model.Config from an HF Qwen3 / Qwen3-MoE config.json dict."""
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.common.attention import FlexAttention
    from torchtitan.models.common.nn_modules import RMSNorm
    from torchtitan.models.qwen3 import (
        _EMBEDDING_INIT, _EMBEDDING_SKIP_INIT, _LINEAR_INIT, _build_qwen3_layers,
        _build_qwen3_moe_layers, _qwen3_norm,
    )
    from torchtitan.models.qwen3.model import Qwen3Model

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
        _as_hf_qwen3_moe(model)
    if attn_type == "sdpa":
        for _, _, parent, attr in list(model.traverse(FlexAttention.Config)):
            parent.__setattr__(attr, _dense_mask_attention_class().Config())
    return model


def load_model_dir(path: str) -> str:
    """Local dir of an HF model: `path` itself, or a hub id fetched with huggingface_hub."""
    if os.path.isdir(path):
        return os.path.abspath(path)
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(path, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.jinja", "*.model"])
    except Exception as error:  # offline, no such repo, gated: say which setting, in one line
        raise ValueError(f"model.path={path} is no local dir and could not be downloaded from the hub "
                         f"({type(error).__name__}: {str(error).splitlines()[0][:200]})") from None


# ----------------------------------------------------------------------------- trainer


def _no_op_dataloader_config():
    """A torchtitan dataloader config whose loader yields nothing: the GRPO loop feeds batches."""
    from torchtitan.components.dataloader import BaseDataLoader

    class NoOpDataLoader(BaseDataLoader):
        @dataclasses.dataclass(kw_only=True, slots=True)
        class Config(BaseDataLoader.Config):
            pass

        def __init__(self, config, **_):
            self.config = config

        def __iter__(self):
            return iter(())

        def state_dict(self):
            return {}

        def load_state_dict(self, state_dict):
            pass

    return NoOpDataLoader.Config()


def trainer_config(cfg: Config, model_dir: str, world_size: int):
    """torchtitan Trainer.Config mapped 1:1 from our Config."""
    from torchtitan.components.checkpointer import CheckpointManager
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer, ParamGroupConfig
    from torchtitan.config.configs import CompileConfig, DebugConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
    from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter
    from torchtitan.protocols.model_spec import ModelSpec
    from torchtitan.trainer import Trainer

    with open(os.path.join(model_dir, "config.json")) as f:
        model = qwen3_model_config(json.load(f), cfg.model.attn_type)
    p, o = cfg.parallelism, cfg.optimizer
    optimizer_steps = cfg.trainer.total_training_steps * cfg.actor.ppo_epochs * (
        cfg.data.train_batch_size // cfg.actor.ppo_mini_batch_size
    )
    return Trainer.Config(
        model_spec=ModelSpec(
            name="qwen3", flavor="hf", model=model, parallelize_fn=_parallelize_keeping_tied_head, pipelining_fn=None,
            post_optimizer_build_fn=None, state_dict_adapter=Qwen3StateDictAdapter,  # no load-balancing hook: HF has none
        ),
        hf_assets_path=model_dir,
        dump_folder=cfg.trainer.output_dir,
        dataloader=_no_op_dataloader_config(),
        loss=CrossEntropyLoss.Config(),  # unused: the GRPO loss lives in grpo.py
        optimizer=OptimizersContainer.Config(
            implementation=o.implementation,
            param_groups=[ParamGroupConfig(pattern=r".*", optimizer_name=o.name, optimizer_kwargs=dict(
                lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay))],
        ),
        lr_scheduler=LRSchedulersContainer.Config(**dataclasses.asdict(cfg.lr_scheduler)),
        training=TrainingConfig(
            seq_len=sequence_budget(cfg), steps=max(optimizer_steps, 1), max_norm=cfg.actor.max_norm,
            dtype="float32", mixed_precision_param=cfg.model.dtype,
            enable_cpu_offload=cfg.actor.enable_cpu_offload, disable_cuda_graphs=True,
        ),
        parallelism=ParallelismConfig(
            data_parallel_replicate_degree=p.data_parallel_replicate_degree,
            data_parallel_shard_degree=dp_shard_degree(p, world_size),
            tensor_parallel_degree=p.tensor_parallel_degree, context_parallel_degree=p.context_parallel_degree,
            expert_parallel_degree=p.expert_parallel_degree, pipeline_parallel_degree=p.pipeline_parallel_degree,
            enable_sequence_parallel=p.enable_sequence_parallel and p.tensor_parallel_degree > 1,
            fsdp_reshard_after_forward=p.fsdp_reshard_after_forward, spmd_backend=resolve_spmd_backend(cfg),
        ),
        checkpoint=CheckpointManager.Config(
            enable=True, folder="checkpoint", interval=1,  # the loop decides when; interval=1 never skips
            keep_latest_k=cfg.checkpoint.keep_latest_k,
            initial_load_path=None if cfg.model.random_init else model_dir,
            initial_load_in_hf=not cfg.model.random_init, initial_load_model_only=True,
            last_save_model_only=True, last_save_in_hf=True, export_dtype="float32",
            load_only=False,
        ),
        activation_checkpoint={"selective": SelectiveAC.Config(), "full": FullAC.Config(), "none": None}[
            cfg.activation_checkpoint.mode
        ],
        compile=CompileConfig(enable=cfg.compile.enable, components=["model"]),
        debug=DebugConfig(seed=cfg.trainer.seed, enable_structured_logging=False),
    )


def _parallelize_keeping_tied_head(model, **kwargs):
    """torchtitan's parallelize_qwen3, re-tying lm_head and embedding between TP and FSDP.

    TP distributes the two modules' weights separately, which unties them; FSDP then keeps
    two sharded copies and the embedding trains on a stale one (seen: FSDP=2 x TP=2 step 2 off).
    Both are Shard(0) over the vocab under TP, so one parameter serves both.
    """
    from torchtitan.models.qwen3 import parallelize_qwen3

    if model.enable_weight_tying:
        tensor_parallelize = model.parallelize

        def parallelize_then_retie(*args, **kw):
            result = tensor_parallelize(*args, **kw)
            model.tok_embeddings.weight = model.lm_head.weight
            return result

        model.parallelize = parallelize_then_retie
    return parallelize_qwen3(model, **kwargs)


def shard_divisor(cfg: Config) -> int:
    """What a packed length must be a multiple of for sequence / context parallel to split it."""
    p = cfg.parallelism
    # CP shards the document BlockMask by whole 128-token blocks, two load-balanced chunks per rank
    return p.tensor_parallel_degree * (2 * p.context_parallel_degree * 128 if p.context_parallel_degree > 1 else 1)


def sequence_budget(cfg: Config) -> int:
    """Longest sequence (RoPE length), rounded up to what SP/CP need to split evenly."""
    divisor = shard_divisor(cfg)
    longest = cfg.data.max_prompt_length + cfg.data.max_response_length
    return -(-longest // divisor) * divisor


class TorchTitanEngine:
    """torchtitan Trainer as an RL actor: model, optimizer, LR schedule, checkpoints, HF export."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.device_type = resolve_device(cfg)
        if self.device_type == "cpu":
            use_cpu_device()
        init_process_group(self.device_type)
        from torchtitan.trainer import Trainer

        self.model_dir = load_model_dir(cfg.model.path)
        self.trainer = Trainer(trainer_config(cfg, self.model_dir, dist.get_world_size()))
        self.model_parts, self.parallel_dims = self.trainer.model_parts, self.trainer.parallel_dims
        self.optimizers, self.lr_schedulers = self.trainer.optimizers, self.trainer.lr_schedulers
        self.checkpointer, self.device = self.trainer.checkpointer, self.trainer.device
        self.sd_adapter = self.checkpointer.sd_adapter
        if self.device_type == "cpu":
            self._use_sum_reduction()
        self.loaded_step = self._load()

    @property
    def model(self) -> torch.nn.Module:
        return self.model_parts[0]

    def _use_sum_reduction(self) -> None:
        # gloo has no PREMUL_SUM; torchtitan already sets the divide factor to 1 (loss is globally normalized)
        from torch.distributed.fsdp import FSDPModule

        for module in self.model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)

    def _load(self) -> int:
        """Load the latest DCP checkpoint of output_dir if any (resume), else the HF weights."""
        folder = self.checkpointer.folder
        if not self.cfg.checkpoint.resume and os.path.isdir(folder):
            raise ValueError(f"checkpoint.resume=False but {folder} exists; remove it or set trainer.output_dir")
        for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:  # step-N folders
            partial = name.startswith("step-") and not os.path.isfile(os.path.join(folder, name, ".metadata"))
            if partial and dist.get_rank() == 0:  # torchtitan skips it too, without a word
                print(f"skipping checkpoint {os.path.join(folder, name)}: incomplete (no .metadata)", flush=True)
        try:
            self.checkpointer.load()
        except RuntimeError as error:  # DCP: a checkpoint of another model (shapes, names)
            raise ValueError(
                f"trainer.output_dir={self.cfg.trainer.output_dir}: its checkpoint does not fit this model "
                f"({str(error).strip().splitlines()[-1][:200]}); choose a fresh trainer.output_dir"
            ) from None
        return self.trainer.step

    # ------------------------------------------------------------------ data parallel

    @property
    def dp_mesh(self):
        return self.parallel_dims.get_optional_mesh("batch")

    @property
    def dp_rank(self) -> int:
        return self.dp_mesh.get_local_rank() if self.dp_mesh is not None else 0

    @property
    def dp_size(self) -> int:
        return self.dp_mesh.size() if self.dp_mesh is not None else 1

    def dp_all_reduce(self, value: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        """All-reduce a copy of a tensor over data-parallel ranks (identity without DP)."""
        if self.dp_mesh is None:
            return value
        value = value.clone()
        dist.all_reduce(value, op=op, group=self.dp_mesh.get_group())
        return value

    def dp_sum(self, value: torch.Tensor) -> torch.Tensor:
        """Sum a tensor over data-parallel ranks."""
        return self.dp_all_reduce(value)

    # ------------------------------------------------------------------ modes and steps

    @contextlib.contextmanager
    def train_mode(self):
        """Model in train mode; gradients start from zero."""
        self.model.train()
        self.optimizers.zero_grad()
        yield

    @contextlib.contextmanager
    def eval_mode(self):
        """Model in eval mode, no autograd."""
        self.model.eval()
        with torch.no_grad():
            yield
        self.model.train()

    def backward(self, loss: torch.Tensor) -> None:
        """loss.backward() inside torchtitan's SPMD context, as its Trainer does (spmd_types needs the mesh)."""
        with self.trainer.train_context():
            loss.backward()

    def optimizer_step(self) -> tuple[float, bool]:
        """Clip grads, step the optimizer unless the norm is non-finite; returns (grad_norm, stepped)."""
        from torchtitan.distributed import utils as dist_utils

        grad_norm = dist_utils.clip_grad_norm_(
            [p for m in self.model_parts for p in m.parameters()], self.cfg.actor.max_norm, foreach=True,
            pp_mesh=self.parallel_dims.get_optional_mesh("pp"), ep_enabled=self.parallel_dims.ep_enabled,
        )
        grad_norm = float(grad_norm.full_tensor() if isinstance(grad_norm, DTensor) else grad_norm)
        stepped = bool(torch.isfinite(torch.tensor(grad_norm)))
        if stepped:
            self.optimizers.step()
        self.optimizers.zero_grad()
        return grad_norm, stepped

    def lr_scheduler_step(self) -> float:
        """Advance the LR schedule; returns the LR just used."""
        lr = self.lr_schedulers.schedulers[0].get_last_lr()[0]
        self.lr_schedulers.step()
        self.trainer.step += 1
        return float(lr)

    # ------------------------------------------------------------------ checkpoints and export

    def save_checkpoint(self, step: int) -> None:
        """Write a DCP checkpoint (model, optimizer, LR schedule, step) for `step`; always writes."""
        self.trainer.step = step
        assert self.checkpointer.save(step), "torchtitan's checkpointer skipped a save"
        self.checkpointer.maybe_wait_for_saving()

    def export_hf(self, step: int) -> str:
        """Write the current weights as HF safetensors (+ config, tokenizer); returns the dir."""
        dcp_folder = self.checkpointer.folder  # keep the export out of the resume folder
        self.checkpointer.folder = os.path.join(self.cfg.trainer.output_dir, "hf")
        try:
            self.checkpointer.save(step, last_step=True)
        finally:
            self.checkpointer.folder = dcp_folder
        out = os.path.join(self.cfg.trainer.output_dir, "hf", f"step-{step}")
        if dist.get_rank() == 0:
            import shutil

            for name in os.listdir(self.model_dir):
                if name.endswith((".json", ".txt", ".model", ".jinja")) and not name.endswith("index.json"):
                    shutil.copy(os.path.join(self.model_dir, name), out)
        dist.barrier()
        return out

    def export_hf_weights(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (HF name, full tensor) one parameter at a time, cast to `dtype` (default: the masters')
        before the gather; tied lm_head.weight included."""
        from torchtitan.components.checkpointer.utils import canonical_fqn

        yielded = set()
        for name, tensor in self.model.state_dict().items():
            if dtype is not None:
                tensor = tensor.to(dtype)  # a DTensor casts its local shard: the gather moves fewer bytes
            if isinstance(tensor, DTensor):
                tensor = tensor.full_tensor()
            for hf_name, hf_tensor in self.sd_adapter.to_hf({canonical_fqn(name): tensor}).items():
                if hf_name not in yielded:
                    yielded.add(hf_name)
                    yield hf_name, hf_tensor
                if hf_name == "model.embed_tokens.weight" and self.trainer.model_config.enable_weight_tying:
                    tied_embedding = hf_tensor
        if "lm_head.weight" not in yielded and self.trainer.model_config.enable_weight_tying:
            yield "lm_head.weight", tied_embedding  # vLLM needs it even for tied models


def to_device(tensor: torch.Tensor, device) -> torch.Tensor:
    """Host -> device copy that does not wait for the device to drain (pinned, non-blocking on CUDA)."""
    if torch.device(device).type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def pack(sequences: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens and positions [1, T] of sequences packed back to back (positions restart per sequence)."""
    tokens = torch.tensor([t for s in sequences for t in s])[None]
    positions = torch.cat([torch.arange(len(s)) for s in sequences])[None]
    return tokens, positions


class TorchTitanEngineWithLMHead(TorchTitanEngine):
    """Adds causal-LM log-probs: `forward(tokens, positions, labels)` on packed micro-batches."""

    def forward(
        self, tokens: torch.Tensor, positions: torch.Tensor, labels: torch.Tensor,
        temperature: float = 1.0, with_entropy: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Per-token log p(label) of a packed [1, T] micro-batch (0 where label is IGNORE_INDEX).

        Sequences are packed back to back; `positions` restart at 0 for each one and define
        the document mask. Returns (logprobs [T], entropy [T] or None), float32.
        """
        length = tokens.shape[1]
        logits, tp_group, vocab, labels, cp_order = self._logits(tokens, positions, labels)
        logprobs, entropy = token_logprobs(
            logits, labels, tp_group, vocab, temperature, with_entropy, self.cfg.actor.logprob_chunk_tokens,
            self.cfg.compile.enable,
        )
        if cp_order is not None:  # this rank holds a load-balanced share of the tokens
            logprobs = self._gather_over_cp(logprobs, cp_order)
            entropy = self._gather_over_cp(entropy, cp_order) if entropy is not None else None
        return logprobs[:length], entropy[:length] if entropy is not None else None

    def full_logits(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Full-vocab logits [T, V] of a packed [1, T] batch (gathered over TP and CP); for sampling."""
        length = tokens.shape[1]
        local, tp_group, _, _, cp_order = self._logits(tokens, positions, torch.full_like(tokens, IGNORE_INDEX))
        if tp_group is not None:
            shards = [torch.empty_like(local) for _ in range(dist.get_world_size(tp_group))]
            dist.all_gather(shards, local.contiguous(), group=tp_group)
            local = torch.cat(shards, dim=-1)
        local = local[0]
        if cp_order is not None:
            local = self._gather_over_cp(local, cp_order)
        return local[:length]

    def _logits(self, tokens, positions, labels):
        """(local logits [1, T', V or V/tp], TP group or None, full vocab size, labels [1, T'], CP order or None).

        Under CP, T' is this rank's share of the tokens and the CP order holds their packed indices.
        """
        tokens, positions, labels = self._pad_for_sharding(tokens, positions, labels)
        tokens, positions, labels = to_device(torch.cat([tokens, positions, labels]), self.device).unbind(0)
        input_dict = {"input": tokens[None], "positions": positions[None]}
        cp_order = self._cp_order(tokens.shape[0]) if self.parallel_dims.cp_enabled else None
        inputs, labels, kwargs = self.trainer.post_dataloading_process(input_dict, labels[None])
        if isinstance(labels, DTensor):
            labels = labels.full_tensor()
        with self.trainer.train_context():  # spmd_types knows the TP mesh only inside it
            return (*_tp_group_and_vocab(self.model(inputs, **kwargs)), labels, cp_order)

    def _cp_order(self, length: int) -> torch.Tensor:
        """Packed index of each token this CP rank holds, sharded as post_dataloading_process shards inputs."""
        from torchtitan.distributed.context_parallel import cp_shard

        index = torch.arange(length, device=self.device)[None]
        balancer = self.trainer.config.parallelism.context_parallel_load_balancer
        (index,), _ = cp_shard(self.parallel_dims.get_mesh("cp"), (index,), None, balancer)
        return index.flatten()

    def _gather_over_cp(self, local: torch.Tensor, cp_order: torch.Tensor) -> torch.Tensor:
        return _GatherOverCP.apply(local, cp_order, self.parallel_dims.get_mesh("cp").get_group())

    def _pad_for_sharding(self, tokens, positions, labels):
        """Pad the packed length to a multiple of what sequence / context parallel split by."""
        pad = -tokens.shape[1] % shard_divisor(self.cfg)
        if pad == 0:
            return tokens, positions, labels
        return (
            F.pad(tokens, (0, pad)),
            torch.cat([positions, torch.arange(pad)[None].to(positions)], dim=1),  # a separate padding doc
            F.pad(labels, (0, pad), value=IGNORE_INDEX),
        )


# ----------------------------------------------------------------------------- log-probs


class _GatherOverCP(torch.autograd.Function):
    """All-gather per-token values (dim 0) from CP ranks into packed order; backward keeps this
    rank's tokens only (every CP peer computes the same loss from the gathered values)."""

    @staticmethod
    def forward(ctx, local, order, group):
        ctx.save_for_backward(order)
        values = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        orders = [torch.empty_like(order) for _ in range(dist.get_world_size(group))]
        dist.all_gather(values, local.contiguous(), group=group)
        dist.all_gather(orders, order.contiguous(), group=group)
        full = local.new_empty((sum(o.numel() for o in orders), *local.shape[1:]))
        full[torch.cat(orders)] = torch.cat(values)
        return full

    @staticmethod
    def backward(ctx, grad):
        (order,) = ctx.saved_tensors
        return grad[order], None, None


def _tp_group_and_vocab(logits):
    """(local logits, TP process group or None, global vocab size)."""
    from torchtitan.distributed.spmd_types import current_spmd_mesh, spmd_mesh_size
    from torchtitan.distributed.utils import get_spmd_backend

    if isinstance(logits, DTensor):
        vocab = logits.shape[-1]
        if logits.placements == (Shard(logits.ndim - 1),):
            return logits.to_local(), logits.device_mesh.get_group(), vocab
        return logits.full_tensor(), None, vocab
    if get_spmd_backend() == "spmd_types" and spmd_mesh_size("tp") > 1:
        group = current_spmd_mesh().get_group("tp")
        return logits, group, logits.shape[-1] * dist.get_world_size(group)
    return logits, None, logits.shape[-1]


def token_logprobs(local_logits, labels, tp_group, vocab: int, temperature: float, with_entropy: bool,
                   chunk_tokens: int, compile_: bool = False):
    """log p(label) and entropy per token of softmax(logits / temperature), float32 (vocab split over tp_group)."""
    logprobs, entropy = _LogProbEntropy.apply(
        local_logits.flatten(0, 1), labels.flatten(), temperature, tp_group, vocab, chunk_tokens, compile_)
    return logprobs, entropy if with_entropy else None


class _LogProbEntropy(torch.autograd.Function):
    """Per-row log p(label) and entropy with the gradient in closed form.

    With z = logits / T, p = softmax(z): d logp_y / dz = onehot_y - p and dH / dz = -p (log p + H),
    so backward needs only the logits and two floats per row (log Z, H): no fp32 graph is kept or
    recomputed. Under TP each rank holds a vocab slice: the forward all-reduces the row max and
    three row sums; the backward is local. Eager mode works `chunk_tokens` rows at a time to bound
    fp32 temporaries; compiled, the reductions and the gradient are fused kernels over all rows.
    """

    @staticmethod
    def forward(ctx, logits, labels, temperature, tp_group, vocab, chunk_tokens, compile_):
        offset = dist.get_rank(tp_group) * -(-vocab // dist.get_world_size(tp_group)) if tp_group else 0
        local_labels = labels - offset  # out of [0, local vocab) where another rank holds the label
        row_max, row_stats, _ = _kernels(compile_)
        rows = _row_chunks(len(logits), chunk_tokens, compile_)
        maxes = torch.cat([row_max(logits[r]) for r in rows])
        if tp_group is not None:
            dist.all_reduce(maxes, op=dist.ReduceOp.MAX, group=tp_group)
        stats = torch.cat([row_stats(logits[r], local_labels[r], maxes[r], temperature) for r in rows])
        if tp_group is not None:
            dist.all_reduce(stats, group=tp_group)
        sum_exp, sum_exp_shifted, label_z = stats.unbind(-1)
        log_z = maxes / temperature + torch.log(sum_exp)
        entropy = torch.log(sum_exp) - sum_exp_shifted / sum_exp  # log Z - E[z], both shifted by m
        ignored = labels == IGNORE_INDEX
        ctx.save_for_backward(logits, local_labels, log_z, entropy, ignored)
        ctx.temperature, ctx.chunk_tokens, ctx.compile_ = temperature, chunk_tokens, compile_
        return (label_z - log_z).masked_fill(ignored, 0.0), entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        logits, local_labels, log_z, entropy, ignored = ctx.saved_tensors
        grad_logprobs = grad_logprobs.masked_fill(ignored, 0.0)
        grad_entropy = torch.zeros_like(entropy) if grad_entropy is None else grad_entropy
        logits_grad = _kernels(ctx.compile_)[2]
        rows = _row_chunks(len(logits), ctx.chunk_tokens, ctx.compile_)
        args = (logits, local_labels, log_z, entropy, grad_logprobs, grad_entropy)
        if len(rows) == 1:
            return logits_grad(*args, ctx.temperature), None, None, None, None, None, None
        grad = torch.empty_like(logits)
        for r in rows:
            grad[r] = logits_grad(*(a[r] for a in args), ctx.temperature)
        return grad, None, None, None, None, None, None


def _row_chunks(count: int, chunk_tokens: int, compile_: bool) -> list[slice]:
    """All rows at once when compiled (fused kernels keep no fp32 copy), else chunks of rows."""
    step = max(count, 1) if compile_ else chunk_tokens
    return [slice(start, start + step) for start in range(0, max(count, 1), step)]


def _row_max(logits):
    return logits.amax(-1).float()


def _row_stats(logits, local_labels, row_max, temperature):
    """[sum e, sum e (z - m), z at the label if this rank holds it] per row; z = logits / T, e = exp(z - m)."""
    z = logits.float() / temperature
    shifted = z - row_max[:, None] / temperature
    e = torch.exp(shifted)
    in_slice = (local_labels >= 0) & (local_labels < logits.shape[-1])
    label_z = z.gather(-1, local_labels.clamp(0, logits.shape[-1] - 1)[:, None])[:, 0] * in_slice
    return torch.stack([e.sum(-1), (e * shifted).sum(-1), label_z], dim=-1)


def _logits_grad(logits, local_labels, log_z, entropy, grad_logprobs, grad_entropy, temperature):
    """d(sum g_lp * logp_y + g_H * H) / d logits = (g_lp (onehot_y - p) - g_H p (log p + H)) / T."""
    logp = logits.float() / temperature - log_z[:, None]
    p = torch.exp(logp)
    onehot = torch.arange(logits.shape[-1], device=logits.device)[None] == local_labels[:, None]
    grad = grad_logprobs[:, None] * (onehot.float() - p) - grad_entropy[:, None] * p * (logp + entropy[:, None])
    return (grad / temperature).to(logits.dtype)


@functools.cache
def _kernels(compile_: bool):
    """(row max, row stats, logits grad), compiled into fused kernels when `compile_`."""
    fns = (_row_max, _row_stats, _logits_grad)
    # automatic dynamic shapes: the token count becomes symbolic, the vocab stays a constant (a
    # symbolic vocab turns each element's row index into a 64-bit division by a runtime value)
    return tuple(torch.compile(fn) for fn in fns) if compile_ else fns
