"""LoRA through torchtitan's `LoRAConverter` (`--model.lora_rank` > 0): a frozen base in the compute dtype, float32
adapters, merged weights for the sync and the HF export, the adapters in PEFT's layout. The engine calls `convert`,
`init_adapters` (after the build), `merged_state` (what the sync and export read), `export`, `AdapterSelectiveAC`."""

import dataclasses
import functools
import json
import math
import os
import zlib

import torch
import torch.distributed as dist
import torchtitan.distributed.fsdp as titan_fsdp
from safetensors.torch import save_file
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
from torchtitan.components.checkpointer.utils import canonical_fqn
from torchtitan.components.lora import LoRAConverter
from torchtitan.distributed.activation_checkpoint import SelectiveAC
from torchtitan.models.common.linear import Linear

from logprobs import full_tensor
from plugins import SettingError


def convert(model_spec, model_cfg, lora_target_names: dict[str, str]):
    """The model spec with LoRA on the linears that model.target_modules names; its parallelize_fn stores the
    frozen base in model.dtype and keeps it frozen."""
    targets = lora_targets(model_cfg, lora_target_names)
    converter = LoRAConverter.Config(rank=model_cfg.lora_rank, alpha=model_cfg.lora_alpha, target_modules=targets)
    model_spec.model = converter.build().convert(model_spec.model)
    model_spec.parallelize_fn = frozen_base(model_spec.parallelize_fn, getattr(torch, model_cfg.dtype))
    return model_spec


def frozen_base(parallelize_fn, dtype: torch.dtype):
    """A parallelize_fn that first gives the adapted linears `addmm_lora`'s forward and casts the frozen parameters to
    the compute dtype (FSDP2 keeps a parameter in its param_dtype as it is), after keeps the base frozen (torchtitan's
    spmd_types backend registers each parameter anew); on one GPU the base stays out of FSDP (a gather is a copy)."""

    def parallelize(model, **kwargs):
        frozen = set()
        for path, module in model.named_modules():
            if hasattr(module, "lora_a") and type(module).__bases__ == (Linear,) and module.bias is None:
                module.__class__ = addmm_lora(type(module))
            for name, p in list(module.named_parameters(recurse=False)):
                if not p.requires_grad:
                    frozen.add(canonical_fqn(f"{path}.{name}" if path else name))
                    setattr(module, name, torch.nn.Parameter(p.detach().to(dtype), requires_grad=False))
        shard = titan_fsdp.fully_shard
        if kwargs["parallel_dims"].world_size == 1 and not kwargs["training"].enable_cpu_offload:
            titan_fsdp.fully_shard = lambda module, **kw: shard(module, **kw, ignored_params={
                p for name, p in model.named_parameters() if canonical_fqn(name) in frozen})  # as registered then
        try:
            model = parallelize_fn(model, **kwargs)
        finally:
            titan_fsdp.fully_shard = shard
        for name, p in model.named_parameters():
            p.requires_grad_(canonical_fqn(name) not in frozen)
        return model

    return parallelize


@functools.cache
def addmm_lora(lora_linear: type) -> type:
    """torchtitan's LoRALinear computing W x + scale B A x through `LoRAMatmul`."""
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = LoRAMatmul.apply(x.flatten(0, -2), self.weight, self.lora_a.weight, self.lora_b.weight, self._lora_scaling)
        return y.unflatten(0, x.shape[:-1])
    return type(lora_linear.__name__, (lora_linear,), {"forward": forward})


class LoRAMatmul(torch.autograd.Function):
    """x W^T + scale (x A^T) B^T as A x, x W^T, one addmm; cuBLAS scales (alpha) and adds, forward and backward."""
    @staticmethod
    def forward(ctx, x, weight, lora_a, lora_b, scale):
        ctx.scale, rank_sized = scale, x @ lora_a.t()
        ctx.save_for_backward(x, weight, lora_a, lora_b, rank_sized)
        return torch.addmm(x @ weight.t(), rank_sized, lora_b.t(), alpha=scale)

    @staticmethod
    def backward(ctx, grad):
        x, weight, lora_a, lora_b, rank_sized = ctx.saved_tensors
        grad_rank, scale = grad @ lora_b, ctx.scale
        grad_x = torch.addmm(grad @ weight, grad_rank, lora_a, alpha=scale) if ctx.needs_input_grad[0] else None
        grad_a = torch.addmm(lora_a, grad_rank.t(), x, beta=0, alpha=scale)  # beta=0: the first argument is not read
        return grad_x, None, grad_a, torch.addmm(lora_b, grad.t(), rank_sized, beta=0, alpha=scale), None


class AdapterSelectiveAC(SelectiveAC):
    """torchtitan's selective AC (compute ops' outputs saved, every other matmul's recomputed) with a LoRA linear as one
    matmul (its three would shift the rule onto B's outputs): A x is always saved; the rule counts the addmm compiled (x
    W^T recomputed only with it; an unadapted linear shaped as an adapted one is never saved), x W^T in eager; as
    torchtitan's, it recomputes the linears of force_recompute_mm_shapes_by_fqns (MoE's router gate), uncounted."""

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(SelectiveAC.Config):
        pass

    def _wrap_block(self, module: torch.nn.Module, *, base_fqn: str | None = None) -> torch.nn.Module:
        adapted, save_ops = [m for m in module.modules() if hasattr(m, "lora_a")], self.get_save_ops()
        shapes = {tuple(m.lora_a.weight.shape[::-1]) for m in adapted}, {tuple(m.weight.shape[::-1]) for m in adapted}
        recomputed = {tuple(m.weight.shape[::-1]) for name, m in module.named_modules(prefix=base_fqn or "")
                      if any(fqn in name for fqn in self.config.force_recompute_mm_shapes_by_fqns)}
        return checkpoint_wrapper(module, context_fn=lambda: create_selective_checkpoint_contexts(
            self.policy(save_ops, *shapes, recomputed)), preserve_rng_state=self.config.preserve_rng_state,
            determinism_check=self.config.determinism_check, early_stop=False, debug=self.config.debug)

    def policy(self, save_ops: set, rank_sized: set, base_sized: set, recomputed: set):
        """The policy of one forward of a block and its recompute (the matmuls' weights: (in, rank), (in, out))."""
        mm, addmm, matmuls = torch.ops.aten.mm.default, torch.ops.aten.addmm.default, [0, 0]  # forward, recompute
        keep, drop = CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE
        def decide(ctx, func, *args, **kwargs):
            if func == torch.ops.aten._to_copy.default and args[0].is_cuda and str(kwargs.get("device")) == "cpu":
                return keep  # as torchtitan: a device-to-host copy (MoE's all-to-all sizes) is never recomputed
            shape = tuple(args[1].shape) if func == mm else None
            if shape in rank_sized:  # A x
                return keep
            if shape in recomputed or (shape in base_sized if torch.compiler.is_compiling() else func == addmm):
                return drop  # the router gate's, or of LoRA's: uncounted
            if func not in (mm, addmm):
                return keep if func in save_ops else drop
            matmuls[ctx.is_recompute] += 1
            return keep if matmuls[ctx.is_recompute] % 2 else drop
        return decide


def init_adapters(model: torch.nn.Module, seed: int) -> None:
    """Each A as PEFT initialises it (kaiming-uniform, B = 0), drawn whole from `seed` and the module's name, so that
    every layout trains the same adapters (torchtitan draws each shard on its own rank)."""
    for path, weight in [(path, m.lora_a.weight) for path, m in model.named_modules() if hasattr(m, "lora_a")]:
        generator = torch.Generator().manual_seed(seed + zlib.crc32(canonical_fqn(path).encode()))
        whole = torch.nn.init.kaiming_uniform_(torch.empty(weight.shape), a=math.sqrt(5), generator=generator)
        if isinstance(weight, DTensor):  # every rank holds the whole tensor: keep its shard, no traffic
            whole = distribute_tensor(whole, weight.device_mesh, weight.placements, src_data_rank=None)
        weight.detach().copy_(whole)


def merged_state(model: torch.nn.Module, scale: float):
    """(state-dict name, tensor) of the model with W + scale x B A in place of each adapted W (in float32, whole)
    and no adapter tensors: what the sync and the HF export read."""
    factors = adapter_factors(model)
    for name, tensor in model.state_dict().items():
        name = canonical_fqn(name)
        if name in factors:
            yield name, full_tensor(tensor).float() + scale * torch.mm(*factors[name])  # W + scale B A
        elif ".lora_a." not in name and ".lora_b." not in name:
            yield name, tensor


def adapter_factors(model: torch.nn.Module) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """State-dict name of each adapted base weight -> (its rows of lora_b, lora_a), whole tensors. lora_b's rows go
    through the parent module's state-dict hooks as the base weight's do (the fused q/k/v linear saves as three)."""
    factors = {}
    for path, module in [(path, module) for path, module in model.named_modules() if hasattr(module, "lora_b")]:
        parent_path, _, attr = path.rpartition(".")
        parent, prefix = model.get_submodule(parent_path), parent_path + "."
        rows = {f"{prefix}{attr}.weight": full_tensor(module.lora_b.weight)}
        for hook in parent._state_dict_hooks.values():
            hook(parent, rows, prefix, {})
        lora_a = full_tensor(module.lora_a.weight)
        factors.update({canonical_fqn(name): (lora_b, lora_a) for name, lora_b in rows.items()})
    return factors


def export(engine, out: str, adapter_out: str) -> None:
    """The merged model as HF safetensors in `out` and the adapters in PEFT's layout in `adapter_out` (torchtitan's
    HF save would write the base weights alone). Every rank gathers; rank 0 writes."""
    tied, cfg = engine.trainer.model_config.enable_weight_tying, engine.cfg.model
    weights = {name: tensor.cpu().contiguous() for name, tensor in engine.export_hf_weights(torch.float32)
               if dist.get_rank() == 0 and not (tied and name == "lm_head.weight")}  # a tied head is the embedding
    adapters, targets = {}, set()
    for name, (lora_b, lora_a) in adapter_factors(engine.model).items():
        for hf_name, hf_rows in engine.sd_adapter.to_hf({name: lora_b}).items():
            module = "base_model.model." + hf_name.removesuffix(".weight")
            for part, tensor in ("lora_A", lora_a), ("lora_B", hf_rows):  # own storage: safetensors refuses shared
                adapters[f"{module}.{part}.weight"] = tensor.cpu().clone()
            targets.add(module.rsplit(".", 1)[1])
    if dist.get_rank() != 0:
        return
    for folder, name, tensors in (out, "model", weights), (adapter_out, "adapter_model", adapters):
        os.makedirs(folder, exist_ok=True)
        save_file(tensors, f"{folder}/{name}.safetensors", metadata={"format": "pt"})
    with open(os.path.join(adapter_out, "adapter_config.json"), "w") as f:
        json.dump(dict(peft_type="LORA", task_type="CAUSAL_LM", r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, bias="none",
                       target_modules=sorted(targets), lora_dropout=0.0, base_model_name_or_path=cfg.path), f, indent=2)


def lora_targets(model, names: dict[str, str]) -> list[str]:
    """The torchtitan linears that model.target_modules names (`names`: HF name -> torchtitan name)."""
    wanted = set(names) if "all-linear" in model.target_modules else set(model.target_modules)
    if unknown := wanted - set(names):
        raise SettingError(f"model.target_modules has {sorted(unknown)}; use all-linear or names of {sorted(names)}")
    if split := {t for hf, t in names.items() if hf in wanted} & {t for hf, t in names.items() if hf not in wanted}:
        sharing = ", ".join(sorted(hf for hf, t in names.items() if t in split))
        raise SettingError(f"model.target_modules: {sharing} are one fused linear in torchtitan; name all or none")
    return sorted({names[hf] for hf in wanted})
