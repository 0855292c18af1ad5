"""The fault-injection suite; helpers live in `faultkit` beside this file."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # importlib mode: let tests import their helpers
