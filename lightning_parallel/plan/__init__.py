"""Planning layouts: dry-run a model on the meta device, predict what each layout costs, recommend one.

Run ``python -m lightning_parallel.plan [Hydra overrides]``; in code see :func:`~lightning_parallel.plan.planner.plan`.
"""
