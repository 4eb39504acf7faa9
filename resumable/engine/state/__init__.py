"""What a checkpoint holds and how it comes back: the state keeper (save, resume, prune), the loop counters and RNG
streams, frozen tensors, verification that a resume took effect, the computation a checkpoint must match, and the
determinism switches and hardware each checkpoint records."""
