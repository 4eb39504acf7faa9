"""Built-in training tasks."""
