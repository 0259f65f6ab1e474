"""What checkpoint checksums cost: hash rates on this CPU and the verification of a checkpoint.

    python -m bench.checksum                       # rates of the standard library's hashes, 1 core
    python -m bench.checksum --mib 1024 --files 8  # also: crc32 of 8 files by 1, 2, 4 threads
    python -m bench.checksum --ckpt runs/a         # verify a run's checkpoints, as a resume would

Prints MB/s per hash (one core, data in memory; ratio against crc32, the one axo4d uses), then
the verification of ``--files`` files of ``--mib`` MiB in total from the page cache by 1, 2 and 4
threads (zlib and hashlib release the GIL, so threads help as far as cores and memory bandwidth
allow), and, for a real checkpoint, the seconds and MB/s of ``python -m axo4d.checkpoint verify``.
A resume shares the files out among its ranks (:func:`axo4d.training.checkpointing.integrity.share_out`), so
on R nodes it reads about 1/R of the checkpoint per node.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import tempfile
import time
import zlib
from pathlib import Path


def _rate(fn, data: bytes, repeat: int = 3) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn(data)
        best = min(best, time.perf_counter() - t0)
    return len(data) / best / 1e6


HASHES = {
    "crc32 (zlib)": lambda d: zlib.crc32(d),
    "adler32 (zlib)": lambda d: zlib.adler32(d),
    "sha1": lambda d: hashlib.sha1(d).digest(),
    "sha256": lambda d: hashlib.sha256(d).digest(),
    "blake2b": lambda d: hashlib.blake2b(d).digest(),
    "md5": lambda d: hashlib.md5(d).digest(),
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.checksum", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--mib", type=int, default=256, help="bytes hashed per measurement (MiB)")
    ap.add_argument("--files", type=int, default=4, help="files for the threaded verification")
    ap.add_argument("--ckpt", default=None, help="a checkpoint or run folder to verify")
    args = ap.parse_args(argv)
    from axo4d.training.checkpointing import integrity

    data = os.urandom(args.mib << 20)
    rates = {name: _rate(fn, data) for name, fn in HASHES.items()}
    print(f"hash rates, one core, {args.mib} MiB in memory (best of 3):")
    for name, r in rates.items():
        print(f"  {name:15s} {r:9,.0f} MB/s   {r / rates['crc32 (zlib)']:5.2f} x crc32")
    with tempfile.TemporaryDirectory() as tmp:
        names = [f"__{i}_0.distcp" for i in range(args.files)]
        per = len(data) // args.files
        for i, n in enumerate(names):
            (Path(tmp) / n).write_bytes(data[i * per : (i + 1) * per])
        manifest = integrity.describe(Path(tmp), names)
        print(f"verifying {args.files} files, {integrity.mib(per * args.files)} (page cache):")
        base = None
        for threads in (1, 2, 4):
            bad, nbytes, secs = min(
                (integrity.verify(Path(tmp), manifest, threads=threads) for _ in range(3)), key=lambda r: r[2]
            )
            assert bad is None, bad
            base = base or secs
            print(f"  {threads} thread(s): {secs:.3f} s  {nbytes / secs / 1e6:9,.0f} MB/s   {base / secs:4.2f} x")
    if args.ckpt:
        from axo4d.checkpoint import main as ckpt_main

        return ckpt_main(["verify", args.ckpt])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
