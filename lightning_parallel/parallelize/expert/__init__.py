"""Expert parallelism: a Mixture-of-Experts block's routed experts divided by expert index over the ``ep`` ranks.

:mod:`.experts` (finding grouped experts and sharding them by expert index), :mod:`.module_list` (experts kept as an
``nn.ModuleList`` of MLPs: each rank keeps its own, the MoE block's forward runs twice around one exchange),
:mod:`.dispatch` (tokens sent to the
rank holding their expert and the results brought back, dropless, by two all-to-alls), :mod:`.gradients` (the
expert gradients' reduction over the ranks that hold the same experts). ``ep`` borrows its ranks from data
parallelism, as in torchtitan and Megatron: the world size is unchanged, and the ranks of one ``ep`` group see
different batches, so the all-to-all carries every token to its expert. No Lightning here.
"""
