"""rollout.py: vLLM log-probs equal the engine's before and after a weight sync; native sampler
greedy equals HF generate; grouping, truncation and finish reasons."""

import os
import sys

import pytest
import torch

from conftest import ROOT, TESTS as HERE, free_port, run_torchrun, run_worker
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
    the merged weights; with vLLM's engine core in its own process, the weights sent to it at each sync)."""
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
    assert got["init"] < 1e-4  # the engine started from dummy weights and took the trainer's
    assert got["stale"] > 1e-2  # a stale sampler is caught
    assert got["synced"] < 1e-4
    assert got["synced_first_only"] < 1e-4  # log-probs asked for the first response of each prompt only


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_packed_weights_read_back_by_vllms_unpacker(dtype):
    """vllm_process's one-buffer weight update: vLLM's own reader gives back every tensor, bit for bit."""
    pytest.importorskip("vllm")
    from vllm.distributed.weight_transfer.packed_tensor import unpack_tensor

    from vllm_process import pack_weights

    weights = [("a.weight", torch.randn(3, 5)), ("b.bias", torch.randn(7)),
               ("c.weight", torch.randn(2, 2, 2).transpose(0, 2))]  # not contiguous
    weights = [(name, tensor.to(dtype)) for name, tensor in weights]
    buffer, layout = pack_weights(weights)
    got = unpack_tensor(buffer, layout["names"], layout["shapes"], [getattr(torch, d) for d in layout["dtype_names"]],
                        layout["tensor_sizes"])
    assert [name for name, _ in got] == [name for name, _ in weights]
    for (_, want), (_, tensor) in zip(weights, got):
        assert tensor.dtype == want.dtype and torch.equal(tensor, want)


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
