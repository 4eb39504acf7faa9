"""Observers of a training session: metrics.jsonl, sessions.jsonl, TensorBoard, progress and console."""
