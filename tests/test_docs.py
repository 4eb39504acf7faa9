"""The docs build in strict mode (a warning is an error), and their code runs: every fenced block of Python, shell
or notebook code in README.md and docs/*.md is executed here, or says in a ``<!-- not run: REASON -->`` line just
above it why it cannot be (Colab only, minutes of training, a fragment) and which test covers it instead."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CODE = ("python", "bash", "sh", "console", "ipython3")
# What a fragment of a training loop refers to (the README's five-line example): a tiny model and dataset.
PRELUDE = """
import torch
import torch.nn.functional as F
import resumable
torch.manual_seed(0)
model = torch.nn.Linear(8, 3)
optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5)
train_set = torch.utils.data.TensorDataset(torch.randn(128, 8), torch.randint(0, 3, (128,)))
"""


def blocks() -> list[tuple[str, int, str, str, str | None]]:
    """(page, line, language, code, reason not run) of every fenced code block."""
    found = []
    for page in PAGES:
        lines = page.read_text().split("\n")
        i = 0
        while i < len(lines):
            match = re.match(r"^```(\S*)\s*$", lines[i])
            if match:
                end = next(k for k in range(i + 1, len(lines)) if lines[k].startswith("```"))
                marker = re.match(r"<!-- not run: (.*) -->$", lines[i - 1]) if i else None
                if not match.group(1).startswith("{"):  # a MyST directive ({toctree}) is not code
                    found.append((page.name, i + 1, match.group(1), "\n".join(lines[i + 1:end]),
                                  marker.group(1).strip() if marker else None))
                i = end
            i += 1
    return found


RUN = [b for b in blocks() if b[2] == "python" and b[4] is None]


def test_every_code_block_runs_or_says_why_not() -> None:
    silent = [f"{page}:{line} ({lang})" for page, line, lang, _, reason in blocks()
              if lang in CODE and reason is None and lang != "python"]
    assert not silent, f"blocks neither run nor marked <!-- not run: REASON -->: {silent}"
    assert all(reason for *_, reason in blocks() if reason is not None), "a not-run marker needs its reason"
    assert RUN, "the docs run some code"


@pytest.mark.parametrize("page,line,lang,code,reason", RUN, ids=[f"{b[0]}:{b[1]}" for b in RUN])
def test_a_python_block_runs(page: str, line: int, lang: str, code: str, reason: str | None, tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-c", PRELUDE + code], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, f"{page}:{line} failed:\n{done.stderr[-3000:]}"


@pytest.mark.skipif(importlib.util.find_spec("myst_parser") is None, reason="sphinx and myst-parser (dev extra)")
def test_the_docs_build_strictly(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html", str(ROOT / "docs"),
                           str(tmp_path / "html")], capture_output=True, text=True, timeout=300,
                          stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr[-3000:]


def test_the_module_map_names_every_module() -> None:
    """docs/architecture.md has a line for every module, under its folder (kept true as modules move)."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    rows, folder = [], None
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or (cells[0] and set(cells[0]) <= {"-"}) or cells[0] == "folder":
            continue
        folder = cells[0].strip("`") or folder
        rows += [(folder, name) for name in re.findall(r"`([a-z_]+\.py)`", cells[1])]
    listed = {f"{'' if f == 'resumable/' else 'resumable/'}{f}{name}".replace("resumable/resumable/", "resumable/")
              for f, name in rows}
    modules = {str(p.relative_to(ROOT)) for p in (ROOT / "resumable").rglob("*.py") if p.name != "__init__.py"}
    assert not modules - listed, f"modules missing from docs/architecture.md: {sorted(modules - listed)}"
    assert not listed - modules, f"docs/architecture.md lists modules that do not exist: {sorted(listed - modules)}"
