"""The compiled build: which modules mypyc compiles, which are compiled in this process, and the switch.

setup.py compiles MODULES with mypyc when mypy and a C compiler are there (the same .py files stay the
source of truth: a compiled module is the .py file's code, checked by mypy and translated to C). At run
time, `TRIO_NSQ_COMPILE=0` imports the .py files even where compiled ones are installed, so one install
runs both ways (`.ci/run` tests both). This file imports nothing of trio_nsq: setup.py loads it by path.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import os
import sys
import warnings
from collections.abc import Mapping, Sequence
from types import ModuleType

# Chosen by py-spy profiles of trio-nsqd under NSQ's bench_writer and bench_reader (README, Figures).
MODULES: tuple[str, ...] = (
    "trio_nsq.shared.protocol",
    "trio_nsq.broker.guid",
    "trio_nsq.broker.message",
    "trio_nsq.broker.pqueue",
    "trio_nsq.broker.channel",
    "trio_nsq.broker.latency",  # Channel.finish_messages records every run of FINs there
    "trio_nsq.broker.topic",
    "trio_nsq.broker.storage.segment_log",
    # every append batch's CRC entry (issue 48); the Makefile reads these lines: no comment after a name
    "trio_nsq.broker.storage.checksums",
    "trio_nsq.broker.storage.cursor",
    "trio_nsq.broker.storage.cursor_file",
    "trio_nsq.broker.storage.deadlines",
    "trio_nsq.broker.storage.log_reader",
    "trio_nsq.broker.storage.channel_backend",
    "trio_nsq.broker.storage.deferred_index",
    "trio_nsq.broker.storage.log_index",
    "trio_nsq.broker.storage.topic_log",
    "trio_nsq.broker.storage.sync_group",
    "trio_nsq.broker.client_v2",
    "trio_nsq.broker.protocol_v2",
    "trio_nsq.shared.http_server",
    # /stats with thousands of topics (issue 33): the snapshot's walk and the JSON it is written as
    "trio_nsq.broker.stats",
    "trio_nsq.broker.stats_json",
)

# mypyc's runtime library shared by MODULES (each compiled module is a shim over it):
# trio_nsq/hot_path__mypyc.*.so, inside the package rather than a top-level module of its own
GROUP = "trio_nsq.hot_path"

# "0" turns compilation off: at build time (setup.py builds pure Python) and at run time (the .py files
# are imported even where compiled modules are installed). Anything else, or unset, means compiled.
ENV = "TRIO_NSQ_COMPILE"


def enabled(environ: Mapping[str, str] = os.environ) -> bool:
    return environ.get(ENV, "1").strip().lower() not in ("0", "no", "false", "off")


def why_not_compiled() -> str | None:
    """Why setup.py builds pure Python here, or None when it compiles MODULES."""
    import shutil  # here, not at the top: every import of trio_nsq imports this module, setup.py alone calls this
    import sysconfig

    if not enabled():
        return f"{ENV}=0"
    if importlib.util.find_spec("mypyc") is None:
        return "mypyc (part of mypy) is not installed"
    compiler = (os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(compiler) is None:
        return f"no C compiler ({compiler})"
    if not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")):
        return "no Python headers (Python.h)"
    return None


def _is_extension(module: ModuleType) -> bool:
    path = getattr(module, "__file__", None) or ""
    return path.endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES))


def compiled_modules() -> list[str]:
    """The modules of MODULES that this process runs compiled (imported from a .so)."""
    return [name for name in MODULES if _is_extension(importlib.import_module(name))]


def installed_from_a_wheel(path: str) -> bool:
    """Whether `path`, a file directly in the trio_nsq folder (mypyc's library), was put there by an
    installer (pip, uv, a wheel unpacked): it is listed in the RECORD of a trio_nsq-*.dist-info beside
    the folder (PEP 376/627), as every file of an installed wheel is and no file of a checkout is (an
    editable install's RECORD lists only its .pth and finder; a checkout on PYTHONPATH has none).

    This asks the files that are imported, not metadata about an install: direct_url.json's `editable`
    is absent for an install from an index, and speaks of whichever trio-nsq distribution is found first,
    not necessarily of the code on sys.path (a checkout on PYTHONPATH with the wheel also installed)."""
    site = os.path.dirname(os.path.dirname(path))  # where the trio_nsq folder is
    entry = os.path.relpath(path, site).replace(os.sep, "/")
    try:
        infos = [name for name in os.listdir(site) if name.startswith("trio_nsq-") and name.endswith(".dist-info")]
    except OSError:
        return False
    for info in infos:
        try:
            with open(os.path.join(site, info, "RECORD"), encoding="utf-8") as record:
                if any(line.split(",", 1)[0] == entry for line in record):
                    return True
        except OSError:
            continue
    return False


def stale_modules() -> list[str]:
    """Compiled modules older than their .py file: a checkout (editable install, or on PYTHONPATH) whose
    source was edited after the build. Python would import the compiled one, so the edit would silently
    not run.

    Only a checkout's file times say that. An installed wheel's are the installer's: pip does not keep a
    wheel's times, so its .py files may be written after its extensions, and no one edits installed
    files anyway; its files are never stale (`installed_from_a_wheel`)."""
    suffixes = tuple(importlib.machinery.EXTENSION_SUFFIXES)
    library = importlib.util.find_spec(GROUP + "__mypyc")
    if library is None or not library.origin:
        return []
    built = os.path.getmtime(library.origin)  # the compiled code lives there; a shim may be older
    stale = []
    for name in MODULES:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.origin or not spec.origin.endswith(suffixes):
            continue
        py = os.path.join(os.path.dirname(spec.origin), name.rsplit(".", 1)[-1] + ".py")
        if os.path.exists(py) and os.path.getmtime(py) > max(built, os.path.getmtime(spec.origin)):
            stale.append(name)
    if stale and installed_from_a_wheel(library.origin):  # read only when the times say stale
        return []
    return stale


class _SourceFirst(importlib.machinery.PathFinder):
    """With TRIO_NSQ_COMPILE=0: MODULES come from their .py files, never from a compiled extension."""

    @classmethod
    def find_spec(cls, fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None
                  ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MODULES:
            return None
        for entry in path or sys.path:
            candidate = os.path.join(entry, fullname.rsplit(".", 1)[-1] + ".py")
            if os.path.exists(candidate):
                return importlib.util.spec_from_file_location(fullname, candidate)
        return None


def use_source_when_disabled() -> None:
    """Called by trio_nsq/__init__.py before any compiled module can be imported."""
    if not enabled() and _SourceFirst not in sys.meta_path:
        sys.meta_path.insert(0, _SourceFirst)


def warn_if_stale() -> None:
    """Called by trio_nsq/__init__.py: an edited source whose compiled module was not rebuilt is said
    out loud (`make` rebuilds; so does `pip install -e .`; TRIO_NSQ_COMPILE=0 runs the sources)."""
    if enabled():
        stale = stale_modules()
        if stale:
            warnings.warn(f"compiled modules older than their .py files (run `make` or `pip install -e .` to "
                          f"rebuild, or set {ENV}=0): {', '.join(stale)}", RuntimeWarning, stacklevel=2)
