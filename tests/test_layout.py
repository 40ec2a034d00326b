"""Which package imports which (README, "How it is built"): read from every module's import statements.

    shared/   what nsqd and nsqlookupd both use: imports nothing of ours but shared
    broker/   nsqd: shared and itself
    lookupd/  nsqlookupd and trio-nsqadmin: shared and itself
    trio_nsq/client, spark, apps, testing: the user side, above the daemons; the daemons never import them

An import inside a function counts as much as one at the top: a late import is still a dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
USER_SIDE = ("client", "spark", "apps", "testing")
# package -> the packages of ours it may import (besides itself)
ALLOWED = {
    "shared": set(),
    "broker": {"shared"},
    "lookupd": {"shared"},
    "client": {"shared"},
    "spark": {"shared", "client"},
    "apps": {"shared", "client"},
    "testing": {"shared", "client", "broker", "lookupd"},  # it runs the daemons in your process
}


def _folder(package: str) -> Path:
    return REPO / package if package in ("shared", "broker", "lookupd") else REPO / "trio_nsq" / package


def _package_of(module: str) -> str | None:
    """trio_nsq.<package>... -> <package>; None for trio_nsq itself, its face modules and foreign ones."""
    parts = module.split(".")
    if parts[0] != "trio_nsq" or len(parts) < 2:
        return None
    return parts[1] if parts[1] in ALLOWED else None


def imports_of(path: Path) -> set[str]:
    """Every module of ours that `path` imports, wherever in the file the import is."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {name for name in found if name.startswith("trio_nsq")}


def _modules(package: str) -> list[Path]:
    return sorted(p for p in _folder(package).rglob("*.py") if "__pycache__" not in p.parts)


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_each_package_imports_only_what_is_below_it(package):
    assert _modules(package), f"no modules found for {package}"
    wrong = []
    for path in _modules(package):
        for module in imports_of(path):
            target = _package_of(module)
            if target is not None and target != package and target not in ALLOWED[package]:
                wrong.append(f"{path.relative_to(REPO)} imports {module}")
    assert wrong == []


def test_the_check_sees_a_wrong_import(tmp_path):
    # the rule is read from the source: an import the daemons must not make is found, even inside a function
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from trio_nsq.client import Producer\n    import trio_nsq.broker.nsqd\n")
    targets = {_package_of(m) for m in imports_of(module)}
    assert {"client", "broker"} <= targets


def test_shared_holds_no_user_side_package():
    assert not [name for name in USER_SIDE if (REPO / "shared" / name).exists()]
    assert all((REPO / "trio_nsq" / name / "__init__.py").is_file() for name in USER_SIDE)


def test_the_storage_imports_nothing_of_the_broker_above_it():
    """broker/storage/ (the segment log and its reader, the topic log, the deadlines, the cursor and its
    file, the log reader, the deferred index, the sync group, a channel's backend) is a package of its
    own: it imports shared and itself, never the broker that uses it (Message, Channel, Topic, ...)."""
    storage = REPO / "broker" / "storage"
    modules = sorted(p for p in storage.glob("*.py"))
    assert len(modules) >= 10
    wrong = [f"{path.relative_to(REPO)} imports {module}"
             for path in modules for module in imports_of(path)
             if not module.startswith(("trio_nsq.shared", "trio_nsq.broker.storage"))]
    assert wrong == []
