"""Where batches come from and the exact position in them: what ``Run(data=...)`` was given (wrap.py), map-style
sources and the sampler's epoch order, streams, the content check of the first batch after a resume, and remapping a
position when the data or the number of processes changed."""
