"""Builds trio-nsq with its hot modules compiled by mypyc (trio_nsq/compiled.py lists them), or as pure
Python when compilation is off (TRIO_NSQ_COMPILE=0) or cannot happen here (no mypyc, no C compiler or
no Python headers). Everything else is declared in pyproject.toml.

The same .py files are the source in both modes, as mypy and black ship theirs: a compiled module is
an extension beside its .py file, imported first when present.
"""

from __future__ import annotations

import importlib.util
import os
import sys

from setuptools import setup

HERE = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.util.spec_from_file_location("_trio_nsq_compiled", os.path.join(HERE, "trio_nsq", "compiled.py"))
assert _spec and _spec.loader
compiled = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(compiled)

# commands that never build extensions (pip's metadata steps, sdist): no need to run mypyc for them
METADATA_ONLY = {"egg_info", "dist_info", "sdist", "clean", "--version", "--name"}


def ext_modules() -> list:
    commands = [arg for arg in sys.argv[1:] if not arg.startswith("-")]
    if commands and commands[0] in METADATA_ONLY or sys.argv[1:] and set(sys.argv[1:]) <= METADATA_ONLY:
        return []
    reason = compiled.why_not_compiled()
    if reason:
        print(f"trio-nsq: building pure Python ({reason})", file=sys.stderr)
        return []
    from mypyc.build import mypycify

    paths = [os.path.join(*name.split(".")) + ".py" for name in compiled.MODULES]
    print(f"trio-nsq: compiling {len(paths)} modules with mypyc", file=sys.stderr)
    return mypycify(paths, opt_level="3", group_name=compiled.GROUP)


setup(ext_modules=ext_modules())
