"""The layout's import rules; at the end, two checks of the tree as a whole: pyflakes finds no undefined or unused
name, and `make test` runs each module's tests on one worker.

Packages: the server side and the shared modules import neither TRL nor DeepSpeed, so a server node needs only the
server's dependencies; the launch side validates nothing by importing the trainer eagerly.

Arrows (module imports, measured on the source: every `import` and `from ... import` anywhere in a module, inside
functions and `if TYPE_CHECKING:` blocks too, since a lazy import is still a dependency). The package is four layers
of rooms, top to bottom (`LAYERS`):

    entry    cli.py, train.py                           the commands a user runs
    rooms    server/, trainer/, launch/                 one room per side
    schema   config/                                    the recipe and the configs it becomes
    shared   protocol, weight_files, weight_broadcast, named_tensors, sglang_client, openai_client, server_pool,
             rewards, wait_progress, and the package root (`__init__.py`: the version and the lazy public names; a module's `from open_r1_ext
             import RemoteGRPOTrainer` counts as an import of the module the name comes from)

Allowed: an import of a module in a lower layer, or of a module in the same room. A *back-arrow* is every other
import: up to a higher layer (the schema importing the trainer, a room importing an entry point) or across to
another room of the same layer (launch/ importing trainer/). A *circle* is a set of modules that import each other
round (a strongly connected component of the import graph), inside one room too. The tree has neither; every module
belongs to a room, so a new one has to be placed before this test passes.
"""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import open_r1_ext
from tests.slurm_helpers import REPO

TRAINER_ONLY = ("trl", "deepspeed", "accelerate", "datasets")


def imported_by(module: str) -> set[str]:
    """Top-level packages that importing `module` in a fresh interpreter brings in."""
    code = f"import sys, {module}; print(' '.join(sorted({{m.split('.')[0] for m in sys.modules}})))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return set(out.stdout.split())


@pytest.mark.parametrize("module", [
    "open_r1_ext.server.app",  # the built-in server and its whole HTTP layer
    "open_r1_ext.protocol",
    "open_r1_ext.weight_files",
    "open_r1_ext.sglang_client",
    "open_r1_ext.server_pool",
    "open_r1_ext.openai_client",
    "open_r1_ext.weight_broadcast",
    "open_r1_ext.named_tensors",
])
def test_server_side_and_shared_modules_import_no_trainer_package(module):
    assert imported_by(module).isdisjoint(TRAINER_ONLY)


def test_server_room_imports_nothing_from_the_trainer_or_launch_rooms():
    code = ("import sys, open_r1_ext.server.app; "
            "print(' '.join(m for m in sys.modules if m.startswith(('open_r1_ext.trainer', 'open_r1_ext.launch'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.split() == [], out.stdout + out.stderr[-3000:]


def test_status_and_plot_import_no_trainer_package(tmp_path):
    """`open-r1-ext status` and `plot` run on a login node: reading a run with a job, a server address, a key and
    logged steps (every lazy import on their way) brings in no TRL, DeepSpeed, accelerate or datasets."""
    (tmp_path / "jobs.env").write_text("SERVER_JOB=999999999\nEXECUTOR=local\n")
    (tmp_path / "replicas" / "server").mkdir(parents=True)
    (tmp_path / "replicas" / "server" / "999999999.addr").write_text("127.0.0.1:9\n")
    (tmp_path / "api_key.yaml").write_text('api-key: "k"\n')
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "max_steps": 2, "time": 1.0, "reward": 0.5}\n'
                                            '{"step": 2, "max_steps": 2, "time": 2.0, "reward": 0.7}\n')
    code = ("import sys; from open_r1_ext.cli import main; "
            f"assert main(['status', {str(tmp_path)!r}]) == 0 and main(['plot', {str(tmp_path)!r}]) == 0; "
            "print(' '.join(sorted({m.split('.')[0] for m in sys.modules})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    imported = set(out.stdout.splitlines()[-1].split())
    assert {"matplotlib", "requests"} <= imported and imported.isdisjoint(TRAINER_ONLY)


# ---------------------------------------------------------------------------------------------- the import graph
PACKAGE = Path(open_r1_ext.__file__).parent
LAYERS = (  # top to bottom: {room: modules and packages in it}
    {"entry": ("open_r1_ext.cli", "open_r1_ext.train")},
    {"server": ("open_r1_ext.server",), "trainer": ("open_r1_ext.trainer",), "launch": ("open_r1_ext.launch",)},
    {"schema": ("open_r1_ext.config",)},
    {"shared": ("open_r1_ext", "open_r1_ext.protocol", "open_r1_ext.weight_files", "open_r1_ext.sglang_client",
                "open_r1_ext.openai_client", "open_r1_ext.server_pool", "open_r1_ext.rewards",
                "open_r1_ext.wait_progress", "open_r1_ext.weight_broadcast", "open_r1_ext.named_tensors")},
)


def module_files(package_dir: Path) -> dict[str, Path]:
    """`{"open_r1_ext.launch.jobs": path}` for every module of the package in `package_dir`."""
    files = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = path.relative_to(package_dir.parent).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return files


def import_graph(package_dir: Path, lazy_names: dict[str, str]) -> dict[str, set[str]]:
    """`{module: modules of the package it imports}`, from each module's source (every import statement, wherever it
    is). `from pkg import name` is the module `pkg.name` if there is one, else `pkg`; a lazy public name of the root
    (`lazy_names`: `from open_r1_ext import RemoteGRPOTrainer`) is the module it comes from."""
    files = module_files(package_dir)
    root = package_dir.name
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        targets = graph.setdefault(module, set())
        package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
                for alias in node.names:
                    name = f"{base}.{alias.name}"
                    targets.add(name if name in files else lazy_names.get(alias.name, base) if base == root else base)
        graph[module] = {t for t in targets if t in files and t != module}
    return graph


def room_of(module: str) -> tuple[int, str]:
    """`(layer index from the top, room)` of a module: the room whose longest entry is the module or a package
    above it."""
    found = [(len(entry), layer, room) for layer, rooms in enumerate(LAYERS) for room, entries in rooms.items()
             for entry in entries if module == entry or (module.startswith(entry + ".") and entry != "open_r1_ext")]
    assert found, f"{module} belongs to no room of LAYERS: place it (tests/test_layout.py)"
    _, layer, room = max(found)
    return layer, room


def back_arrows(graph: dict[str, set[str]]) -> list[str]:
    """Every import up a layer or across to another room of the same layer, as `a -> b (room -> room)`."""
    found = []
    for module, targets in sorted(graph.items()):
        layer, room = room_of(module)
        for target in sorted(targets):
            target_layer, target_room = room_of(target)
            if target_room != room and target_layer <= layer:
                found.append(f"{module} -> {target} ({room} -> {target_room})")
    return found


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in sorted(graph.get(module, ())):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = []
            while not component or component[-1] != module:
                component.append(stack.pop())
            if len(component) > 1:
                found.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return found


def test_the_package_has_no_circle_and_no_back_arrow():
    graph = import_graph(PACKAGE, open_r1_ext._LAZY)
    assert {"open_r1_ext.config.recipe", "open_r1_ext.launch.jobs", "open_r1_ext.trainer.data"} <= set(graph)
    assert "open_r1_ext.config.recipe" in graph["open_r1_ext.trainer.data"]  # the graph sees imports at all
    assert circles(graph) == []
    assert back_arrows(graph) == []


def test_the_schema_imports_no_side_and_every_side_reads_it():
    """config/ is the one schema: the trainer, the launchers and the entry points import it, and it imports only the
    shared modules below it (config flows one way: YAML -> schema -> sides)."""
    graph = import_graph(PACKAGE, open_r1_ext._LAZY)
    below = {target for module, targets in graph.items() if module.startswith("open_r1_ext.config") for target in targets}
    assert {room_of(target)[1] for target in below} <= {"schema", "shared"}
    readers = {room_of(module)[1] for module, targets in graph.items()
               if any(t.startswith("open_r1_ext.config") for t in targets)}
    assert {"trainer", "launch", "entry"} <= readers


def test_the_checks_find_a_lazy_back_arrow_and_the_circle_it_closes(tmp_path):
    """The checks on a copy of the package where the schema imports the run-key module again inside a function
    (the circle this layout removed: launch/run_key.py imports the recipe): both are reported."""
    copy = tmp_path / "open_r1_ext"
    for module, path in module_files(PACKAGE).items():
        target = copy / path.relative_to(PACKAGE)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(path.read_text())
    recipe = copy / "config" / "recipe.py"
    recipe.write_text(recipe.read_text() + "\n\ndef _key_rule(recipe):\n    from open_r1_ext.launch.run_key import key_file\n")
    graph = import_graph(copy, open_r1_ext._LAZY)
    assert back_arrows(graph) == ["open_r1_ext.config.recipe -> open_r1_ext.launch.run_key (schema -> launch)"]
    assert circles(graph) == [["open_r1_ext.config.recipe", "open_r1_ext.launch.run_key"]]


def test_pyflakes_finds_no_undefined_or_unused_name():
    """An undefined name is a NameError on whatever path reaches it, tested or not (two were found this way)."""
    found = subprocess.run([sys.executable, "-m", "pyflakes", "open_r1_ext", "tests", "tools"],
                           cwd=REPO, capture_output=True, text=True)
    assert found.returncode == 0, found.stdout + found.stderr


def test_make_test_runs_each_module_on_one_worker(request):
    """`make test`'s `--dist loadgroup` groups by the id xdist gives each test (`tests/conftest.py`). When it did not
    (pytest 9.2), every test went its own way: module fixtures (servers) started on both workers, SLURM tests ran side
    by side. Under `make test` this test's own id says; elsewhere a fast module is run as `make test` runs the suite."""
    if request.config.getoption("loadgroup", default=False):
        assert request.node.nodeid.endswith("@tests.test_layout"), request.node.nodeid
        return
    ran = subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadgroup", "-v", "-p", "no:cacheprovider",
                          "tests/test_jobs.py"], cwd=REPO, capture_output=True,
                         text=True, timeout=300)
    passed = [line for line in ran.stdout.splitlines() if " PASSED " in line]
    assert ran.returncode == 0 and passed, ran.stdout + ran.stderr
    assert all(line.rstrip().endswith("@tests.test_jobs") for line in passed), passed
    assert len({line.split()[0] for line in passed}) == 1, passed  # one worker ran them all
