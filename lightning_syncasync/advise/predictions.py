"""The cost model's predictions as ``syncasync-advise`` prints them: every candidate at the probed cluster
(:func:`format_predictions`), and at other sizes (``--simulate-nodes``: :func:`simulate`, :func:`format_simulation`,
:func:`plot_scaling`)."""

from __future__ import annotations

from collections.abc import Sequence

from lightning_syncasync.advise._lines import format_settings
from lightning_syncasync.advise.measurements import Measurements
from lightning_syncasync.advise.report import ALL_CANDIDATES, CANDIDATES, Thresholds, build_model, candidate_settings
from lightning_syncasync.algorithms.costmodel import Prediction


def format_predictions(
    preds: dict[str, Prediction], allowed: Sequence[str], recommended: str, steps_factor: dict[str, float] | None = None
) -> list[str]:
    factor = steps_factor or {}
    w = max([20, *(len(name) + 2 for name in preds)])
    lines = [
        f"{'strategy':<{w}}{'samples/s':>11}{'efficiency':>12}{'step ms':>10}{'comm ms':>10}{'wait ms':>10}"
        f"{'steps':>7}  {'bottleneck':<15}settings"
    ]
    for name, p in sorted(preds.items(), key=lambda kv: -kv[1].samples_per_s / factor.get(kv[0], 1.0)):
        mark = "*" if name == recommended else ("+" if name in allowed else " ")
        lines.append(
            f"{mark}{name:<{w - 1}}{p.samples_per_s:>11.1f}{p.efficiency:>11.1%}{p.step_s * 1e3:>10.1f}"
            f"{p.comm_s * 1e3:>10.1f}{p.wait_s * 1e3:>10.1f}{factor.get(name, 1.0):>6.2f}x  {p.bottleneck:<15}"
            f"{format_settings(p.settings).strip()}"
        )
    lines.append(
        "(* recommended, + allowed by the decision flow; predictions from the cost model; steps: to a target, "
        "relative to DDP's, measured; rows ordered by time to a target)"
    )
    return lines


def simulate(
    m: Measurements,
    nodes_list: Sequence[int],
    strategies: Sequence[str] = CANDIDATES,
    params: dict | None = None,
    tolerance: float = Thresholds.settings_tolerance,
) -> list[Prediction]:
    """Predictions at each node count, each strategy with its settings chosen again for that size (a user would
    retune ``inter_period``/``staleness`` for a larger cluster)."""
    model = build_model(m, params)
    out = []
    for n in nodes_list:
        settings = candidate_settings(model, n, tolerance, [s for s in strategies if s in ALL_CANDIDATES])
        # Strategies outside the candidates (the cost model's variants, e.g. ddp_int8_allgather) at their defaults.
        out += [model.predict(s, n, **settings.get(s, {})) for s in strategies]
    return out


def format_simulation(preds: Sequence[Prediction]) -> list[str]:
    nodes = sorted({p.nodes for p in preds})
    names = list(dict.fromkeys(p.strategy for p in preds))
    by = {(p.strategy, p.nodes): p for p in preds}
    w = max([20, *(len(s) + 1 for s in names)])
    head = f"{'strategy':<{w}}" + "".join(f"{f'{n} nodes':>22}" for n in nodes)
    lines = [head, f"{'':<{w}}" + "".join(f"{'samples/s  eff':>22}" for _ in nodes)]
    for s in names:
        cells = "".join(f"{by[(s, n)].samples_per_s:>14.4g} {by[(s, n)].efficiency:>6.1%}" for n in nodes)
        lines.append(f"{s:<{w}}{cells}")
    for s in names:
        chosen = [f"{n}: {format_settings(by[(s, n)].settings).strip()}" for n in nodes if by[(s, n)].settings]
        if chosen and any("inter_period" in c or "staleness" in c or "mode" in c for c in chosen):
            lines.append(f"  {s} settings by nodes: " + "; ".join(chosen))
    return lines


def plot_scaling(preds: Sequence[Prediction], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for s in dict.fromkeys(p.strategy for p in preds):
        pts = sorted((p.nodes, p.samples_per_s, p.efficiency) for p in preds if p.strategy == s)
        # auto_sync coincides with the mode it settles in: dashed, so both stay visible.
        style = {"linestyle": "--", "marker": "x"} if s == "auto_sync" else {"marker": "o"}
        ax1.plot([x[0] for x in pts], [x[1] for x in pts], label=s, **style)
        ax2.plot([x[0] for x in pts], [x[2] for x in pts], label=s, **style)
    ax1.set(xscale="log", yscale="log", xlabel="nodes", ylabel="predicted samples/s", title="throughput")
    ax2.set(xscale="log", xlabel="nodes", ylabel="samples/s / no-communication limit", title="efficiency")
    ax2.set_ylim(0, 1.05)
    for ax in (ax1, ax2):
        ax.grid(True, which="both", alpha=0.3)
    ax2.legend(fontsize=8)
    fig.suptitle("syncasync-advise: cost-model scaling from measured per-rank numbers")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
