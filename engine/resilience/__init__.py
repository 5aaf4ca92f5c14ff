"""Keeping a long run alive: preemption signals, non-finite and spiking steps, hung collectives."""
