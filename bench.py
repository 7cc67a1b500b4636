"""Benchmark on one GPU: actor update, log-prob pass, weight export and native rollout (Qwen3-0.6B shapes).

    python bench.py --out bench.json              # the update table in benchmarks/ (one GPU, random init, bf16)
    python bench.py --quick --out /tmp/b.json     # a tiny model on CPU: checks that the script runs
    python bench.py --profile --trace t.json.gz   # the first case profiled; `python bench_trace.py t.json.gz` sums it
    python bench.py --lora-ranks 0,32 [--shape 8b] [--budget 4096] --out lora.json   # the update without/with LoRA
    python bench.py --lora-ranks 0,32 --profile --trace t.json.gz   # each rank's update profiled: t.r0.json.gz, ...

The loop end to end with vLLM is `bench_e2e.py`.

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
import tempfile
import time

import torch

from config import Config, validate
from engine import ONE_PROCESS, TorchTitanEngineWithLMHead
from loop import Sample, compute_logprobs, forward_backward_batch, grpo_loss_fn, pack_micro_batches
from tiny import write_model_dir


QWEN3_0P6B = dict(  # Qwen/Qwen3-0.6B config.json (shapes only; weights are random)
    architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936, hidden_size=1024,
    intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
    max_position_embeddings=40960, rope_theta=1000000, rms_norm_eps=1e-6, tie_word_embeddings=True,
    hidden_act="silu", attention_bias=False,
)
QWEN3_8B = dict(  # Qwen/Qwen3-8B config.json (shapes only)
    QWEN3_0P6B, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
    num_key_value_heads=8, tie_word_embeddings=False,
)
TINY = dict(QWEN3_0P6B, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16)


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


def bench_config(model_dir: str, out_dir: str, attn: str, compile_: bool, ac: str, budget: int, device: str,
                 lora: int = 0) -> Config:
    cfg = Config()
    cfg.model.path, cfg.model.random_init, cfg.model.attn_type = model_dir, True, attn
    cfg.model.lora_rank, cfg.model.lora_alpha = lora, 2.0 * lora or 16.0
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
    cfg = bench_config(model_dir, out_dir, case["attn"], case["compile"], case["ac"], case["budget"], args.device,
                       case.get("lora", 0))
    engine = TorchTitanEngineWithLMHead(cfg)
    tokens = sum(len(s.tokens) for s in samples)
    warmup = 2 if case["compile"] else 1
    seconds = time_update(engine, cfg, samples, warmup, args.steps, args.device)
    flops = engine.training_flops([len(s.tokens) for s in samples])  # LoRA: the same FLOPs counted (MFU comparable)
    row = dict(case, seconds=seconds, tokens_per_s=tokens / seconds,
               mfu=flops / seconds / peak_flops(args.device), peak_memory_gb=peak_memory_gb(args.device))
    with Timer(args.device) as t:  # what the sync exports (LoRA: merged), in the rollout's dtype
        for _ in engine.export_hf_weights(dtype=torch.bfloat16 if args.device == "cuda" else None):
            pass
    row["export_s"] = t.seconds
    if args.profile and (extras or args.lora_ranks):  # LoRA: every rank's update, to compare their kernels
        row["profile"] = profile_update(engine, cfg, samples, args, case.get("lora", 0))
    if extras:
        try:
            row.update(extra_measurements(engine, cfg, samples, args))
        except Exception as error:
            row["extras_error"] = f"{type(error).__name__}: {error}".splitlines()[0]
    del engine
    return row


def profile_update(engine, cfg, samples, args, lora: int = 0) -> dict:
    """One profiled update: top kernels, GPU-busy fraction, host syncs; the trace goes to --trace (LoRA: one per
    rank, `.r<rank>` before the suffix)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
    with profile(activities=activities) as prof:
        seconds = time_update(engine, cfg, samples, 0, 1, args.device)
    table = prof.key_averages().table(sort_by="cuda_time_total" if args.device == "cuda" else "cpu_time_total",
                                      row_limit=25)
    print(table, flush=True)
    if args.trace:
        stem, dot_json, rest = args.trace.partition(".json")
        prof.export_chrome_trace(f"{stem}.r{lora}{dot_json}{rest}" if args.lora_ranks else args.trace)
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
    from native import NativeRollout

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
    lengths = torch.tensor([len(s.response_ids) for s in members])
    loss, _ = grpo.grpo_token_loss(current, current.detach(), advantages, weights, cfg.algorithm, entropy,
                                   lengths=lengths)
    return loss


def cases(quick: bool, lora_ranks: list[int] | None = None, budget: int | None = None) -> list[dict]:
    """The configurations measured, most important first (a timeout keeps the first rows)."""
    if lora_ranks is not None:  # the recipe's update (or the quick one) at each rank, at its budget or `budget`
        base = cases(quick)[1] if quick else dict(attn="flex", compile=True, ac="selective", budget=16384)
        return [dict(base, lora=rank, budget=budget or base["budget"]) for rank in lora_ranks]
    if quick:
        return [dict(attn="sdpa", compile=False, ac="none", budget=2048),
                dict(attn="sdpa", compile=False, ac="selective", budget=2048)]
    rows = [dict(attn="flex", compile=c, ac=a, budget=16384)
            for c in (True, False) for a in ("none", "selective", "full")]
    rows += [dict(attn="flex", compile=True, ac="none", budget=b) for b in (8192, 32768)]
    rows += [dict(attn="varlen", compile=True, ac=a, budget=b) for a, b in (("none", 16384), ("selective", 16384),
                                                                            ("none", 32768))]
    rows += [dict(attn="flex_flash", compile=True, ac="none", budget=16384)]
    return rows


def print_table(rows: list[dict], hf: dict) -> None:
    print(f"\n{'attn':<11}{'compile':<8}{'AC':<10}{'budget':>7}{'LoRA':>5}{'tok/s':>10}{'MFU':>7}{'x HF':>6}"
          f"{'mem GB':>8}{'export s':>9}")
    for r in rows:
        head = f"{r['attn']:<11}{str(r['compile']):<8}{r['ac']:<10}{r['budget']:>7}{r.get('lora', 0):>5}"
        if "error" in r:
            print(f"{head}  error: {r['error'][:80]}")
            continue
        ratio = r["tokens_per_s"] / hf["tokens_per_s"] if hf.get("tokens_per_s") else float("nan")
        print(f"{head}{r['tokens_per_s']:>10.0f}{r['mfu']:>7.1%}{ratio:>6.2f}{r['peak_memory_gb']:>8.1f}"
              f"{r['export_s']:>9.3f}")
    if hf.get("tokens_per_s"):
        print(f"{'HF sdpa':<11}{'-':<8}{'none':<10}{hf['budget']:>7}{hf['tokens_per_s']:>10.0f}{hf['mfu']:>7.1%}"
              f"{1.0:>6.2f}{hf['peak_memory_gb']:>8.1f}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench.json")
    parser.add_argument("--quick", action="store_true", help="tiny model on CPU")
    parser.add_argument("--steps", type=int, default=3, help="timed updates per configuration")
    parser.add_argument("--sequences", type=int, default=320, help="sequences per update (64 prompts x 5)")
    parser.add_argument("--rollout-prompts", type=int, default=64)
    parser.add_argument("--rollout-tokens", type=int, default=128)
    parser.add_argument("--cases", default=None, help="comma-separated indices of the configurations to run")
    parser.add_argument("--profile", action="store_true", help="profile one update of the first case (LoRA: of each)")
    parser.add_argument("--trace", default=None, help="with --profile: write the first case's Chrome trace here")
    parser.add_argument("--hf-json", default=None, help="reuse the HF baseline of an earlier report")
    parser.add_argument("--lora-ranks", default=None,
                        help="comma-separated LoRA ranks (0: off) of the recipe's update; no HF baseline, no extras")
    parser.add_argument("--budget", type=int, default=None,
                        help="with --lora-ranks: tokens per micro-batch (default: the recipe's 16384)")
    parser.add_argument("--shape", choices=("0.6b", "8b"), default="0.6b", help="Qwen3 shapes (random weights)")
    args = parser.parse_args()
    args.device = "cpu" if args.quick else "cuda"
    args.lora_ranks = [int(r) for r in args.lora_ranks.split(",")] if args.lora_ranks else None
    if args.quick:
        args.sequences, args.steps, args.rollout_prompts, args.rollout_tokens = 8, 1, 2, 4
    return args


def main() -> None:
    args = parse_args()
    os.environ.update({**ONE_PROCESS, **os.environ})  # one process, no torchrun
    if args.quick:
        import cpu
        from engine import init_process_group

        cpu.use_cpu_device()
        init_process_group("cpu")
    hf_config = TINY if args.quick else {"0.6b": QWEN3_0P6B, "8b": QWEN3_8B}[args.shape]
    model_dir = write_model_dir(tempfile.mkdtemp(prefix="bench_model_"), hf_config, "digits", seed=None)
    samples = gsm8k_like_samples(args.sequences, hf_config["vocab_size"])
    tokens = sum(len(s.tokens) for s in samples)
    report = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
              "torch": torch.__version__, "sequences": len(samples), "tokens_per_update": tokens,
              "peak_tflops": peak_flops(args.device) / 1e12, "rows": [], "shape": args.shape,
              "hf": {} if args.lora_ranks else hf_baseline(args, hf_config, samples)}
    print(f"{report['device']}: {len(samples)} sequences, {tokens} tokens per update", flush=True)
    save(report, args.out)
    all_cases = cases(args.quick, args.lora_ranks, args.budget)
    chosen = [int(i) for i in args.cases.split(",")] if args.cases else range(len(all_cases))
    for index in chosen:
        extras = index == chosen[0] and not args.lora_ranks
        report["rows"].append(measure_case(all_cases[index], model_dir, samples, args, extras))
        save(report, args.out)
    hf, first = report["hf"], next((row for row in report["rows"] if "seconds" in row), None)
    if hf:
        hf["mfu"] = first["mfu"] * first["seconds"] / hf["seconds"] if first else float("nan")  # same useful FLOPs
    print_table(report["rows"], hf)
    save(report, args.out)


def hf_baseline(args, hf_config: dict, samples) -> dict:
    """The HF transformers update on the same sequences (or the baseline of an earlier report, --hf-json)."""
    if args.hf_json:
        with open(args.hf_json) as f:
            return json.load(f)["hf"]
    budget = 2048 if args.quick else 16384
    seconds, memory = hf_update_seconds(hf_config, samples, budget, 1, args.steps, args.device)
    return dict(budget=budget, seconds=seconds, tokens_per_s=sum(len(s.tokens) for s in samples) / seconds,
                peak_memory_gb=memory)


def measure_case(case: dict, model_dir: str, samples, args, extras: bool) -> dict:
    """One configuration's row, or its error (a backend missing on this machine: report it, keep measuring)."""
    try:
        row = run_engine_case(case, model_dir, samples, args, extras)
    except Exception as error:
        row = dict(case, error=f"{type(error).__name__}: {error}".splitlines()[0])
    print(json.dumps({k: v for k, v in row.items() if k != "profile"}), flush=True)
    if "profile" in row:
        print(json.dumps({k: v for k, v in row["profile"].items() if k != "table"}, indent=1), flush=True)
    return row


def save(report: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
