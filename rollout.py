"""Rollout: colocated vLLM or the trainer's own model (both a `Sampler`: token-id prompts in, a `Rollout` out), and
the weight sync trainer -> vLLM."""

import contextlib
import gc
import os
import time
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
import torch.distributed as dist

from config import Config
from plugins import sampler_class


@dataclass
class Rollout:
    prompt_ids: list[list[int]]  # one per response (repeated n times per prompt)
    response_ids: list[list[int]]
    logprobs: list[list[float] | None]  # sampling log-probs of response_ids (None where not asked for)
    finish_reasons: list[str]  # "stop" (EOS) or "length" (hit max_response_length)


class Sampler(Protocol):
    """What the loop asks of a rollout engine (VLLMRollout here, NativeRollout in native.py; an SGLang one would be a
    third, in a file of its own): built as `Sampler(cfg, engine, eos_token_ids)`; `generate` n responses per prompt
    (one greedy each, reproducible from `seed`, sampling log-probs for the first `logprob_samples` of each prompt,
    None: all), `sync_weights` from the trainer (returns seconds), `sleep` to free its accelerator memory for the
    update (the next sync restores it), `close`. What it needs of the run it declares:"""

    environment: dict[str, str]  # environment variables the entry point sets before building it
    uses_rollout_tp: bool  # it runs rollout.tensor_parallel_size-rank groups (the size must divide TP x CP)
    generates_beside_the_trainer: bool  # own weights and thread: it can generate while the trainer updates

    def generate(self, prompt_ids: list[list[int]], n: int, greedy: bool = False, seed: int = 0,
                 logprob_samples: int | None = None) -> Rollout: ...

    def sync_weights(self) -> float: ...

    def sleep(self) -> None: ...

    def close(self) -> None: ...


def build_rollout(cfg: Config, engine, eos_token_ids: list[int]) -> Sampler:
    """The sampler named by rollout.name (a built-in name, a module or a .py path whose SAMPLER it builds)."""
    return sampler_class(cfg)(cfg, engine, eos_token_ids)


class VLLMRollout:
    """One vLLM engine per rank (TP=1) or per rollout-TP group (external_launcher), in-process. It starts from dummy
    weights and takes the trainer's at once (as verl does): a random-init or resumed trainer is what gets sampled."""

    environment = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}  # vLLM's engine in this process: the sync copies in place
    uses_rollout_tp = True
    generates_beside_the_trainer = False  # beside the update it would share the interpreter lock: a slower step

    def __init__(self, cfg: Config, engine, eos_token_ids: list[int] | None = None):
        wrong = {k: v for k, v in self.environment.items() if os.environ.get(k) != v}
        if wrong:  # the entry point sets `environment` before vLLM is imported
            raise RuntimeError(f"rollout.name={cfg.rollout.name} needs {wrong} in the environment before starting")
        try:
            from vllm import LLM
        except ImportError as error:
            raise ImportError(f"rollout.name=vllm but vllm cannot be imported ({error}); install the pinned set "
                              "(bash run.sh does) or use --rollout.name native") from error
        self.cfg, self.engine = cfg, engine
        on_gpu = engine.device_type == "cuda"
        self.dtype = torch.bfloat16 if on_gpu and cfg.model.dtype == "bfloat16" else torch.float32
        r = cfg.rollout
        options = dict(
            model=engine.model_dir, dtype=self.dtype, tensor_parallel_size=r.tensor_parallel_size, load_format="dummy",
            distributed_executor_backend="external_launcher" if dist.get_world_size() > 1 else None,
            gpu_memory_utilization=r.gpu_memory_utilization, max_num_seqs=r.max_num_seqs,
            compilation_config={"max_cudagraph_capture_size": r.max_num_seqs},  # vLLM's default: <= 512
            enable_prefix_caching=r.enable_prefix_caching, enforce_eager=r.enforce_eager or not on_gpu,
            max_model_len=r.max_model_len or cfg.data.max_prompt_length + cfg.data.max_response_length,
            enable_sleep_mode=on_gpu and r.free_cache_engine, seed=r.seed + dist.get_rank() // r.tensor_parallel_size,
            logprobs_mode="processed_logprobs",  # log-probs after temperature, as the trainer computes them
        )
        self.llm = self.build_llm(LLM, options, on_gpu)
        self.sleeping = False
        # a dense model on a GPU computes with its weights as loaded: copying into them is all a sync needs
        self.copies_in_place = on_gpu and not self.llm.llm_engine.vllm_config.model_config.is_moe
        self.sync_weights()

    def generate(self, prompt_ids: list[list[int]], n: int, greedy: bool = False, seed: int = 0,
                 logprob_samples: int | None = None) -> Rollout:
        """n samples per prompt (or one greedy response each); `seed` makes the draw reproducible; sampling
        log-probs for the first `logprob_samples` responses of each prompt (None: all), None for the rest."""
        from vllm.inputs import TokensPrompt

        assert not self.sleeping, "vLLM is asleep: its weights were discarded; call sync_weights() first"
        n = 1 if greedy else n
        with_logprobs = n if logprob_samples is None else min(logprob_samples, n)
        # vLLM's host-side cost of returning log-probs grows with the requests that ask for them: ask in two requests
        per_prompt = [self._params(count, greedy, logprobs)
                      for count, logprobs in ((with_logprobs, True), (n - with_logprobs, False)) if count]
        requests = [(prompt, params) for prompt in prompt_ids for params in per_prompt]
        with self.seeded(seed):
            outputs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p, _ in requests],
                                        self.request_params([params for _, params in requests], seed),
                                        use_tqdm=dist.get_rank() == 0)
        rollout = Rollout([], [], [], [])
        for (prompt, params), output in zip(requests, outputs):
            for sample in output.outputs:
                rollout.prompt_ids.append(list(prompt))
                rollout.response_ids.append(list(sample.token_ids))
                rollout.logprobs.append(list(sample.logprobs.logprobs) if params.logprobs is not None else None)
                rollout.finish_reasons.append("length" if sample.finish_reason == "length" else "stop")
        return rollout

    def build_llm(self, llm_class, options: dict, on_gpu: bool):
        """vLLM's LLM (llm_class) with these keywords, in this process."""
        return llm_class(**options)

    @contextlib.contextmanager
    def seeded(self, seed: int):
        """One seed for the whole call (per-request seeds make vLLM's CPU runner draw each request's noise apart):
        vLLM's CPU runner draws from torch's RNG, its GPU runner seeds requests from numpy's; both are restored."""
        numpy_state = np.random.get_state()
        with torch.random.fork_rng(devices=[torch.device(self.engine.device)] if self.engine.device_type == "cuda"
                                   else []):
            torch.manual_seed(seed)
            np.random.seed(seed % 2**32)
            try:
                yield
            finally:
                np.random.set_state(numpy_state)

    def request_params(self, params: list, seed: int) -> list:
        """Each request's SamplingParams: as built (seeded() seeds the whole call)."""
        return params

    def _params(self, n: int, greedy: bool, logprobs: bool):
        from vllm import SamplingParams

        r = self.cfg.rollout
        return SamplingParams(
            n=n, temperature=0.0 if greedy else r.temperature, top_p=1.0 if greedy else r.top_p,
            top_k=-1 if greedy else r.top_k, max_tokens=self.cfg.data.max_response_length,
            logprobs=0 if logprobs else None, flat_logprobs=True,  # the sampled token's log-prob only, flat lists
            detokenize=False,  # the loop decodes the texts it scores itself
        )

    def sync_weights(self) -> float:
        """Load the trainer's current weights (in the rollout dtype) into the live engine; seconds."""
        start = time.perf_counter()
        if self.sleeping:  # the weights' memory first; the KV cache only once the load is done
            freeze_live_objects()
            self.llm.wake_up(tags=["weights"])
        self.load(self.engine.export_hf_weights(dtype=self.dtype))
        if self.sleeping:
            self.llm.wake_up(tags=["kv_cache"])
            self.sleeping = False
        self.llm.reset_prefix_cache()
        return time.perf_counter() - start

    def load(self, weights) -> None:
        """Load (HF name, tensor) pairs into the engine's weights in place."""
        if self.copies_in_place:
            self.llm.collective_rpc(copy_into_weights, args=(weights,))
        else:
            self.reload(weights)

    def reload(self, weights) -> None:
        """vLLM's reload: it re-runs its post-load processing (CPU repacking, MoE kernel layouts) layer by layer."""
        if self.engine.device_type == "cpu":
            self.llm.collective_rpc(forget_moe_kernels)
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights, "is_checkpoint_format": True})

    def sleep(self) -> None:
        """Free the GPU memory of the KV cache and the weights (discarded: the next sync reloads them)."""
        if self.llm.llm_engine.vllm_config.model_config.enable_sleep_mode and not self.sleeping:
            freeze_live_objects()
            self.llm.sleep(level=2)
            self.sleeping = True

    def close(self) -> None:
        """Shut the engine down; vLLM's teardown also destroys torch.distributed's default group."""
        self.llm.llm_engine.engine_core.shutdown()


def freeze_live_objects() -> None:
    """Collect garbage once, then keep the survivors out of later cycle collections: vLLM runs a full
    gc.collect() in each sleep and wake, and torch.compile's many long-lived objects made each one slow
    (vLLM freezes its own start-up heap for the same reason). Frozen objects are still freed by refcount."""
    gc.collect()
    gc.freeze()


def copy_into_weights(worker, weights) -> None:
    """vLLM's own loader on the live model (run on each vLLM worker): each tensor is copied into its (possibly
    fused, TP-sharded) parameter; faster than reload_weights (benchmarks/ has the timings)."""
    model = worker.model_runner.get_model()
    unset = {name for name, _ in model.named_parameters()} - set(model.load_weights(weights))
    if unset:  # after a sleep they would hold whatever the woken memory held
        raise RuntimeError(f"weight sync: the trainer's weights left vLLM parameters unset: {sorted(unset)[:4]}")


def forget_moe_kernels(worker) -> None:
    """Make vLLM's next reload set up its MoE kernels afresh (run on each vLLM worker): vLLM CPU 0.32 treats a
    reload as a "weight update" and skips the experts' prepacking, so new weights landed unpacked in packed buffers.
    Without a kernel the reload counts as a first load and prepacks. GPU backends update in place."""
    for module in worker.model_runner.model.modules():
        method = getattr(module, "quant_method", None)
        if getattr(method, "moe_kernel", None) is not None:
            method.moe_kernel = None


SAMPLER = VLLMRollout  # what rollout.name=vllm builds (plugins.SAMPLERS)
