"""``resumable plot``: what gets plotted, read from a hand-written run dir (no training)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from resumable.tools.plot import plot_command, plot_data, render


def write_jsonl(path: Path, records: list[dict], torn: str = "") -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + torn, encoding="utf-8")


def fake_run(run_dir: Path) -> Path:
    """60 steps logged every step, an evaluation at the end of each 20-step epoch, killed twice and resumed."""
    run_dir.mkdir(parents=True, exist_ok=True)
    metrics: list[dict] = []
    for step in range(1, 61):
        epoch = (step - 1) // 20
        metrics.append({"step": step, "epoch": epoch, "loss": 2.0 / step, "lr": 0.1 * (1 - step / 61),
                        "samples_per_s": 500.0, "time": 1000.0 + step})
        if step % 20 == 0:
            metrics.append({"step": step, "epoch": epoch, "train_loss": 2.0 / step, "test_loss": 2.5 / step,
                            "test_acc": 0.5 + step / 200, "elapsed_s": float(step), "time": 1000.0 + step})
    write_jsonl(run_dir / "metrics.jsonl", metrics, torn='{"step": 61, "epoch": 3, "lo')
    sessions = [
        {"event": "start", "session": 1, "time": 1000.0, "step": 0, "resumed_from": None, "host": "h", "pid": 1},
        {"event": "end", "session": 1, "time": 1025.0, "step": 25, "ended": "SIGTERM"},
        {"event": "start", "session": 2, "time": 1030.0, "step": 20, "resumed_from": 20, "host": "h", "pid": 2},
        {"event": "start", "session": 3, "time": 1050.0, "step": 40, "resumed_from": 40, "host": "h", "pid": 3},
        {"event": "end", "session": 3, "time": 1070.0, "step": 60, "ended": "finished"},
    ]
    write_jsonl(run_dir / "sessions.jsonl", sessions, torn='{"event": "start", "sess')
    return run_dir


def test_plot_data(tmp_path: Path) -> None:
    data = plot_data(fake_run(tmp_path))
    assert data.resume_steps == [20, 40]
    assert data.loss_steps == list(range(1, 61)) and len(data.loss) == 60
    assert data.lr_steps == list(range(1, 61)) and len(data.lr) == 60
    assert data.acc_steps == [20, 40, 60] and data.acc == pytest.approx([0.6, 0.7, 0.8])
    assert data.acc_key == "test_acc"


def test_plot_data_other_evaluation_metric(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "metrics.jsonl", [{"step": 1, "epoch": 0, "loss": 1.0, "lr": 0.1},
                                             {"step": 1, "epoch": 0, "train_loss": 1.0, "val_f1": 0.4}])
    data = plot_data(tmp_path)
    assert data.acc_key == "val_f1" and data.acc == [0.4] and data.resume_steps == []


def test_plot_command(tmp_path: Path) -> None:
    run_dir = fake_run(tmp_path / "run")
    runner = CliRunner()
    result = runner.invoke(plot_command, [str(run_dir)])
    assert result.exit_code == 0, result.output
    png = run_dir / "training.png"
    assert png.read_bytes().startswith(b"\x89PNG")
    assert result.output.strip() == f"wrote {png} (60 training records, 3 evaluations, 2 resumes)"

    out = tmp_path / "elsewhere" / "plot.png"
    result = runner.invoke(plot_command, [str(run_dir), "--out", str(out), "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output)
    assert summary == {"png": str(out), "loss_points": 60, "acc_points": 3, "lr_points": 60, "resume_steps": [20, 40]}
    assert out.read_bytes().startswith(b"\x89PNG")


@pytest.mark.parametrize("contents", [None, "", '{"step": 1, "lo'])
def test_plot_no_metrics(tmp_path: Path, contents: str | None) -> None:
    if contents is not None:
        (tmp_path / "metrics.jsonl").write_text(contents, encoding="utf-8")
    with pytest.raises(ValueError, match="metrics.jsonl"):
        plot_data(tmp_path)
    result = CliRunner().invoke(plot_command, [str(tmp_path)])
    assert result.exit_code == 2
    assert result.output.startswith("error: ") and result.output.count("\n") == 1 and "metrics.jsonl" in result.output
    assert not (tmp_path / "training.png").exists()


def test_plot_without_matplotlib(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` raise ImportError
    with pytest.raises(ImportError, match=r"pip install 'resumable\[plot\]'"):
        render(plot_data(fake_run(tmp_path)), tmp_path / "x.png", "x")
    result = CliRunner().invoke(plot_command, [str(tmp_path)])
    assert result.exit_code == 2 and "pip install" in result.output
