"""`make typecheck`: mypy over the one import name, gpipe, as the build maps it.

The repository keeps gpipe.coordinator in coordinator/ and gpipe.worker in worker/ (pyproject.toml's
package-dir). mypy finds modules by folder and does not follow setuptools' editable-install hook, so this
names every source file with its module, from the same mapping the build reads, and runs mypy's own build
with the settings of pyproject.toml's [tool.mypy]. Extra arguments go to mypy as on its command line."""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

from mypy import build
from mypy.errors import CompileError
from mypy.fscache import FileSystemCache
from mypy.main import process_options
from mypy.modulefinder import BuildSource

ROOT = Path(__file__).resolve().parent.parent


def sources() -> list[BuildSource]:
    """Every module of the package, with its folder from pyproject.toml's package-dir."""
    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {"gpipe": "gpipe", **setup.get("package-dir", {})}
    out = []
    for package, folder in sorted(folders.items()):
        base = ROOT / folder
        for path in sorted(base.rglob("*.py*")):
            if path.suffix not in (".py", ".pyi") or (path.suffix == ".py" and path.with_suffix(".pyi").exists()):
                continue
            rel = path.relative_to(base).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            # a folder mapped elsewhere (gpipe/coordinator would be gpipe.coordinator) is that mapping's
            module = ".".join([package, *parts])
            if package == "gpipe" and any(module == m or module.startswith(m + ".") for m in folders if m != "gpipe"):
                continue
            out.append(BuildSource(str(path), module))
    return out


def main() -> int:
    files, options = process_options(["--config-file", str(ROOT / "pyproject.toml"), *sys.argv[1:], "-c", ""],
                                     fscache=FileSystemCache())
    try:
        result = build.build(sources(), options, stdout=sys.stdout, stderr=sys.stderr)
    except CompileError as e:
        print("\n".join(e.messages))
        return 2
    for line in result.errors:
        print(line)
    n = len({s.path for s in sources()})
    if result.errors:
        files_with = len({line.split(":", 1)[0] for line in result.errors if ": error:" in line})
        print(f"Found {sum(': error:' in line for line in result.errors)} errors in {files_with} files "
              f"(checked {n} source files)")
        return 1
    print(f"Success: no issues found in {n} source files")
    return 0


if __name__ == "__main__":
    sys.exit(main())
