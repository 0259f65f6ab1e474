"""Training: what runs a job on the grid once the model exists.

Sub-packages, bottom to top (a sub-package imports those before it, never after; checked by
``tests/unit/test_architecture.py``):

* :mod:`axo4d.training.datasets` -- token sources, tokenizers, the batches of a step;
* :mod:`axo4d.training.optim` -- the sharded optimizer and host offload;
* :mod:`axo4d.training.checkpointing` -- saving, verifying, choosing and loading checkpoints, the
  output folder;
* :mod:`axo4d.training.hf` -- Hugging Face folders in and out;

and beside them the modules that tie them together: :mod:`~axo4d.training.startup` (the one
start-up path of every command line), :mod:`~axo4d.training.trainer` (a step),
:mod:`~axo4d.training.memory_plan` (the start-up memory check), :mod:`~axo4d.training.init_from`,
metrics, performance figures and plots.
"""
