"""Print the project's dependencies, one per line, from pyproject.toml alone (argv: the pyproject.toml path,
then the extras as in pip, e.g. `[gpu]` or ``), so that the Dockerfile installs them in a layer that the code
does not invalidate. Python 3.10 (Ubuntu 22.04's) has no tomllib: pip's vendored tomli reads it there."""
import sys

try:
    import tomllib
except ModuleNotFoundError:
    from pip._vendor import tomli as tomllib

with open(sys.argv[1], "rb") as fh:
    project = tomllib.load(fh)["project"]
extras = [e.strip() for e in (sys.argv[2] if len(sys.argv) > 2 else "").strip("[]").split(",") if e.strip()]
print("\n".join(project["dependencies"] + [d for e in extras for d in project["optional-dependencies"][e]]))
