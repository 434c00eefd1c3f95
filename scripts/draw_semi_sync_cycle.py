"""Draws docs/images/semi-sync-cycle.png, the picture of one cycle of
semi-synchronous training in docs/semi-sync.md.  Needs matplotlib:

  pip install matplotlib && python scripts/draw_semi_sync_cycle.py
"""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

OUT = Path(__file__).resolve().parent.parent / "docs" / "images" / "semi-sync-cycle.png"
K = 4  # local steps drawn per cycle (k)
LOCAL, SYNC, STORE, TEXT = "#cfe3f7", "#f7d9b5", "#d9ead3", "#222222"


def box(ax, x, y, w, h, color, label, size=8.5):
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02,rounding_size=0.08", fc=color, ec="#555555"))
    ax.text(x + w / 2, y + h / 2, label, ha="center", va="center", fontsize=size, color=TEXT)


def arrow(ax, start, end, label=None, both=False):
    ax.add_patch(
        FancyArrowPatch(start, end, arrowstyle="<|-|>" if both else "-|>", mutation_scale=11, color="#444444", lw=1.1)
    )
    if label:
        ax.text((start[0] + end[0]) / 2 + 0.08, (start[1] + end[1]) / 2, label, fontsize=7.5, color=TEXT, va="center")


def main():
    fig, ax = plt.subplots(figsize=(11, 5.0), dpi=110)
    ax.set_xlim(-1.3, 10.2)
    ax.set_ylim(-0.45, 4.9)
    ax.axis("off")
    workers = {"worker 0": 3.5, "worker 1": 0.5}
    sync_x = K * 1.55 + 0.1
    for name, y in workers.items():
        ax.text(-1.25, y + 0.35, name, fontsize=10, weight="bold", va="center")
        for step in range(K):
            first = "fetch new keys\nfrom the store,\n" if step == 0 else ""
            box(ax, step * 1.55, y, 1.4, 0.75, LOCAL, f"local step {step + 1}\n{first}train local tables", size=7.5)
        box(ax, sync_x, y, 1.6, 0.75, SYNC, "sync: push deltas,\nempty local tables", size=7.5)
        box(ax, sync_x + 1.85, y, 1.4, 0.75, LOCAL, "local step 1\nof the next cycle", size=7.5)
    # The store between the two workers, under the sync column.
    box(ax, sync_x - 1.3, 1.85, 2.6, 0.85, STORE, "store: Redis (accumulate, atomic)\nor each key's owner (summed)", 8)
    arrow(ax, (sync_x + 0.5, 3.5), (sync_x + 0.5, 2.72))
    arrow(ax, (sync_x + 0.5, 1.25), (sync_x + 0.5, 1.83))
    ax.text(sync_x - 1.0, 3.1, "deltas (local - base)", fontsize=7.5, color=TEXT)
    ax.text(sync_x - 1.0, 1.5, "deltas (local - base)", fontsize=7.5, color=TEXT)
    arrow(ax, (sync_x + 1.45, 3.48), (sync_x + 1.45, 1.27), both=True)
    ax.text(sync_x + 1.52, 2.3, "dense weights\naveraged\n(all-reduce)", fontsize=7.5, color=TEXT, va="center")
    ax.annotate(
        "", xy=(0.0, 4.5), xytext=(K * 1.55 - 0.15, 4.5), arrowprops=dict(arrowstyle="<->", color="#444444", lw=1.1)
    )
    ax.text(
        K * 1.55 / 2 - 0.1, 4.7, f"k local steps (here k = {K}): no gradient crosses workers", ha="center", fontsize=9
    )
    ax.text(
        -1.25,
        -0.35,
        "The first lookup of a key after a sync fetches its row and optimizer slots from the store (its base);"
        " later lookups read the local tables.",
        fontsize=7.5,
        color="#444444",
    )
    OUT.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(OUT, bbox_inches="tight")
    print(OUT)


if __name__ == "__main__":
    main()
