"""engine.py: HF-logit parity, parallel layouts vs one process, checkpoint round trip, bad input.

Multi-process runs use torchrun with gloo on CPU (tests/engine_worker.py), under both SPMD
backends: partial_dtensor in this env (torch 2.13) and spmd_types in the torch 2.14.1 env
named by TITAN_GRPO_SPMD_PYTHON (tests/run.sh builds it). Tolerances: float32 log-probs vs
HF 1e-5; layouts vs one process: loss/grad-norm rtol 1e-5, weights after two lr=1e-2 Adam
steps atol 5e-4 (reduction order differs between layouts).
"""

import json
import os
import sys

import pytest
import torch

from conftest import TESTS as HERE, free_port, run_torchrun, run_worker
from tiny import make_tiny_qwen3


BACKEND_PYTHON = {"partial_dtensor": sys.executable, "spmd_types": os.environ.get("TITAN_GRPO_SPMD_PYTHON")}


def backend_python(backend):
    python = BACKEND_PYTHON[backend]
    if python is None:
        pytest.skip("spmd_types needs torch >= 2.14: set TITAN_GRPO_SPMD_PYTHON (tests/run.sh does)")
    return python


def torchrun(nproc, out, model_dir, *flags, env=None, backend="partial_dtensor"):
    cmd = [backend_python(backend), "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--master_port",
           str(free_port()), os.path.join(HERE, "engine_worker.py"), str(out), model_dir,
           "--parallelism.spmd_backend", backend, *flags]
    run_torchrun(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})}, timeout=900)
    return torch.load(out)


@pytest.mark.parametrize("attn,tp,cp,multiple", [
    ("sdpa", 1, 1, 1), ("sdpa", 2, 1, 2), ("varlen", 2, 1, 2), ("sdpa", 1, 2, 512),
    ("flex", 1, 1, 128), ("flex", 2, 1, 256), ("flex", 2, 2, 1024), ("flex_flash", 1, 1, 128),
])
def test_packed_micro_batches_are_padded_to_what_sharding_and_flex_need(attn, tp, cp, multiple):
    """SP splits by TP, CP by 2 x CP 128-token blocks, and Flex gets whole 128-token blocks (a shorter query, such
    as a 2-token DP padding micro-batch, would take Inductor's flex decoding kernel); the padding is its own
    document whose labels are ignored."""
    from types import SimpleNamespace

    from config import Config
    from engine import IGNORE_INDEX, TorchTitanEngineWithLMHead, pack, packed_length_multiple

    cfg = Config()
    cfg.model.attn_type, cfg.parallelism.tensor_parallel_degree, cfg.parallelism.context_parallel_degree = attn, tp, cp
    assert packed_length_multiple(cfg) == multiple
    tokens, positions = pack([[5] * 90, [7] * 40])
    labels = torch.arange(130)[None]
    padded = TorchTitanEngineWithLMHead._pad_to_packed_length(SimpleNamespace(cfg=cfg), tokens, positions, labels)
    length = -(-130 // multiple) * multiple
    assert [t.shape[1] for t in padded] == [length] * 3
    assert torch.equal(padded[1][0, 130:], torch.arange(length - 130)) and (padded[2][0, 130:] == IGNORE_INDEX).all()
    assert torch.equal(padded[2][0, :130], labels[0])


def test_varlen_runs_without_the_flash_package_torchtitan_switches_to(monkeypatch, dense_dir):
    """On a Hopper GPU (faked) without FA3 installed, torchtitan's varlen module fails to build; the project's
    keeps torch's built-in FlashAttention-2. (Its parity with the dense-mask reference was checked on a GPU: benchmarks/.)"""
    import torchtitan.tools.utils
    from torch.nn.attention import current_flash_attention_impl
    from torchtitan.models.common.attention import VarlenAttention

    import qwen3

    assert not qwen3.importable("flash_attn_interface")
    monkeypatch.setattr(torchtitan.tools.utils, "get_cuda_flash_attention_impl", lambda: "FA3")
    monkeypatch.setattr(qwen3, "get_cuda_flash_attention_impl", lambda: "FA3")
    qwen3.use_installed_flash.cache_clear()
    with pytest.raises(ModuleNotFoundError, match="flash_attn_interface"):
        VarlenAttention(VarlenAttention.Config())
    with open(os.path.join(dense_dir, "config.json")) as f:
        model = qwen3.qwen3_model_config(json.load(f), "varlen")
    inner = [cfg for _, cfg, _, _ in model.traverse(VarlenAttention.Config)]
    assert len(inner) == 2 and all(type(cfg) is qwen3.VarlenOnInstalledFlash.Config for cfg in inner)
    inner[0].build()
    assert current_flash_attention_impl() is None


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory):
    return make_tiny_qwen3(str(tmp_path_factory.mktemp("dense")), layers=2, tie=True)


@pytest.fixture(scope="module", params=list(BACKEND_PYTHON))
def backend(request):
    return request.param


@pytest.fixture(scope="module")
def reference(dense_dir, backend, tmp_path_factory):
    return torchrun(1, tmp_path_factory.mktemp("ref") / f"one_{backend}.pt", dense_dir, backend=backend)


def test_logprobs_match_hf_transformers(dense_dir, tmp_path):
    """Packed micro-batch log-probs and entropy equal HF's per-sequence ones (untied model too)."""
    untied = make_tiny_qwen3(str(tmp_path / "untied"), tie=False, seed=1)
    for path in (dense_dir, untied):
        got = checkpoint_worker("parity", tmp_path / "parity.pt", path)
        assert torch.allclose(got["logprobs"], got["hf_logprobs"], atol=1e-5), (got["logprobs"] - got["hf_logprobs"]).abs().max()
        assert torch.allclose(got["entropy"], got["hf_entropy"], atol=1e-5)


def checkpoint_worker(case, out, *args):
    """tests/checkpoint_worker.py CASE OUT ARGS in a fresh process; what it saved."""
    return run_worker("checkpoint_worker.py", out, case, out, *args)


LAYOUTS = {
    "fsdp2": (2, ["--parallelism.data_parallel_shard_degree", "2"]),
    "tp2": (2, ["--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1"]),
    "hsdp2x1": (2, ["--parallelism.data_parallel_replicate_degree", "2",
                    "--parallelism.data_parallel_shard_degree", "1"]),
    "fsdp2_tp2": (4, ["--parallelism.data_parallel_shard_degree", "2", "--parallelism.tensor_parallel_degree", "2"]),
    "cp2": (2, ["--parallelism.context_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1"]),
    "fsdp2_cp2": (4, ["--parallelism.data_parallel_shard_degree", "2", "--parallelism.context_parallel_degree", "2"]),
    "tp2_cp2": (4, ["--parallelism.data_parallel_shard_degree", "1", "--parallelism.tensor_parallel_degree", "2",
                    "--parallelism.context_parallel_degree", "2"]),
}


@pytest.mark.parametrize("compiled", [False, True])
def test_token_logprobs_gradient_matches_float64_autograd(compiled):
    """The closed-form log-prob/entropy backward equals autograd through a float64 log-softmax."""
    from logprobs import IGNORE_INDEX, token_logprobs

    torch.manual_seed(0)
    rows, vocab, temperature = 13, 37, 0.7
    logits = (3 * torch.randn(rows, vocab)).requires_grad_()
    labels = torch.randint(0, vocab, (rows,))
    labels[[0, 5]] = IGNORE_INDEX
    grad_logprobs, grad_entropy = torch.randn(rows), torch.randn(rows)

    logprobs, entropy = token_logprobs(logits[None], labels[None], None, vocab, temperature, True,
                                       chunk_tokens=4, compile_=compiled)
    (logprobs * grad_logprobs + entropy * grad_entropy).sum().backward()

    ref_logits = logits.detach().double().requires_grad_()
    logp = torch.log_softmax(ref_logits / temperature, dim=-1)
    ref_logprobs = logp.gather(-1, labels.clamp(min=0)[:, None])[:, 0].masked_fill(labels == IGNORE_INDEX, 0.0)
    ref_entropy = -(logp.exp() * logp).sum(-1)
    (ref_logprobs * grad_logprobs + ref_entropy * grad_entropy).sum().backward()
    torch.testing.assert_close(logprobs.double(), ref_logprobs, rtol=0, atol=1e-5)
    torch.testing.assert_close(entropy.double(), ref_entropy, rtol=0, atol=1e-5)
    torch.testing.assert_close(logits.grad.double(), ref_logits.grad, rtol=0, atol=1e-5)


@pytest.mark.parametrize("compiled", [False, True])
def test_token_logprobs_never_hold_full_fp32_logits(compiled):
    """No allocation reaches [tokens, vocab] float32: eager works in row chunks, compiled in fused kernels."""
    from torch.profiler import ProfilerActivity, profile

    from logprobs import token_logprobs

    rows, vocab, chunk = 512, 3001, 128
    logits = torch.randn(1, rows, vocab, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, vocab, (1, rows))

    def step():
        logprobs, entropy = token_logprobs(logits, labels, None, vocab, 0.9, True, chunk, compiled)
        (logprobs.sum() + entropy.sum()).backward()

    step()  # compile outside the profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    largest = max(e.cpu_memory_usage for e in prof.events())
    assert largest == rows * vocab * 2  # the bf16 logits gradient, nothing larger


@pytest.mark.parametrize("layout", list(LAYOUTS) + ["tp2_no_sp"])
def test_parallel_layout_matches_one_process(layout, backend, dense_dir, reference, tmp_path):
    nproc, flags = LAYOUTS.get(layout) or (2, LAYOUTS["tp2"][1] + ["--parallelism.enable_sequence_parallel", "False"])
    got = torchrun(nproc, tmp_path / f"{layout}.pt", dense_dir, *flags, backend=backend)
    assert got["loss"] == pytest.approx(reference["loss"], rel=1e-5)
    assert got["grad_norm"] == pytest.approx(reference["grad_norm"], rel=1e-5)
    assert torch.allclose(got["logprobs"], reference["logprobs"], atol=1e-4)
    assert torch.allclose(got["full_logits"], reference["full_logits"], atol=1e-3)  # native sampler's input
    assert set(got["weights"]) == set(reference["weights"])
    for name, tensor in reference["weights"].items():
        assert torch.allclose(got["weights"][name], tensor, atol=5e-4), name
    assert "lm_head.weight" in got["weights"]  # tied head exported for vLLM


def test_fused_adamw_default_matches_torch_for_loop_adamw(backend, dense_dir, reference, tmp_path):
    """optimizer.implementation=fused (the default) steps the DTensor masters as torch's plain AdamW does."""
    got = torchrun(1, tmp_path / "for_loop.pt", dense_dir, "--optimizer.implementation", "for-loop", backend=backend)
    assert got["loss"] == pytest.approx(reference["loss"], rel=1e-6)
    for name, tensor in reference["weights"].items():
        assert torch.allclose(got["weights"][name], tensor, atol=1e-5), name  # fused rounds differently: ~1e-6


def test_spmd_backends_agree_in_one_process(dense_dir, tmp_path):
    """spmd_types (torch 2.14.1) gives the partial_dtensor run's losses, grad norms and weights."""
    runs = [torchrun(1, tmp_path / f"{b}.pt", dense_dir, backend=b) for b in BACKEND_PYTHON]
    assert runs[1]["loss"] == pytest.approx(runs[0]["loss"], rel=1e-5)
    assert runs[1]["grad_norm"] == pytest.approx(runs[0]["grad_norm"], rel=1e-5)
    assert torch.allclose(runs[1]["logprobs"], runs[0]["logprobs"], atol=1e-4)


def test_modes_end_with_the_sharded_masters_registered(reference):
    """One process keeps FSDP's gathered params through a block of forwards; after the block the model holds
    the optimizer's parameters again (an export or checkpoint reads them, the next block gathers fresh ones)."""
    assert reference["masters_registered"]


def hf_logprobs_with(model_dir, weights, checkpoint_dir, temperature=0.9):
    """Log-probs of engine_worker's fixed batch (packed order, 0 at each sequence end) by HF transformers
    (float32) loading `weights` as a checkpoint (transformers 5 fuses the experts on load)."""
    import shutil

    from checkpoint_worker import hf_logprobs
    from engine_worker import fixed_batch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    shutil.copytree(model_dir, checkpoint_dir, ignore=shutil.ignore_patterns("*.safetensors"))
    save_file({name: tensor.contiguous() for name, tensor in weights.items()}, f"{checkpoint_dir}/model.safetensors")
    hf = AutoModelForCausalLM.from_pretrained(checkpoint_dir, dtype=torch.float32)
    return hf_logprobs(hf, fixed_batch(hf.config.vocab_size), temperature)[0]


def test_moe_matches_hf_after_optimizer_steps_with_and_without_expert_parallel(tmp_path):
    """Tiny Qwen3-MoE, one process and EP=2 (x FSDP=2): first step equal; after two optimizer steps the
    engine's log-probs equal HF's (float32, < 1e-4) holding the exported weights: experts compute in float32
    and routing carries no load-balancing bias that the export would drop."""
    moe = make_tiny_qwen3(str(tmp_path / "moe"), moe=True, tie=False)
    one = torchrun(1, tmp_path / "moe1.pt", moe)
    ep = torchrun(2, tmp_path / "moe_ep2.pt", moe, "--parallelism.expert_parallel_degree", "2",
                  "--parallelism.data_parallel_shard_degree", "2")
    assert ep["loss"][0] == pytest.approx(one["loss"][0], rel=1e-5)
    assert ep["grad_norm"][0] == pytest.approx(one["grad_norm"][0], rel=1e-4)
    assert any(".mlp.experts.3.down_proj.weight" in k for k in ep["weights"])
    for name, run in (("one", one), ("ep", ep)):
        want = hf_logprobs_with(moe, run["weights"], tmp_path / f"hf_{name}")
        assert (run["logprobs"] - want).abs().max() < 1e-4


def test_checkpoint_resume_and_hf_export(dense_dir, tmp_path):
    """Save at step 1, a new process loads it: next-step loss equal; HF export loads in transformers."""
    out = tmp_path / "ckpt_run"
    first = checkpoint_worker("first", tmp_path / "first.pt", dense_dir, out)
    assert os.path.isdir(out / "checkpoint" / "step-1") and first["losses"][0] != first["losses"][1]
    resumed = checkpoint_worker("resume", tmp_path / "resumed.pt", dense_dir, out)
    assert resumed["loaded_step"] == 1
    assert resumed["loss"] == pytest.approx(first["losses"][1], rel=1e-6)
    hf = checkpoint_worker("hf", tmp_path / "hf.pt", first["export"])
    assert torch.allclose(hf["logprobs"], first["final"], atol=1e-5)


LORA = ["--model.lora_rank", "4", "--model.lora_alpha", "8"]


@pytest.fixture(scope="module")
def lora_reference(dense_dir, backend, tmp_path_factory):
    return torchrun(1, tmp_path_factory.mktemp("lora") / f"one_{backend}.pt", dense_dir, *LORA, backend=backend)


def test_lora_starts_as_the_base_model_and_trains_only_its_adapters(reference, lora_reference):
    """B = 0 at initialisation: the base model's log-probs exactly; the optimizer holds the adapters (A and B of
    every linear but lm_head: 2 layers x 5), and after two steps they alone changed."""
    assert (lora_reference["initial_logprobs"] - reference["initial_logprobs"]).abs().max() < 1e-6
    optimized = lora_reference["optimized"]
    assert len(optimized) == 20 and all(name.endswith((".lora_a.weight", ".lora_b.weight")) for name in optimized)
    assert lora_reference["changed"] == optimized
    assert lora_reference["loss"][1] < lora_reference["loss"][0]


@pytest.mark.parametrize("layout", ["fsdp2", "tp2", "fsdp2_tp2"])
def test_lora_parallel_layout_matches_one_process(layout, backend, dense_dir, lora_reference, tmp_path):
    nproc, flags = LAYOUTS[layout]
    got = torchrun(nproc, tmp_path / f"{layout}.pt", dense_dir, *flags, *LORA, backend=backend)
    assert got["loss"] == pytest.approx(lora_reference["loss"], rel=1e-5)
    assert got["grad_norm"] == pytest.approx(lora_reference["grad_norm"], rel=1e-5)
    assert got["changed"] == lora_reference["changed"]
    for name, tensor in lora_reference["weights"].items():  # merged
        assert torch.allclose(got["weights"][name], tensor, atol=5e-4), name


def test_lora_merged_weights_are_what_the_engine_computes(dense_dir, lora_reference, tmp_path):
    """HF transformers holding the exported merged weights (W + alpha / rank x B A; B's rows of the fused q/k/v
    linear split as the base weight's) gives the engine's log-probs after two steps."""
    want = hf_logprobs_with(dense_dir, lora_reference["weights"], tmp_path / "hf")
    assert (lora_reference["logprobs"] - want).abs().max() < 1e-5


def test_lora_checkpoint_resume_and_exports(dense_dir, tmp_path):
    """LoRA: the checkpoint holds adapters and their optimizer state (the resumed step's loss equal); the merged HF
    export and the PEFT adapter on the base model (peft's PeftModel) both give the engine's log-probs."""
    out = tmp_path / "ckpt_run"
    first = checkpoint_worker("first", tmp_path / "first.pt", dense_dir, out, *LORA)
    resumed = checkpoint_worker("resume", tmp_path / "resumed.pt", dense_dir, out, *LORA)
    assert resumed["loaded_step"] == 1 and first["losses"][0] != first["losses"][1]
    assert resumed["loss"] == pytest.approx(first["losses"][1], rel=1e-6)
    merged = checkpoint_worker("hf", tmp_path / "hf.pt", first["export"])
    assert torch.allclose(merged["logprobs"], first["final"], atol=1e-5)
    adapter = out / "lora" / "step-2"
    with open(adapter / "adapter_config.json") as f:
        assert json.load(f)["target_modules"] == sorted(
            ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    peft = checkpoint_worker("peft", tmp_path / "peft.pt", dense_dir, adapter)
    assert torch.allclose(peft["logprobs"], first["final"], atol=1e-5)


@pytest.mark.parametrize("layout", ["one_process", "fsdp2", "tp2"])
def test_lora_stores_the_frozen_base_in_the_compute_dtype(layout, backend, dense_dir, tmp_path):
    """model.dtype=bfloat16 with LoRA: every base parameter is bfloat16 and frozen (2 bytes a parameter, no float32
    master), the adapters alone are float32 and trainable, and the optimizer state is AdamW's two float32 moments of
    the adapters and nothing else. During the update the base is held once: no gathered copy beside it, and its
    backward computes no weight gradient of the base. On one GPU FSDP (whose gather is a copy there, per parameter,
    layer, micro-batch and pass) shards the adapters alone; with two ranks, everything."""
    nproc, flags = (1, []) if layout == "one_process" else LAYOUTS[layout]
    run = torchrun(nproc, tmp_path / f"{layout}.pt", dense_dir, *flags, *LORA, "--model.dtype", "bfloat16",
                   backend=backend)
    got = run["storage"]
    adapters = {name for name in got["params"] if ".lora_a." in name or ".lora_b." in name}
    assert len(adapters) == 20
    for name, (dtype, trainable) in got["params"].items():
        assert (dtype, trainable) == (("torch.float32", True) if name in adapters else ("torch.bfloat16", False)), name
    assert set(got["param_bytes"]) == {"torch.bfloat16", "torch.float32"}
    assert got["fsdp_sharded"] == sorted(adapters if layout == "one_process" else got["params"])
    assert got["state_bytes"] == {"torch.float32": 2 * got["param_bytes"]["torch.float32"]}
    assert run["frozen_held_bytes"] == run["frozen_stored_bytes"] >= got["param_bytes"]["torch.bfloat16"]
    matmuls, shapes = set(run["backward_matmul_shapes"]), run["shapes"]  # a parameter's: whole and this rank's
    frozen = {shape for name in got["params"] if name not in adapters for shape in shapes[name] if len(shape) == 2}
    assert not frozen & matmuls  # no weight gradient of the frozen base is computed
    assert all(shapes[name] & matmuls for name in adapters)  # the adapters' are


class LoRALinearLike(torch.nn.Linear):
    """A frozen linear plus adapters under torchtitan's LoRALinear names, in its forward (W x + scale B A x)."""

    def __init__(self, inputs: int, outputs: int, rank: int = 8):
        super().__init__(inputs, outputs, bias=False)
        self.weight.requires_grad_(False)
        self.lora_a = torch.nn.Linear(inputs, rank, bias=False)
        self.lora_b = torch.nn.Linear(rank, outputs, bias=False)
        torch.nn.init.normal_(self.lora_b.weight)  # B = 0 would hide a wrong gradient of A
        self._lora_scaling = 2.0

    def forward(self, x):
        return super().forward(x) + self._lora_scaling * self.lora_b(self.lora_a(x))


class BlockLike(torch.nn.Module):
    """A transformer block's five matmuls (fused QKV, output, gate, up, down), in their order; with `router`, an MoE
    router's gate (a linear named moe.router.gate, never adapted) before the feed-forward."""

    def __init__(self, linear, router: bool = False):
        super().__init__()
        self.wqkv, self.wo, self.w1, self.w3, self.w2 = linear(64, 96), linear(64, 64), linear(64, 160), \
            linear(64, 160), linear(160, 64)
        if router:
            self.moe = torch.nn.Module()
            self.moe.router = torch.nn.Module()
            self.moe.router.gate = torch.nn.Linear(64, 4, bias=False)

    def forward(self, x):
        x = x + self.wo(torch.relu(self.wqkv(x))[..., :64])
        if hasattr(self, "moe"):
            x = x * self.moe.router.gate(x).softmax(-1)[..., :1]
        return x + self.w2(self.w1(x) * self.w3(x))


def saved_matmul_bytes(block, ac_config) -> dict[str, int]:
    """Bytes of the matmul outputs selective AC keeps for the backward in one forward of `block`: [tokens, out]
    ("out") and rank-sized ("rank", 8 columns)."""
    import torchtitan.distributed.activation_checkpoint as titan_ac
    from torch.utils.checkpoint import CheckpointPolicy

    import lora

    saved, original = {"out": 0, "rank": 0}, titan_ac.create_selective_checkpoint_contexts

    def counting(policy_fn, *args, **kwargs):
        def policy(ctx, func, *op_args, **op_kwargs):
            decision = policy_fn(ctx, func, *op_args, **op_kwargs)
            if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default) and not ctx.is_recompute \
                    and decision == CheckpointPolicy.MUST_SAVE:
                rows, columns = op_args[-2].shape[0], op_args[-1].shape[1]
                saved["rank" if columns == 8 else "out"] += rows * columns * op_args[-1].element_size()
            return decision
        return original(policy, *args, **kwargs)

    titan_ac.create_selective_checkpoint_contexts = lora.create_selective_checkpoint_contexts = counting
    try:
        wrapped = ac_config.build()._wrap_block(block)
        wrapped(torch.randn(128, 64, requires_grad=True)).sum().backward()
    finally:
        titan_ac.create_selective_checkpoint_contexts = lora.create_selective_checkpoint_contexts = original
    return saved


def engine_ac_config(dense_dir, *flags):
    """The activation-checkpointing config the engine gives torchtitan."""
    from config import parse_cli
    from engine import trainer_config

    cfg = parse_cli(["--model.path", dense_dir, "--activation_checkpoint.mode", "selective", *flags])
    return trainer_config(cfg, dense_dir, 1).activation_checkpoint


@pytest.mark.parametrize("router", [False, True])
@pytest.mark.parametrize("compiling", [False, True])
def test_selective_ac_keeps_the_matmul_outputs_of_the_block_without_lora(dense_dir, compiling, router, monkeypatch):
    """Selective AC as the engine configures it: a block whose linears carry LoRA adapters (the engine's forward:
    one addmm adds the adapter) keeps the [tokens, out] matmul-output bytes of the same block without them, plus
    every A x (rank-sized, never recomputed), in eager and as traced for torch.compile; an MoE router's gate is
    recomputed and not counted, as torchtitan's selective AC does. torchtitan's default on its own LoRA forward keeps
    about twice as many (the adapters' matmuls, counted, shift its every-other-matmul rule onto their B outputs)."""
    from torchtitan.distributed.activation_checkpoint import SelectiveAC

    from lora import addmm_lora

    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: compiling)  # the policy's decisions under compile
    full = saved_matmul_bytes(BlockLike(lambda i, o: torch.nn.Linear(i, o, bias=False), router),
                              engine_ac_config(dense_dir))
    with_lora = saved_matmul_bytes(BlockLike(addmm_lora(LoRALinearLike), router),
                                   engine_ac_config(dense_dir, "--model.lora_rank", "8"))
    titan_default = saved_matmul_bytes(BlockLike(LoRALinearLike), SelectiveAC.Config())
    assert with_lora == {"out": full["out"], "rank": 5 * 128 * 8 * 4} and full["out"] > 0
    assert titan_default["out"] > 1.9 * full["out"]


def test_lora_linear_backward_is_matmuls_that_apply_the_scale():
    """The adapted linear's backward is five matmuls (x's gradient through W and through the adapter, A's, B's, and
    A x's) with the LoRA scale applied by the matmuls themselves (alpha): no kernel of its own scales a tensor."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from lora import addmm_lora

    class RecordOps(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    linear, ops = addmm_lora(LoRALinearLike)(64, 96), []
    x = torch.randn(2, 8, 64, requires_grad=True)
    out = linear(x)
    with RecordOps():
        out.backward(torch.randn_like(out))
    assert sorted(op for op in ops if op in ("mm", "addmm")) == ["addmm"] * 3 + ["mm"] * 2
    assert not [op for op in ops if op.startswith("mul") or op.startswith("div")], ops


@pytest.mark.parametrize("backend", [None, "inductor"])
def test_lora_forward_under_selective_ac_gives_torchtitans_values(backend):
    """The engine's LoRA forward (A x, x W^T, one addmm) under its selective AC, eager and compiled by Inductor,
    gives torchtitan's LoRA forward's output and adapter gradients without AC."""
    from lora import AdapterSelectiveAC, addmm_lora

    torch.manual_seed(0)
    reference = BlockLike(LoRALinearLike)
    block = BlockLike(addmm_lora(LoRALinearLike))
    block.load_state_dict(reference.state_dict())
    wrapped = AdapterSelectiveAC.Config().build()._wrap_block(block)
    if backend:
        wrapped = torch.compile(wrapped, backend=backend, fullgraph=True)
    x = torch.randn(2, 64, 64)
    got, want = wrapped(x), reference(x)
    (got * want.detach()).sum().backward()
    (want * want.detach()).sum().backward()
    assert torch.allclose(got, want, atol=1e-5)
    for (name, mine), theirs in zip(block.named_parameters(), reference.parameters()):
        assert (mine.grad is None) == (theirs.grad is None), name
        assert mine.grad is None or torch.allclose(mine.grad, theirs.grad, rtol=1e-4, atol=1e-4), name


def test_cpu_block_masks_hold_every_block_and_attend_as_create_block_mask():
    """cpu.all_blocks_mask, the CPU's BlockMasks (built without torchtitan's compiled search for empty blocks), over
    packed documents that cross 128-token blocks: it lists every block create_block_mask finds, and flex attention
    through it equals flex attention through create_block_mask's mask exactly (float64)."""
    from torch.nn.attention.flex_attention import and_masks, create_block_mask, flex_attention
    from torchtitan.models.common.attention import (
        get_causal_mask_mod, get_efficient_causal_mask_mod_for_packed_document,
    )

    import cpu

    positions = torch.cat([torch.arange(n) for n in (70, 130, 9, 200, 1)])[None]
    mask_mod = and_masks(get_causal_mask_mod(), get_efficient_causal_mask_mod_for_packed_document(positions))
    length = positions.shape[1]
    ours = cpu.all_blocks_mask(mask_mod, 1, None, length, length, device="cpu", BLOCK_SIZE=128)
    searched = create_block_mask(mask_mod, 1, None, length, length, device="cpu", BLOCK_SIZE=128)
    assert ours.shape == searched.shape == (1, 1, length, length)
    assert bool((ours.to_dense() >= searched.to_dense()).all())
    q, k, v = (torch.randn(1, 2, length, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(i))
               for i in range(3))
    assert torch.equal(flex_attention(q, k, v, block_mask=ours), flex_attention(q, k, v, block_mask=searched))
