"""The benchmarks' own measuring tools: what bench_e2e.py reports about the host during each generate; the trace summary."""

import gc
import json
import math
import subprocess
import sys
import threading
import time

import torch

from bench import HostClock
from bench_e2e import StepClock
from bench_trace import read_trace


def test_host_clock_counts_the_collections_and_the_cpu_time_inside_it():
    gc.collect()
    with HostClock() as clock:
        gc.collect()  # one full collection
        busy_until = time.process_time() + 0.2
        while time.process_time() < busy_until:
            pass
    gc.collect()  # after the block: not counted
    assert clock.runs[2] == 1 and clock.seconds[2] > 0
    assert clock.cpu_s >= 0.2


def spin(cpu_seconds: float) -> None:
    """Keep this thread's CPU busy for cpu_seconds of its own CPU time."""
    until = time.thread_time() + cpu_seconds
    while time.thread_time() < until:
        pass


def test_step_clock_tells_the_trainer_thread_from_other_threads_and_child_processes():
    """CPU seconds land where they were spent: this thread, another thread of the process (also by its name), a
    child process."""
    child = subprocess.Popen([sys.executable, "-c", "import time\nuntil = time.process_time() + 0.6\n"
                              "while time.process_time() < until: pass\ntime.sleep(5)"])
    done, spun = threading.Event(), threading.Event()
    other = threading.Thread(target=lambda: (spin(0.4), spun.set(), done.wait()), name="rollout_0")
    try:
        with StepClock("cpu") as clock:
            other.start()
            spin(0.2)
            spun.wait()
            time.sleep(1.5)  # the child's 0.6 s (on another core, or after these)
    finally:
        child.kill()
        done.set()
    report = clock.report()
    assert 0.2 <= report["cpu_trainer_s"] < 0.35, report
    assert 0.4 <= report["cpu_threads_s"] < 0.55, report
    by_thread = report["cpu_by_thread"]  # /proc's clock ticks (10 ms): a tick's slack each side
    assert 0.38 <= by_thread["rollout_0"] < 0.57, report  # a thread alive at the clock's end
    assert 0.18 <= by_thread[threading.current_thread().name] < 0.37, report
    assert 0.5 <= report["cpu_engine_s"] < 0.8, report  # the child's start-up too (before the clock: not counted)
    assert math.isnan(report["gpu_busy"])  # no GPU: not sampled
    assert math.isnan(report["gpu_used_gb"])


def test_step_clock_samples_the_gpus_busy_share_and_the_most_memory_in_use(monkeypatch):
    """On a GPU: the mean of NVML's utilization samples and the largest device-wide memory sample."""
    used = iter([10e9, 30e9, 20e9] + [5e9] * 1000)
    monkeypatch.setattr(torch.cuda, "utilization", lambda: 50)
    monkeypatch.setattr(torch.cuda, "device_memory_used", lambda: next(used))
    with StepClock("cuda") as clock:
        time.sleep(0.5)  # ~5 samples
    report = clock.report()
    assert report["gpu_busy"] == 0.5 and report["gpu_used_gb"] == 30.0, report


def test_read_trace_sums_kernel_time_by_kind_and_the_idle_gaps(tmp_path, capsys):
    kernels = [("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT", 0, 3000),  # microseconds
               ("triton_tem_fused_flex_attention_backward_3", 3000, 2000),
               ("void at::native::detail::chunk_cat_cuda_kernel<float, c10::BFloat16>", 6000, 500),  # 1 ms idle before
               ("triton_poi_fused__unsafe_view_mul_silu_8", 6500, 400),
               ("sm90_xmma_gemm_bf16bf16_bf16f32", 6900, 1000),
               ("void at::native::vectorized_elementwise_kernel<4, add>", 7900, 300)]
    events = [{"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur} for name, ts, dur in kernels]
    events.append({"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoD (Device -> Device)", "ts": 8200, "dur": 600})
    events.append({"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 9000})  # host events are ignored
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    read_trace(str(path))
    printed = capsys.readouterr().out
    assert "span 8.8 ms, kernels 7.8 ms, GPU idle 1.0 ms" in printed
    by_kind = printed.split("kernel time by kind (ms):\n")[1].split("\n\n")[0].splitlines()
    assert [line.split(None, 1) for line in by_kind] == [
        ["4.0", "matmul"], ["2.0", "attention"], ["0.6", "memcpy / memset"], ["0.5", "FSDP copy"],
        ["0.4", "other fused (Inductor)"], ["0.3", "other"]]


def test_mps_is_refused_in_one_line_without_the_off_policy_comparison():
    run = subprocess.run([sys.executable, "bench_e2e.py", "--mps", "--quick", "--steps", "1"],
                         capture_output=True, text=True)
    assert run.returncode == 2, run.stderr
    assert run.stderr.strip().splitlines() == [
        "--mps: needs --one-step-off-policy and nvidia-cuda-mps-control on PATH (CUDA's MPS, a GPU host)"]


def test_mps_serves_the_off_policy_mode_and_runs_named_mps_and_quits(tmp_path, monkeypatch):
    """A stand-in control daemon records how it was called; the off-policy mode and an --also run named *_mps are its
    clients (its pipe directory in their environment), the synchronous baseline and other --also runs are not."""
    import argparse

    import bench_e2e

    calls = tmp_path / "calls.txt"
    control = tmp_path / "nvidia-cuda-mps-control"
    control.write_text('#!/bin/sh\nlog="$CUDA_MPS_LOG_DIRECTORY/control.log"\n'
                       f'if [ "$1" = -d ]; then echo "start pipe=$CUDA_MPS_PIPE_DIRECTORY" >> {calls}\n'
                       '  echo "[ts] Control: New client 1 connected" >> "$log"\n'
                       '  echo "[ts] Control: New client 2 connected" >> "$log"\n'
                       f'else echo "$(cat -) pipe=$CUDA_MPS_PIPE_DIRECTORY" >> {calls}; fi\n')
    control.chmod(0o755)
    monkeypatch.setattr(bench_e2e, "MPS_CONTROL", str(control))
    seen = {}

    def run_mode(args, loop_flags, mode, words, mps_env):
        seen[mode] = mps_env
        return {"steps": [{"timing_s/step": 2.0}, {"timing_s/step": 1.0}], "spec": mode, "mean_step_s": 1.0}

    monkeypatch.setattr(bench_e2e, "run_mode", run_mode)
    monkeypatch.setattr(bench_e2e, "print_steps", lambda rows, phases: None)
    args = argparse.Namespace(mps=True, also=["synchronous_mps:", "time_sliced:--rollout.name vllm_process"], steps=2)
    report = bench_e2e.compare_off_policy(args, [])
    assert list(seen) == ["synchronous", "one_step_off_policy", "synchronous_mps", "time_sliced"]
    assert seen["synchronous"] == seen["time_sliced"] == {}
    pipe = seen["one_step_off_policy"]["CUDA_MPS_PIPE_DIRECTORY"]
    assert seen["synchronous_mps"] == seen["one_step_off_policy"] and pipe
    assert calls.read_text().splitlines() == [f"start pipe={pipe}", f"quit pipe={pipe}"]  # started, then quit
    assert report["mps_clients"] == 2  # the connections the control log records
