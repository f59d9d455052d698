"""Console scripts run in the test process: a parser error costs milliseconds here, where a subprocess pays for
importing torch and Lightning (4 s on a fast core, twice that on CI's). Tests of the exit path itself (exit status,
no traceback, nothing started) keep a subprocess each."""

from __future__ import annotations

import contextlib
import io
import sys
from collections.abc import Callable, Sequence
from typing import Any


class CommandFailed(Exception):
    """A command-line tool exited with a non-zero status; the message is its error output."""

    def __init__(self, code: object, message: str) -> None:
        super().__init__(message)
        self.code = code


def run_main(main: Callable[[list[str]], Any], argv: Sequence[str]) -> str:
    """Run a console script's ``main`` here and return its stdout; a non-zero exit raises :class:`CommandFailed`
    with its error output (from the ``error:`` line on, as argparse prints it)."""
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        try:
            result = main(list(argv))
        except SystemExit as exit_:
            result = exit_.code
    if isinstance(result, str):  # sys.exit("message"): the interpreter would print it to stderr and exit with 1
        print(result, file=err)
    code = result if isinstance(result, int) else (0 if result is None else 1)
    if code == 0:
        return out.getvalue()
    lines = err.getvalue().strip().splitlines()
    first = next((i for i, line in enumerate(lines) if ": error:" in line), 0)
    raise CommandFailed(code, "\n".join(lines[first:]))


def run_cli(*args: str, run: bool = True) -> str:
    """``syncasync-cli ARGS`` in this process, for what ends before a Trainer runs (parsing, ``--print_config``;
    ``run=False`` parses and instantiates without a subcommand, as ``fit`` does first): its stdout, or
    :class:`CommandFailed` with its error output."""
    from unittest import mock

    from lightning_syncasync.cli import build_cli

    with mock.patch.object(sys, "argv", ["syncasync-cli"]):  # pytest's own arguments are not the CLI's
        return run_main(lambda argv: build_cli(args=argv, run=run), args)
