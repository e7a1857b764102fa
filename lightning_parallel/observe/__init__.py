"""Observing what a layout costs while it trains: Lightning callbacks (summary, ScalingMonitor) and plots.

The counters they read (gradient communication, DTensor collectives, state bytes) live in
:mod:`lightning_parallel.measure`.
"""
