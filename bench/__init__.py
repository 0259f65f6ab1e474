"""Benchmarks and evidence runs: each module is ``python -m bench.<name>`` and its
docstring says what it measures and how to run it (for example
:mod:`bench.bytes_check` and :mod:`bench.validate_perfmodel` for the performance model)."""
