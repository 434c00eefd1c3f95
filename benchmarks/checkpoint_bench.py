"""Checkpoint benchmark: saving and restoring a large table with
tf.train.Checkpoint, tfde beside TFRA 0.8.1, each in a fresh process.

  python -m benchmarks.checkpoint_bench                 # 10M rows of dim 64 (~2.6 GB of rows)
  python -m benchmarks.checkpoint_bench --n 1000000     # smaller

Prints seconds and the memory each save and restore needs beyond the table
itself (peak RSS, from the kernel's high-water mark): tfde streams a table
in chunks of at most 64 MiB of rows (tfde/saving/format.py), TFRA exports
the whole table into one tensor.
"""

from __future__ import annotations

import argparse
import sys
import tempfile

from benchmarks import table_bench

MIB = 1 << 20


def tfde_checkpoint(phase: str, n: int, dim: int, directory: str) -> dict:
    import tensorflow as tf

    import tfde
    from benchmarks import common

    def make(name):
        return tfde.Variable(name, dim=dim, initializer=0.0)

    return common.checkpoint_probe(
        tf, make, lambda v, k, r: v.upsert(k, r), lambda v: v.size(), phase, n, dim, directory
    )


def measure(n: int, dim: int, with_tfra: bool = True) -> dict:
    out = {}
    sides = [("tfde", table_bench.run_tfde)] + ([("tfra", table_bench.run_tfra)] if with_tfra else [])
    for name, run in sides:
        with tempfile.TemporaryDirectory() as d:  # save and restore each in a fresh process
            out[name] = {**run("checkpoint", "save", n, dim, d), **run("checkpoint", "restore", n, dim, d)}
    return out


def report(r: dict) -> list:
    t = r["tfde"]
    lines = [
        f"checkpoint of {t['rows']:,} rows, dim {t['dim']} (tf.train.Checkpoint write + read)",
        f"{'':24}{'tfde':>12}{'TFRA':>12}{'tfde/TFRA':>11}",
    ]
    rows = [
        ("save s", "save_s", 1, "{:.1f}"),
        ("restore s", "restore_s", 1, "{:.1f}"),
        ("save extra MiB", "save_extra_bytes", MIB, "{:,.0f}"),
        ("restore extra MiB", "restore_extra_bytes", MIB, "{:,.0f}"),
        ("table MiB (RSS)", "table_bytes", MIB, "{:,.0f}"),
        ("files MiB", "file_bytes", MIB, "{:,.0f}"),
    ]
    for label, key, scale, form in rows:
        a = t[key] / scale
        b = r["tfra"][key] / scale if "tfra" in r else None
        ratio = f"{a / b:.2f}x" if b else ""
        lines.append(f"{label:24}{form.format(a):>12}{form.format(b) if b is not None else '-':>12}{ratio:>11}")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=10_000_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--no-tfra", action="store_true")
    args = p.parse_args(argv)
    info = table_bench.machine()
    print(
        f"machine: {info['cpu']}, {info['cores']} cores; python {info['python']}, TF {info['tf']}, "
        f"tfde git {info['git']}"
    )
    r = measure(args.n, args.dim, not args.no_tfra)
    print("\n".join(report(r)))
    path = table_bench.write_results("checkpoint", {"machine": info, **r})
    print(f"\nwritten: {path.relative_to(table_bench.HERE.parent)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
