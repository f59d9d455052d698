"""``syncasync-bench``: scenarios, the side-by-side runner and the report."""

from lightning_syncasync.bench.runner import BenchRunner, Contender, resolve_contenders
from lightning_syncasync.bench.scenarios import SCENARIOS, Scenario

__all__ = ["SCENARIOS", "BenchRunner", "Contender", "Scenario", "resolve_contenders"]
