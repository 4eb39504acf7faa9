"""``resumable plot RUN_DIR``: training loss, test accuracy and learning rate against step, with a dashed line
where each session resumed. matplotlib is optional (``pip install 'resumable[plot]'``) and imported lazily."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from numbers import Real
from pathlib import Path

import click

from ..reporting.history import read_sessions
from ..reporting.metrics import read_records

METRICS = "metrics.jsonl"
MAIN_METRIC = "test_acc"
# Numeric keys that are not evaluation metrics; any other numeric key of a record is one.
NOT_EVALUATION = frozenset({"step", "epoch", "time", "elapsed_s", "samples_per_s", "train_loss", "loss", "lr"})


@dataclass
class PlotData:
    """Exactly what gets plotted."""

    loss_steps: list[int] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)
    acc_steps: list[int] = field(default_factory=list)
    acc: list[float] = field(default_factory=list)
    lr_steps: list[int] = field(default_factory=list)
    lr: list[float] = field(default_factory=list)
    resume_steps: list[int] = field(default_factory=list)
    acc_key: str = MAIN_METRIC  # test_acc, or the first other evaluation metric when a model logs none


def _number(value: object) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool)


def _series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    points = [(r["step"], float(r[key])) for r in records if _number(r.get(key))]
    return [s for s, _ in points], [v for _, v in points]


def plot_data(run_dir: Path) -> PlotData:
    """Read ``RUN_DIR/metrics.jsonl`` and ``RUN_DIR/sessions.jsonl`` (torn last lines ignored)."""
    path = Path(run_dir) / METRICS
    if not path.is_file():
        raise ValueError(f"no {path}: pass a run dir that has been trained in (resumable-train --run-dir DIR)")
    records = [r for r in read_records(path) if isinstance(r.get("step"), int) and not isinstance(r["step"], bool)]
    if not records:
        raise ValueError(f"{path} has no records yet: train for at least --log-every steps, then plot again")
    acc_key = MAIN_METRIC
    if not any(_number(r.get(MAIN_METRIC)) for r in records):
        others = [k for r in records for k, v in r.items() if k not in NOT_EVALUATION and _number(v)]
        acc_key = others[0] if others else MAIN_METRIC
    data = PlotData(acc_key=acc_key)
    data.loss_steps, data.loss = _series(records, "loss")
    data.acc_steps, data.acc = _series(records, acc_key)
    data.lr_steps, data.lr = _series(records, "lr")
    data.resume_steps = [s.resumed_from for s in read_sessions(Path(run_dir)) if s.resumed_from is not None]
    return data


def render(data: PlotData, out: Path, title: str) -> Path:
    """Draw three stacked panels sharing the step axis and save them as a PNG at ``out``."""
    try:
        import matplotlib
    except ImportError as e:
        raise ImportError("plotting needs matplotlib: pip install 'resumable[plot]' (or pip install matplotlib)") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, sharex=True, figsize=(9, 8))
    try:
        panels = ((data.loss_steps, data.loss, "training loss", {}),
                  (data.acc_steps, data.acc, data.acc_key.replace("_", " "), {"marker": "o"}),
                  (data.lr_steps, data.lr, "learning rate", {}))
        for ax, (steps, values, label, style) in zip(axes, panels, strict=True):
            ax.plot(steps, values, label=label, **style)
            ax.set_ylabel(label)
            ax.grid(True, alpha=0.3)
            for i, step in enumerate(data.resume_steps):
                ax.axvline(step, color="grey", linestyle="--", linewidth=1, label="resumed" if i == 0 else None)
            ax.legend(loc="best", fontsize="small")
        axes[0].set_title(title)
        axes[-1].set_xlabel("step")
        fig.tight_layout()
        out = Path(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, dpi=120, format="png")
    finally:
        plt.close(fig)
    return out


@click.command("plot")
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Where to write the PNG.  [default: RUN_DIR/training.png]")
@click.option("--json", "as_json", is_flag=True, help="After writing the PNG, print a JSON summary instead of a line.")
def plot_command(run_dir: Path, out: Path | None, as_json: bool) -> None:
    """Plot RUN_DIR's training loss, test accuracy and learning rate, marking where each session resumed."""
    try:
        data = plot_data(run_dir)
        png = render(data, out or run_dir / "training.png", title=run_dir.resolve().name)
    except (ValueError, ImportError, OSError) as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    if as_json:
        click.echo(json.dumps({"png": str(png), "loss_points": len(data.loss), "acc_points": len(data.acc),
                               "lr_points": len(data.lr), "resume_steps": data.resume_steps}))
    else:
        click.echo(f"wrote {png} ({len(data.loss)} training records, {len(data.acc)} evaluations, "
                   f"{len(data.resume_steps)} resumes)")
