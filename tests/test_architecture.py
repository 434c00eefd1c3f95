"""The layout the tree promises (docs/layout.md; docs/design.md): the
import graph of tfde has no cycle, and the core knows distributed training
only through the Exchange seam (tfde/exchange.py), with the engines beside
it in tfde/distributed/.  Read from the sources (ast), nothing imported."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "tfde"
# Everything else in tfde/ is the core.  The package's __init__ wires the
# engines in; the demo, the CLI and the TFRA names sit above both.
OUTSIDE_CORE = ("tfde.distributed", "tfde.compat", "tfde.demo", "tfde.cli", "tfde.__main__")


def _modules() -> dict:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        found[name[: -len(".__init__")] if name.endswith(".__init__") else name] = path
    return found


MODULES = _modules()
CORE = sorted(m for m in MODULES if m != "tfde" and not any(m == p or m.startswith(p + ".") for p in OUTSIDE_CORE))


def _imports(path: Path) -> set:
    """The tfde modules `path` imports anywhere (module level or inside
    functions), and every other module name it imports."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            submodules = {f"{node.module}.{a.name}" for a in node.names} & set(MODULES)
            out.update(submodules)
            if len(submodules) < len(node.names):  # names defined in node.module itself
                out.add(node.module)
    return out


def _in(module: str, packages) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def test_the_import_graph_has_no_cycle():
    """A cycle hidden in a function-level import is a cycle too; a module's
    import of its own package does not count (the package is initialised
    first)."""
    graph = {m: {i for i in _imports(p) if i in MODULES} for m, p in MODULES.items()}
    done, cycles = set(), []

    def visit(module, path):
        for dep in sorted(graph[module]):
            if dep == module or module.startswith(dep + "."):
                continue
            if dep in path:
                cycles.append(path[path.index(dep) :] + [dep])
            elif dep not in done:
                visit(dep, path + [dep])
        done.add(module)

    for module in sorted(graph):
        if module not in done:
            visit(module, [module])
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_core_is_most_of_the_package():
    assert {"tfde.variable", "tfde.optimizer", "tfde.exchange", "tfde.policy", "tfde.saving.state"} <= set(CORE)


@pytest.mark.parametrize("module", CORE)
def test_the_core_knows_distribution_only_through_the_exchange_seam(module):
    imported = _imports(MODULES[module])
    engines = sorted(i for i in imported if _in(i, ("tfde.distributed", "horovod")))
    assert not engines, f"{module} imports {engines}; the core talks to tfde.exchange only"
    source = MODULES[module].read_text()
    assert "sys.modules" not in source or "horovod" not in source, f"{module} looks for Horovod in sys.modules"


@pytest.mark.parametrize("module", CORE)
def test_no_core_module_names_an_engine(module):
    """Not even in a comment or a message: what the core says of an engine
    it learns from the engine (Engine.wrapping_hint and the like)."""
    source = MODULES[module].read_text().lower()
    for name in ("horovod", "hvd."):
        assert name not in source, f"{module} names {name!r}; say it in tfde/distributed/ instead"


def test_the_engines_are_registered_by_the_package():
    init = _imports(PACKAGE / "__init__.py")
    assert "tfde.distributed" in init
    registered = _imports(PACKAGE / "distributed" / "__init__.py")
    assert {"tfde.distributed.tf_distribute", "tfde.distributed.horovod"} <= registered


def test_the_native_redis_client_waits_as_the_defaults_say():
    """The retry policy is written in C++ (backends/redis/resp_client.h) and
    in Python (tfde/_defaults.py); the two agree."""
    import re

    from tfde import _defaults

    header = (ROOT / "backends" / "redis" / "resp_client.h").read_text()

    def constant(name):
        return int(re.search(rf"{name}\s*=\s*(\d+)", header).group(1))

    assert constant("kBackoffBaseMs") == round(_defaults.REDIS_BACKOFF_BASE_S * 1000)
    assert constant("kBackoffMaxMs") == round(_defaults.REDIS_BACKOFF_MAX_S * 1000)
    assert constant("int retry_deadline_ms") == _defaults.REDIS_RETRY_DEADLINE_MS
