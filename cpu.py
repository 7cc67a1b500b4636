"""torchtitan 0.3.0 on CPU (tests, laptops): three adaptations, made here instead of in site-packages.

- torchtitan assumes CUDA: six of its modules call torch.cuda-style functions through module-level
  `device_type` / `device_module` globals; `use_cpu_device()` points them at the CPU, process-wide.
- gloo has no PREMUL_SUM, which FSDP2 averages gradients with; `use_sum_reduction()` makes FSDP sum (torchtitan
  normalises the loss globally, so its divide factor is 1 anyway).
- CPU attention is qwen3.py's `attn_type=sdpa`; its BlockMasks come from `all_blocks_mask` (no compiled block search).
"""

import importlib

import torch
import torchtitan.models.common.decoder as titan_decoder
from torch.distributed.fsdp import FSDPModule
from torch.nn.attention.flex_attention import BlockMask

TORCHTITAN_DEVICE_MODULES = ("torchtitan.tools.utils", "torchtitan.distributed.utils",
                             "torchtitan.distributed.parallel_dims", "torchtitan.components.metrics",
                             "torchtitan.models.common.token_dispatcher", "torchtitan.tools.profiler")


class CpuDeviceModule:
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
    """Point torchtitan's module-level device globals (CUDA by default) at the CPU; BlockMasks without a search."""
    titan_decoder.create_attention_mask = all_blocks_mask
    for name in TORCHTITAN_DEVICE_MODULES:
        module = importlib.import_module(name)
        if hasattr(module, "device_type"):
            module.device_type = "cpu"
        if hasattr(module, "device_module"):
            module.device_module = CpuDeviceModule()


def all_blocks_mask(mask_mod, B, H, Q_LEN, KV_LEN, device=None, BLOCK_SIZE=128, **_) -> BlockMask:
    """create_block_mask's BlockMask with every block listed as partial, built without the search for empty blocks
    that torchtitan compiles (seconds per process): mask_mod decides each element, as in qwen3.py's dense mask."""
    q_blocks, kv_blocks = -(-Q_LEN // BLOCK_SIZE), -(-KV_LEN // BLOCK_SIZE)
    kv_indices = torch.arange(kv_blocks, dtype=torch.int32, device=device).repeat(B, 1, q_blocks, 1)
    return BlockMask.from_kv_blocks(torch.full((B, 1, q_blocks), kv_blocks, dtype=torch.int32, device=device),
                                    kv_indices, BLOCK_SIZE=BLOCK_SIZE, mask_mod=mask_mod, seq_lengths=(Q_LEN, KV_LEN))


def use_sum_reduction(model: torch.nn.Module) -> None:
    """Make every FSDP module of `model` reduce gradients with a plain sum (gloo has no PREMUL_SUM)."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
