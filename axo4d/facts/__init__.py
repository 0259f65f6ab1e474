"""The model facts: torch-free values that describe a model on a grid, shared by the library and the
performance model (the only part of ``axo4d`` that ``perfmodel`` reads).

``grid`` (the grid's rank arithmetic, groups, orders), ``placement`` (each parameter's typed split
over the axes, how its gradient is summed and cut into checkpoint chunks), ``parts`` (the parts of a
block: placements, collectives, FLOPs, divisibility), ``spec`` (whole models on a grid: shapes,
padded vocabulary, parameter counts), ``archs`` (the architecture registry), ``memory`` (memory per
rank), ``schedule_rules`` (the schedule's constants and bucket rule) and ``fp8_rule`` (which GEMMs
take FP8). Nothing here imports torch or communicates.
"""
