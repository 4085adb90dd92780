"""PNG figures of the experiments (matplotlib, Agg backend; the optional ``sim`` extra)."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

from lumen_core.sim.experiments import Outcome


def pyplot() -> ModuleType:
    """matplotlib.pyplot on the Agg backend; RuntimeError when matplotlib is missing."""
    try:
        import matplotlib
    except ImportError as error:
        raise RuntimeError("--plot needs matplotlib: pip install 'lumen_core[sim]'") from error
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: Path) -> Path:  # type: ignore[no-untyped-def]
    """Lay out, write as a 120-dpi PNG and close ``fig``; returns ``path``."""
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    pyplot().close(fig)
    return path


def _path(base: str | Path, suffix: str) -> Path:
    base = Path(base)
    stem = base.with_suffix("") if base.suffix == ".png" else base
    return Path(f"{stem}-{suffix}.png") if suffix else stem.with_suffix(".png")


def plot_outcome(outcome: Outcome, path: str | Path) -> list[Path]:
    """Draw what the experiment has series for: one figure goes to ``path``, several to
    ``<path>-<series>.png``. Returns the files written (maybe none)."""
    drawers = {
        "rolling": _plot_rolling,
        "bars": _plot_bars,
        "curves": _plot_curves,
        "coverage": _plot_coverage,
    }
    present = [name for name in drawers if name in outcome.series]
    return [drawers[name](outcome, _path(path, name if len(present) > 1 else "")) for name in present]


def _plot_rolling(outcome: Outcome, path: Path) -> Path:
    plt = pyplot()
    series = outcome.series["rolling"]
    assert isinstance(series, dict)
    fig, axes = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    for name, values in series.items():
        if not isinstance(values, dict):
            continue
        style = "--" if name == "failure-free" else "-"
        axes[0].plot(series["t_s"], values["ttft_s"], style, label=name)
        axes[1].plot(series["t_s"], [v * 1000 for v in values["tpot_s"]], style, label=name)
    for ax in axes:
        ax.axvline(0.0, color="grey", lw=0.8)
    axes[0].set_ylabel("rolling mean TTFT (s)")
    axes[1].set_ylabel("rolling mean TPOT (ms)")
    axes[1].set_xlabel("time from the failure (s), requests by arrival")
    axes[0].legend()
    axes[0].set_title(f"{outcome.experiment}: TTFT and TPOT around the failure")
    return save_figure(fig, path)


def _plot_bars(outcome: Outcome, path: Path) -> Path:
    plt = pyplot()
    bars = outcome.series["bars"]
    assert isinstance(bars, dict)
    labels = list(bars)
    metrics = ("mean_ttft_s", "mean_tpot_s", "recovery_s")
    fig, axes = plt.subplots(1, 3, figsize=(13, 4.5))
    for ax, metric in zip(axes, metrics):
        ax.barh(labels, [bars[label][metric] for label in labels])
        ax.set_title(metric)
    fig.suptitle("ablation: LUMEN's mechanisms on top of FC (proto4)")
    return save_figure(fig, path)


def _plot_curves(outcome: Outcome, path: Path) -> Path:
    plt = pyplot()
    curves = outcome.series["curves"]
    assert isinstance(curves, dict)
    fig, axes = plt.subplots(2, len(curves), figsize=(3 * len(curves), 5.5), squeeze=False)
    for col, (parameter, curve) in enumerate(curves.items()):
        for row, metric in enumerate(("mean_ttft_s", "recovery_s")):
            ax = axes[row][col]
            ax.plot(curve["x"], curve[metric], "o-")
            ax.set_xlabel(parameter)
            if col == 0:
                ax.set_ylabel(metric)
    fig.suptitle("sensitivity of LUMEN (proto4)")
    return save_figure(fig, path)


def _plot_coverage(outcome: Outcome, path: Path) -> Path:
    plt = pyplot()
    data = outcome.series["coverage"]
    assert isinstance(data, dict)
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, values in data["budgets"].items():
        ax.plot(data["prompts"], values, "o-", label=f"budget {label}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("checkpoint coverage at the failure")
    ax.legend()
    return save_figure(fig, path)
