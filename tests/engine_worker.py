"""Run under torchrun: build the engine with a given layout, take two optimizer steps on a
fixed packed batch, save loss / grad norm / log-probs / final HF weights (rank 0) for comparison.

    torchrun --nproc_per_node=N tests/engine_worker.py OUT.pt MODEL_DIR [--section.field value ...]
"""

import collections
import contextlib
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from config import parse_cli  # noqa: E402
from engine import IGNORE_INDEX, TorchTitanEngineWithLMHead, full_tensor, pack  # noqa: E402
from torchtitan.components.checkpointer.utils import canonical_fqn  # noqa: E402


ENTROPY_COEF = float(os.environ.get("ENTROPY_COEF", "0.1"))


def fixed_batch(vocab: int, seed: int = 0):
    """Eight sequences of mixed lengths; each DP rank takes its share."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (int(n),), generator=g) for n in torch.randint(5, 30, (8,), generator=g)]


def packed(seqs):
    tokens, positions = pack([s.tolist() for s in seqs])
    labels = torch.cat([torch.cat([s[1:], torch.tensor([IGNORE_INDEX])]) for s in seqs])[None]
    return tokens, positions, labels


def main():
    out, model_dir, extra = sys.argv[1], sys.argv[2], sys.argv[3:]
    cfg = parse_cli(["--model.path", model_dir, "--model.attn_type", "sdpa", "--model.dtype", "float32",
                     "--trainer.device", "cpu", "--data.max_prompt_length", "32", "--data.max_response_length", "32",
                     "--optimizer.lr", "1e-2", "--optimizer.weight_decay", "0.0", "--actor.max_norm", "1e9",
                     "--trainer.output_dir", os.path.join(os.path.dirname(out), "run_" + os.path.basename(out)),
                     *extra])
    engine = TorchTitanEngineWithLMHead(cfg)
    seqs = fixed_batch(engine.trainer.model_config.vocab_size)
    total_tokens = sum(len(s) - 1 for s in seqs)
    mine = seqs[engine.dp_rank::engine.dp_size]
    result = {"loss": [], "grad_norm": []}
    with engine.eval_mode():
        result["initial_logprobs"] = engine.forward(*packed(seqs), temperature=0.9)[0].cpu()
    before = parameters(engine)
    frozen = [p for p in engine.model.parameters() if not p.requires_grad]  # as stored, outside a mode's block
    with engine.train_mode():
        for step in range(2):
            loss_sum = torch.zeros((), device=engine.device)
            for index, micro in enumerate((mine[: len(mine) // 2], mine[len(mine) // 2:])):  # two per rank
                logprobs, entropy = engine.forward(*packed(micro), temperature=0.9, with_entropy=True)
                loss = -(logprobs.sum() + ENTROPY_COEF * entropy.sum()) / total_tokens  # globally normalised
                first = step == index == 0
                with OutputShapes() if first else contextlib.nullcontext() as matmuls:
                    engine.backward(loss)
                loss_sum += loss.detach()
                if first:  # what the backward multiplied; the stored frozen tensors and any gathered copies of them
                    result["backward_matmul_shapes"] = matmuls.shapes
                    now = [p for p in engine.model.parameters() if not p.requires_grad]
                    result["frozen_held_bytes"] = storage_bytes(frozen + now)
            result["loss"].append(engine.dp_all_reduce(loss_sum).item())
            grad_norm, _ = engine.optimizer_step()
            result["grad_norm"].append(grad_norm)
    with engine.eval_mode():
        result["logprobs"] = engine.forward(*packed(seqs), temperature=0.9)[0].cpu()
        result["full_logits"] = engine.full_logits(*packed(seqs)[:2]).float().cpu()
    after = parameters(engine)
    result["changed"] = sorted(name for name in before if not torch.equal(before[name], after[name]))
    masters = {id(p) for group in engine.optimizers.optimizers[0].param_groups for p in group["params"]}
    result["optimized"] = sorted(canonical_fqn(n) for n, p in engine.model.named_parameters() if id(p) in masters)
    result["masters_registered"] = masters <= {id(p) for p in engine.model.parameters()}  # not gathered copies
    result["storage"] = storage(engine)
    result["frozen_stored_bytes"] = storage_bytes(frozen)
    result["shapes"] = {canonical_fqn(n): {tuple(p.shape), tuple(local(p).shape)}  # whole, this rank's
                        for n, p in engine.model.named_parameters()}
    weights = {name: tensor.detach().cpu().clone() for name, tensor in engine.export_hf_weights()}
    if dist.get_rank() == 0:
        result["weights"] = weights
        torch.save(result, out)
    dist.barrier()
    dist.destroy_process_group()


def storage(engine) -> dict:
    """How the model is held: (dtype, requires_grad) of each parameter by name, those FSDP shards, and the bytes of
    the parameters and of the optimizer state by dtype (this rank's shards)."""
    params = {canonical_fqn(n): (str(p.dtype), p.requires_grad) for n, p in engine.model.named_parameters()}
    fsdp_sharded = sorted(canonical_fqn(n) for n, p in engine.model.named_parameters()  # the dim FSDP shards on
                          if isinstance(p, DTensor) and {"fsdp", "dp_shard"} & set(p.device_mesh.mesh_dim_names))
    param_bytes, state_bytes = {}, {}
    for p in engine.model.parameters():
        shard = local(p)
        param_bytes[str(p.dtype)] = param_bytes.get(str(p.dtype), 0) + shard.numel() * shard.element_size()
    for state in engine.optimizers.optimizers[0].state.values():
        for value in state.values():
            shard = local(value)
            if shard.dim():  # the step counters are scalars
                size = shard.numel() * shard.element_size()
                state_bytes[str(shard.dtype)] = state_bytes.get(str(shard.dtype), 0) + size
    return {"params": params, "fsdp_sharded": fsdp_sharded, "param_bytes": param_bytes, "state_bytes": state_bytes}


MATMULS = (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm)


class OutputShapes(TorchDispatchMode):
    """Counts the output shapes of the matmuls (aten packets, any overload) run under it."""

    def __init__(self):
        super().__init__()
        self.shapes = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in MATMULS:
            self.shapes[tuple(out.shape)] += 1
        return out


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (a DTensor's local shard)."""
    storages = {}
    for held in (local(t).untyped_storage() for t in tensors):
        storages[held.data_ptr()] = held.nbytes()
    return sum(storages.values())


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor; any other tensor as it is."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def parameters(engine):
    """Every parameter, whole, by its canonical name."""
    return {canonical_fqn(name): full_tensor(p.detach()).cpu().clone() for name, p in engine.model.named_parameters()}


if __name__ == "__main__":
    main()
