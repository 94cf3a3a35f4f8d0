"""PNG plots of a run, drawn from `results.json`'s document (matplotlib, imported only here, Agg backend).

- `ttft_cdf.png`: TTFT CDF per policy, log-scaled seconds.
- `timeseries.png`: per policy over simulated time, the hit ratio of the requests admitted in each sampling window
  and the engines' queue depth (requests waiting, summed over replicas); a third panel with the replica count when
  it changed during the run (autoscaling).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def write_plots(out_dir: Path, document: dict[str, Any]) -> list[Path]:
    """Draw the plots into `out_dir`; returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    policies: dict[str, Any] = document["policies"]
    written: list[Path] = []

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, data in policies.items():
        cdf = data["ttft_cdf_s"]
        n = len(cdf)
        ax.plot([max(v, 1e-3) for v in cdf], [i / (n - 1) for i in range(n)], label=label)
    ax.set_xscale("log")
    ax.set_xlabel("time to first token (s)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(f"TTFT CDF: {document['scenario']['name']}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = out_dir / "ttft_cdf.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    written.append(path)

    is_scaling = any(len({x["num_replicas"] for x in data["series"]}) > 1 for data in policies.values())
    rows = 3 if is_scaling else 2
    fig, axes = plt.subplots(rows, 1, figsize=(8, 2.6 * rows + 0.6), sharex=True)
    for label, data in policies.items():
        series = data["series"]
        times = [x["time_s"] for x in series]
        hits = [x["window_hit_ratio"] for x in series]
        axes[0].plot(
            [t for t, h in zip(times, hits, strict=True) if h is not None],
            [h for h in hits if h is not None],
            label=label,
        )
        axes[1].plot(times, [x["engine_waiting"] for x in series], label=label)
        if is_scaling:
            axes[2].step(times, [x["num_replicas"] for x in series], where="post", label=label)
    axes[0].set_ylabel("prefix hit ratio")
    axes[0].set_ylim(0, 1)
    axes[1].set_ylabel("requests queued\nin engines")
    if is_scaling:
        axes[2].set_ylabel("replicas")
    axes[-1].set_xlabel("simulated time (s)")
    axes[0].legend(fontsize="small", ncol=3)
    for ax in axes:
        ax.grid(True, alpha=0.3)
    fig.tight_layout()
    path = out_dir / "timeseries.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    written.append(path)
    return written


def write_plan_plot(path: Path, trials: list[dict[str, Any]], *, attainment_bound: float | None, title: str) -> None:
    """`shoal simulate plan`'s runs (`plan.json`'s `trials`): replica-seconds against SLO attainment, a point per
    run, a series per policy's static fleets and one for the autoscaled fleets; filled where the run met the SLO,
    hollow where it missed, a star on the plan, each static point labelled with its replicas."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict[str, list[dict[str, Any]]] = {}
    for trial in trials:
        if trial["error"] is None:
            name = f"{trial['policy']}, autoscaled" if trial["autoscaled"] else f"{trial['policy']}, static"
            series.setdefault(name, []).append(trial)
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for name, points in series.items():
        color = ax.plot([], [], label=name)[0].get_color()
        marker = "s" if points[0]["autoscaled"] else "o"
        for point in points:
            x, y = point["attainment"], point["replica_seconds"]
            face = color if point["meets"] else "none"
            ax.scatter([x], [y], marker=marker, s=36, facecolors=face, edgecolors=color)
            if not point["autoscaled"]:
                ax.annotate(str(point["replicas"]), (x, y), textcoords="offset points", xytext=(4, 3), fontsize=7)
            if point["chosen"]:
                ax.scatter([x], [y], marker="*", s=220, facecolors="none", edgecolors="black", label="plan")
    if attainment_bound is not None:
        ax.axvline(attainment_bound, color="grey", linestyle="--", linewidth=1, label="attainment bound")
    ax.set_xlabel("SLO attainment (share of requests)")
    ax.set_ylabel("replica-seconds")
    ax.set_title(f"Fleet plan: {title} (filled: meets the SLO)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
