"""The package's floors (docs/architecture.md, "Layout"): a module imports only from its own floor or the
floors below it, so the foundation never depends on a role, a role never on the controller, and nothing
but the commands on the commands. Imports under `if TYPE_CHECKING:` are exempt (they run in no process)."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# where each package's files live (pyproject.toml's package-dir)
PACKAGE_DIRS = {
    "rl_tpu": ROOT / "rl_tpu",
    "rl_tpu.trainer": ROOT / "trainer",
    "rl_tpu.rollout": ROOT / "rollout",
    "rl_tpu.weight_sync": ROOT / "weight_sync",
}
# bottom to top; a module's floor is that of its longest matching prefix
FLOORS: list[tuple[str, tuple[str, ...]]] = [
    ("foundation", ("rl_tpu",)),
    ("roles", ("rl_tpu.trainer", "rl_tpu.rollout", "rl_tpu.weight_sync")),
    ("controller", ("rl_tpu.controller", "rl_tpu.integrations")),
    ("commands", ("rl_tpu.commands",)),
]


def floor_of(module: str) -> int:
    best, floor = -1, -1
    for i, (_, prefixes) in enumerate(FLOORS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best:
                best, floor = len(p), i
    return floor


def modules() -> dict[str, Path]:
    found = {}
    for package, folder in PACKAGE_DIRS.items():
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([package, *parts])] = path
    return found


def _type_checking_block(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")
    )


def imported(source: str, module: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, module) of every rl_tpu import in `source`, at any depth, outside TYPE_CHECKING blocks."""
    out: list[tuple[int, str]] = []

    def visit(node: ast.AST) -> None:
        if _type_checking_block(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            out.extend((node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "rl_tpu")
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolved against this module's package
                package = module.split(".") if is_package else module.split(".")[:-1]
                package = package[: len(package) - (node.level - 1)]
                base = ".".join(package + ([base] if base else []))
            if base.split(".")[0] == "rl_tpu":
                out.append((node.lineno, base))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(source))
    return out


def upward_imports(source: str, module: str, is_package: bool = False) -> list[str]:
    mine = floor_of(module)
    return [
        f"{module}:{line} imports {target} ({FLOORS[floor_of(target)][0]} is above {FLOORS[mine][0]})"
        for line, target in imported(source, module, is_package)
        if floor_of(target) > mine
    ]


def test_every_module_is_on_a_floor():
    assert all(floor_of(m) >= 0 for m in modules())
    assert floor_of("rl_tpu.controller.loop") == 2 and floor_of("rl_tpu.rollout.tools") == 1


def test_no_module_imports_a_floor_above_its_own():
    found = modules()
    assert len(found) > 80, sorted(found)  # the walk saw the whole package
    bad = [
        msg
        for module, path in found.items()
        for msg in upward_imports(path.read_text(encoding="utf-8"), module, path.name == "__init__.py")
    ]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize(
    ("source", "module", "expected"),
    [
        ("from rl_tpu.controller.loop import train\n", "rl_tpu.config", 1),
        ("def f():\n    import rl_tpu.trainer.model\n", "rl_tpu.model_folder", 1),  # a lazy import counts
        ("from ..controller import loop\n", "rl_tpu.rollout.worker", 1),  # relative, resolved
        (
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from rl_tpu.trainer import x\n",
            "rl_tpu.types",
            0,
        ),
        ("from rl_tpu.config import Config\n", "rl_tpu.commands.cli", 0),
        ("from rl_tpu.weight_sync import sync\n", "rl_tpu.rollout.worker", 0),  # same floor
    ],
)
def test_the_check_sees_an_upward_import(source, module, expected):
    assert len(upward_imports(source, module)) == expected
