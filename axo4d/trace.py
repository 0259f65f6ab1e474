"""Compare the ranks' collective traces of a run that hung or failed.

    python -m axo4d.trace OUT/traces        # or OUT

When a collective fails or times out, every live rank writes ``OUT/traces/rank_K.json``: its
last ``parallel.trace_collectives`` collectives (group, operation, the group's sequence number,
bytes, entered and completed times) and the one it waits in (:mod:`axo4d.dist.flight`). This
prints one row per group and member -- the last collective each rank entered and completed, and
what it waits in -- then the diagnosis: the rank that is behind, on which group and at which
sequence number (:mod:`axo4d.dist.flight_report`). No trace from a rank means it was stopped, hung
or dead. Exit status 2 when the folder holds no trace. Imports no torch.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from axo4d.dist.flight import load_traces
from axo4d.dist.flight_report import diagnose, table


def run(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m axo4d.trace", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("folder", help="OUT/traces of a run (or the run folder OUT)")
    args = ap.parse_args(argv)
    folder = Path(args.folder)
    if (folder / "traces").is_dir():
        folder = folder / "traces"
    traces = load_traces(folder)
    if not traces:
        print(
            f"axo4d.trace: error: no collective trace in {str(folder)!r} (rank_K.json files are written when a "
            f"collective fails or times out, with parallel.trace_collectives > 0)",
            file=sys.stderr,
        )
        return 2
    world = max(int(t.get("world_size", 0)) for t in traces.values()) or max(traces) + 1
    grid = next((t.get("grid") for t in traces.values() if t.get("grid")), "?")
    print(f"{len(traces)} of {world} ranks wrote a trace (grid {grid}); {folder}")
    failed = {r: t.get("failed", "") for r, t in traces.items()}
    for r, why in sorted(failed.items())[:3]:
        why = why[len(f"rank {r}: ") :] if why.startswith(f"rank {r}: ") else why
        print(f"  rank {r}: {why}")
    print()
    print(table(traces, world))
    print()
    for line in diagnose(traces, world):
        print(line)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Torch-free (a login node reads the traces): one error line and status 2 on bad input."""
    return run(argv)


if __name__ == "__main__":
    sys.exit(main())
