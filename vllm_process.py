"""vLLM in processes of its own (`--rollout.name vllm_process`): its LLM, client included, in a child process of the
trainer rank and its engine core (scheduler, GPU worker) in another, so that none of the generation's host work
holds the trainer's interpreter lock; the weights travel over CUDA IPC through vLLM's weight-transfer API (packed
chunks through one reused buffer). The one-step off-policy mode needs that to update beside the generation
(benchmarks/h100_qwen3-0.6b.md); everything else is `rollout.VLLMRollout`."""

import contextlib
import io
import os
import random

import torch

from llm_process import LLMInAProcess
from rollout import VLLMRollout, forget_moe_kernels


class OwnProcessVLLM(VLLMRollout):
    """VLLMRollout whose vLLM runs in child processes of the trainer rank (one engine per rank, on the rank's GPU;
    TP peers train on their first peer's groups); nothing it does touches the trainer's RNG."""

    # IPC handles and the CPU reload function reach the engine's process by pickle
    environment = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}
    uses_rollout_tp = False  # one engine per rank, tensor_parallel_size 1
    generates_beside_the_trainer = True

    def __init__(self, cfg, engine, eos_token_ids=None):
        self.transfer_ready = False  # vLLM's IPC receiver is set up at the first load (the base class syncs once)
        super().__init__(cfg, engine, eos_token_ids)
        self.copies_in_place = False  # every sync goes through load() (IPC or bytes), never an in-process copy

    def build_llm(self, llm_class, options: dict, on_gpu: bool):
        """vLLM's LLM in a child process (`LLMInAProcess`), with vLLM's own process group of one, not torchrun's; the
        IPC weight-transfer backend on a GPU. On CPU (which sends the tensors themselves) no chunked prefill: vLLM CPU
        cannot rewind a seeded request's generator after a partial prefill ("CPU Generator does not use offset")."""
        device_options = {"weight_transfer_config": {"backend": "ipc"}} if on_gpu else {"enable_chunked_prefill": False}
        with engine_process_environment(self.engine.device):
            return LLMInAProcess({**options, "distributed_executor_backend": "mp", **device_options})

    @contextlib.contextmanager
    def seeded(self, seed: int):
        """Nothing to seed here: each request carries its own seed (request_params)."""
        yield

    def request_params(self, params: list, seed: int) -> list:
        """A seed per request, drawn from `seed`: the engine's process may start a batch before every request of the
        call arrived, so a seed for the whole call would not draw the same twice (vLLM seeds response k of a
        request with its seed + k)."""
        seeds = random.Random(seed)
        return [p if p.temperature == 0 else clone(p, seed=seeds.getrandbits(62)) for p in params]

    def load(self, weights) -> None:
        """(HF name, tensor) pairs into the engine: over CUDA IPC in chunks, or (CPU) as bytes."""
        if self.engine.device_type != "cuda":
            blob = io.BytesIO()
            torch.save(list(weights), blob)
            self.llm.collective_rpc(reload_from_bytes, args=(blob.getvalue(),))
            return
        if not self.transfer_ready:
            self.llm.collective_rpc("init_weight_transfer_engine", args=({"packed": True},))
            self.transfer_ready = True
        from vllm.distributed.weight_transfer.packed_tensor import DEFAULT_PACKED_BUFFER_SIZE_BYTES

        buffer_bytes = max(DEFAULT_PACKED_BUFFER_SIZE_BYTES, largest_parameter_bytes(self.engine.model, self.dtype))
        send_in_chunks(self.llm, weights, str(torch.cuda.get_device_properties(self.engine.device).uuid), buffer_bytes)
        torch.cuda.ipc_collect()  # the engine let the buffer go at finish_weight_update


@contextlib.contextmanager
def engine_process_environment(device: torch.device):
    """While vLLM starts its processes: they see only this rank's GPU (vLLM's single worker takes the first visible
    one); under CUDA MPS, a trainer started at below-normal priority (CUDA_MPS_CLIENT_PRIORITY=1) starts them at
    normal, so that generation, the off-policy step's longer side, goes first. This process's CUDA context is
    already made: the variables no longer change it."""
    if device.type != "cuda":
        yield
        return
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    visible = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
    changes = {"CUDA_VISIBLE_DEVICES": visible[device.index]}
    if os.environ.get("CUDA_MPS_CLIENT_PRIORITY") == "1":
        changes["CUDA_MPS_CLIENT_PRIORITY"] = "0"
    before = {name: os.environ.get(name) for name in changes}
    os.environ.update(changes)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                del os.environ[name]
            else:
                os.environ[name] = value


def send_in_chunks(llm, weights, gpu_uuid: str, buffer_bytes: int) -> int:
    """vLLM's packed IPC transfer: its producer copies the tensors into one buffer of `buffer_bytes`, shared once over
    CUDA IPC, and yields a chunk whenever the next tensor would not fit; each update_weights call returns after the
    engine copied its chunk out, so the producer may overwrite the buffer. Beside the weights the trainer holds one
    buffer, not a copy of the model (nor does the engine); the number of chunks."""
    from vllm.distributed.weight_transfer import packed_tensor

    llm.collective_rpc("start_weight_update")
    chunks = packed_tensor.packed_ipc_producer(weights, gpu_uuid, post_iter_func=lambda item: item[1],
                                               buffer_size_bytes=buffer_bytes)
    sent = 0
    for chunk in chunks:
        update = {"names": chunk.names, "dtype_names": chunk.dtype_names, "shapes": chunk.shapes,
                  "tensor_sizes": chunk.tensor_sizes, "ipc_handles": chunk.ipc_handle}
        llm.collective_rpc("update_weights", args=(update,))
        sent += 1
    llm.collective_rpc("finish_weight_update")  # the engine releases its mapping of the buffer
    return sent


def largest_parameter_bytes(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """Bytes of the trainer's largest parameter in `dtype`: an HF tensor is a parameter or a piece of one (experts
    stacked in one parameter are exported one by one), so every exported tensor fits in this many."""
    return max(p.numel() for p in model.parameters()) * dtype.itemsize


def reload_from_bytes(worker, blob: bytes) -> None:
    """vLLM's reload from torch.save'd (name, tensor) pairs (run in the engine's process; the CPU sync)."""
    forget_moe_kernels(worker)
    worker.reload_weights(weights_iterator=iter(torch.load(io.BytesIO(blob))), is_checkpoint_format=True)


def clone(params, **changes):
    """A copy of SamplingParams with some fields changed."""
    copy = params.clone()
    for name, value in changes.items():
        setattr(copy, name, value)
    return copy


SAMPLER = OwnProcessVLLM  # what rollout.name=vllm_process builds (plugins.SAMPLERS)
