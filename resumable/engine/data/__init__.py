"""Where batches come from and the exact position in them: what ``Run(data=...)`` was given (wrap.py), map-style
sources and the sampler's epoch order, streams, and the content check of the first batch after a resume."""
