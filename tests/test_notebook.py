"""scripts/colab_quickstart.ipynb: a valid notebook whose non-Colab cells train, resume and plot on the CPU, in a
real Jupyter kernel."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

NOTEBOOK = Path(__file__).resolve().parent.parent / "scripts" / "colab_quickstart.ipynb"
MNIST_ENV = "RESUMABLE_TEST_MNIST"


def load() -> dict[str, Any]:
    return json.loads(NOTEBOOK.read_text(encoding="utf-8"))


def source(cell: dict[str, Any]) -> str:
    text = cell["source"]
    return text if isinstance(text, str) else "".join(text)


def tags(cell: dict[str, Any]) -> list[str]:
    return cell.get("metadata", {}).get("tags", [])


def test_notebook_structure() -> None:
    nb = load()
    assert nb["nbformat"] == 4 and isinstance(nb["nbformat_minor"], int)
    assert nb["metadata"]["kernelspec"]["name"] == "python3"
    cells = nb["cells"]
    assert isinstance(cells, list) and cells
    for cell in cells:
        assert cell["cell_type"] in ("markdown", "code")
        assert isinstance(cell["source"], (str, list)) and source(cell).strip()
        assert isinstance(cell.get("metadata"), dict)
        if nb["nbformat_minor"] >= 5:
            assert re.fullmatch(r"[a-zA-Z0-9_-]{1,64}", cell["id"])
        if cell["cell_type"] == "code":
            assert cell["outputs"] == [] and cell["execution_count"] is None  # stored without outputs
    if nb["nbformat_minor"] >= 5:
        assert len({cell["id"] for cell in cells}) == len(cells)
    code = [cell for cell in cells if cell["cell_type"] == "code"]
    assert any("colab-only" in tags(cell) for cell in code)
    assert all("google.colab" not in source(cell) for cell in code if "colab-only" not in tags(cell))
    assert sum("parameters" in tags(cell) for cell in cells) == 1
    assert [cell for cell in code if "resumable-train" in source(cell) and source(cell).lstrip().startswith("!")]
    try:
        import nbformat
    except ImportError:
        return
    nbformat.validate(nbformat.reads(NOTEBOOK.read_text(encoding="utf-8"), as_version=4))


def test_the_notebook_runs_top_to_bottom_twice_in_a_kernel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every cell that is not Colab-only, in a real Jupyter kernel, from top to bottom; then all of them again, as a
    user does after a disconnect: the second pass finds each run complete and says so, without training again."""
    data_dir = os.environ.get(MNIST_ENV)
    if not data_dir:
        pytest.skip(f"set {MNIST_ENV} to a folder with MNIST/raw/ (e.g. ../shared/data/mnist-mini) to run the "
                    "notebook's cells")
    if not (Path(data_dir) / "MNIST" / "raw").is_dir():
        pytest.skip(f"{MNIST_ENV}={data_dir} has no MNIST/raw/ folder")
    from kernel import Kernel

    cells = load()["cells"]
    code = [i for i, cell in enumerate(cells) if cell["cell_type"] == "code" and "colab-only" not in tags(cell)]
    (parameters,) = [i for i in code if "parameters" in tags(cells[i])]
    (train,) = [i for i in code if "!resumable-train" in source(cells[i])]
    (plot,) = [i for i in code if "!resumable plot" in source(cells[i])]
    (api,) = [i for i in code if "resumable.Run(" in source(cells[i])]
    (hf,) = [i for i in code if "ResumableCallback(" in source(cells[i])]
    monkeypatch.delenv("WANDB_API_KEY", raising=False)  # the W&B cell is skipped without a key
    run_dir = tmp_path / "run"
    kernel = Kernel(tmp_path, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    try:
        for attempt in (1, 2):
            for i in code:
                cell = kernel.run(source(cells[i]), timeout=300)
                assert cell.done and cell.error is None, (i, cell)
                if i == parameters:  # the defaults are valid Python; the test's values replace them
                    assert {"RUN_DIR", "DATA_DIR", "EPOCHS", "EXTRA", "MAX_STEPS_API", "RESUMABLE_SOURCE",
                            "WANDB_PROJECT", "TRAINER_STEPS"} <= set(kernel.value("list(globals())"))
                    kernel.run(f"RUN_DIR = {str(run_dir)!r}; DATA_DIR = {data_dir!r}; EPOCHS = 1; MAX_STEPS_API = 10; "
                               f"EXTRA = '--max-steps 10 --no-progress --device cpu'; NUM_WORKERS = 2; "
                               f"TRAINER_STEPS = 20")
                elif i == train:
                    assert kernel.value("_exit_code") == 0, cell.text
                    expected = "training on cpu" if attempt == 1 else "already complete at step 10"
                    assert expected in cell.text, cell.text
                elif i == plot:
                    assert (run_dir / "training.png").stat().st_size > 0
                    assert any("image/png" in output.get("data", {}) for output in cell.outputs)
                elif i == api:
                    assert kernel.value("(run.finished, run.state.step, run.resumed_from)") == (
                        True, 10, None if attempt == 1 else 10)
                elif i == hf:  # complete after the first pass; the second loads its final state, training nothing
                    assert kernel.value("(callback.exit_code, trainer.state.global_step)") == (0, 20)
                    assert len(kernel.value("trainer.state.log_history")) > 1
                    saved = sorted(path.name for path in (tmp_path / "run-trainer").glob("checkpoint-*"))
                    assert saved == ["checkpoint-10", "checkpoint-20"]  # no checkpoint-21
                    assert (tmp_path / "run-trainer" / "checkpoint-20" / "manifest.json").is_file()
    finally:
        kernel.shutdown()
    own = tmp_path / "run-own" / "checkpoints"
    assert any((step / "manifest.json").is_file() for step in own.glob("step-*"))


def _cell(marker: str) -> dict[str, Any]:
    (found,) = [cell for cell in load()["cells"] if cell["cell_type"] == "code" and marker in source(cell)]
    return found


def test_install_cell_installs_from_the_source_parameter_or_says_what_to_do(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cell = _cell("EXTRAS = ")  # the colab-only install cell: no placeholder, the parameter decides
    assert "OWNER" not in json.dumps(load())
    calls: list[list[str]] = []
    monkeypatch.setattr(subprocess, "run", lambda args, check: calls.append(args))
    copy = tmp_path / "resumable"
    copy.mkdir()
    for where in (str(copy), "git+https://example.org/resumable.git"):
        exec(compile(source(cell), "<install>", "exec"), {"RESUMABLE_SOURCE": where})
    assert [args[-1] for args in calls] == [f"resumable[drive,plot,wandb,hf] @ file://{copy}",
                                            "resumable[drive,plot,wandb,hf] @ git+https://example.org/resumable.git"]
    with pytest.raises(SystemExit, match="upload the resumable repository folder to your Drive"):
        exec(compile(source(cell), "<install>", "exec"), {"RESUMABLE_SOURCE": str(tmp_path / "missing")})
    assert len(calls) == 2  # nothing installed from a folder that is not there


def test_wandb_cell_adds_the_option_only_with_a_key(monkeypatch: pytest.MonkeyPatch) -> None:
    cell = compile(source(_cell("--wandb {WANDB_PROJECT}")), "<wandb>", "exec")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    namespace = {"EXTRA": "--max-steps 5", "WANDB_PROJECT": "p"}
    exec(cell, namespace)
    assert namespace["EXTRA"] == "--max-steps 5"
    monkeypatch.setenv("WANDB_API_KEY", "k")
    exec(cell, namespace)
    assert namespace["EXTRA"] == "--max-steps 5 --wandb p"
