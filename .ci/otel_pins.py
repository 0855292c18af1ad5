"""Print pip requirements for .ci/run's second environment, read from pyproject so that they cannot drift from
it: every OTel package pinned at its floor (`floor`); the API and SDK at the release line just below the floor
(`below`: `init()` must refuse it in one line and start nothing); the test runner and its plugins from the
`test` extra (`tools`: the floor tests need nothing heavier)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

pyproject = (Path(__file__).parent.parent / "pyproject.toml").read_text()  # no tomllib: Python 3.10 runs this too
floors = {name: (int(major), int(minor)) for name, major, minor in
          re.findall(r'"(opentelemetry-[a-z-]+)>=(\d+)\.(\d+)[^"]*"', pyproject)}
if len(set(floors.values())) != 1:
    sys.exit(f"pyproject: the OTel packages have different floors: {floors}")
mode = sys.argv[1] if len(sys.argv) > 1 else "floor"
if mode == "floor":
    print(" ".join(f"{name}=={major}.{minor}.0" for name, (major, minor) in floors.items()))
elif mode == "tools":
    test_extra = pyproject.split("\ntest = [", 1)[1].split("\n]", 1)[0]
    print(" ".join(re.findall(r'"((?:pytest|hypothesis|psutil)[^"]*)"', test_extra)))
elif mode == "below":
    print(" ".join(f"{name}=={major}.{minor - 1}.*" for name, (major, minor) in floors.items()
                   if name in ("opentelemetry-api", "opentelemetry-sdk")))
else:
    sys.exit(f"usage: {sys.argv[0]} floor|below|tools")
