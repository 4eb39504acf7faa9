"""The training loop and its policies: when to save (triggers), when to stop (the session budget, stop signals,
the planned stop under torchrun) and what to do when a step hangs (the watchdog)."""
