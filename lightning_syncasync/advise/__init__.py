"""``syncasync-advise``: which strategy should this cluster train with?

It measures (``probe``: compute speed per rank on your model and data, link latency and bandwidth inside and across
nodes, pauses), decides (``report.recommend``: a decision flow over the measured numbers, with the
``algorithms/costmodel.ScalingModel`` prediction choosing among the strategies the flow allows), and prints the
recommendation as ``syncasync-train`` overrides and a ``syncasync-cli`` line. ``--simulate-nodes`` extends the same
model to clusters of up to a million nodes; ``--calibrate`` fits it to ``syncasync-bench`` runs and reports its error.
"""

from lightning_syncasync.advise.measurements import Measurements
from lightning_syncasync.advise.report import Recommendation, Thresholds, recommend

__all__ = ["Measurements", "Recommendation", "Thresholds", "recommend"]
