"""Markdown tables of a results file written by benchmarks.run or by
benchmarks.table_bench (for docs/benchmarks.md and benchmarks/README.md).

  python -m benchmarks.markdown [benchmarks/results/latest.json]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from benchmarks.table_bench import OPS  # the table's rows, in the order the benchmark prints them

HERE = Path(__file__).resolve().parent


def m(x: float) -> str:
    return f"{x / 1e6:.2f}M"


def gather_reference_row(t: dict, dims: list) -> str:
    """The row of find_hit without a table: a dense TensorFlow gather (results
    from before it existed hold a single-threaded numpy gather instead)."""
    key = "dense_gather" if "dense_gather" in t["dims"][dims[0]]["tfde"] else "numpy_gather"
    cells = []
    for d in dims:
        ours, theirs = t["dims"][d]["tfde"], t["dims"][d]["tfra"]
        cell = f"{m(ours[key])} (find_hit {ours['find_hit'] / ours[key]:.2f}× of it"
        if key == "dense_gather" and "find_hit" in theirs:
            cell += f"; {ours[key] / theirs['find_hit']:.2f}× TFRA's find_hit"
        cells.append(cell + ")")
    label = "dense tf.gather, no table" if key == "dense_gather" else "numpy gather (find ceiling)"
    return f"| {label} | " + " | ".join(cells) + " |"


def tables(r: dict) -> list:
    out = []
    info = r["machine"]
    out.append(
        f"Machine: {info['cpu']}, {info['cores']} cores; tfde git {info['git']} ({info['tfde']}); "
        f"reference: {info['reference']}."
    )
    if "table" in r:
        t = r["table"]
        dims = list(t["dims"])
        out += [
            "",
            f"Table ops, {t['n']:,} int64 keys, float32 rows; keys/s, tfde / TFRA (ratio), median of "
            f"{t['rounds']} alternating fresh-process rounds of the median of 5 repeats:",
            "",
            "| operation | " + " | ".join(f"dim {d}" for d in dims) + " |",
            "|---|" + "---:|" * len(dims),
        ]
        for op in OPS:
            if op not in t["dims"][dims[0]]["tfde"]:  # results from before the op was measured
                continue
            cells = []
            for d in dims:
                ours, theirs = t["dims"][d]["tfde"][op], t["dims"][d]["tfra"].get(op)
                cells.append(f"{m(ours)} / {m(theirs)} ({ours / theirs:.2f}×)" if theirs else m(ours))
            label = op.replace("_batch_", f"_batch{t['batch']}_")
            out.append(f"| {label} | " + " | ".join(cells) + " |")
        out.append(gather_reference_row(t, dims))
        out.append(
            "| memory B/row, tfde / TFRA (raw) | "
            + " | ".join(
                f"{t['dims'][d]['tfde']['rss_bytes_per_row']:.0f} / "
                f"{t['dims'][d]['tfra'].get('rss_bytes_per_row', 0):.0f} ({8 + 4 * int(d)})"
                for d in dims
            )
            + " |"
        )
    if "redis" in r:
        x = r["redis"]
        out += [
            "",
            f"Redis backend, {x['n']:,} keys, dim {x['dim']}, batches of {x['batch']}; keys/s, median of 7 "
            "alternating rounds:",
            "",
            "| op | tfde | TFRA (C++ client) | tfde/TFRA | plain redis-py pipeline | tfde/plain |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for op in ("find", "insert"):
            ours, plain, theirs = x[f"tfde_{op}"], x[f"plain_{op}"], x["tfra"].get(op)
            out.append(
                f"| {op} | {ours:,.0f} | {theirs:,.0f} | {ours / theirs:.2f}× | {plain:,.0f} | {ours / plain:.0%} |"
            )
    if "e2e" in r:
        out += [
            "",
            "Two-tower training (the demo model; median of rounds):",
            "",
            "| backend | system | examples/s | × TFRA | recall@100 |",
            "|---|---|---:|---:|---:|",
        ]
        for backend, res in r["e2e"].items():
            ref = res.get("TFRA tf-keras")
            for label, v in res.items():
                if label == "data":
                    continue
                ratio = f"{v['examples_per_s'] / ref['examples_per_s']:.2f}×" if ref else "-"
                out.append(f"| {backend} | {label} | {v['examples_per_s']:,.0f} | {ratio} | {v['recall']:.4f} |")
            d = res["data"]
            out.append(
                f"| {backend} | most-popular baseline ({d['interactions']:,} interactions, {d['epochs']} "
                f"epochs) | | | {d['most_popular_recall']:.4f} |"
            )
    return out


def as_run(r: dict) -> dict:
    """A results file of benchmarks.table_bench alone, shaped like one of benchmarks.run."""
    if "dims" not in r:
        return r
    first = next(iter(r["dims"].values()))
    tfra = first.get("tfra_rounds") or [{}]
    info = {
        **r["machine"],
        "tfde": f"TF {r['machine']['tf']}",
        "reference": f"TFRA 0.8.1 on TF {tfra[0]['tf']}" if "tf" in tfra[0] else "none",
    }
    return {"machine": info, "table": {k: r[k] for k in ("n", "batch", "rounds", "dims")}}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    path = Path(argv[0]) if argv else HERE / "results" / "latest.json"
    print("\n".join(tables(as_run(json.loads(path.read_text())))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
