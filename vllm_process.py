"""vLLM with its engine core in processes of its own (`--rollout.name vllm_process`): the scheduler and the GPU worker
run there, so the trainer's Python thread is free while vLLM generates, and the weights travel over CUDA IPC through
vLLM's weight-transfer API (one packed buffer a sync). The one-step off-policy mode needs that freed thread to update
beside the generation (benchmarks/h100_qwen3-0.6b.md); everything else is `rollout.VLLMRollout`."""

import contextlib
import io
import os
import random

import torch

from rollout import VLLMRollout, forget_moe_kernels


class OwnProcessVLLM(VLLMRollout):
    """VLLMRollout whose engine core is a child process of the trainer rank (one engine per rank, on the rank's GPU;
    TP peers train on their first peer's groups); nothing it does touches the trainer's RNG."""

    # IPC handles and the CPU reload function reach the engine's process by pickle
    environment = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}
    uses_rollout_tp = False  # one engine per rank, tensor_parallel_size 1
    generates_beside_the_trainer = True

    def __init__(self, cfg, engine, eos_token_ids=None):
        self.transfer_ready = False  # vLLM's IPC receiver is set up at the first load (the base class syncs once)
        with engine_on_this_ranks_gpu(engine.device):
            super().__init__(cfg, engine, eos_token_ids)
        self.copies_in_place = False  # every sync goes through load() (IPC or bytes), never an in-process copy

    def engine_options(self, on_gpu: bool) -> dict:
        """vLLM's own process group of one, not torchrun's; the IPC weight-transfer backend on a GPU. On CPU (which
        sends the tensors themselves) no chunked prefill: vLLM CPU cannot rewind a seeded request's generator after
        a partial prefill ("CPU Generator does not use offset")."""
        device_options = {"weight_transfer_config": {"backend": "ipc"}} if on_gpu else {"enable_chunked_prefill": False}
        return {"distributed_executor_backend": "mp", **device_options}

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
        """(HF name, tensor) pairs into the engine: one packed buffer over CUDA IPC, or (CPU) as bytes."""
        if self.engine.device_type != "cuda":
            blob = io.BytesIO()
            torch.save(list(weights), blob)
            self.llm.collective_rpc(reload_from_bytes, args=(blob.getvalue(),))
            return
        from torch.multiprocessing.reductions import reduce_tensor

        if not self.transfer_ready:
            self.llm.collective_rpc("init_weight_transfer_engine", args=({"packed": True},))
            self.transfer_ready = True
        buffer, update = pack_weights(weights)
        update["ipc_handles"] = {str(torch.cuda.get_device_properties(buffer.device).uuid): reduce_tensor(buffer)[1]}
        torch.cuda.current_stream().synchronize()  # the buffer is written before the engine reads it
        self.llm.collective_rpc("start_weight_update")
        self.llm.collective_rpc("update_weights", args=(update,))
        self.llm.collective_rpc("finish_weight_update")  # the engine has copied out of the buffer and let it go
        del buffer
        torch.cuda.ipc_collect()


@contextlib.contextmanager
def engine_on_this_ranks_gpu(device: torch.device):
    """While vLLM starts its processes: they see only this rank's GPU (vLLM's single worker takes the first visible
    one). This process's CUDA context is already made, so the variable no longer changes its own devices."""
    if device.type != "cuda":
        yield
        return
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    visible = before.split(",") if before else [str(i) for i in range(torch.cuda.device_count())]
    os.environ["CUDA_VISIBLE_DEVICES"] = visible[device.index]
    try:
        yield
    finally:
        if before is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = before


def pack_weights(weights) -> tuple[torch.Tensor, dict]:
    """(name, tensor) pairs of one dtype (as exported) as one uint8 buffer, plus the layout vLLM's packed weight
    update reads back (it views each slice in place, so mixed dtypes could misalign)."""
    names, tensors = zip(*weights)
    flat = [t.reshape(-1).view(torch.uint8) for t in tensors]
    layout = {"names": list(names), "dtype_names": [str(t.dtype).removeprefix("torch.") for t in tensors],
              "shapes": [list(t.shape) for t in tensors], "tensor_sizes": [f.numel() for f in flat]}
    return torch.cat(flat), layout


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
