"""``FaultInjector``: make one rank fail on purpose at a given step, to test what the others do.

The faults are the ones distributed training meets on real clusters:

* ``kill``: the rank's process is SIGKILLed (an OOM kill, a node reboot);
* ``stop``: it is SIGSTOPped (a hung process: swapping, a stuck file system, a debugger);
* ``raise``: it raises ``RuntimeError`` (a bug on one rank);
* ``cut``: its node's network interface goes down for ``seconds`` and comes back (a switch or cable fault). Needs
  ``syncasync-emulate`` with network namespaces (the interface is ``GLOO_SOCKET_IFNAME``) and root; the link is
  brought back by a child shell, so it comes back even if this process dies meanwhile.

Specs, also from the environment variable ``SYNCASYNC_FAULT`` (set by ``syncasync-emulate --fault``):
``kill:1@5`` (rank 1 at step 5), ``stop:2@4``, ``raise:0@3``, ``cut:2@6+3`` (rank 2, step 6, 3 seconds).
Faults fire only in the first attempt of a job (``TORCHELASTIC_RESTART_COUNT`` unset or 0), so a job restarted by
``torchrun --max-restarts`` runs clean: that is how the elastic-restart tests get one failure and one recovery.

Before firing, the rank prints ``syncasync-fault: rank R KIND at step S (t=UNIX_TIME)`` to stderr: detection times
are measured from that stamp.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

ENV_FAULT = "SYNCASYNC_FAULT"
KINDS = ("kill", "stop", "raise", "cut")
_SPEC = re.compile(r"^(?P<kind>[a-z]+):(?P<rank>\d+)@(?P<step>\d+)(?:\+(?P<seconds>\d+(?:\.\d+)?))?$")


@dataclass(frozen=True)
class FaultSpec:
    kind: str
    rank: int
    step: int
    seconds: float | None = None


def parse_fault(spec: str) -> FaultSpec:
    """Parse ``KIND:RANK@STEP[+SECONDS]``; errors name the setting and the expected form."""
    m = _SPEC.match(spec.strip())
    if m is None or m["kind"] not in KINDS:
        raise ValueError(
            f"fault spec {spec!r} is not KIND:RANK@STEP[+SECONDS] with KIND one of {KINDS}; HINT: kill:1@5 kills "
            "rank 1 at step 5, cut:2@6+3 takes rank 2's link down for 3 s"
        )
    seconds = None if m["seconds"] is None else float(m["seconds"])
    if (m["kind"] == "cut") != (seconds is not None) or (seconds is not None and seconds <= 0):
        raise ValueError(f"fault spec {spec!r}: '+SECONDS' (> 0) goes with cut and only with cut; HINT: cut:2@6+3")
    return FaultSpec(m["kind"], int(m["rank"]), int(m["step"]), seconds)


class FaultInjector(Callback):
    """Inject ``kind`` on global rank ``rank`` when it starts step ``step`` (first attempt only).

    Args:
        kind: ``kill``, ``stop``, ``raise`` or ``cut``.
        rank: the global rank that fails.
        step: the global step (optimizer steps so far) at which it fails.
        seconds: for ``cut``: how long the link stays down.

    Example::

        # rank 1 is killed when it starts step 20 (tests and `syncasync-emulate --fault kill:1@20` use it)
        trainer = L.Trainer(strategy="async_ssp", devices=2, callbacks=[FaultInjector("kill", rank=1, step=20)])
    """

    def __init__(self, kind: str, rank: int, step: int, seconds: float | None = None) -> None:
        spec = parse_fault(f"{kind}:{rank}@{step}" + ("" if seconds is None else f"+{seconds}"))
        self.spec = spec
        self.fired = False

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> FaultInjector | None:
        env = os.environ if environ is None else environ
        raw = env.get(ENV_FAULT, "").strip()
        if not raw:
            return None
        s = parse_fault(raw)
        return cls(s.kind, s.rank, s.step, s.seconds)

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.spec.rank >= trainer.world_size:
            raise ValueError(
                f"fault rank {self.spec.rank} does not exist in a world of {trainer.world_size}; "
                f"HINT: pick a rank below {trainer.world_size}"
            )
        if self.spec.kind == "cut" and not os.environ.get("GLOO_SOCKET_IFNAME"):
            raise ValueError(
                "fault 'cut' needs the node's interface in GLOO_SOCKET_IFNAME; HINT: run under syncasync-emulate "
                "with network namespaces (the default when root)"
            )

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: object, idx: int) -> None:
        s = self.spec
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if self.fired or not first_attempt or trainer.global_rank != s.rank or trainer.global_step != s.step:
            return
        self.fired = True
        sys.stderr.write(f"syncasync-fault: rank {s.rank} {s.kind} at step {s.step} (t={time.time():.3f})\n")
        sys.stderr.flush()
        if s.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif s.kind == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif s.kind == "raise":
            raise RuntimeError(f"injected fault on rank {s.rank} at step {s.step}")
        else:
            ifname = os.environ["GLOO_SOCKET_IFNAME"]
            subprocess.run(["ip", "link", "set", "dev", ifname, "down"], check=True)
            # In this process's group: it outlives this process if the rank dies, and the emulator's clean-up
            # (which signals each rank's whole group) still ends it.
            subprocess.Popen(["sh", "-c", f"sleep {s.seconds}; ip link set dev {ifname} up"])  # noqa: S603
