"""Optimizers over a model's parameter pieces: AdamW over the slices this rank owns (the sharded
optimizer over ``data``, ZeRO-1) and host offload of its state. Talks to the model's schedule only
through the schedule's bucket interface (:class:`axo4d.nn.schedule.Schedule`); knows nothing of
data or checkpoint files (it describes its state as chunks of logical tensors).
"""
