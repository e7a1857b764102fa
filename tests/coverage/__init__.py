"""The coverage sweep: every transformers family of three tasks under dp2, tp2, pp2 and cp2 (issue 29).

* :mod:`tests.coverage.configs` — which families (the installed transformers' auto mappings) and each one's
  tiny config, derived from its config class by attribute name (:data:`~tests.coverage.configs.OVERRIDES` lists
  the few exceptions, each with its reason; :data:`~tests.coverage.configs.EAGER_EXPERTS` the
  mixture-of-experts implementation every layout runs, and why);
* :mod:`tests.coverage.models` — the LightningModule wrappers and synthetic data per task;
* :mod:`tests.coverage.cells` — one cell: the Trainer, the comparison with single-device training, the verdict
  (and :func:`~tests.coverage.cells.settings`, what a cell runs beyond its layout's defaults, e.g.
  ``sync_batchnorm=True`` for data parallelism over BatchNorm);
* :mod:`tests.coverage.world` — the torchrun entry point: one world of 2 ranks loops over every cell;
* :mod:`tests.coverage.sweep` — the parent: references, the world and its watchdog, ``results.json``;
* :mod:`tests.coverage.report` — the Markdown summary and README.md's generated block.

Run ``python -m tests.coverage --help``.
"""
