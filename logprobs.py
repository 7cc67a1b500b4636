"""Per-token log-probs and entropy of (TP-sharded) logits, and the gather of CP-sharded tokens: `token_logprobs`
(float32, the gradient in closed form, the vocab split over the TP group) and `GatherOverCP` (packed order)."""

import functools

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard
from torchtitan.distributed.spmd_types import current_spmd_mesh, spmd_mesh_size
from torchtitan.distributed.utils import get_spmd_backend

IGNORE_INDEX = -100  # label of positions that predict nothing (prompt, padding)


class GatherOverCP(torch.autograd.Function):
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


def tp_group_and_vocab(logits):
    """(local logits, TP process group or None, global vocab size)."""
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


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a (possibly sharded) DTensor; a one-rank mesh needs no gather."""
    if not isinstance(tensor, DTensor):
        return tensor
    return tensor.to_local() if tensor.device_mesh.size() == 1 else tensor.full_tensor()
