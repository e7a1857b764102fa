"""Measuring tools: gradient-communication counters, DTensor collective tallies, per-rank state bytes.

Used by :mod:`lightning_parallel.parallelize` (counting DDP's hooks), :mod:`lightning_parallel.plan` (dry
runs) and :mod:`lightning_parallel.observe` (training-time monitors), so it sits below all three. No Lightning here.
"""
