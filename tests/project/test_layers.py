"""The package's layers and rooms, read from its folders: each imports only what lies below it.

    gpipe/                     the engine: pipeline, stage interpreter, schedules, transport, ... and its rooms
      capture/ memory/ data/   (the engine's rooms import the engine and each other)
      torchgpipe/              (torchgpipe's API over gpipe.Pipeline: a room of the engine too)
    gpipe/service/             what the service's processes share: gRPC, net, zygote, records, v1/
    worker/                    gpipe.worker: dataplane/ (c10d, channels, lanes), then the daemon above it
    coordinator/               gpipe.coordinator, by room, lowest first:
                               spec/ < outputs/ < plan/ < attempt/ < supervisor/ < server/ < cli/

A module's room is its folder; a new module in a folder follows that folder's rule with nothing to list.
`gpipe.Pipeline` is the engine alone: importing it loads no gRPC, no protobuf, no service module."""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = {"gpipe": "gpipe", **tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
           ["package-dir"]}
ENGINE_ROOMS = ("capture", "memory", "data", "torchgpipe")
COORDINATOR_ROOMS = ("spec", "outputs", "plan", "attempt", "supervisor", "server", "cli")

# Each layer or room, lowest first, with what it may import of ours (beside itself).
ENGINE = ("gpipe", *(f"gpipe.{r}" for r in ENGINE_ROOMS))
SERVICE = ("gpipe.service",)
DATA_PLANE = ("gpipe.worker.dataplane",)
DAEMON = ("gpipe.worker",)
COORDINATOR = tuple(f"gpipe.coordinator.{r}" for r in COORDINATOR_ROOMS)
ORDER = [ENGINE, SERVICE, DATA_PLANE, DAEMON, *((room,) for room in COORDINATOR)]


def module_of(path: Path) -> str:
    """The dotted name `path` installs as (pyproject.toml's package-dir)."""
    for package, folder in sorted(FOLDERS.items(), key=lambda kv: -len(kv[0])):
        base = ROOT / folder
        if path.is_relative_to(base) and not (package == "gpipe" and path.parts[len(base.parts)] in
                                              ("coordinator", "worker")):
            parts = [p for p in path.relative_to(base).with_suffix("").parts if p != "__init__"]
            return ".".join([package, *parts])
    raise AssertionError(f"{path} is in no package")


def room_of(module: str) -> str:
    """The layer or room a module of ours belongs to: the longest of ORDER's names it lies in."""
    names = [name for group in ORDER for name in group]
    return max((n for n in names if module == n or module.startswith(n + ".")), key=len)


def sources() -> list[Path]:
    out = []
    for folder in set(FOLDERS.values()):
        out += [p for p in (ROOT / folder).rglob("*.py") if "v1" not in p.parts]
    return sorted(out)


def imported(path: Path) -> set[str]:
    """Every module of ours `path` imports, at any depth of its code (a function's own imports too)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}
    return {m for m in out if m == "gpipe" or m.startswith("gpipe.")}


def rank(room: str) -> int:
    return next(i for i, group in enumerate(ORDER) if room in group)


def test_every_module_lies_in_a_room_and_every_room_is_a_folder():
    for group in ORDER:
        for room in group:
            package = room.split(".")
            folder = FOLDERS.get(room) or FOLDERS.get(".".join(package[:2]), "gpipe")
            path = ROOT / folder / Path(*package[2:]) if room.startswith(("gpipe.coordinator.", "gpipe.worker."))\
                else ROOT / folder if room in FOLDERS else ROOT / "gpipe" / Path(*package[1:])
            assert (path / "__init__.py").is_file(), f"{room}: no folder {path}"
    rooms = {room_of(module_of(p)) for p in sources()}
    assert rooms == {name for group in ORDER for name in group}


def test_each_room_imports_only_what_lies_below_it():
    bad = {}
    for path in sources():
        here = room_of(module_of(path))
        above = sorted(m for m in imported(path) if m != "gpipe" and rank(room_of(m)) > rank(here))
        if above:
            bad[str(path.relative_to(ROOT))] = above
    assert bad == {}


@pytest.mark.parametrize("module, room", [
    ("gpipe.stage", "gpipe"), ("gpipe.memory.zero", "gpipe.memory"), ("gpipe.service.v1.jobs_pb2", "gpipe.service"),
    ("gpipe.worker.dataplane.c10d", "gpipe.worker.dataplane"), ("gpipe.worker.daemon", "gpipe.worker"),
    ("gpipe.coordinator.cli.main", "gpipe.coordinator.cli"), ("gpipe.coordinator.spec.job", "gpipe.coordinator.spec"),
])
def test_a_module_s_room_is_its_folder(module, room):
    assert room_of(module) == room


def test_a_higher_room_s_import_is_caught(tmp_path):
    """The rule holds a new file to it: a spec module importing the supervisor is named."""
    path = ROOT / "coordinator" / "spec" / "_probe_for_the_test.py"
    assert room_of(module_of(path)) == "gpipe.coordinator.spec"
    assert rank("gpipe.coordinator.supervisor") > rank("gpipe.coordinator.spec")
    assert rank("gpipe.worker") > rank("gpipe.service") > rank("gpipe")


LOADED = """
import sys
import gpipe
gpipe.Pipeline
print("\\n".join(sorted(sys.modules)))
"""


def test_gpipe_pipeline_loads_the_engine_alone():
    r = subprocess.run([sys.executable, "-c", LOADED], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    service = ("grpc", "google.protobuf", "gpipe.service", "gpipe.coordinator", "gpipe.worker", "prometheus_client",
               "tensorboard", "matplotlib", "pydantic", "yaml")
    loaded = [m for m in r.stdout.split() if m == "gpipe.stage" or m.startswith(service)]
    assert loaded == ["gpipe.stage"], loaded


def test_only_gpipe_is_installed_at_the_top_level():
    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert {p.split(".")[0] for p in setup["packages"]} == {"gpipe"}
    assert all(name.startswith("gpipe.") for name in setup["package-dir"])
    assert all(m["name"].startswith("gpipe.") for m in setup.get("ext-modules", []))


def test_the_docs_layout_table_names_every_room_and_module():
    """docs/how-it-works.md's layout table: a row per room, naming each of its modules (written from the folders)."""
    text = (ROOT / "docs" / "how-it-works.md").read_text()
    rows = {line.split("|")[1].strip().strip("`"): line for line in text.splitlines() if line.startswith("| `")}
    for group in ORDER:
        for room in group:
            folder = next(str(module_folder.relative_to(ROOT)) + "/" for module_folder in
                          {p.parent for p in sources()} if room_of(module_of(module_folder / "__init__.py")) == room
                          and module_of(module_folder / "__init__.py") == room)
            assert folder in rows, f"docs/how-it-works.md has no row for {folder}"
            named = {p.name for p in (ROOT / folder).glob("*.py") if p.name != "__init__.py"}
            missing = sorted(n for n in named if f"`{n}`" not in rows[folder])
            assert missing == [], f"{folder}'s row does not name {missing}"
