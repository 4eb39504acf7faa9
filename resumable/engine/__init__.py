"""The training engine: the Run facade and the parts it wires (run dir, checkpointer, loop, data, DDP)."""
