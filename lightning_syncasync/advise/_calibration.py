"""``syncasync-bench`` records as the cost model's calibration takes them (``syncasync-advise --calibrate``): which
modelled strategy and settings a record ran, or why it is not modelled."""

from __future__ import annotations

from typing import Any


def calibration_record(record: dict[str, Any], scenario: Any, grad_bytes: float) -> dict[str, Any] | str:
    """A ``syncasync-bench`` record in the form ``ScalingModel.calibrate`` takes, or why it is not modelled."""
    cfg = record.get("config") or {}
    st = cfg.get("strategy") or {}
    target = str(st.get("_target_", ""))
    callbacks = cfg.get("callbacks") or {}
    adaptive = callbacks.get("adaptive_batch")
    compression = st.get("compression") or "none"
    settings: dict[str, Any] = {}
    if adaptive and adaptive.get("grow_batch"):
        return "grows the global batch (not modelled)"
    if target.endswith("DDPStrategy") and not st.get("local_sgd"):
        model = "ddp_adaptive_batch" if adaptive else "ddp"
        if compression != "none":
            if adaptive:
                return "adaptive batches with compression (not modelled)"
            settings["compression"] = compression
    elif target.endswith("ModelParallelStrategy") and not adaptive:
        if int(st.get("tensor_parallel_size") or 1) != 1:
            return "tensor parallelism (not modelled)"
        model = "fsdp"
    elif target.endswith("ShardedHierSyncStrategy") and not adaptive:  # before hier_sync: its name ends the same
        if st.get("hsdp"):
            model = "hsdp"
        else:
            model = "hier_sync_sharded"
            settings = {"inter_period": int(st.get("inter_period", 4)), "max_delay": int(st.get("max_delay", 1))}
            if compression != "none":
                settings["compression"] = compression
    elif target.endswith("HierSyncStrategy") and not adaptive:
        model = "hier_sync"
        settings = {"inter_period": int(st.get("inter_period", 4)), "max_delay": int(st.get("max_delay", 1))}
        if compression != "none":
            settings["compression"] = compression
    elif target.endswith("ShardedAsyncSSPStrategy"):  # before async_ssp: its name ends the same
        return "async_ssp over FSDP2 shards (not modelled)"
    elif target.endswith("AsyncSSPStrategy") and not adaptive:
        model = "async_ssp"
        # Records from before round-level async (no local_steps in the config) ran per step.
        local_steps = int(st.get("local_steps", 1))
        staleness = st.get("staleness")
        if local_steps > 1 and staleness is None:
            return "async_ssp rounds without a staleness bound (not modelled)"
        settings = {"staleness": staleness, "local_steps": local_steps}
        if compression != "none":
            settings["compression"] = compression
    else:
        return f"{target.rsplit('.', 1)[-1] or 'unknown strategy'} (not modelled)"
    ideal = record.get("ideal_per_rank_samples_per_s")
    if not ideal or not record.get("samples_per_s"):
        return "no ideal per-rank rates in the record"
    jitter = None
    if scenario.jitter:
        p, f = scenario.jitter.split(":")
        jitter = [float(p), float(f)]
    procs = st.get("node_size") or scenario.procs_per_node
    return {
        "scenario": record["scenario"], "strategy": record["strategy"], "model_strategy": model,
        "settings": settings, "samples_per_s": float(record["samples_per_s"]),
        "ideal_per_rank_samples_per_s": list(ideal), "batch_size": int(cfg["data"]["batch_size"]),
        "grad_bytes": grad_bytes, "nodes": scenario.world_size // procs, "procs_per_node": procs,
        "link_mbit": scenario.link_mbit, "jitter": jitter,
    }  # fmt: skip
