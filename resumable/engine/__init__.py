"""The training engine: :class:`~resumable.engine.run.Run` (run.py) is the facade over five parts, each importing
only the ones listed after it.

- ``session/``: one session of a Run in its process (a script or a notebook kernel): the session itself (run dir
  opened, checkpoint loaded, the loop, its reporters), the open runs and how a loop was left, the fresh start, the
  code identity and the session's end.
- ``loop/``: the loop and its policies (save triggers, the session budget and stop signals, the step watchdog,
  the planned stop under torchrun).
- ``state/``: what a checkpoint holds and how it comes back (the state keeper, loop counters and RNG streams,
  frozen tensors, the checks before and after a restore, the computation a checkpoint must match, the position
  remapped when the data or world size changed, determinism, hardware).
- ``data/``: where batches come from and the exact position in them (map-style sources, the sampler, streams,
  the content check of the first batch after a resume).
- ``rundir/``: who owns a run dir and which checkpoint a session starts from (location, lock, lease, rewind, the
  crash-loop check).
"""
