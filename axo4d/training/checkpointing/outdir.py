"""The run folder (``--out``): checked writable, and claimed by one run at a time.

Two runs writing the same folder would interleave ``metrics.jsonl``, and the second's fresh
start would move the first's ``checkpoints/`` aside while it saves into it. Rank 0 therefore holds
an exclusive ``flock`` on ``OUT/.lock`` for the whole run (the kernel drops it when the process
ends, however it ends); a second run with the same ``--out`` stops with one line naming the
first (its pid and host). File systems without ``flock`` (some Lustre mounts: ``noflock``) skip
the claim. Called on rank 0 only, after every input check and before anything else is written.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import time
from pathlib import Path
from typing import IO

from axo4d.config.errors import ConfigError
from axo4d.training.checkpointing.checkpointer import complete_checkpoints

LOCK_NAME = ".lock"
PROBE_NAME = ".write-test"


def probe_writable(out: Path) -> None:
    """Create ``out`` and write (then remove) a probe file in it; one ConfigError when it cannot."""
    probe = Path(out) / PROBE_NAME
    try:
        Path(out).mkdir(parents=True, exist_ok=True)
        with open(probe, "w") as f:
            f.write("ok")
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        where = f" ({e.filename})" if e.filename and str(e.filename) != str(out) else ""
        full = "; the disk is full" if e.errno in (errno.ENOSPC, errno.EDQUOT) else ""
        raise ConfigError(f"output folder {str(out)!r} is not usable: {e.strerror or e}{where}{full}") from None
    finally:
        try:
            probe.unlink()
        except OSError:
            pass


def claim_output(out: Path) -> IO | None:
    """Take this run's exclusive claim on ``out`` (keep the returned file open for the run's
    lifetime); ConfigError naming the other run when one holds it. None where flock is unavailable."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - non-POSIX
        return None
    f = open(Path(out) / LOCK_NAME, "a+")
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
            f.seek(0)
            holder = f.read().strip() or "another process"
            f.close()
            raise ConfigError(
                f"output folder {str(out)!r} is in use by another run ({holder}); "
                f"use another --out, or wait for that run to end"
            ) from None
        f.close()  # ENOLCK, EOPNOTSUPP, ENOSYS: this file system cannot lock
        return None
    f.seek(0)
    f.truncate()
    f.write(f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    f.flush()
    return f


def prepare_output(out: Path, resume_step: int | None) -> None:
    """Lay out ``out`` for a run that starts fresh (``resume_step=None``: an earlier run's
    ``checkpoints/`` moved to ``checkpoints.prev``, ``metrics.jsonl`` emptied) or resumes at
    ``resume_step`` (checkpoints after it set aside, the metrics of the steps before it kept)."""
    metrics = out / "metrics.jsonl"
    if resume_step is None:
        old = out / "checkpoints"
        if old.is_dir():
            prev = out / "checkpoints.prev"
            shutil.rmtree(prev, ignore_errors=True)
            os.rename(old, prev)
            print(f"note: {old} of an earlier run moved to {prev} (use --resume auto to continue a run)", flush=True)
        metrics.write_text("")
        return
    set_aside_later_checkpoints(out, resume_step)
    keep = []
    if metrics.is_file():
        for line in metrics.read_text().splitlines():
            try:
                if json.loads(line)["step"] < resume_step:
                    keep.append(line + "\n")
            except (ValueError, KeyError, TypeError):
                pass
    tmp = metrics.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(keep))
    os.replace(tmp, metrics)


def set_aside_later_checkpoints(out: Path, step: int) -> None:
    """Checkpoints in ``out`` newer than the resumed step belong to an abandoned future: move them
    to ``checkpoints.prev`` so that ``--resume auto`` never picks them."""
    later = [p for p in complete_checkpoints(out / "checkpoints") if int(p.name[5:]) > step]
    if later:
        prev = out / "checkpoints.prev"
        prev.mkdir(exist_ok=True)
        for p in later:
            shutil.rmtree(prev / p.name, ignore_errors=True)
            os.rename(p, prev / p.name)
        print(f"note: {len(later)} checkpoint(s) after step {step} moved to {prev}", flush=True)
