"""Print pip constraints that pin every lower bound in pyproject.toml (``name>=v`` -> ``name==v``).

CI installs the oldest supported stack with them (``PIP_CONSTRAINT``), so the lower bounds
pyproject states are the versions CI tests: the dependencies and the test extra's.
"""

import re
import sys
import tomllib
from pathlib import Path

project = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())["project"]
requirements = [*project["dependencies"], *project["optional-dependencies"]["test"]]
for requirement in requirements:
    match = re.fullmatch(r"\s*([A-Za-z0-9_.\-]+)\s*>=\s*([^,;\s]+)\s*", requirement.split("#")[0])
    if not match:
        sys.exit(f"{requirement!r} in pyproject.toml has no plain lower bound (name>=version) to pin")
    print(f"{match[1]}=={match[2]}")
