"""Commands built on the engine: chaos (and its targets and fork server), torchrun launcher, plot, export."""
