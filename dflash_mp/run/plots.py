"""Training curves of a run as PNGs in RUN_DIR/plots/ (`python -m dflash_mp.plot RUN_DIR`, and at the
end of training).

Reads RUN_DIR/metrics.jsonl (one JSON object per optimizer step): loss, per-position accuracy
(`acc`, block indices 1..B-1), acceptance length `tau` where an evaluation logged it,
throughput (`samples_per_s`), and for DFlash 2 the selector (`selector.png`: accepted drafts per
training block along the served and the unary path, top-K recall, selector accuracy).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The step records of a metrics.jsonl; a line cut short by a kill is skipped."""
    records = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and "step" in record:
            records.append(record)
    return records


def _series(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    points = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float))]
    return [s for s, _ in points], [v for _, v in points]


def steady_top(values: list[float]) -> float:
    """An axis top for a rate: 1.2x the 95th percentile after the first step, whose compile or
    warm-up time would otherwise set the scale."""
    steady = sorted(values[1:])
    return 1.2 * steady[min(len(steady) - 1, int(0.95 * len(steady)))]


def _smooth(values: list[float], window: int) -> list[float]:
    """Trailing moving average: per-step metrics of small batches are noisy."""
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def plot_run(run_dir: str | Path) -> list[Path]:
    """Write the run's plots into RUN_DIR/plots/ and return their paths."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a cluster node
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    metrics_path = run_dir / "metrics.jsonl"
    if not metrics_path.is_file():
        raise FileNotFoundError(f"{metrics_path} does not exist: give the run directory of a training job")
    records = read_metrics(metrics_path)
    if not records:
        raise ValueError(f"{metrics_path} holds no step records yet")
    window = max(1, len(records) // 50)
    out_dir = run_dir / "plots"
    out_dir.mkdir(exist_ok=True)
    written = []
    for name, figure in _figures(plt, records, window):  # each saved and closed before the next is drawn
        figure.tight_layout()
        path = out_dir / f"{name}.png"
        figure.savefig(path, dpi=100)
        plt.close(figure)
        written.append(path)
    return written


# The per-step series plotted alone: metrics key, title.
_SERIES = (
    ("loss", "training loss (decay-weighted CE)"),
    ("tau", "acceptance length tau (speculative decoding eval)"),
    ("samples_per_s", "throughput (rows / s, drafter side)"),
)


def _figures(plt: Any, records: list[dict[str, Any]], window: int) -> Iterator[tuple[str, Any]]:
    """(file name, figure) of every plot the records have data for, drawn one at a time."""
    for key, title in _SERIES:
        steps, values = _series(records, key)
        if steps:  # e.g. no evaluation ran, so no tau
            yield key, _series_figure(plt, key, title, steps, values, window)
    with_acc = [r for r in records if isinstance(r.get("acc"), list) and r["acc"]]
    if with_acc:
        yield "acc", _accuracy_figure(plt, with_acc, window)
    with_selector = [r for r in records if isinstance(r.get("accepted_len_selector"), (int, float))]
    if with_selector:  # DFlash 2
        yield "selector", _selector_figure(plt, with_selector, window)


def _series_figure(plt: Any, key: str, title: str, steps: list[int], values: list[float], window: int) -> Any:
    figure, axes = plt.subplots(figsize=(7, 4))
    if key == "tau":  # one point per evaluation: few, and each already an average
        axes.plot(steps, values, marker="o", markersize=3)
    else:
        axes.plot(steps, values, alpha=0.3, label="per step")
        axes.plot(steps, _smooth(values, window), label=f"mean of {window} steps")
        axes.legend(fontsize="small")
    axes.set(xlabel="optimizer step", ylabel=key, title=title)
    if key == "samples_per_s" and len(values) > 2:
        axes.set_ylim(0, steady_top(values))
    axes.grid(alpha=0.3)
    return figure


def _accuracy_figure(plt: Any, with_acc: list[dict[str, Any]], window: int) -> Any:
    """Top-1 accuracy at each block position k, one line per k."""
    figure, axes = plt.subplots(figsize=(7, 4))
    steps = [r["step"] for r in with_acc]
    for k in range(len(with_acc[0]["acc"])):
        accuracy = [r["acc"][k] if k < len(r["acc"]) else 0.0 for r in with_acc]
        axes.plot(steps, _smooth(accuracy, window), label=f"k={k + 1}")
    axes.set(
        xlabel="optimizer step",
        ylabel="top-1 accuracy",
        title=f"accuracy by block position k (mean of {window} steps)",
        ylim=(0, 1),
    )
    axes.grid(alpha=0.3)
    axes.legend(fontsize="small", ncol=2)
    return figure


def _selector_figure(plt: Any, with_selector: list[dict[str, Any]], window: int) -> Any:
    """DFlash 2: accepted drafts per block by path, and the selector's recall and accuracy."""
    figure, (paths, heads) = plt.subplots(1, 2, figsize=(11, 4))
    steps = [r["step"] for r in with_selector]
    for key, label in (
        ("accepted_len_selector", "served (selector walk)"),
        ("accepted_len_unary", "unary argmax"),
    ):
        paths.plot(steps, _smooth([r[key] for r in with_selector], window), label=label)
    paths.set(xlabel="optimizer step", ylabel="accepted drafts per block", title="training blocks, by path")
    for key, label in (
        ("topk_recall", "unary top-K recall"),
        ("selector_acc", "selector accuracy (teacher-forced)"),
    ):
        means = [sum(r[key]) / max(len(r[key]), 1) for r in with_selector]
        heads.plot(steps, _smooth(means, window), label=label)
    heads.set(xlabel="optimizer step", ylabel="mean over block positions", ylim=(0, 1), title="selector")
    for axes in (paths, heads):
        axes.grid(alpha=0.3)
        axes.legend(fontsize="small")
    return figure
