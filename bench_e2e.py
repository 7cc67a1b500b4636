"""GRPO steps of the loop with vLLM on one GPU, then vLLM alone on the last step's prompts and the weight
sync in parts. Weights are random (Qwen3-0.6B shapes, or 8B with --shape 8b): every response runs to the limit.

    python bench_e2e.py --steps 2 --model-dir /tmp/q06 --out e2e.json -- <loop.py flags, e.g. run.sh's recipe>
    python bench_e2e.py --steps 1 --quick --out /tmp/e2e.json -- <flags>   # a tiny model on CPU (flags: at least
        --model.attn_type sdpa, and --data.train_files / --data.val_files where the hub is out of reach)
    python bench_e2e.py --steps 4 --one-step-off-policy ... -- <flags>     # synchronous against one-step off-policy
        [--also "NAME:--rollout.name vllm_process OMP_NUM_THREADS=1"]  # one more run: its flags, environment
        [--mps]  # the off-policy runs (and --also runs named *_mps) as clients of a CUDA MPS server of their own
    python bench_e2e.py --steps 2 ... -- <flags> --model.lora_rank 32       # + vLLM's LoRA path vs the merged sync

For each generate it also reports the seconds of Python's cycle collector and the process's CPU seconds
(`--profile`: the host's own time in one more generate by file and function, from cProfile).
"""

import argparse
import contextlib
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter

import torch

import loop
import lora
from bench import QWEN3_0P6B, QWEN3_8B, HostClock, Timer
from config import parse_cli, sampler_class
from engine import ONE_PROCESS
from tiny import write_model_dir


class ClockedSampler:
    """The loop's sampler, with the host's side of each generate timed by a HostClock."""

    def __init__(self, sampler):
        self.sampler, self.clock = sampler, HostClock()

    def generate(self, *args, **kwargs):
        with self.clock:
            return self.sampler.generate(*args, **kwargs)

    def __getattr__(self, name):  # sync_weights, sleep, close, llm, ...: the sampler's own
        return getattr(self.sampler, name)


class StepClock:
    """While entered (a step): CPU seconds of the trainer's thread, of this process's other threads (the generation
    ahead, torch's intra-op pool; also by thread), of vLLM's own processes; the GPU's busy share (NVML's utilization:
    the share of time a kernel ran) and the most device memory in use (NVML's: every process on the GPU, vLLM's
    pools included), both sampled every 0.1 s. Where the time and the memory go when the two sides share the GPU."""

    def __init__(self, device: str):
        self.device = device

    def __enter__(self):
        self.trainer_s, self.process_s, self.engine_s = -time.thread_time(), -time.process_time(), -engine_cpu_s()
        self.threads_before = thread_cpu_s()
        self.busy, self.used, self._stop = [], [], threading.Event()
        self._poller = threading.Thread(target=self._poll, daemon=True)
        if self.device == "cuda":
            self._poller.start()
        return self

    def _poll(self) -> None:
        with contextlib.suppress(Exception):  # no NVML (pynvml): no busy share
            while not self._stop.wait(0.1):
                self.busy.append(torch.cuda.utilization())
                self.used.append(torch.cuda.device_memory_used())

    def __exit__(self, *_):
        self._stop.set()
        if self._poller.is_alive():
            self._poller.join()
        self.trainer_s += time.thread_time()
        self.process_s += time.process_time()
        self.engine_s += engine_cpu_s()
        after = thread_cpu_s()
        self.by_thread = {name: round(s - self.threads_before.get(name, 0.0), 2) for name, s in after.most_common()}

    def report(self) -> dict:
        return {"cpu_trainer_s": self.trainer_s, "cpu_threads_s": self.process_s - self.trainer_s,
                "cpu_engine_s": self.engine_s, "cpu_by_thread": self.by_thread,
                "gpu_busy": sum(self.busy) / len(self.busy) / 100 if self.busy else float("nan"),
                "gpu_used_gb": max(self.used) / 1e9 if self.used else float("nan")}


def thread_cpu_s() -> Counter:
    """CPU seconds of this process's live threads so far, summed by name: Python's name for a Python thread (the
    generation ahead runs on `rollout_0`), the OS's otherwise (`pt_autograd_0`: the backward; OpenMP's pool and
    others share the process's name). Where a step's host time goes, and which threads take turns on the GIL."""
    names, ticks, total = {t.native_id: t.name for t in threading.enumerate()}, os.sysconf("SC_CLK_TCK"), Counter()
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
            end = stat.rindex(")")  # the OS's name is between the parentheses; utime, stime are fields 14 and 15
            fields = stat[end + 2:].split()  # from field 3 (state) on
            total[names.get(int(tid), stat[stat.index("(") + 1:end])] += (int(fields[11]) + int(fields[12])) / ticks
    return total


def engine_cpu_s() -> float:
    """CPU seconds of this process's children (vLLM's engine core and workers, where they run apart)."""
    import psutil

    total = 0.0
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            times = child.cpu_times()
            total += times.user + times.system
    return total


PHASES = ("gen", "old_log_prob", "update_actor", "update_weights", "step")
OFF_POLICY_PHASES = ("gen", "gen_ahead", "old_log_prob", "update_actor", "wait_rollout", "update_weights", "step")


def e2e(args, loop_flags: list[str]) -> dict:
    """GRPO steps of the loop with its sampler, then (unless --steps-only) on the last step's prompts vLLM alone
    (no log-probs, no detokenization, one seed: the least the engine can do) and the loop's generate, and the
    weight sync in parts."""
    cfg = parse_cli(["--model.path", args.model_dir, "--model.random_init", "True", *loop_flags])
    os.environ.update(sampler_class(cfg).environment)  # as loop.main
    run = loop.build_run(cfg)
    run.sampler = ClockedSampler(run.sampler)  # in place: the run's groups source generates through run.sampler
    report = {"flags": loop_flags, "steps": []}
    for step in range(1, args.steps + 1):
        unfrozen = len(gc.get_objects())  # what a full collection walks
        with StepClock(args.device) as step_clock:
            metrics = loop.train_step(cfg, step, run)
        clock = run.sampler.clock
        report["steps"].append({"step": step, **metrics, "unfrozen_objects": unfrozen, **clock.report("gen_"),
                                **step_clock.report()})
        print(" ".join(f"{k}={metrics[f'timing_s/{k}']:.2f}" for k in PHASES) + f" gen: collector "
              f"{sum(clock.seconds):.2f} s {clock.runs}, CPU {clock.cpu_s:.1f} s; unfrozen {unfrozen}", flush=True)
    run.sampler = run.sampler.sampler  # the rest times vLLM itself
    if args.steps_only:
        run.sampler.close()
        return report
    prompts = [ids for ids, _ in run.train_set.batch(args.steps, cfg.data.train_batch_size)]
    report["rollout"] = rollout_reference(cfg, run.sampler, prompts, args.device)
    if args.profile:
        report["host_profile"] = host_profile(cfg, run.sampler, prompts)
    report["sync"] = sync_parts(run.engine, run.sampler, args.device)
    print_e2e(report)
    if cfg.model.lora_rank:
        report["vllm_lora"] = vllm_lora_path(cfg, run, prompts, args.device)  # closes the loop's vLLM first
        print_vllm_lora(report)
    else:
        run.sampler.close()
    return report


def rollout_reference(cfg, sampler, prompts, device: str, rounds: int = 3) -> dict:
    """Seconds and generated tokens on the same prompts, each kind `rounds` times, interleaved: vLLM alone
    (no log-probs, no detokenization), vLLM alone with a log-prob for every token, the loop's generate
    (log-probs for `rollout_logprob_samples` responses per prompt)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    bare = dict(n=cfg.rollout.n, temperature=cfg.rollout.temperature, max_tokens=cfg.data.max_response_length,
                detokenize=False)
    kinds = {"alone": SamplingParams(**bare), "alone_logprobs": SamplingParams(**bare, logprobs=0, flat_logprobs=True)}
    report = {"prompts": len(prompts), "loop_logprob_samples": loop.rollout_logprob_samples(cfg), "n": cfg.rollout.n}

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


def vllm_lora_path(cfg, run, prompts, device: str, rounds: int = 2) -> dict:
    """vLLM's own LoRA path, which the loop's merged sync stands in for: the adapters written in PEFT's layout, then a
    vLLM with enable_lora (dummy base weights: the speed is the same) generating the prompts as `alone` does, with
    a new adapter id each round (the load a sync would make included), the same id again, and no adapter."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    folder = tempfile.mkdtemp(prefix="bench_lora_")
    with Timer(device) as export:
        lora.export(run.engine, os.path.join(folder, "merged"), folder)  # the merged HF model beside it
    run.sampler.close()  # one vLLM at a time
    gc.unfreeze()
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    r = cfg.rollout
    llm = LLM(model=run.engine.model_dir, dtype=run.sampler.dtype, load_format="dummy",
              gpu_memory_utilization=r.gpu_memory_utilization, max_num_seqs=r.max_num_seqs,
              compilation_config={"max_cudagraph_capture_size": r.max_num_seqs},
              enforce_eager=r.enforce_eager or device != "cuda",
              max_model_len=r.max_model_len or cfg.data.max_prompt_length + cfg.data.max_response_length,
              enable_lora=True, max_lora_rank=max(cfg.model.lora_rank, 8), max_loras=1)
    params = SamplingParams(n=r.n, temperature=r.temperature, max_tokens=cfg.data.max_response_length,
                            detokenize=False)
    requests = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    report = {"export_s": export.seconds}
    for i in range(rounds):
        for kind, adapter in (("new_adapter", LoRARequest(f"round{i}", i + 1, folder)),
                              ("same_adapter", LoRARequest(f"round{i}", i + 1, folder)), ("no_adapter", None)):
            with Timer(device) as timer:
                llm.generate(requests, params, use_tqdm=False, lora_request=adapter)
            report.setdefault(f"{kind}_s", []).append(timer.seconds)
    llm.llm_engine.engine_core.shutdown()
    return report


def print_vllm_lora(report: dict) -> None:
    v, alone = report["vllm_lora"], report["rollout"]["alone_s"]
    print(f"vLLM's LoRA path: export (the adapters and the merged model) {v['export_s']:.3f} s; generate with a new "
          f"adapter (its load included) {' / '.join(f'{x:.2f}' for x in v['new_adapter_s'])} s, the same adapter "
          f"{' / '.join(f'{x:.2f}' for x in v['same_adapter_s'])} s, no adapter "
          f"{' / '.join(f'{x:.2f}' for x in v['no_adapter_s'])} s. The loop's path: merged sync "
          f"{report['sync']['sync_awake_s']:.3f} s, vLLM alone on the merged weights "
          f"{' / '.join(f'{x:.2f}' for x in alone)} s")


def loop_generate(cfg, sampler, prompts):
    """The loop's request on `prompts` (n responses each, log-probs where the loop asks), with a fixed seed."""
    return sampler.generate(prompts, cfg.rollout.n, seed=1, logprob_samples=loop.rollout_logprob_samples(cfg))


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


HOST = ("cpu_trainer_s", "cpu_threads_s", "cpu_engine_s")


def print_steps(rows: list[dict], phases: tuple[str, ...]) -> None:
    print(f"\n{'step':<6}" + "".join(f"{p:>15}" for p in phases) + f"{'mfu':>8}{'mismatch':>10}{'mem GB':>8}"
          + "".join(f"{h:>15}" for h in HOST) + f"{'gpu_busy':>10}{'device GB':>11}")
    for row in rows:
        print(f"{row['step']:<6}" + "".join(f"{row[f'timing_s/{p}']:>15.2f}" for p in phases)
              + f"{row.get('perf/mfu/actor', float('nan')):>8.1%}"
              f"{row.get('rollout_corr/abs_logprob_diff', float('nan')):>10.4f}"
              f"{row.get('perf/max_memory_allocated_gb', float('nan')):>8.1f}"
              + "".join(f"{row.get(h, float('nan')):>15.2f}" for h in HOST)
              + f"{row.get('gpu_busy', float('nan')):>10.0%}{row.get('gpu_used_gb', float('nan')):>11.1f}")
    for row in rows:
        busiest = list(row.get("cpu_by_thread", {}).items())[:6]
        print(f"step {row['step']} CPU s by thread: " + ", ".join(f"{name} {s:.1f}" for name, s in busiest))


MPS_CONTROL = "nvidia-cuda-mps-control"


@contextlib.contextmanager
def private_mps(start: bool):
    """Yields the environment that makes a process a client of a CUDA MPS server of this run's own (its control
    daemon's pipe and log directories in a temporary one), or {} when not started; the daemon quits on exit.
    Without MPS the kernels of two processes take turns on the GPU (time-slicing); under one MPS server they run
    at once, as kernels of two streams of one process do."""
    if not start:
        yield {}
        return
    root = tempfile.mkdtemp(prefix="bench_mps_")
    env = {"CUDA_MPS_PIPE_DIRECTORY": f"{root}/pipe", "CUDA_MPS_LOG_DIRECTORY": f"{root}/log"}
    for path in env.values():
        os.makedirs(path)
    subprocess.run([MPS_CONTROL, "-d"], env={**os.environ, **env}, check=True)
    try:
        yield env
    finally:
        subprocess.run([MPS_CONTROL], input=b"quit\n", env={**os.environ, **env}, check=False)


def mps_clients(env: dict) -> int:
    """How many client connections the private MPS server's control log records (0 without one): proof that the
    runs did share the GPU through it rather than silently falling back to time-slicing."""
    log = os.path.join(env["CUDA_MPS_LOG_DIRECTORY"], "control.log") if env else ""
    if not os.path.exists(log):
        return 0
    with open(log) as f:
        return sum("new client" in line.lower() for line in f)


def compare_off_policy(args, loop_flags: list[str]) -> dict:
    """The steps synchronous, with trainer.one_step_off_policy, and with each --also variant (same prompts and seeds),
    each in a fresh process of this script; the mean step after the first (which compiles, and which the off-policy
    mode generates synchronously) of each, and its ratio to the synchronous one. With --mps the off-policy mode and
    every --also run named *_mps are clients of a private MPS server; the other --also runs time-slice the GPU."""
    modes = {"synchronous": [], "one_step_off_policy": ["--trainer.one_step_off_policy", "True", "--rollout.name",
                                                        "vllm_process"]}
    modes.update((name, spec.split()) for name, spec in (variant.split(":", 1) for variant in args.also))
    report = {}
    with private_mps(args.mps) as mps_env:
        for mode, words in modes.items():
            client = mode == "one_step_off_policy" or mode.endswith("_mps")
            report[mode] = run_mode(args, loop_flags, mode, words, mps_env if client else {})
        report["mps_clients"] = mps_clients(mps_env)
    sync_s = report["synchronous"]["mean_step_s"]
    for mode in modes:
        rows = report[mode]["steps"]
        print(f"\n{mode} ({report[mode]['spec']}):", end="")
        print_steps(rows, OFF_POLICY_PHASES if "timing_s/gen_ahead" in rows[-1] else PHASES)
        report[mode]["ratio"] = report[mode]["mean_step_s"] / sync_s
    if args.mps:
        print(f"MPS: the server's control log records {report['mps_clients']} client connections")
    for mode in list(modes)[1:]:
        print(f"{mode}: step {report[mode]['mean_step_s']:.2f} s against {sync_s:.2f} s synchronous (mean of steps "
              f"2-{args.steps}): {report[mode]['ratio']:.2f}x")
    report["ratio"] = report["one_step_off_policy"]["ratio"]
    return report


def run_mode(args, loop_flags: list[str], mode: str, words: list[str], mps_env: dict) -> dict:
    """One mode's steps in a fresh process of this script: its loop flags and KEY=VALUE environment in words."""
    setting = {w: "=" in w and not w.startswith("-") for w in words}  # KEY=VALUE: an environment variable
    env = {**mps_env, **dict(w.split("=", 1) for w in words if setting[w])}
    flags = [w for w in words if not setting[w]]
    out = tempfile.mkdtemp(prefix=f"bench_e2e_{mode}_")
    subprocess.run([sys.executable, os.path.abspath(__file__), "--steps", str(args.steps), "--steps-only",
                    "--shape", args.shape,
                    "--model-dir", args.model_dir, "--out", f"{out}/e2e.json", *(["--quick"] if args.quick else []),
                    "--", *loop_flags, "--rollout.free_cache_engine", "False", *flags,
                    "--trainer.output_dir", f"{out}/run"], check=True, env={**os.environ, **env})
    with open(f"{out}/e2e.json") as f:
        report = json.load(f)
    rows = report["steps"]
    return {**report, "spec": " ".join(words) + (" (MPS)" if mps_env else ""),
            "mean_step_s": sum(r["timing_s/step"] for r in rows[1:]) / max(len(rows) - 1, 1)}


def print_e2e(report: dict) -> None:
    print_steps(report["steps"], PHASES)
    r, s = report["rollout"], report["sync"]
    mean = {kind: sum(r[f"{kind}_s"]) / len(r[f"{kind}_s"]) for kind in ("alone", "alone_logprobs", "loop")}
    # round by round: host drift cancels
    paired = sorted(loop / alone for loop, alone in zip(r["loop_s"], r["alone_s"]))
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2, help="GRPO steps of the loop (the first one compiles)")
    parser.add_argument("--out", default="e2e.json")
    parser.add_argument("--quick", action="store_true", help="a tiny model on CPU")
    parser.add_argument("--profile", action="store_true", help="the host side of one more generate (cProfile)")
    parser.add_argument("--model-dir", default=None, help="where to write the Qwen3-shaped model dir")
    parser.add_argument("--shape", choices=("0.6b", "8b"), default="0.6b", help="Qwen3 shapes (random weights)")
    parser.add_argument("--one-step-off-policy", action="store_true",
                        help="the steps synchronous and one-step off-policy, each in its own process, and their ratio")
    parser.add_argument("--also", action="append", default=[], metavar="NAME:ARGS",
                        help="with --one-step-off-policy, one more run: loop flags and KEY=VALUE environment in ARGS")
    parser.add_argument("--mps", action="store_true",
                        help="with --one-step-off-policy, that mode and --also runs named *_mps under a private CUDA "
                             "MPS server")
    parser.add_argument("--steps-only", action="store_true", help="no vLLM reference rounds, no sync parts")
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    args, loop_flags = parser.parse_args(argv[:split]), argv[split + 1:]
    if args.mps and not (args.one_step_off_policy and shutil.which(MPS_CONTROL)):
        sys.exit(print(f"--mps: needs --one-step-off-policy and {MPS_CONTROL} on PATH (CUDA's MPS, a GPU host)",
                       file=sys.stderr) or 2)
    os.environ.update({**ONE_PROCESS, **os.environ})  # one process, no torchrun
    args.device = "cpu" if args.quick else "cuda"
    shapes = QUICK if args.quick else {"0.6b": QWEN3_0P6B, "8b": QWEN3_8B}[args.shape]
    args.model_dir = write_model_dir(args.model_dir or tempfile.mkdtemp(prefix="bench_model_"), shapes, "qwen3", None)
    report = compare_off_policy(args, loop_flags) if args.one_step_off_policy else e2e(args, loop_flags)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)


QUICK = dict(QWEN3_0P6B, hidden_size=128, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1, head_dim=64)  # vLLM's CPU attention wants head_dim 64


if __name__ == "__main__":
    main()
