"""Static layout checks on skipless_jax/, read with `ast` (nothing is imported or run):

(a) no import cycle between project modules, imports inside functions included;
(b) no module uses another module's private (`_x`) name;
(c) no library-internal import (`_src` and other `_`-prefixed module paths of a library);
(d) one training loop: `jax.transfer_guard` (the guard around the step) in one module of trainers/,
    and no other module of trainers/ loops over training batches.
(e) layers point down: `skipless_jax.models` imports nothing of the packages above it;
(f) no file outside tests/ puts tests/ on `sys.path` (scripts use the package, not the tests' helpers).
(g) no module outside trainers/ names a trainer (`config.trainer == 'dino'`): callers read the
    registered `Trainer` record, which every trainer satisfies;
(h) every trainer's train state is a flax.struct dataclass (its abstract initial state, built).

Run alone: `python -m pytest tests/test_structure.py -q`.
"""

from __future__ import annotations

import ast
import os
import re

import pytest

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "skipless_jax")
PACKAGE = "skipless_jax"

# Known violations left to other work, each named so it can be removed when fixed; the test
# fails if an entry is no longer needed. Empty means none is known.
ALLOWED_CYCLES: list[frozenset[str]] = []
ALLOWED_PRIVATE: list[tuple[str, str]] = []  # (using module, "module._name")
ALLOWED_LIBRARY_INTERNAL: list[tuple[str, str]] = [  # (using module, imported path)
    # orbax's array-metadata store (issue 31: the public API, or one shim with a version check).
    ("skipless_jax.checkpoint.orbax_io", "orbax.checkpoint._src.metadata.array_metadata_store"),
]


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def project_modules(root: str = ROOT, package: str = PACKAGE) -> dict[str, ast.Module]:
    """Dotted module name (a package is its `__init__`) -> parsed source, for every .py file."""
    modules = {}
    for folder, _, files in os.walk(root):
        for file in files:
            if not file.endswith(".py"):
                continue
            rel = os.path.relpath(os.path.join(folder, file), os.path.dirname(root))[: -len(".py")]
            parts = rel.split(os.sep)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            with open(os.path.join(folder, file), encoding="utf-8") as f:
                modules[".".join(parts)] = ast.parse(f.read(), filename=file)
    return modules


def _absolute(module: str, node: ast.ImportFrom, is_package: bool) -> str:
    """The absolute module of a `from ... import` (relative imports resolved against `module`)."""
    if not node.level:
        return node.module or ""
    base = module.split(".")
    base = base[: len(base) - node.level + (1 if is_package else 0)]
    return ".".join(base + ([node.module] if node.module else []))


def imports(modules: dict[str, ast.Module]) -> dict[str, list[tuple[str, str | None, ast.AST]]]:
    """module -> [(imported module, imported name or None, node)], every import in the file.

    `from a import b` counts as importing module `a.b` when that is a project module, else as
    using name `b` of module `a`.
    """
    out: dict[str, list[tuple[str, str | None, ast.AST]]] = {}
    for module, tree in modules.items():
        is_package = any(m.startswith(module + ".") for m in modules)
        found = []
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found += [(alias.name, None, node) for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                source = _absolute(module, node, is_package)
                for alias in node.names:
                    full = f"{source}.{alias.name}"
                    found.append((full, None, node) if full in modules else (source, alias.name, node))
        out[module] = found
    return out


def import_graph(modules: dict[str, ast.Module]) -> dict[str, set[str]]:
    """module -> the project modules it imports (anywhere in the file)."""
    graph = {}
    for module, found in imports(modules).items():
        targets = set()
        for target, _, _ in found:
            # `import a.b.c` names a.b.c; keep the longest prefix that is a project module.
            parts = target.split(".")
            while parts and ".".join(parts) not in modules:
                parts.pop()
            if parts and ".".join(parts) != module:
                targets.add(".".join(parts))
        graph[module] = targets
    return graph


def cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(frozenset(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def private_uses(modules: dict[str, ast.Module]) -> list[tuple[str, str]]:
    """(using module, "module._name") for every private name of a project module used elsewhere:
    `from m import _x`, or `m._x` where `m` is bound to a project module by an import."""
    found = []
    for module, imported in imports(modules).items():
        bound = {}  # local name -> project module
        for target, name, node in imported:
            if name is not None:
                if target in modules and _private(name):
                    found.append((module, f"{target}.{name}"))
                continue
            if target not in modules:
                continue
            for alias in node.names:
                if isinstance(node, ast.Import) and alias.name == target:
                    bound[alias.asname or target] = target
                elif isinstance(node, ast.ImportFrom) and target.endswith("." + alias.name):
                    bound[alias.asname or alias.name] = target
        for node in ast.walk(modules[module]):
            if isinstance(node, ast.Attribute) and _private(node.attr):
                dotted = _dotted(node.value)
                if dotted in bound and bound[dotted] != module:
                    found.append((module, f"{bound[dotted]}.{node.attr}"))
                elif dotted in modules and dotted != module:  # `import a.b` then `a.b._x`
                    found.append((module, f"{dotted}.{node.attr}"))
    return sorted(set(found))


def _dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        inner = _dotted(node.value)
        return None if inner is None else f"{inner}.{node.attr}"
    return None


# What `skipless_jax.models` sits below: the code that trains, evaluates, resumes, sweeps and exports runs.
ABOVE_MODELS = ("trainers", "evaluators", "pretrained", "sweep", "export", "report", "main")


def upward_imports(modules: dict[str, ast.Module], layer: str = f"{PACKAGE}.models",
                   above: tuple[str, ...] = ABOVE_MODELS) -> list[tuple[str, str]]:
    """(module of `layer`, higher module) for every import, at the top or inside a function, from
    `layer` (the package and its modules) to one of the packages or modules `above` it."""
    root = layer.split(".")[0]
    higher = tuple(f"{root}.{name}" for name in above)
    found = []
    for module, imported in imports(modules).items():
        if module != layer and not module.startswith(layer + "."):
            continue
        for target, name, _ in imported:
            full = target if name is None or target != root else f"{target}.{name}"
            if any(full == h or full.startswith(h + ".") for h in higher):
                found.append((module, full))
    return sorted(set(found))


def insertions_of_tests_dir(root: str) -> list[str]:
    """'file: line' for every `sys.path` change naming 'tests' in a .py file outside `root`/tests."""
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in ("tests", "__pycache__", "node_modules")]
        for file in files:
            if not file.endswith(".py"):
                continue
            path = os.path.join(folder, file)
            with open(path, encoding="utf-8") as f:
                tree = ast.parse(f.read(), filename=path)
            for node in ast.walk(tree):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                        and _dotted(node.func.value) == "sys.path" and "tests" in ast.unparse(node)):
                    found.append(f"{os.path.relpath(path, root)}:{node.lineno}")
    return found


def library_internal_imports(modules: dict[str, ast.Module]) -> list[tuple[str, str]]:
    """(module, path) for every import of a library module path with a private part (`x._src`)."""
    found, ours = [], {m.split(".")[0] for m in modules}
    for module, imported in imports(modules).items():
        for target, name, _ in imported:
            if target.split(".")[0] in ours or not target:
                continue
            path = target if name is None else f"{target}.{name}"
            if any(_private(part) for part in path.split(".")):
                found.append((module, path))
    return sorted(set(found))


@pytest.fixture(scope="module")
def modules():
    return project_modules()


def test_the_checks_see_the_violations_they_forbid():
    """The scanners themselves, on a three-module package written here."""
    sources = {
        "p": "",
        "p.a": "import p.b\n",
        "p.b": "def f():\n    from p import c\n    return c._hidden\n",
        "p.c": "from p.a import _x\nfrom orbax.checkpoint._src.tree import utils\nimport jax._src.core\n",
        "p.d": "from p import a\nfrom jax import numpy\n",
        "p.low": "",
        "p.low.x": "from p import high\ndef f():\n    from p.high import y\n    import p.top\n",
        "p.high": "", "p.high.y": "", "p.top": "",
    }
    mods = {name: ast.parse(text) for name, text in sources.items()}
    assert cycles(import_graph(mods)) == [frozenset({"p.a", "p.b", "p.c"})]
    assert private_uses(mods) == [("p.b", "p.c._hidden"), ("p.c", "p.a._x")]
    assert library_internal_imports(mods) == [("p.c", "jax._src.core"), ("p.c", "orbax.checkpoint._src.tree.utils")]
    assert upward_imports(mods, "p.low", ("high", "top")) == [("p.low.x", "p.high"), ("p.low.x", "p.high.y"),
                                                               ("p.low.x", "p.top")]


def test_the_path_check_sees_a_tests_insertion(tmp_path):
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "conftest.py").write_text("import sys\nsys.path.insert(0, 'tests')\n")
    (tmp_path / "script.py").write_text("import os, sys\nsys.path.insert(0, os.path.join(ROOT, 'tests'))\n"
                                        "sys.path.insert(0, ROOT)\n")
    assert insertions_of_tests_dir(str(tmp_path)) == ["script.py:2"]


def test_no_import_cycle(modules):
    found = cycles(import_graph(modules))
    unexpected = [sorted(c) for c in found if c not in ALLOWED_CYCLES]
    assert not unexpected, f"import cycles between project modules: {unexpected}"
    stale = [sorted(c) for c in ALLOWED_CYCLES if c not in found]
    assert not stale, f"allow-listed cycles that no longer exist (remove them): {stale}"


def test_no_private_name_of_another_module(modules):
    found = private_uses(modules)
    unexpected = [u for u in found if u not in ALLOWED_PRIVATE]
    assert not unexpected, f"private names used across modules: {unexpected}"
    stale = [u for u in ALLOWED_PRIVATE if u not in found]
    assert not stale, f"allow-listed private uses that no longer exist (remove them): {stale}"


def test_no_library_internal_import(modules):
    found = library_internal_imports(modules)
    unexpected = [u for u in found if u not in ALLOWED_LIBRARY_INTERNAL]
    assert not unexpected, f"library-internal imports: {unexpected}"
    stale = [u for u in ALLOWED_LIBRARY_INTERNAL if u not in found]
    assert not stale, f"allow-listed library-internal imports that no longer exist (remove them): {stale}"


def test_models_import_nothing_above_them(modules):
    """models/ is below the trainers, evaluators, pretrained, sweep, export, report and main: a
    converter that writes a run directory lives above it (big_vision: models/ never imports trainers/)."""
    found = upward_imports(modules)
    assert not found, f"skipless_jax.models imports from the layers above it: {found}"


def test_no_script_puts_tests_on_the_path():
    """Scripts (experiments/, benchmarks/, examples/, ...) take what they need from the package or
    write it themselves; tests/ helpers are the tests' own."""
    found = insertions_of_tests_dir(os.path.dirname(ROOT))
    assert not found, f"sys.path insertions of tests/ outside tests/: {found}"


def test_no_config_file_reads_another():
    """configs/*.py take shared recipes from skipless_jax/config_blocks.py, never by importing or
    executing a sibling config file (renaming one config then breaks no other)."""
    folder = os.path.join(os.path.dirname(ROOT), "configs")
    names = {f[:-3] for f in os.listdir(folder) if f.endswith(".py")}
    found = []
    for name in sorted(names):
        with open(os.path.join(folder, f"{name}.py"), encoding="utf-8") as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import | ast.ImportFrom):
                modules = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                if any(m.split(".")[0] in names | {"configs", "importlib", "runpy"} for m in modules):
                    found.append(f"{name}: imports {modules}")
            elif isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", "")) in (
                    "exec", "exec_module", "sibling", "run_path"):
                found.append(f"{name}: calls {ast.unparse(node.func)}")
    assert not found, found


def attribute_uses(modules: dict[str, ast.Module], dotted: str) -> list[str]:
    """The modules that spell `dotted` (e.g. 'jax.transfer_guard') as an attribute chain."""
    return sorted(name for name, tree in modules.items()
                  if any(isinstance(node, ast.Attribute) and ast.unparse(node) == dotted for node in ast.walk(tree)))


TRAIN_DATA = re.compile(r"train|batches")  # what a loop over the training batches iterates
TRAIN_STEP = re.compile(r"train_step")  # what such a loop calls each step


def training_loops(modules: dict[str, ast.Module]) -> list[tuple[str, int]]:
    """(module, line) of every loop over training batches: a `for` over something spelled like
    them (`train_iter`, `device_batches(...)`, `batches`), or a `for`/`while` whose body calls a
    train step or pulls a batch with `next(...)`. Evaluation loops (over `local`, `windows`, ...
    calling no train step) are not."""
    found = []
    for name, tree in modules.items():
        for node in ast.walk(tree):
            if not isinstance(node, ast.For | ast.AsyncFor | ast.While):
                continue
            calls = [ast.unparse(c.func) for b in node.body for c in ast.walk(b) if isinstance(c, ast.Call)]
            over = isinstance(node, ast.For | ast.AsyncFor) and TRAIN_DATA.search(ast.unparse(node.iter))
            if over or any(TRAIN_STEP.search(c) or c == "next" for c in calls):
                found.append((name, node.lineno))
    return sorted(found)


def test_one_training_loop(modules):
    """The step runs under `jax.transfer_guard` in one module of trainers/ (loop.py), which every
    trainer calls, and no other module of trainers/ loops over training batches: a trainer with
    its own (unguarded) copy of the loop shows up here."""
    trainers = {name: tree for name, tree in modules.items() if name.startswith(f"{PACKAGE}.trainers.")}
    assert attribute_uses(trainers, "jax.transfer_guard") == [f"{PACKAGE}.trainers.loop"]
    sample = {"p.a": ast.parse("import jax\nwith jax.transfer_guard('disallow'):\n    pass\n"),
              "p.b": ast.parse("transfer_guard = 1\n")}
    assert attribute_uses(sample, "jax.transfer_guard") == ["p.a"]
    assert {name for name, _ in training_loops(trainers)} == {f"{PACKAGE}.trainers.loop"}
    own_loops = {  # a trainer's own loop, in each shape the check must see, and loops it must not
        "t.over_iterator": "for batch in train_iter:\n    state, m = step(state, batch)\n",
        "t.over_batches": "for i, b in enumerate(common.device_batches(config, mesh, it, 0)):\n    pass\n",
        "t.next_batch": "for step in range(9):\n    batch = next(data)\n    state, m = update(state, batch)\n",
        "t.while_step": "while True:\n    state, m = self.train_step(state, x)\n",
        "t.evaluation": "for batch in local:\n    total += sums(params, batch)\n",
        "t.fields": "for field in ('batch_size', 'eval_batch_size'):\n    check(field)\n",
    }
    got = training_loops({name: ast.parse(source) for name, source in own_loops.items()})
    assert got == [("t.next_batch", 1), ("t.over_batches", 1), ("t.over_iterator", 1), ("t.while_step", 1)]


# ---------------------------------------------------------------- trainers by their record only

def trainer_names() -> set[str]:
    """The registered names, read from trainers/__init__.py's `REGISTRY` (nothing imported)."""
    with open(os.path.join(ROOT, "trainers", "__init__.py")) as f:
        tree = ast.parse(f.read())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "REGISTRY" for t in node.targets):
            return {k.value for k in node.value.keys}
    raise AssertionError("trainers/__init__.py has no REGISTRY")


def _literals(node: ast.AST) -> set[str]:
    return {n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)}


def trainer_name_uses(modules: dict[str, ast.Module], names: set[str]) -> list[tuple[str, int, str]]:
    """(module, line, what) for every place outside trainers/ that names a trainer: a comparison of
    something spelled with 'trainer' against a name (`config.trainer == 'dino'`, `in (...)`), a
    `.get('trainer', <name>)` default, or a list of three or more names."""
    found = []
    for module, tree in modules.items():
        if module == f"{PACKAGE}.trainers" or module.startswith(f"{PACKAGE}.trainers."):
            continue
        for node in ast.walk(tree):
            sides = [node.left, *node.comparators] if isinstance(node, ast.Compare) else []
            compared = any("trainer" in ast.unparse(s) for s in sides) and names & set().union(*map(_literals, sides))
            default = (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
                       and len(node.args) == 2 and _literals(node.args[0]) == {"trainer"}
                       and _literals(node.args[1]) & names)
            listed = isinstance(node, (ast.Tuple, ast.List, ast.Set)) and len(_literals(node) & names) >= 3
            if compared or default or listed:
                found.append((module, node.lineno, ast.unparse(node)))
    return found


def test_no_trainer_named_outside_trainers(modules):
    """Callers read the trainer's record (trainers.of_config), never compare `config.trainer`."""
    names = trainer_names()
    assert names == {"supervised", "dino", "mae", "lm"}
    assert trainer_name_uses(modules, names) == []
    sample = {  # the check sees each form it forbids, and not a recipe setting its trainer
        "p.a": ast.parse("if config.trainer == 'dino':\n    pass\n"),
        "p.b": ast.parse("x = config.get('trainer', 'supervised')\n"),
        "p.c": ast.parse("TRAINERS = ('supervised', 'dino', 'mae')\n"),
        "p.d": ast.parse("ok = trainer in ('lm',)\n"),
        "p.e": ast.parse("config.trainer = 'dino'\nrecipe(a, 'supervised')\n"),
        f"{PACKAGE}.trainers.x": ast.parse("if config.trainer == 'dino':\n    pass\n"),
    }
    assert [m for m, _, _ in trainer_name_uses(sample, names)] == ["p.a", "p.b", "p.c", "p.d"]


def test_every_registered_trainer_satisfies_the_protocol():
    import dataclasses

    from skipless_jax import trainers

    for name in trainers.REGISTRY:
        record = trainers.get(name)
        assert isinstance(record, trainers.Trainer) and record.name == name
        for f in dataclasses.fields(trainers.Trainer):
            value = getattr(record, f.name)
            assert value is not None or str(f.type).endswith("| None"), (name, f.name)
    lm = trainers.get("lm")
    with pytest.raises(TypeError):  # a missing field fails at construction (a trainer module's import)
        trainers.Trainer(**{f.name: getattr(lm, f.name) for f in dataclasses.fields(lm) if f.name != "analysis"})
    with pytest.raises(TypeError, match="analysis is required for inputs='tokens'"):
        dataclasses.replace(lm, analysis=None)
    with pytest.raises(TypeError, match="check_config must be callable"):
        dataclasses.replace(lm, check_config="not a function")
    with pytest.raises(TypeError, match="not in trainers.REGISTRY"):
        dataclasses.replace(lm, name="byol")
    with pytest.raises(ValueError, match=r"trainer='byol' is unknown; allowed: \['dino', 'lm', 'mae', 'supervised'\]"):
        trainers.get("byol")


# A recipe of each registered trainer (configs/), for its initial state.
TRAINER_RECIPES = {"supervised": "quickstart", "dino": "dino_digits", "mae": "mae_digits_pretrain",
                   "lm": "lm_quickstart"}


def test_every_trainer_state_is_a_flax_struct_dataclass():
    """The abstract initial state (`jax.eval_shape` of the record's `initial_state`) of each
    registered trainer is a flax.struct dataclass; its checkpoint entries are its set fields,
    by name, with the non-finite counters and the parameters among them."""
    import dataclasses

    import jax

    from skipless_jax import checkpoint, trainers

    from util import load_config

    assert set(TRAINER_RECIPES) == set(trainers.REGISTRY)
    for name in trainers.REGISTRY:
        state = jax.eval_shape(trainers.get(name).initial_state(load_config(TRAINER_RECIPES[name])),
                               jax.random.PRNGKey(0))
        assert dataclasses.is_dataclass(state) and type(state).__dict__.get("_flax_dataclass"), (name, type(state))
        entries = checkpoint.entries(state)
        assert {"nonfinite", "opt_state", "params", "rng", "step"} <= set(entries), (name, sorted(entries))
        assert type(state.nonfinite).__dict__.get("_flax_dataclass"), name
