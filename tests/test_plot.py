"""plot.py: a run's metrics.jsonl as a PNG of reward and validation against step."""

import json
import os
import subprocess
import sys

from conftest import ROOT

ROWS = [{"step": 0, "val-core/arithmetic/reward/mean@1": 0.0}] + [
    {"step": s, "critic/score/mean": s / 10, "actor/pg_loss": 0.0} for s in range(1, 11)] + [
    {"step": 10, "critic/score/mean": 1.0, "val-core/arithmetic/reward/mean@1": 0.8}]


def test_plot_writes_a_png_of_reward_and_validation(tmp_path):
    import plot

    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    curves = plot.read_curves(str(path))
    assert curves["train reward (mean)"][:2] == [(1, 0.1), (2, 0.2)]
    assert curves["validation (mean@1, greedy)"] == [(0, 0.0), (10, 0.8)]
    result = subprocess.run([sys.executable, os.path.join(ROOT, "plot.py"), str(path)], capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    with open(tmp_path / "curve.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_is_one_line_and_exit_2(tmp_path):
    script = ("import runpy, sys; sys.modules['matplotlib'] = None; sys.argv = ['plot.py', 'metrics.jsonl']; "
              f"runpy.run_path({os.path.join(ROOT, 'plot.py')!r}, run_name='__main__')")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 2 and result.stderr == (
        "titan-grpo: plot.py needs matplotlib, which is not installed; pip install matplotlib\n"), result.stderr
