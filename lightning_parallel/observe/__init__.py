"""Observing what a layout costs: communication counters and training summaries."""
