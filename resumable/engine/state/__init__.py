"""What a checkpoint holds and how it comes back: the state keeper (save, resume, prune), the loop counters and RNG
streams, frozen tensors, the checks of a payload before it is loaded and the verification that a resume took effect,
the computation a checkpoint must match, the position remapped when the data or the world size changed, and the
determinism switches and hardware each checkpoint records."""
