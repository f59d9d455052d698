"""The files in examples/ run as users run them: each one as a subprocess, with a few steps, writing only to tmp_path.

Multi-process runs use 2 processes over gloo (the CI machine has 2 cores). The sbatch file is checked without SLURM:
its syntax, its ``#SBATCH`` lines, and the command it hands to ``srun`` (a stand-in ``srun`` prints it).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_syncasync.emulate.cluster import free_port

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
HYDRA_OWN_CONFIG = EXAMPLES / "hydra_own_config"
# A few steps, then one short validation, so every job has a val_acc to report.
HYDRA_BUDGET = ["trainer.max_epochs=1", "trainer.limit_train_batches=6", "trainer.limit_val_batches=2"]


def _env(**extra: str) -> dict[str, str]:
    """This environment without a rendezvous or rank another test (or Lightning in this process) may have left."""
    env = dict(os.environ)
    for var in ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "RANK", "LOCAL_RANK", "WORLD_SIZE", "PL_GLOBAL_SEED"):
        env.pop(var, None)
    env.update(extra)
    return env


def _command(script: str, module: str) -> list[str]:
    """The console script as users type it (``syncasync-train``), else the module it runs."""
    path = Path(sys.executable).with_name(script)
    return [str(path)] if path.exists() else [sys.executable, "-m", module]


def _run(cmd: list[str], cwd: Path, timeout: int, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=cwd, env=env or _env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    return proc


@pytest.mark.spawn
@pytest.mark.timeout(150)
def test_own_module_trains_with_hier_sync_and_both_callbacks(tmp_path):
    proc = _run([sys.executable, str(EXAMPLES / "own_module.py"), "--max-steps", "12", "--val-every", "6"],
                tmp_path, timeout=130)  # fmt: skip
    out = proc.stdout + proc.stderr
    assert re.search(r"final val_acc=[01]\.\d{4} after 12 steps on 2 ranks", proc.stdout), out[-3000:]
    # node_size=1: each process is a virtual node, so the hierarchy runs on one machine ...
    assert "syncasync summary: HierSyncStrategy" in proc.stdout and "2 virtual node(s) of 1" in proc.stdout, out[-3000:]
    # ... and AdaptiveBatchSize replaced the loader (each virtual node keeps half the global batch).
    assert "AdaptiveBatchSize: global batch 64 split [32, 32] over 2 ranks (per node 32)" in out, out[-3000:]
    assert list((tmp_path / "outputs" / "own_module").rglob("metrics.csv")), "no CSV log in --out-dir"


_JUPYTER = (
    # What Jupyter looks like to Lightning and to multiprocessing: IPython sets sys.ps1 (Lightning's _IS_INTERACTIVE,
    # read when lightning is imported), and the cells run in a __main__ that has no file to re-import.
    "import sys; sys.ps1 = 'In : '; path = sys.argv[1]; "
    "exec(compile(open(path).read(), path, 'exec'), {'__name__': '__main__'})"
)


@pytest.mark.spawn
@pytest.mark.timeout(150)
def test_notebook_cells_run_as_in_jupyter(tmp_path):
    proc = _run([sys.executable, "-c", _JUPYTER, str(EXAMPLES / "notebook.py")], tmp_path, timeout=130,
                env=_env(SYNCASYNC_EXAMPLE_BATCHES="4", TMPDIR=str(tmp_path)))  # fmt: skip
    for name in ("hier_sync", "async_ssp"):
        assert re.search(rf"^{name}\s+val_acc=[01]\.\d{{4}} .* samples/s", proc.stdout, re.M), proc.stdout[-3000:]


@pytest.mark.timeout(60)
def test_notebook_explanation_holds_lightning_refuses_spawn_but_not_fork_in_jupyter(monkeypatch):
    """The notebook's first cell says why it uses fork: Lightning refuses the spawn (and popen) launchers in an
    interactive session. Building the Trainer is enough to see it; no process starts."""
    from lightning.pytorch import Trainer
    from lightning.pytorch.trainer.connectors import accelerator_connector
    from lightning.pytorch.utilities.exceptions import MisconfigurationException

    import lightning_syncasync  # noqa: F401
    from lightning_syncasync.strategies import HierSyncStrategy

    monkeypatch.setattr(accelerator_connector, "_IS_INTERACTIVE", True)
    kwargs = {"accelerator": "cpu", "devices": 2, "logger": False}
    for name in ("hier_sync_spawn", "hier_sync"):
        with pytest.raises(MisconfigurationException, match="not compatible with an interactive environment"):
            Trainer(strategy=name, **kwargs)
    Trainer(strategy=HierSyncStrategy(node_size=1, start_method="fork"), **kwargs)


@pytest.mark.spawn
@pytest.mark.timeout(200)
def test_hydra_own_config_multirun_over_strategies(tmp_path):
    proc = _run(
        [*_command("syncasync-train", "lightning_syncasync.train"), "-m", f"hydra.searchpath=[file://{HYDRA_OWN_CONFIG}]",
         "experiment=my_digits", "strategy=ddp_spawn,my_hier_sync", *HYDRA_BUDGET, f"hydra.sweep.dir={tmp_path}"],
        tmp_path, timeout=180,
    )  # fmt: skip
    jobs = sorted(p.name for p in tmp_path.iterdir() if p.is_dir() and p.name.isdigit())
    assert jobs == ["0", "1"], proc.stdout[-3000:]
    results = [json.loads((tmp_path / job / "results.json").read_text()) for job in jobs]
    assert [r["strategy"] for r in results] == ["DDPStrategy", "HierSyncStrategy"]
    for r in results:
        assert r["config"]["model"]["hidden"] == 192 and r["config"]["model"]["optimizer"] == "adamw"  # my_mlp
        assert r["world_size"] == 2 and 0.0 < r["metrics"]["val_acc"] <= 1.0
    hier = results[1]
    assert hier["config"]["strategy"]["node_size"] == 1 and hier["config"]["strategy"]["start_method"] == "spawn"
    assert hier["sync_summary"]["num_nodes"] == 2  # two virtual nodes on one machine


@pytest.mark.spawn
@pytest.mark.slow  # 21 s; Hydra's multirun from the user's own config runs in the default suite (above)
@pytest.mark.timeout(200)
def test_hydra_own_config_optuna_sweep(tmp_path):
    _run(
        [*_command("syncasync-train", "lightning_syncasync.train"), "-m", f"hydra.searchpath=[file://{HYDRA_OWN_CONFIG}]",
         "experiment=my_digits", "hparams_search=optuna", "strategy=my_hier_sync", "hydra.sweeper.n_trials=1",
         *HYDRA_BUDGET, f"hydra.sweep.dir={tmp_path}"],
        tmp_path, timeout=180,
    )  # fmt: skip
    # One trial: a trial costs a child process and its 2 spawned ranks (about 15 s on 2 cores), and what is checked
    # (Optuna's parameters reach a single run, which reports back) is the same for every trial.
    jobs = sorted(p for p in tmp_path.iterdir() if p.is_dir() and p.name.isdigit())
    assert [p.name for p in jobs] == ["0"]
    (trial,) = [json.loads((job / "results.json").read_text()) for job in jobs]
    # The trial ran once, as a single run (not a sweep of its own), with Optuna's parameters and this folder's options.
    assert trial["strategy"] == "HierSyncStrategy" and trial["config"]["model"]["depth"] == 3
    assert trial["config"]["model"]["hidden"] in (64, 128, 256)
    best = (tmp_path / "optimization_results.yaml").read_text()
    assert "best_value" in best and "model.lr" in best
    assert not list(tmp_path.glob("*/multirun")) and not (tmp_path / "multirun").exists()


@pytest.mark.spawn
@pytest.mark.timeout(150)
def test_cli_config_fits(tmp_path):
    proc = _run(
        [*_command("syncasync-cli", "lightning_syncasync.cli"), "fit", "--config", str(EXAMPLES / "cli_config.yaml"),
         "--trainer.max_epochs=1", "--trainer.limit_train_batches=8", "--trainer.limit_val_batches=2",
         "--trainer.enable_progress_bar=false"],
        tmp_path, timeout=130,
    )  # fmt: skip
    assert "syncasync summary: AsyncSSPStrategy" in proc.stdout, proc.stdout[-3000:]
    assert re.search(r"done: .*val_\w+=\d\.\d{4}.* after \d+ steps", proc.stdout), proc.stdout[-1000:]  # final metric
    summary = json.loads((tmp_path / "outputs" / "cli" / "sync_summary.json").read_text())
    assert summary["world_size"] == 2 and summary["strategy"] == "AsyncSSPStrategy"
    assert list((tmp_path / "outputs" / "cli").rglob("last.ckpt")), "ModelCheckpoint(save_last=True) wrote nothing"


@pytest.mark.spawn
@pytest.mark.timeout(200)
def test_torchrun_script_as_two_local_nodes(tmp_path):
    """Two torchrun invocations on 127.0.0.1, node_rank 0 and 1, one process each: a 2-node hier_sync job."""
    run_dir = tmp_path / "run"
    port = str(free_port())
    torchrun = f"{sys.executable} -m torch.distributed.run"
    cmd = ["bash", str(EXAMPLES / "multinode" / "torchrun.sh"), *HYDRA_BUDGET]
    procs = []
    for node_rank in (0, 1):
        env = _env(NODE_RANK=str(node_rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=port, NPROC_PER_NODE="1",
                   TRAINER="cpu", RUN_DIR=str(run_dir), TORCHRUN=torchrun)  # fmt: skip
        with (tmp_path / f"node{node_rank}.log").open("w") as log:
            procs.append(subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True))  # fmt: skip
    try:
        codes = [p.wait(timeout=170) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)  # the torchrun agent and its worker, started by this test
                p.wait()
    logs = "\n".join((tmp_path / f"node{r}.log").read_text()[-3000:] for r in (0, 1))
    assert codes == [0, 0], logs
    results = json.loads((run_dir / "results.json").read_text())
    assert results["strategy"] == "HierSyncStrategy" and results["world_size"] == 2, logs
    summary = results["sync_summary"]
    assert summary["num_nodes"] == 2 and summary["node_size"] == 1, logs
    assert summary["bytes_inter_per_step"] > 0, logs  # the node models were averaged across the two nodes
    assert 0.0 < results["metrics"]["val_acc"] <= 1.0


@pytest.mark.timeout(60)
def test_multinode_scripts_parse_and_slurm_hands_srun_the_job(tmp_path):
    torchrun, sbatch = EXAMPLES / "multinode" / "torchrun.sh", EXAMPLES / "multinode" / "slurm.sbatch"
    for script in (torchrun, sbatch):
        subprocess.run(["bash", "-n", str(script)], check=True, timeout=30)
    lines = sbatch.read_text().splitlines()
    directives = dict(
        line.removeprefix("#SBATCH ").split("=", 1) for line in lines if line.startswith("#SBATCH ")
    )  # fmt: skip
    assert directives["--nodes"] == "2" and directives["--ntasks-per-node"] == "4"
    assert directives["--gpus-per-node"] == directives["--ntasks-per-node"]  # one task per GPU
    # sbatch reads #SBATCH lines only before the first command.
    first_command = next(i for i, line in enumerate(lines) if line.strip() and not line.startswith("#"))
    assert max(i for i, line in enumerate(lines) if line.startswith("#SBATCH")) < first_command

    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "srun").write_text('#!/bin/sh\necho "srun $*"\n')
    (fake_bin / "srun").chmod(0o755)
    env = _env(PATH=f"{fake_bin}{os.pathsep}{os.environ['PATH']}", SLURM_JOB_ID="4242", SLURM_JOB_NUM_NODES="2",
               SLURM_NTASKS_PER_NODE="4", SLURM_CPUS_PER_TASK="8")  # fmt: skip
    proc = _run(["bash", str(sbatch), "trainer.max_epochs=3"], tmp_path, timeout=30, env=env)
    assert proc.stdout.strip() == (
        "srun python -m lightning_syncasync.train strategy=hier_sync trainer=gpu trainer.num_nodes=2 "
        "trainer.devices=4 hydra.run.dir=outputs/slurm/4242 trainer.max_epochs=3"
    )

    # torchrun.sh refuses to start without its node rank, naming the variable.
    proc = subprocess.run(["bash", str(torchrun)], env=_env(MASTER_ADDR="127.0.0.1"), capture_output=True, text=True,
                          timeout=30)  # fmt: skip
    assert proc.returncode != 0 and "NODE_RANK" in proc.stderr
