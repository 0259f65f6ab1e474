"""Performance model of 4D-parallel GPT training (docs/design.md section 4).

Public API::

    from perfmodel import estimate, rank_grids, load_machine, counted_bytes
    est = estimate(model_from_name("gpt-20b"), Grid.parse("data=4,x=8,y=8,z=4"), 64,
                   load_machine("perlmutter"))

Command line: ``python -m perfmodel {rank,explain,tts,profile} --help``.
"""

from .collectives import counted_bytes, group_name
from .machine import Machine, MachineError, load_machine, machine_names
from .model import Estimate, estimate, rank_grids, step_flops

__all__ = [
    "Estimate",
    "Machine",
    "MachineError",
    "counted_bytes",
    "estimate",
    "group_name",
    "load_machine",
    "machine_names",
    "rank_grids",
    "step_flops",
]
