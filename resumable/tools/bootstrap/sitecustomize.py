"""Chaos's child bootstrap: every Python process of a chaos session (or of a test that hands faults to a child)
starts with this folder on PYTHONPATH (:meth:`resumable.faults.Faults.to_env`), so Python runs this file at start-up,
before the target's code: torchrun's workers, a ``python train.py`` command target and ``resumable-train`` alike.

It runs the ``sitecustomize`` this folder shadows, if there is one, then installs the faults that
``RESUMABLE_FAULTS`` holds (obeyed only with ``RESUMABLE_FAULTS_ARMED=1``) as this process's fault hook
(:func:`resumable.faults.install`). This is the one place the environment is read for faults: the engine asks the
hook, whose default injects nothing.
"""

import importlib.machinery
import importlib.util
import os
import sys


def _run_the_shadowed_sitecustomize() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    others = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", others)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


_run_the_shadowed_sitecustomize()
try:
    from resumable.faults import install_from_env
except ImportError:  # a process of the session that does not see resumable (another interpreter): nothing to inject
    pass
else:
    install_from_env()
