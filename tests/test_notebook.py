"""scripts/colab_quickstart.ipynb: a valid notebook whose non-Colab cells train, resume and plot on the CPU."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import types
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


class Notebook:
    """Runs code cells in one namespace, as IPython would: ``!cmd`` lines go to the shell after ``{NAME}``
    expansion from the namespace; each shell result is kept, and a non-zero exit fails the test."""

    def __init__(self, cells: list[dict[str, Any]]) -> None:
        self.cells = cells
        self.namespace: dict[str, Any] = {"__name__": "__main__", "_shell": self.shell}
        self.results: list[subprocess.CompletedProcess[str]] = []
        self.env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}

    def shell(self, command: str) -> None:
        command = command.format_map(self.namespace)
        result = subprocess.run(command, shell=True, env=self.env, capture_output=True, text=True, timeout=300)
        self.results.append(result)
        assert result.returncode == 0, f"!{command} exited {result.returncode}:\n{result.stdout}\n{result.stderr}"

    def run(self, index: int) -> None:
        lines = []
        for line in source(self.cells[index]).splitlines():
            stripped = line.lstrip()
            if stripped.startswith("!"):
                line = f"{line[:len(line) - len(stripped)]}_shell({stripped[1:]!r})"
            lines.append(line)
        exec(compile("\n".join(lines), f"<cell {index}>", "exec"), self.namespace)


def test_notebook_runs_and_resumes_on_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data_dir = os.environ.get(MNIST_ENV)
    if not data_dir:
        pytest.skip(f"set {MNIST_ENV} to a folder with MNIST/raw/ (e.g. ../shared/data/mnist-mini) to run the "
                    "notebook's cells")
    if not (Path(data_dir) / "MNIST" / "raw").is_dir():
        pytest.skip(f"{MNIST_ENV}={data_dir} has no MNIST/raw/ folder")
    try:
        import IPython.display  # noqa: F401
        shown: list[Any] | None = None
    except ImportError:  # a stub, so the plot cell's display path runs too
        shown = []
        stub = types.ModuleType("IPython.display")
        stub.Image = lambda filename: Path(filename)
        stub.display = shown.append
        monkeypatch.setitem(sys.modules, "IPython", types.ModuleType("IPython"))
        monkeypatch.setitem(sys.modules, "IPython.display", stub)
    monkeypatch.chdir(tmp_path)

    cells = load()["cells"]
    code = [i for i, cell in enumerate(cells) if cell["cell_type"] == "code" and "colab-only" not in tags(cell)]
    (parameters,) = [i for i in code if "parameters" in tags(cells[i])]
    (train,) = [i for i in code if "!resumable-train" in source(cells[i])]
    (plot,) = [i for i in code if "!resumable plot" in source(cells[i])]
    (api,) = [i for i in code if "resumable.Run(" in source(cells[i])]
    (hf,) = [i for i in code if "ResumableCallback(" in source(cells[i])]
    monkeypatch.delenv("WANDB_API_KEY", raising=False)  # the W&B cell is skipped without a key
    notebook = Notebook(cells)
    notebook.run(parameters)  # the defaults must at least be valid Python...
    assert {"RUN_DIR", "DATA_DIR", "EPOCHS", "EXTRA", "MAX_STEPS_API", "RESUMABLE_SOURCE", "WANDB_PROJECT",
            "TRAINER_STEPS"} <= notebook.namespace.keys()
    run_dir = tmp_path / "run"
    notebook.namespace.update(  # ...then the test's values replace them
        RUN_DIR=str(run_dir), DATA_DIR=data_dir, EPOCHS=1, EXTRA="--max-steps 10 --no-progress --device cpu",
        MAX_STEPS_API=10, NUM_WORKERS=2, TRAINER_STEPS=20)

    for i in code:
        if i == parameters:
            continue
        if i == train:
            notebook.run(i)
            assert "training on cpu" in notebook.results[-1].stderr
            # Re-running the cell continues the run: here to a higher --max-steps, then once more when complete.
            notebook.namespace["EXTRA"] = "--max-steps 20 --no-progress --device cpu"
            notebook.run(i)
            assert "resuming from step 10" in notebook.results[-1].stderr
            notebook.run(i)
            assert "already complete at step 20" in notebook.results[-1].stderr
            continue
        notebook.run(i)
        if i == plot:
            assert (run_dir / "training.png").stat().st_size > 0
            assert shown is None or shown == [run_dir / "training.png"]
        if i == api:
            assert notebook.namespace["run"].finished
            assert notebook.namespace["run"].state.step == 10
        if i == hf:  # the Trainer trained to the end, and each checkpoint it wrote is committed
            assert notebook.namespace["callback"].exit_code == 0
            assert notebook.namespace["trainer"].state.global_step == 20
            assert (tmp_path / "run-trainer" / "checkpoint-20" / "manifest.json").is_file()

    own = tmp_path / "run-own" / "checkpoints"
    assert any((step / "manifest.json").is_file() for step in own.glob("step-*"))
    # Re-running the API cell finds the complete run instead of training again.
    notebook.run(api)
    assert notebook.namespace["run"].finished and notebook.namespace["run"].resumed_from == 10
    # Re-running the Trainer cell finds its newest committed checkpoint complete and does not train again.
    notebook.run(hf)
    assert notebook.namespace["callback"].exit_code == 0 and notebook.namespace["trainer"].state.global_step == 0
    saved = sorted(path.name for path in (tmp_path / "run-trainer").glob("checkpoint-*"))
    assert saved == ["checkpoint-10", "checkpoint-20"]  # no checkpoint-21


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
