"""GPU readiness that a CPU machine can check: the two rules that keep the pack's tensors on the right device.

CPU runs cannot catch a tensor created on the wrong device: everything is on the CPU. These tests read the source
instead (``ast``), so a GPU-only bug of that kind fails here, on every machine, before a user's first GPU run:

1. every tensor factory call in the pack's library code (algorithms, strategies, callbacks, plugins) names its
   device: a tensor made without ``device=`` lands on the CPU, and next to a model on a GPU that is an error
   (``x + cpu_tensor``) or a silent host round trip;
2. every collective in that code goes through ``algorithms/_comm.py``, whose functions put the tensor on the device
   the backend takes (NCCL: CUDA only; gloo: the CPU for a model on a GPU), and every enumeration of subgroups
   through its ``new_subgroups`` (torch's fails under a gloo job bound to a GPU).

The tests under ``tests/gpu`` check the same at run time, on a GPU, and on an accelerator emulated on the CPU
(``tests/test_emulated_gpu.py``), which every machine runs.
"""

from __future__ import annotations

import ast
from pathlib import Path

import lightning_syncasync

PACKAGE = Path(lightning_syncasync.__file__).parent
# Library code that runs next to the user's model. Tools (bench, advise, emulate) and the demo datasets make host
# tensors on purpose and time raw collectives; they are not held to these rules.
LIBRARY = ("algorithms", "strategies", "callbacks", "plugins")
FACTORIES = {
    "zeros", "ones", "empty", "full", "tensor", "as_tensor", "arange", "linspace", "eye",
    "rand", "randn", "randint", "randperm",
}  # fmt: skip
COLLECTIVES = {
    "all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "all_gather_single", "all_to_all",
    "all_to_all_single", "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "reduce", "gather",
    "scatter", "send", "recv", "isend", "irecv", "all_gather_object", "broadcast_object_list",
}  # fmt: skip
# The one module allowed to call collectives directly, and async ones whose tensor is placed by the caller.
COMM_MODULE = PACKAGE / "algorithms" / "_comm.py"
ASYNC_ALLOWED = {(PACKAGE / "algorithms" / "averaging" / "delayed.py", "all_reduce")}


def _library_files() -> list[Path]:
    return sorted(f for part in LIBRARY for f in (PACKAGE / part).rglob("*.py"))


def _calls(path: Path, module_names: set[str]) -> list[tuple[int, str, ast.Call]]:
    """``(line, name, call)`` of every call ``<module>.<name>(...)`` with ``<module>`` one of ``module_names``."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = node.func.value
            name = ast.unparse(owner) if isinstance(owner, ast.Name | ast.Attribute) else ""
            if name in module_names:
                out.append((node.lineno, node.func.attr, node))
    return out


def test_the_rules_see_the_library_code():
    files = _library_files()
    assert len(files) > 30
    calls = [c for f in files for c in _calls(f, {"torch"}) if c[1] in FACTORIES]
    assert len(calls) > 20, "the scan found almost no factory calls: is it reading the package?"


def test_every_tensor_factory_in_the_library_names_its_device():
    missing = [
        f"{f.relative_to(PACKAGE.parent)}:{line}: torch.{name}(...) without device="
        for f in _library_files()
        for line, name, call in _calls(f, {"torch"})
        if name in FACTORIES and not any(k.arg == "device" for k in call.keywords)
    ]
    assert not missing, (
        "these tensors would be made on the CPU next to a model on a GPU; name the device (the data's, or "
        '"cpu" for host-side figures):\n' + "\n".join(missing)
    )


def test_every_collective_in_the_library_goes_through_comm():
    direct = []
    for f in _library_files():
        if f == COMM_MODULE:
            continue
        for line, name, call in _calls(f, {"dist", "torch.distributed"}):
            if name not in COLLECTIVES:
                continue
            is_async = any(k.arg == "async_op" for k in call.keywords)
            if is_async and (f, name) in ASYNC_ALLOWED:
                continue
            direct.append(f"{f.relative_to(PACKAGE.parent)}:{line}: dist.{name}(...)")
    assert not direct, (
        "collectives outside algorithms/_comm.py do not put their tensors where the backend needs them (NCCL: CUDA, "
        "gloo: the CPU); use all_reduce_, broadcast_, all_gather_flat, reduce_scatter_flat or all_to_all_flat:\n"
        + "\n".join(direct)
    )


def test_every_subgroup_enumeration_in_the_library_goes_through_comm():
    # torch's new_subgroups_by_enumeration fails under a gloo job bound to a GPU (Lightning's process_group_backend=
    # "gloo" on GPUs); _comm.new_subgroups works around it (its docstring; tests/test_emulated_gpu.py shows it).
    direct = [
        f"{f.relative_to(PACKAGE.parent)}:{line}"
        for f in _library_files()
        if f != COMM_MODULE
        for line, name, _ in _calls(f, {"dist", "torch.distributed"})
        if name == "new_subgroups_by_enumeration"
    ]
    assert not direct, "use lightning_syncasync.algorithms._comm.new_subgroups instead:\n" + "\n".join(direct)
