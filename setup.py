"""Optional compiled build of the pure core (decision 0041); pyproject.toml holds the rest.

    EXTPROC_MYPYC=1 .venv/bin/python setup.py build_ext --inplace     # what `make compiled` runs

Without EXTPROC_MYPYC this adds nothing: the package is pure Python, as installed by
`pip install -e .`. With it, mypyc compiles extproc/core's modules to extension modules
placed beside their sources; Python imports an extension before a .py of the same name, and
`make uncompiled` deletes them, which brings the pure-Python modules back.
"""

from __future__ import annotations

import os
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).resolve().parent
# Left to Python (decision 0041 says what each needs to compile): config.py (read once at
# start-up; it reads its dataclasses' defaults through the class, which mypyc's native
# classes refuse); machine.py (its dataclass's `TABLE: ClassVar` default is taken for a
# field at import, and its ProtocolViolation inherits from RuntimeError), with gate.py and
# guard.py, whose machines subclass it; tool_route.py (its own RuntimeError subclass).
NOT_COMPILED = ("config.py", "machine.py", "gate.py", "guard.py", "tool_route.py")
# The modules of the I/O-free core, but its package marker.
COMPILED = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "extproc" / "core").glob("*.py")
                  if p.name != "__init__.py" and p.name not in NOT_COMPILED)

ext_modules = []
if os.environ.get("EXTPROC_MYPYC") == "1":
    from mypyc.build import mypycify

    ext_modules = mypycify(["--strict", *COMPILED], opt_level="3")

setup(ext_modules=ext_modules)
