"""The GPU tests' results in the GPU check's summary (:mod:`lightning_syncasync.bench.gpu`): a JSON file, a pytest
``--junitxml`` file summarised (counts, and each test's outcome with its failure's message) and the exit status."""

from __future__ import annotations

import argparse
import json
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

from lightning_syncasync.bench._gpu_device import ERROR_CHARS, error_text


def read_pytest(args: argparse.Namespace) -> dict[str, Any] | None:
    if args.pytest_json is None and args.pytest_junitxml is None and args.pytest_exit_code is None:
        return None
    out: dict[str, Any] = {"exit_code": args.pytest_exit_code}
    if args.pytest_json is not None:
        try:
            out["json"] = json.loads(Path(args.pytest_json).read_text())
        except (OSError, ValueError) as err:  # the benchmark's numbers are worth keeping without the test results
            out["json"] = {"error": f"--pytest-json {args.pytest_json}: {error_text(err)}"}
    if args.pytest_junitxml is not None:
        try:
            out["junit"] = summarise_junit(Path(args.pytest_junitxml))
        except (OSError, ET.ParseError) as err:
            out["junit"] = {"error": f"--pytest-junitxml {args.pytest_junitxml}: {error_text(err)}"}
    return out


def summarise_junit(path: Path) -> dict[str, Any]:
    """Counts and each test's outcome (with the failure's message) from a pytest ``--junitxml`` file."""
    root = ET.parse(path).getroot()
    cases = []
    for case in root.iter("testcase"):
        outcome, message = "passed", None
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                message = (node.get("message") or node.text or "")[:ERROR_CHARS]
                break
        cases.append(
            {
                "name": f"{case.get('classname', '')}::{case.get('name', '')}",
                "outcome": outcome,
                "time_s": float(case.get("time", 0.0)),
                "message": message,
            }
        )
    counts = {k: sum(c["outcome"] == k for c in cases) for k in ("passed", "failed", "error", "skipped")}
    return {**counts, "tests": len(cases), "cases": cases}
