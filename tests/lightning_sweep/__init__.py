"""The sweep of Lightning's side (issue 53 item 1): every callback in ``lightning.pytorch.callbacks`` and the utilities
that read parameters or gradients, under dp2, dp2 shard, tp2, pp2 and tp2 x pp2, each cell against one device training
the same tiny GPT (float64), classified ``same`` / ``refused`` / ``wrong`` / ``crash``.

``python -m tests.lightning_sweep`` runs it and writes ``results.json`` and the table in docs/lightning-callbacks.md;
``tests/distributed/test_lightning_sweep_sample.py`` re-runs a fixed sample and compares it with the committed statuses.
"""
