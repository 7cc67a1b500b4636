"""rollout.py: vLLM log-probs equal the engine's before and after a weight sync; native sampler
greedy equals HF generate; grouping, truncation and finish reasons."""

import multiprocessing
import os
import sys

import pytest
import torch

from conftest import ROOT, SAMPLER_MATCH, TESTS as HERE, free_port, run_torchrun, run_worker
from tiny import make_tiny_qwen3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_qwen3(str(tmp_path_factory.mktemp("rollout")), layers=2, hidden=128, heads=2, kv_heads=1)  # vLLM CPU: head_dim 64


@pytest.mark.parametrize("flags", [[], ["--rollout.enable_prefix_caching", "True"], ["--model.lora_rank", "4"],
                                   ["--rollout.name", "vllm_process"]],
                         ids=["default", "prefix_caching", "lora", "engine_in_its_own_process"])
def test_vllm_logprobs_match_engine_and_weight_sync(model_dir, tmp_path, flags):
    """One process: n responses per prompt, consecutive, ending at EOS or the length limit; log-probs as the engine's
    (with prefix caching, also after a sync on a prompt whose KV block vLLM cached before it; with LoRA, vLLM takes
    the merged weights; with vLLM in processes of its own, the weights sent to it at each sync)."""
    assert_rollout_worker_matches(model_dir, tmp_path, flags, nproc=1)


@pytest.fixture(scope="module")
def tp_model_dir(tmp_path_factory):  # two KV heads: the trainer's TP=2 splits them
    return make_tiny_qwen3(str(tmp_path_factory.mktemp("rollout_tp")), layers=2, hidden=128, heads=2, kv_heads=2)


@pytest.fixture(scope="module")
def moe_model_dir(tmp_path_factory):  # Qwen3-MoE, 4 experts top-2
    return make_tiny_qwen3(str(tmp_path_factory.mktemp("rollout_moe")), layers=2, hidden=128, heads=2, kv_heads=2,
                           moe=True)


@pytest.mark.parametrize("layout", [
    ["--parallelism.data_parallel_shard_degree", "2"],
    ["--parallelism.data_parallel_shard_degree", "1", "--parallelism.tensor_parallel_degree", "2"],
    ["--parallelism.data_parallel_shard_degree", "1", "--parallelism.tensor_parallel_degree", "2",
     "--rollout.tensor_parallel_size", "2"],
    ["--parallelism.data_parallel_shard_degree", "1", "--parallelism.tensor_parallel_degree", "2",
     "--model.lora_rank", "4"],
], ids=["fsdp2", "tp2", "tp2_rollout_tp2", "tp2_lora"])
def test_vllm_on_every_rank_matches_engine_before_and_after_sync(tp_model_dir, tmp_path, layout):
    """torchrun, 2 processes: each rank's vLLM (or one vLLM TP group) samples what the trainer computes."""
    assert_rollout_worker_matches(tp_model_dir, tmp_path, layout)


def test_vllm_moe_matches_engine_before_and_after_sync(moe_model_dir, tmp_path):
    """Qwen3-MoE under FSDP=2 x EP=2: vLLM takes the gathered experts (vLLM CPU needs its MoE kernels reset)."""
    assert_rollout_worker_matches(moe_model_dir, tmp_path, ["--parallelism.data_parallel_shard_degree", "2",
                                                            "--parallelism.expert_parallel_degree", "2"])


def assert_rollout_worker_matches(model_dir, tmp_path, layout, nproc=2):
    pytest.importorskip("vllm")
    out = str(tmp_path / "result.pt")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--master_port", str(free_port()),
           os.path.join(HERE, "rollout_worker.py"), out, model_dir, *layout]
    result = run_torchrun(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT,
                          env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    assert "Traceback" not in result.stderr, result.stderr[-5000:]  # the run ends cleanly, vLLM shut down
    got = torch.load(out)
    assert got["well_formed"]
    assert got["seeded"]  # the same seed draws the same responses, another seed others
    assert got["init"] < SAMPLER_MATCH  # the engine started from dummy weights and took the trainer's
    assert got["stale"] > 1e-2  # a stale sampler is caught
    assert got["synced"] < SAMPLER_MATCH
    assert got["synced_first_only"] < SAMPLER_MATCH  # log-probs asked for the first response of each prompt only
    assert got["export_fits_transfer_buffer"]  # vllm_process sizes its IPC buffer by the largest parameter
    assert got["client_threads_here"] == []  # vllm_process: the client's threads run in vLLM's process, not here


def test_weights_go_to_vllm_in_chunks_through_one_reused_buffer(monkeypatch):
    """vllm_process's GPU sync: vLLM's packed producer (here a CPU stand-in with its contract: one buffer, overwritten
    by the next chunk as soon as the update call for this one returns) carries every tensor bit for bit, each chunk
    inside start/finish_weight_update, in as many chunks as the buffer needs."""
    pytest.importorskip("vllm")
    from vllm.distributed.weight_transfer import packed_tensor

    from vllm_process import send_in_chunks

    def producer(weights, gpu_uuid, post_iter_func, buffer_size_bytes):
        buffer = torch.empty(buffer_size_bytes, dtype=torch.uint8)
        chunk, used = [], 0
        for item in weights:
            flat = post_iter_func(item).contiguous().view(-1).view(torch.uint8)
            if used and used + flat.numel() > buffer_size_bytes:
                yield packed_tensor.PackedIpcChunk(*zip(*chunk), ipc_handle={gpu_uuid: buffer})
                chunk, used = [], 0
            buffer[used:used + flat.numel()] = flat
            chunk.append((item[0], list(item[1].shape), str(item[1].dtype).removeprefix("torch."), flat.numel()))
            used += flat.numel()
        if chunk:
            yield packed_tensor.PackedIpcChunk(*zip(*chunk), ipc_handle={gpu_uuid: buffer})

    class Engine:  # what vLLM's IPC receiver does with a chunk: unpack its part of the buffer and copy it out
        calls, received = [], {}

        def collective_rpc(self, method, args=()):
            self.calls.append(method)
            if method == "update_weights":
                update = args[0]
                content = update["ipc_handles"]["gpu0"][:sum(update["tensor_sizes"])]
                views = packed_tensor.unpack_tensor(content, update["names"], update["shapes"],
                                                    [getattr(torch, d) for d in update["dtype_names"]],
                                                    update["tensor_sizes"])
                self.received.update((name, view.clone()) for name, view in views)

    monkeypatch.setattr(packed_tensor, "packed_ipc_producer", producer)
    weights = [("a.weight", torch.randn(30, 50).bfloat16()), ("b.bias", torch.randn(70).bfloat16()),
               ("c.weight", torch.randn(20, 20, 2).bfloat16().transpose(0, 2)),  # not contiguous
               ("d.weight", torch.randn(40, 40).bfloat16())]
    engine = Engine()
    chunks = send_in_chunks(engine, iter(weights), "gpu0", buffer_bytes=40 * 40 * 2)
    assert chunks == 3  # a + b, c, d: the largest tensor fills the buffer alone
    assert engine.calls == ["start_weight_update"] + ["update_weights"] * 3 + ["finish_weight_update"]
    assert list(engine.received) == [name for name, _ in weights]
    for name, want in weights:
        assert engine.received[name].dtype == want.dtype and torch.equal(engine.received[name], want)


def test_vllm_in_its_own_process_raises_its_errors_here(model_dir, tmp_path):
    """vllm_process: an error in vLLM's process (here: no model where one is named) raises in the trainer's, with
    vLLM's message, and that process ends; a call to a vLLM whose process died says so instead of waiting."""
    pytest.importorskip("vllm")
    from llm_process import LLMInAProcess

    with pytest.raises(RuntimeError, match=r"(?s)vLLM's process: .*missing"):
        LLMInAProcess({"model": str(tmp_path / "missing")})
    assert not any(p.name == "vllm" for p in multiprocessing.active_children())  # ended before the error was raised
    llm = LLMInAProcess(dict(model=model_dir, dtype=torch.float32, load_format="dummy", enforce_eager=True,
                             max_model_len=64, gpu_memory_utilization=0.1))
    llm.reset_prefix_cache()
    llm._process.kill()
    with pytest.raises(RuntimeError, match=r"vLLM's process ended \(exit code -9\)"):
        llm.reset_prefix_cache()


@pytest.mark.parametrize("priority", [None, "0", "1"])
def test_vllm_processes_start_on_this_ranks_gpu_at_normal_mps_priority(monkeypatch, priority):
    """vllm_process starts vLLM's processes seeing this rank's GPU alone; a trainer at below-normal MPS priority
    (1) starts them at normal (0), any other setting passes through; both variables are restored afterwards."""
    from vllm_process import engine_process_environment

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    if priority is None:
        monkeypatch.delenv("CUDA_MPS_CLIENT_PRIORITY", raising=False)
    else:
        monkeypatch.setenv("CUDA_MPS_CLIENT_PRIORITY", priority)
    with engine_process_environment(torch.device("cuda", 1)):
        seen = os.environ["CUDA_VISIBLE_DEVICES"], os.environ.get("CUDA_MPS_CLIENT_PRIORITY")
    assert seen == ("5", {"1": "0"}.get(priority, priority))
    assert (os.environ["CUDA_VISIBLE_DEVICES"], os.environ.get("CUDA_MPS_CLIENT_PRIORITY")) == ("3,5", priority)
    with engine_process_environment(torch.device("cpu")):
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "3,5"  # a CPU run changes nothing
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")  # unset: every GPU is visible; it is unset again afterwards
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with engine_process_environment(torch.device("cuda", 1)):
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "1"
    assert "CUDA_VISIBLE_DEVICES" not in os.environ


def test_native_sampler_greedy_matches_hf_and_its_logprobs_match_engine(model_dir, tmp_path):
    got = run_sampler_worker("native", model_dir, tmp_path)
    assert got["greedy"] == got["hf_greedy"]
    assert got["well_formed"]
    assert got["mismatch"] < 1e-5


@pytest.mark.parametrize("flags", [[], ["--model.lora_rank", "4"]], ids=["full", "lora"])
def test_hf_export_chats_and_serves_in_vllm(model_dir, tmp_path, flags):
    """After a training step, the exported dir keeps the chat template, and vLLM (CPU) greedy-decodes it
    as HF transformers does; with LoRA the merged export does, and so does vLLM's own LoRA path (enable_lora, the
    base model and the PEFT adapter)."""
    pytest.importorskip("vllm")
    got = run_sampler_worker("export", model_dir, tmp_path, *flags)
    assert got["served"] == got["hf"]
    if flags:
        assert got["served_with_adapter"] == got["hf"]


def test_freeze_live_objects_collects_garbage_before_freezing():
    """Frozen objects are skipped by every later collection: garbage cycles must go first, live objects stay."""
    import gc
    import weakref

    from rollout import freeze_live_objects

    class Node:
        pass

    cycle = Node()
    cycle.myself = cycle
    cycle_alive = weakref.ref(cycle)
    del cycle
    live = Node()
    try:
        freeze_live_objects()
        assert cycle_alive() is None, "a garbage cycle was frozen instead of collected"
        assert all(obj is not live for obj in gc.get_objects()), "a live object is still walked by gc.collect()"
    finally:
        gc.unfreeze()


def run_sampler_worker(case, model_dir, tmp_path, *flags):
    out = tmp_path / f"{case}.pt"
    return run_worker("sampler_worker.py", out, case, out, model_dir, *flags,
                      env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"})


def test_copy_into_weights_refuses_to_leave_a_parameter_unset():
    """The in-place copy (dense models on a GPU) raises when the trainer's weights miss a vLLM parameter."""
    from types import SimpleNamespace

    from rollout import copy_into_weights

    class Model(torch.nn.Linear):
        def load_weights(self, weights):
            return {"weight"}  # what vLLM's loader reports it set

    worker = SimpleNamespace(model_runner=SimpleNamespace(get_model=lambda: Model(2, 2)))
    with pytest.raises(RuntimeError, match="unset: \\['bias'\\]"):
        copy_into_weights(worker, [])
