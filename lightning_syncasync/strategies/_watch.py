"""Every strategy of the pack ends a run with a lost peer fast and by name (issue 10): it adds a ``PeerWatchdog``."""

from __future__ import annotations

from typing_extensions import override


class WatchedStrategy:
    """Mixin (before the Lightning base) adding a :class:`~lightning_syncasync.callbacks.watchdog.PeerWatchdog` with
    the strategy's ``peer_timeout_s`` (capped at 30 s) unless the user configured one."""

    @override
    def setup_environment(self) -> None:
        super().setup_environment()  # type: ignore[misc]
        module = self.lightning_module  # type: ignore[attr-defined]
        if module is not None:
            from lightning_syncasync.callbacks.watchdog import ensure_watchdog  # callbacks sit above strategies

            ensure_watchdog(module.trainer, float(getattr(self, "peer_timeout_s", 30.0)))
