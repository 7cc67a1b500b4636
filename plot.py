"""A run's curve: mean train reward and greedy validation against step, from its metrics.jsonl, as a PNG.

    python plot.py outputs/demo/metrics.jsonl               # writes outputs/demo/curve.png
    python plot.py RUN/metrics.jsonl --out curve.png --title "Qwen3-0.6B, GSM8K"

Needs matplotlib (`pip install matplotlib`); without it, one line saying so and exit code 2."""

import argparse
import importlib.util
import json
import os
import sys

SCORE, ALL_SCORE = "critic/score/mean", "critic/score/all_mean"


def read_curves(path: str) -> dict[str, list[tuple[int, float]]]:
    """(step, value) series of the train reward (every generated response's where dynamic sampling logged it) and of
    each validation metric (val-core/...) in a metrics.jsonl."""
    curves = {}
    with open(path) as f:
        for row in (json.loads(line) for line in f if line.strip()):
            score = row.get(ALL_SCORE, row.get(SCORE))
            if score is not None:
                curves.setdefault("train reward (mean)", []).append((row["step"], score))
            for key in (k for k in row if k.startswith("val-core/")):
                curves.setdefault(f"validation ({key.split('/')[-1]}, greedy)", []).append((row["step"], row[key]))
    return curves


def plot(curves: dict[str, list[tuple[int, float]]], out: str, title: str) -> None:
    """Draw the curves on one axis (reward in [0, 1]) and save a PNG."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=120)
    for label, points in curves.items():
        steps, values = zip(*points)
        ax.plot(steps, values, marker="o" if label.startswith("validation") else None, markersize=4, label=label)
    ax.set(xlabel="step", ylabel="reward", title=title)
    ax.grid(alpha=0.3)
    ax.legend(loc="best")
    fig.tight_layout()
    fig.savefig(out)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("metrics", help="a run's metrics.jsonl")
    parser.add_argument("--out", default=None, help="the PNG to write (default: curve.png beside metrics.jsonl)")
    parser.add_argument("--title", default="GRPO")
    args = parser.parse_args(argv)
    if importlib.util.find_spec("matplotlib") is None:
        print("titan-grpo: plot.py needs matplotlib, which is not installed; pip install matplotlib", file=sys.stderr)
        sys.exit(2)
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(args.metrics)), "curve.png")
    plot(read_curves(args.metrics), out, args.title)
    print(f"wrote {out}")


if __name__ == "__main__":
    main(sys.argv[1:])
