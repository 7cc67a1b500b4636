"""The trainer side: torchtitan's `Trainer`, wrapped as verl's TorchTitan engine.

`TorchTitanEngine` builds a `torchtitan.trainer.Trainer` (as verl does: a no-op dataloader, the model family's
ModelSpec, the model dir's tokenizer, its checkpointer for the HF load and DCP) and reuses `model_parts`,
`optimizers`, `lr_schedulers`, `parallel_dims`, `checkpointer`. `TorchTitanEngineWithLMHead` adds per-token
log-probs and entropy of packed micro-batches (vocab sharded under TP, tokens under CP). CPU: cpu.py first.
"""

import contextlib
import copy
import dataclasses
import json
import os
import shutil
from collections.abc import Iterator
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torchtitan.components.checkpointer import CheckpointManager
from torchtitan.components.checkpointer.utils import canonical_fqn
from torchtitan.components.dataloader import BaseDataLoader
from torchtitan.components.loss import CrossEntropyLoss
from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer, ParamGroupConfig
from torchtitan.config.configs import CompileConfig, DebugConfig, ParallelismConfig, TrainingConfig
from torchtitan.distributed import utils as dist_utils
from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
from torchtitan.distributed.context_parallel import cp_shard
from torchtitan.trainer import Trainer

import cpu
import lora
from config import Config, SettingError, dp_shard_degree, load_plugin, resolve_device, resolve_spmd_backend
from logprobs import IGNORE_INDEX, GatherOverCP, full_tensor, token_logprobs, tp_group_and_vocab


# what torchrun sets, for one process started without it (entry points set them: torchtitan reads LOCAL_RANK itself)
ONE_PROCESS = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(29500 + os.getpid() % 1000)}


def init_process_group(device: str) -> None:
    """Init torch.distributed (nccl on GPU, gloo on CPU) from torchrun's environment variables."""
    if dist.is_initialized():
        return
    if device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    # gloo beside nccl: small bookkeeping collectives (counts, flags, objects) run on CPU tensors
    dist.init_process_group("cpu:gloo,cuda:nccl" if device == "cuda" else "gloo")


def load_model_dir(path: str) -> str:
    """Local dir of an HF model: `path` itself, or a hub id fetched with huggingface_hub."""
    if os.path.isdir(path):
        return os.path.abspath(path)
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(path, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.jinja", "*.model"])
    except Exception as error:  # offline, no such repo, gated: say which setting, in one line
        raise SettingError(f"model.path={path} is no local dir and could not be downloaded from the hub "
                           f"({type(error).__name__}: {str(error).splitlines()[0][:200]})") from None


class NoOpDataLoader(BaseDataLoader):
    """A torchtitan dataloader that yields nothing: the GRPO loop feeds the batches."""

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


def trainer_config(cfg: Config, model_dir: str, world_size: int):
    """torchtitan Trainer.Config mapped 1:1 from our Config."""
    with open(os.path.join(model_dir, "config.json")) as f:
        hf_config = json.load(f)
    p, o = cfg.parallelism, cfg.optimizer
    mini_batches = cfg.data.train_batch_size // cfg.actor.ppo_mini_batch_size
    optimizer_steps = cfg.trainer.total_training_steps * cfg.actor.ppo_epochs * mini_batches
    family = load_plugin("model.family", cfg.model.family)
    model_spec = family.model_spec(hf_config, cfg.model.attn_type)
    if cfg.model.lora_rank:  # frozen base, trainable adapters; the optimizer takes only the adapters
        model_spec = lora.convert(model_spec, cfg.model, family.LORA_TARGETS)
    return Trainer.Config(
        model_spec=model_spec, hf_assets_path=model_dir, dump_folder=cfg.trainer.output_dir,
        dataloader=NoOpDataLoader.Config(),
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
            last_save_model_only=True, last_save_in_hf=True, export_dtype="float32", load_only=False,
        ),
        activation_checkpoint={"full": FullAC.Config(), "none": None, "selective": (
            lora.AdapterSelectiveAC if cfg.model.lora_rank else SelectiveAC).Config()}[cfg.activation_checkpoint.mode],
        compile=CompileConfig(enable=cfg.compile.enable, components=["model"]),
        debug=DebugConfig(seed=cfg.trainer.seed, enable_structured_logging=False),
    )


def packed_length_multiple(cfg: Config) -> int:
    """What a packed length is padded to a multiple of: what sequence / context parallel split by, and for Flex
    whole 128-token blocks (Inductor gives a query shorter than 128 its decoding kernel, which did not compile
    for a float32 model on an H200; DP padding micro-batches are 2 tokens)."""
    p = cfg.parallelism
    # CP shards the document BlockMask by whole 128-token blocks, two load-balanced chunks per rank
    blocks = 2 * p.context_parallel_degree * 128 if p.context_parallel_degree > 1 else 1
    if cfg.model.attn_type in ("flex", "flex_flash"):
        blocks = max(blocks, 128)
    return p.tensor_parallel_degree * blocks


def sequence_budget(cfg: Config) -> int:
    """Longest sequence (RoPE length), rounded up to a packed length."""
    divisor = packed_length_multiple(cfg)
    longest = cfg.data.max_prompt_length + cfg.data.max_response_length
    return -(-longest // divisor) * divisor


class TorchTitanEngine:
    """torchtitan Trainer as an RL actor: model, optimizer, LR schedule, checkpoints, HF export."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.device_type = resolve_device(cfg)
        if self.device_type == "cpu":
            cpu.use_cpu_device()
        init_process_group(self.device_type)
        self.model_dir = load_model_dir(cfg.model.path)
        self.trainer = Trainer(trainer_config(cfg, self.model_dir, dist.get_world_size()))
        self.model_parts, self.parallel_dims = self.trainer.model_parts, self.trainer.parallel_dims
        self.optimizers, self.lr_schedulers = self.trainer.optimizers, self.trainer.lr_schedulers
        self.checkpointer, self.device = self.trainer.checkpointer, self.trainer.device
        self.sd_adapter = self.checkpointer.sd_adapter
        self.dp_mesh = self.parallel_dims.get_optional_mesh("batch")  # None without data parallelism
        self.dp_rank = self.dp_mesh.get_local_rank() if self.dp_mesh is not None else 0
        self.dp_size = self.dp_mesh.size() if self.dp_mesh is not None else 1
        if self.device_type == "cpu":
            cpu.use_sum_reduction(self.model)
        self.fsdp_modules = [m for m in self.model.modules() if isinstance(m, FSDPModule)]
        if not self.parallel_dims.fsdp_enabled and (not cfg.model.lora_rank or self.parallel_dims.world_size == 1):
            self._gather_once_per_block()
        if cfg.model.lora_rank:
            lora.init_adapters(self.model, cfg.trainer.seed)
        self.loaded_step = self._load()

    def _gather_once_per_block(self) -> None:
        """FSDP on a one-rank shard group (one GPU, TP only): the masters are whole, so resharding saves no
        memory. Keep the gathered (bf16) params from the first forward of a block of micro-batches until `_reshard`
        ends it (optimizer step, mode exit), instead of gathering (a copy) per layer, micro-batch and pass. With LoRA
        on one GPU only the adapters are FSDP's (lora.py); with TP it would hold the base twice, so not there."""
        for module in self.fsdp_modules:
            module.set_reshard_after_forward(False, recurse=False)
            module.set_reshard_after_backward(False, recurse=False)

    def _reshard(self) -> None:
        """Back to the sharded masters (with their grads): before an optimizer step, and at a mode's exit."""
        for module in self.fsdp_modules:
            module.reshard()

    @property
    def model(self) -> torch.nn.Module:
        return self.model_parts[0]

    def _load(self) -> int:
        """Load the latest DCP checkpoint of output_dir if any (resume), else the HF weights."""
        folder = self.checkpointer.folder
        if not self.cfg.checkpoint.resume and os.path.isdir(folder):
            raise SettingError(f"checkpoint.resume=False but {folder} exists; remove it or set trainer.output_dir")
        for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:  # step-N folders
            partial = name.startswith("step-") and not os.path.isfile(os.path.join(folder, name, ".metadata"))
            if partial and dist.get_rank() == 0:  # torchtitan skips it too, without a word
                print(f"skipping checkpoint {os.path.join(folder, name)}: incomplete (no .metadata)", flush=True)
        try:
            self.checkpointer.load()
        except (RuntimeError, CheckpointException) as error:  # a checkpoint of another model (shapes, names)
            raise SettingError(
                f"trainer.output_dir={self.cfg.trainer.output_dir}: its checkpoint does not fit this model "
                f"({str(error).strip().splitlines()[-1][:200]}); choose a fresh trainer.output_dir"
            ) from None
        return self.trainer.step

    def training_flops(self, sequence_lengths: list[int]) -> float:
        """FLOPs of one forward + backward over sequences of these lengths (the model family's formula)."""
        parameters = sum(p.numel() for p in self.model.parameters())
        return load_plugin("model.family", self.cfg.model.family).training_flops(
            self.trainer.model_config, parameters, sequence_lengths)

    def dp_all_reduce(self, value: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        """All-reduce a copy of a tensor over data-parallel ranks (identity without DP)."""
        if self.dp_mesh is None:
            return value
        value = value.clone()
        dist.all_reduce(value, op=op, group=self.dp_mesh.get_group())
        return value

    @contextlib.contextmanager
    def train_mode(self):
        """Model in train mode, gradients starting from zero; the previous mode comes back after."""
        was_training = self.model.training
        self.model.train()
        self.optimizers.zero_grad()
        try:
            yield
        finally:
            self._reshard()
            self.model.train(was_training)

    @contextlib.contextmanager
    def eval_mode(self):
        """Model in eval mode, no autograd; the previous mode comes back after."""
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                yield
        finally:
            self._reshard()
            self.model.train(was_training)

    def backward(self, loss: torch.Tensor) -> None:
        """loss.backward() inside torchtitan's SPMD context, as its Trainer does (spmd_types needs the mesh)."""
        with self.trainer.train_context():
            loss.backward()

    def optimizer_step(self) -> tuple[float, bool]:
        """Clip grads, step the optimizer unless the norm is non-finite; returns (grad_norm, stepped)."""
        self._reshard()  # the masters' grads are what clip and step see; the next forward gathers the new weights
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
        return float(lr)

    def checkpoint_folder(self, step: int) -> str:
        """Where the DCP checkpoint of `step` is (or goes)."""
        return os.path.join(self.checkpointer.folder, f"step-{step}")

    def save_checkpoint(self, step: int) -> None:
        """Write a DCP checkpoint (model, optimizer, LR schedule, step) for `step`; always writes."""
        self.trainer.step = step  # the GRPO step: what a resume reads back as loaded_step
        assert self.checkpointer.save(step), "torchtitan's checkpointer skipped a save"
        self.checkpointer.maybe_wait_for_saving()

    def export_hf(self, step: int) -> str:
        """Write the current weights as HF safetensors (+ config, tokenizer); returns the dir. With LoRA: the
        merged weights, and the adapters alone in PEFT's layout in output_dir/lora/step-N."""
        out = os.path.join(self.cfg.trainer.output_dir, "hf", f"step-{step}")
        if self.cfg.model.lora_rank:
            lora.export(self, out, os.path.join(self.cfg.trainer.output_dir, "lora", f"step-{step}"))
        else:
            dcp_folder = self.checkpointer.folder  # keep the export out of the resume folder
            self.checkpointer.folder = os.path.join(self.cfg.trainer.output_dir, "hf")
            try:
                self.checkpointer.save(step, last_step=True)
            finally:
                self.checkpointer.folder = dcp_folder
        if dist.get_rank() == 0:
            for name in os.listdir(self.model_dir):
                if name.endswith((".json", ".txt", ".model", ".jinja")) and not name.endswith("index.json"):
                    shutil.copy(os.path.join(self.model_dir, name), out)
        dist.barrier()
        return out

    def export_hf_weights(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (HF name, full tensor) one parameter at a time, cast to `dtype` (default: the masters')
        before the gather; tied lm_head.weight included. With LoRA: the merged weights W + alpha / rank x B A."""
        cfg = self.cfg.model
        state = lora.merged_state(self.model, cfg.lora_alpha / cfg.lora_rank) if cfg.lora_rank else (
            (canonical_fqn(name), tensor) for name, tensor in self.model.state_dict().items())
        yielded = set()
        for name, tensor in state:
            tensor = full_tensor(tensor.to(dtype) if dtype is not None else tensor)  # a shard casts: fewer bytes move
            for hf_name, hf_tensor in self.sd_adapter.to_hf({name: tensor}).items():
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


class LocalLogits(NamedTuple):
    """What this rank's model forward gives: its share of the logits, and how it is shared."""

    logits: torch.Tensor  # [1, T', V] or [1, T', V / tp]: TP shards the vocab, CP the tokens (T' of T)
    tp_group: dist.ProcessGroup | None  # the vocab shards' group, None when this rank holds the whole vocab
    vocab: int
    labels: torch.Tensor  # [1, T'], this rank's tokens' labels
    cp_order: torch.Tensor | None  # packed index of each of this rank's tokens under CP, else None


class TorchTitanEngineWithLMHead(TorchTitanEngine):
    """Adds causal-LM log-probs: `forward(tokens, positions, labels)` on packed micro-batches."""

    @classmethod
    def reference(cls, cfg: Config) -> "TorchTitanEngineWithLMHead":
        """A frozen copy of the initial policy for the KL loss (its own output dir, no activation checkpointing)."""
        ref_cfg = copy.deepcopy(cfg)
        ref_cfg.trainer.output_dir = os.path.join(cfg.trainer.output_dir, "reference")
        ref_cfg.activation_checkpoint.mode = "none"
        return cls(ref_cfg)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0,
                with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(log p(label) [T], entropy [T] or None), float32, of a packed [1, T] micro-batch (0 where the label is
        IGNORE_INDEX); `positions` restart at 0 for each sequence and define the document mask."""
        length = tokens.shape[1]
        out = self._logits(tokens, positions, labels)
        logprobs, entropy = token_logprobs(
            out.logits, out.labels, out.tp_group, out.vocab, temperature, with_entropy,
            self.cfg.actor.logprob_chunk_tokens, self.cfg.compile.enable,
        )
        if out.cp_order is not None:  # this rank holds a load-balanced share of the tokens
            logprobs = self._gather_over_cp(logprobs, out.cp_order)
            entropy = self._gather_over_cp(entropy, out.cp_order) if entropy is not None else None
        return logprobs[:length], entropy[:length] if entropy is not None else None

    def full_logits(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Full-vocab logits [T, V] of a packed [1, T] batch (gathered over TP and CP); for sampling."""
        length = tokens.shape[1]
        out = self._logits(tokens, positions, torch.full_like(tokens, IGNORE_INDEX))
        local = out.logits
        if out.tp_group is not None:
            shards = [torch.empty_like(local) for _ in range(dist.get_world_size(out.tp_group))]
            dist.all_gather(shards, local.contiguous(), group=out.tp_group)
            local = torch.cat(shards, dim=-1)
        local = local[0]
        if out.cp_order is not None:
            local = self._gather_over_cp(local, out.cp_order)
        return local[:length]

    def _logits(self, tokens, positions, labels) -> LocalLogits:
        """The model forward of a packed [1, T] micro-batch, as this rank holds it (see LocalLogits)."""
        tokens, positions, labels = self._pad_to_packed_length(tokens, positions, labels)
        tokens, positions, labels = to_device(torch.cat([tokens, positions, labels]), self.device).unbind(0)
        input_dict = {"input": tokens[None], "positions": positions[None]}
        cp_order = self._cp_order(tokens.shape[0]) if self.parallel_dims.cp_enabled else None
        inputs, labels, kwargs = self.trainer.post_dataloading_process(input_dict, labels[None])
        if isinstance(labels, DTensor):
            labels = labels.full_tensor()
        with self.trainer.train_context():  # spmd_types knows the TP mesh only inside it
            return LocalLogits(*tp_group_and_vocab(self.model(inputs, **kwargs)), labels, cp_order)

    def _cp_order(self, length: int) -> torch.Tensor:
        """Packed index of each token this CP rank holds, sharded as post_dataloading_process shards inputs."""
        index = torch.arange(length, device=self.device)[None]
        balancer = self.trainer.config.parallelism.context_parallel_load_balancer
        (index,), _ = cp_shard(self.parallel_dims.get_mesh("cp"), (index,), None, balancer)
        return index.flatten()

    def _gather_over_cp(self, local: torch.Tensor, cp_order: torch.Tensor) -> torch.Tensor:
        return GatherOverCP.apply(local, cp_order, self.parallel_dims.get_mesh("cp").get_group())

    def _pad_to_packed_length(self, tokens, positions, labels):
        """Pad the packed length to a multiple of packed_length_multiple (a padding document, labels ignored)."""
        pad = -tokens.shape[1] % packed_length_multiple(self.cfg)
        if pad == 0:
            return tokens, positions, labels
        pad_doc = torch.arange(pad)[None].to(positions)  # the positions of a separate padding document
        return F.pad(tokens, (0, pad)), torch.cat([positions, pad_doc], 1), F.pad(labels, (0, pad), value=IGNORE_INDEX)
