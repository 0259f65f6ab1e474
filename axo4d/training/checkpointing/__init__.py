"""Checkpoints: sharded saves with torch.distributed.checkpoint, atomic (``COMPLETE`` last), every
file checksummed and verified before it is read; choosing what to resume from; one-file export and
import; claiming the run's output folder. Reads model and optimizer state through placements and
chunks, never through a model class.
"""
