"""Parallelism and compilation applied to the single-device model from outside."""
