"""The layout's rules, read from the source (every import, module level or inside a function):
no import cycle among the project's modules nor among its packages (a package: one directory's modules,
its subpackages apart), dependencies that point one way between the parts, a ``pipeline/`` whose top
level holds a handful of modules, and an engine whose folder shows its parts."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("pipeline", "actors", "jobs")
MAX_TOP_LEVEL_MODULES = 5   # pipeline/*.py, __init__ included


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in sorted((REPO / pkg).rglob("*.py"))}


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The project's modules that ``name`` imports anywhere in its file."""
    is_pkg = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_pkg else name.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            # "from a.b import c" imports module a.b.c when there is one, else names of a.b
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:      # "import a.b.c" of a known a.b.c, or the nearest known parent
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    mods = _modules()
    known = set(mods)
    return {m: _imports(m, p, known) for m, p in mods.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def test_cycle_finder_finds_a_planted_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_graph_sees_every_import_form(graph):
    assert "pipeline.format.reader" in graph["pipeline.engine.worker.loader"]      # from a.b import name
    assert "pipeline.io.storage" in graph["pipeline.format.reader"]         # from a import module
    assert "pipeline.quant.plan.report" in graph["jobs.plan"]
    assert "pipeline.io.checkpoint" in graph["jobs.quantize"]               # inside a function


def test_no_import_cycle(graph):
    assert _cycles(graph) == []


def _package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The import graph between packages: a module's package is its directory (a package's __init__ is
    in the package itself), an edge where a module of one imports a module of another."""
    mods = _modules()

    def package(m: str) -> str:
        return m if mods[m].name == "__init__.py" else m.rpartition(".")[0]

    out: dict[str, set[str]] = {}
    for m, deps in graph.items():
        out.setdefault(package(m), set()).update(package(d) for d in deps if package(d) != package(m))
    return out


def test_no_package_cycle(graph):
    """Packages depend one way too: e.g. pipeline.quant.plan on pipeline.quant.job and never back,
    pipeline.engine's subpackages in layers (core above worker above layers above attention, native, triton
    and cache), pipeline.quant's in the order its docstring lists them."""
    packages = _package_graph(graph)
    assert "pipeline.quant.job" in packages["pipeline.quant.plan"]
    assert _cycles(packages) == []


def _violations(graph, src_prefix: str, dst_prefix: str, allowed_src: tuple[str, ...] = ()) -> list[str]:
    def under(m: str, p: str) -> bool:
        return m == p or m.startswith(p + ".")
    return sorted(f"{m} -> {d}" for m, deps in graph.items() if under(m, src_prefix)
                  and not any(under(m, a) for a in allowed_src) for d in deps if under(d, dst_prefix))


@pytest.mark.parametrize("src, dst, allowed", [
    ("pipeline", "actors", ()),                 # the library imports no Ray layer
    ("pipeline", "jobs", ()),
    ("actors", "jobs", ()),
    ("pipeline.engine", "pipeline.quant", ()),  # engine and quantizer meet only in the format
    ("pipeline.quant", "pipeline.engine", ()),
    ("pipeline.format", "pipeline.quant", ()),
    ("pipeline.format", "pipeline.engine", ()),
    ("pipeline.io", "pipeline.model", ()),
    ("pipeline.io", "pipeline.format", ()),
    ("pipeline.model", "pipeline.quant", ()),
    ("pipeline.model", "pipeline.engine", ()),
    ("pipeline", "pipeline.serving", ("pipeline.serving",)),   # only the serving layer knows the protocol
    ("actors.quantize", "actors.serving", ()),  # the quantize job's actors and the serving deployments apart
    ("actors.serving", "actors.quantize", ()),
])
def test_dependencies_point_one_way(graph, src, dst, allowed):
    assert _violations(graph, src, dst, allowed) == []


def test_pipeline_imports_no_ray():
    offenders = sorted(str(p.relative_to(REPO)) for p in (REPO / "pipeline").rglob("*.py")
                       if "ray" in {n.split(".")[0] for n in _all_imported(p)})
    assert offenders == []


def _all_imported(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names.add(node.module)
    return names


def test_pipeline_top_level_is_small():
    top = sorted(p.name for p in (REPO / "pipeline").glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL_MODULES, top


ENGINE_PACKAGES = ("core", "worker", "layers", "attention", "cache", "sharding", "native", "triton")
MAX_ENGINE_FLAT_MODULES = 10


def test_engine_folder_shows_its_parts():
    engine = REPO / "pipeline" / "engine"
    assert sorted(p.name for p in engine.iterdir() if (p / "__init__.py").exists()) == sorted(ENGINE_PACKAGES)
    flat = sorted(p.name for p in engine.glob("*.py"))
    assert len(flat) <= MAX_ENGINE_FLAT_MODULES, flat


MAX_FLAT_MODULES = 10   # *.py of one folder, __init__ included


def _folders(top: Path) -> list[Path]:
    return sorted({p.parent for p in top.rglob("*.py")})


def test_every_folder_of_pipeline_and_actors_is_small():
    """Every folder of pipeline/ and actors/ holds at most MAX_FLAT_MODULES modules (the rest in
    subpackages of one concern each); pipeline/'s own top level is held to MAX_TOP_LEVEL_MODULES above."""
    big = {str(d.relative_to(REPO)): n for d in _folders(REPO / "pipeline") + _folders(REPO / "actors")
           if (n := len(list(d.glob("*.py")))) > MAX_FLAT_MODULES}
    assert big == {}


QUANT_PACKAGES = ("numerics", "recipe", "transforms", "writing", "calibration", "job", "plan", "evaluation")
ACTOR_PACKAGES = ("cluster", "quantize", "serving")


def test_quantizer_and_actors_show_their_parts():
    """pipeline/quant holds its packages only (one concern each, listed in its docstring); actors/ likewise."""
    for top, parts in ((REPO / "pipeline" / "quant", QUANT_PACKAGES), (REPO / "actors", ACTOR_PACKAGES)):
        assert sorted(p.name for p in top.iterdir() if (p / "__init__.py").exists()) == sorted(parts)
        assert [p.name for p in top.glob("*.py")] == ["__init__.py"]


def test_quantizer_packages_depend_on_earlier_ones(graph):
    """Each of pipeline.quant's packages imports only those listed before it in QUANT_PACKAGES (the order of
    pipeline/quant/__init__.py's docstring): following the job from its entry goes down, never back."""
    packages = _package_graph(graph)
    back = sorted(f"{a} -> {d}" for i, a in enumerate(QUANT_PACKAGES) for d in packages[f"pipeline.quant.{a}"]
                  if d.startswith("pipeline.quant.") and d.split(".")[2] in QUANT_PACKAGES
                  and QUANT_PACKAGES.index(d.split(".")[2]) > i)   # its own subpackages (numerics.native) aside
    assert back == []


# The recipe is interpreted in one place: its package, and the plan it resolves into for a model
# (pipeline.quant.transforms.recipe_plan.resolve). Everywhere else follows the plan's steps, which apply
# themselves, and asks the recipe's methods (layer_types, quantized_layer...), never these fields.
RECIPE_HOMES = ("pipeline/quant/recipe/", "pipeline/quant/transforms/recipe_plan.py")
BEHAVIOUR_FIELDS = ("smooth", "calibration", "steps", "fa_quant", "quantize_mtp", "dynamic")
STEP_CLASSES = ("QuaRot", "IterSmooth", "FlexSmooth", "Step")
CALIBRATION_NAMES = ("MSMODELSLIM", "FLOAT_PASS")


def _is_recipe(e: ast.expr) -> bool:
    return (isinstance(e, ast.Name) and "recipe" in e.id.lower()) or (isinstance(e, ast.Attribute)
                                                                       and e.attr == "recipe")


def _names(e: ast.expr) -> set[str]:
    return {n.id if isinstance(n, ast.Name) else n.attr for n in ast.walk(e) if isinstance(n, (ast.Name, ast.Attribute))}


def _recipe_interpretations(source: str, where: str = "<source>") -> list[str]:
    """Where ``source`` reads a recipe field that selects behaviour (``recipe.smooth``, ``self.recipe.steps``,
    ``getattr(recipe, "calibration")``), dispatches on a step's class (``isinstance(s, QuaRot)``) or names a
    calibration mode's constant."""
    out = []
    for node in ast.walk(ast.parse(source, where)):
        line = f"{where}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Attribute) and node.attr in BEHAVIOUR_FIELDS and _is_recipe(node.value):
            out.append(f"{line} reads recipe.{node.attr}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and len(node.args) >= 2:
            if node.func.id == "isinstance" and _names(node.args[1]) & set(STEP_CLASSES):
                out.append(f"{line} dispatches on a step's class")
            elif (node.func.id in ("getattr", "hasattr") and _is_recipe(node.args[0])
                  and isinstance(node.args[1], ast.Constant) and node.args[1].value in BEHAVIOUR_FIELDS):
                out.append(f"{line} reads recipe.{node.args[1].value}")
        elif isinstance(node, ast.Name) and node.id in CALIBRATION_NAMES:
            out.append(f"{line} names {node.id}")
        elif isinstance(node, ast.ImportFrom) and {a.name for a in node.names} & set(CALIBRATION_NAMES):
            out.append(f"{line} imports a calibration mode's constant")
    return out


def test_the_interpretation_finder_finds_planted_ones():
    planted = ("from pipeline.quant.recipe.recipe import MSMODELSLIM\n"
               "def f(recipe, self, step, job):\n"
               "    a = recipe.smooth\n"
               "    b = self.recipe.calibration == MSMODELSLIM\n"
               "    c = isinstance(step, (QuaRot, steps.IterSmooth))\n"
               "    d = getattr(job.recipe, 'steps')\n"
               "    e = recipe.layer_types, recipe.dialect, job.smooth, isinstance(step, dict)\n")
    found = sorted(f.split(" ", 1)[1] for f in _recipe_interpretations(planted))
    assert found == sorted(["imports a calibration mode's constant", "reads recipe.smooth", "reads recipe.calibration",
                            "names MSMODELSLIM", "dispatches on a step's class", "reads recipe.steps"])


def test_only_the_recipe_and_its_plan_interpret_the_recipe():
    """No module outside pipeline/quant/recipe/ and the plan it resolves into branches on the recipe's
    fields or on its steps' types: following the recipe from the job's entry goes down, never back."""
    found = []
    for pkg in (*PACKAGES, "scripts"):
        for p in sorted((REPO / pkg).rglob("*.py")):
            rel = str(p.relative_to(REPO))
            if not rel.startswith(RECIPE_HOMES):
                found += _recipe_interpretations(p.read_text(), rel)
    assert found == []
