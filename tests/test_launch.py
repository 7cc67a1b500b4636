"""run.sh as users launch it: the CPU demo in two processes, and across two torchrun "nodes"."""

import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT, free_port

ONE_STEP = ["--trainer.total_training_steps", "1", "--trainer.val_before_train", "False"]


def run_sh(out, env, *, wait=True, extra=()):
    env = {**os.environ, "PYTHON": sys.executable, "NUM_GPUS": "0", "FSDP_SIZE": "2", "OUTPUT_DIR": str(out), **env}
    process = subprocess.Popen(["bash", "run.sh", *ONE_STEP, *extra], cwd=ROOT, env=env, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    return finish(process, out) if wait else process


def finish(process, out):
    stdout, stderr = process.communicate(timeout=900)
    assert process.returncode == 0, stdout[-2000:] + stderr[-4000:]
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_two_nodes_equal_one_node_with_two_processes(tmp_path):
    """NNODES=2 (one process each, static rendezvous on 127.0.0.1) gives the same GRPO step as one node
    running both processes: same reward, loss, gradient norm and entropy."""
    single = run_sh(tmp_path / "single", {})
    port = str(free_port())
    nodes = [run_sh(tmp_path / "nodes", {"NNODES": "2", "NODE_RANK": str(rank), "MASTER_PORT": port}, wait=False)
             for rank in (0, 1)]
    multi = [finish(process, tmp_path / "nodes") for process in nodes][0]
    assert [r["step"] for r in multi] == [r["step"] for r in single] == [1]
    for key in ("critic/score/mean", "actor/pg_loss", "actor/grad_norm", "actor/entropy", "response_length/mean"):
        assert multi[0][key] == pytest.approx(single[0][key], rel=1e-6, abs=1e-9), key


def test_a_bad_setting_stops_run_sh_with_one_line_before_it_starts_the_processes(tmp_path):
    """FSDP_SIZE=2 on CPU: run.sh checks the settings once (loop.py --check) before torchrun would start two
    processes."""
    env = {**os.environ, "PYTHON": sys.executable, "NUM_GPUS": "0", "FSDP_SIZE": "2", "OUTPUT_DIR": str(tmp_path)}
    result = subprocess.run(["bash", "run.sh", "--rollout.n", "0"], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 2 and result.stderr == "titan-grpo: rollout.n=0 must be >= 1\n", result.stderr


def test_run_sh_refuses_a_locked_output_dir_before_it_starts_the_processes(tmp_path):
    """FSDP_SIZE=2 on CPU with OUTPUT_DIR held by another run: the check before torchrun (loop.py --check: settings,
    model dir, data, output dir) says so in one line, exit 2; no process was started (no step ran)."""
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time, prompts; prompts.lock_output_dir(sys.argv[1]); "
                               "print('locked', flush=True); time.sleep(600)", str(tmp_path)], cwd=ROOT,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        env = {**os.environ, "PYTHON": sys.executable, "NUM_GPUS": "0", "FSDP_SIZE": "2", "OUTPUT_DIR": str(tmp_path)}
        result = subprocess.run(["bash", "run.sh", *ONE_STEP], cwd=ROOT, env=env, capture_output=True, text=True,
                                timeout=600)
    finally:
        holder.kill()
    want = f"titan-grpo: trainer.output_dir={tmp_path} is in use by another run (pid {holder.pid})"
    assert result.returncode == 2 and result.stderr.startswith(want) and result.stderr.count("\n") == 1, result.stderr
    assert "step 1" not in result.stdout


def test_a_refusal_only_a_rank_finds_ends_run_sh_with_that_line_last(tmp_path):
    """FSDP_SIZE=2 on CPU, resuming with LoRA on into the checkpoint of a full fine-tuning run: the ranks find it at
    load (after the check before torchrun passed); the launch ends with their one line last, exit 2, and no
    traceback (torchrun's own included)."""
    run_sh(tmp_path, {}, extra=["--checkpoint.save_freq", "1"])
    env = {**os.environ, "PYTHON": sys.executable, "NUM_GPUS": "0", "FSDP_SIZE": "2", "OUTPUT_DIR": str(tmp_path)}
    result = subprocess.run(["bash", "run.sh", *ONE_STEP, "--model.lora_rank", "4"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=900)
    last = result.stderr.strip().splitlines()[-1]
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert last.startswith(f"titan-grpo: trainer.output_dir={tmp_path}: its checkpoint does not fit this model"), last


def test_the_cpu_demo_learns(tmp_path):
    """`bash run.sh` with no GPU and no MODEL_PATH, as a new user runs it (its default settings): the mean train
    reward (of every generated response) is <= 0.15 over the first 3 steps and >= 0.6 over the last 10, greedy validation rises from 0 to >= 0.6,
    and the run ends with its summary line naming metrics.jsonl, the checkpoint and the HF export."""
    env = {**os.environ, "PYTHON": sys.executable, "NUM_GPUS": "0", "OUTPUT_DIR": str(tmp_path)}
    result = subprocess.run(["bash", "run.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    with open(tmp_path / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    scores = [r["critic/score/all_mean"] for r in rows if "critic/score/all_mean" in r]  # every response's
    vals = [r["val-core/arithmetic/reward/mean@1"] for r in rows if "val-core/arithmetic/reward/mean@1" in r]
    early, late = sum(scores[:3]) / 3, sum(scores[-10:]) / 10
    assert early <= 0.15 and late >= 0.6, (early, late, scores)
    assert vals[0] == 0.0 and vals[-1] >= 0.6, vals
    summary = result.stdout.strip().splitlines()[-1]
    assert summary.startswith("done in ") and f"reward {early:.3f} -> {late:.3f}" in summary, summary
    for where in (tmp_path / "metrics.jsonl", tmp_path / "checkpoint" / "step-60", tmp_path / "hf" / "step-60"):
        assert str(where) in summary and where.exists(), (where, summary)
