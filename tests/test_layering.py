"""The import arrows of dspark_jax run one way: down the layers of docs/design.md, with no circle.

Every module's imports are read with `ast` (function-level imports included, relative ones
resolved): an import of a module in a higher layer fails naming the file, the line and both
layers, and so does any circle of imports between modules. A package's ``__init__`` belongs to
its package's layer; the package root (``dspark_jax/__init__.py``, the public API) has a layer
of its own, below the applications that import it.
"""

from __future__ import annotations

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "dspark_jax"

LAYERS = (
    ("base", ("dspark_jax.validation", "dspark_jax.device_memory")),
    ("sampling", ("dspark_jax.sampling",)),
    ("paging", ("dspark_jax.paging",)),
    ("kernels", ("dspark_jax.kernels",)),
    ("draft", ("dspark_jax.draft",)),
    ("verification", ("dspark_jax.verification",)),
    ("models", ("dspark_jax.models",)),
    ("parallel", ("dspark_jax.parallel",)),
    ("decoding", ("dspark_jax.decoding",)),
    ("scheduling", ("dspark_jax.scheduling",)),
    ("text", ("dspark_jax.text",)),
    ("formats", ("dspark_jax.formats",)),
    ("train", ("dspark_jax.train",)),
    ("testing", ("dspark_jax.testing",)),
    ("api", ("dspark_jax",)),            # the package root only, not what lies below it
    ("apps", ("dspark_jax.apps",)),
)
"""The layers, lowest first, and the modules (with everything below them) each holds."""

MAX_LINES = 800


def module_files(package: pathlib.Path = PACKAGE) -> dict[str, pathlib.Path]:
  """``{dotted module name: file}`` of every module of the package."""
  out = {}
  for path in sorted(package.rglob("*.py")):
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
      parts = parts[:-1]
    out[".".join(parts)] = path
  return out


def layer_of(module: str) -> int:
  """The index in `LAYERS` of the layer holding `module`; ValueError naming an unplaced one."""
  best, found = -1, None
  for index, (_, prefixes) in enumerate(LAYERS):
    for prefix in prefixes:
      exact_only = prefix == "dspark_jax"
      if module == prefix or (not exact_only and module.startswith(prefix + ".")):
        if len(prefix) > best:
          best, found = len(prefix), index
  if found is None:
    raise ValueError(f"{module}: in no layer of LAYERS (tests/test_layering.py, docs/design.md)")
  return found


def imports_of(module: str, path: pathlib.Path, modules) -> list[tuple[int, str]]:
  """``(line, imported module)`` for every dspark_jax import in `path`, at any depth. ``from X
  import name`` counts as importing ``X.name`` where that is a module, else ``X``."""
  is_package = path.name == "__init__.py"
  out = []
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.Import):
      out += [(node.lineno, alias.name) for alias in node.names
              if alias.name.split(".")[0] == "dspark_jax"]
    elif isinstance(node, ast.ImportFrom):
      if node.level:
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[:len(base) - (node.level - 1)]
        source = ".".join(base + ([node.module] if node.module else []))
      else:
        source = node.module or ""
      if source.split(".")[0] != "dspark_jax":
        continue
      for alias in node.names:
        name = f"{source}.{alias.name}"
        out.append((node.lineno, name if name in modules else source))
  return out


def graph(package: pathlib.Path = PACKAGE) -> tuple[dict, dict]:
  """The module files and ``{module: [(line, imported module), ...]}``."""
  modules = module_files(package)
  return modules, {name: imports_of(name, path, modules) for name, path in modules.items()}


def upward_imports(package: pathlib.Path = PACKAGE) -> list[str]:
  """One line per import of a higher layer (or of a module in no layer)."""
  modules, edges = graph(package)
  bad = []
  for name, found in edges.items():
    rel = modules[name].relative_to(package.parent)
    try:
      mine = layer_of(name)
    except ValueError as error:
      bad.append(str(error))
      continue
    for line, other in found:
      try:
        theirs = layer_of(other)
      except ValueError as error:
        bad.append(f"{rel}:{line}: {error}")
        continue
      if theirs > mine:
        bad.append(f"{rel}:{line}: {name} (layer {LAYERS[mine][0]}) imports {other} (layer "
                   f"{LAYERS[theirs][0]}, higher)")
  return bad


def cycles(package: pathlib.Path = PACKAGE) -> list[list[str]]:
  """The circles of imports between modules: each strongly connected set of two or more
  modules (or a module importing itself), sorted."""
  _, edges = graph(package)
  succ = {m: sorted({o for _, o in found if o in edges}) for m, found in edges.items()}
  index, low, stack, on_stack, out = {}, {}, [], set(), []

  def visit(start):  # Tarjan's algorithm, iteratively (no recursion limit)
    work = [(start, iter(succ[start]))]
    index[start] = low[start] = len(index)
    stack.append(start)
    on_stack.add(start)
    while work:
      node, children = work[-1]
      child = next(children, None)
      if child is not None:
        if child not in index:
          index[child] = low[child] = len(index)
          stack.append(child)
          on_stack.add(child)
          work.append((child, iter(succ[child])))
        elif child in on_stack:
          low[node] = min(low[node], index[child])
        continue
      work.pop()
      if work:
        low[work[-1][0]] = min(low[work[-1][0]], low[node])
      if low[node] == index[node]:
        group = []
        while True:
          member = stack.pop()
          on_stack.discard(member)
          group.append(member)
          if member == node:
            break
        if len(group) > 1 or node in succ[node]:
          out.append(sorted(group))

  for module in sorted(succ):
    if module not in index:
      visit(module)
  return sorted(out)


def test_no_import_of_a_higher_layer():
  bad = upward_imports()
  assert not bad, "imports against the layer order (docs/design.md):\n" + "\n".join(bad)


def test_no_import_cycle():
  found = cycles()
  assert not found, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_every_module_has_a_layer_and_at_most_800_lines():
  for name, path in module_files().items():
    layer_of(name)
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{path.relative_to(ROOT)}: {lines} lines, more than {MAX_LINES}"


def test_design_lists_the_layers_in_order():
  text = (ROOT / "docs" / "design.md").read_text()
  section = text.split("## Layers", 1)[1].split("\n## ", 1)[0]
  listed = re.findall(r"^\d+\. \*\*(\w+)\*\*", section, flags=re.M)
  assert listed == [name for name, _ in LAYERS]


def test_the_checks_see_an_upward_import_and_a_cycle(tmp_path):
  package = tmp_path / "dspark_jax"
  (package / "kernels").mkdir(parents=True)
  (package / "draft").mkdir()
  for init in (package, package / "kernels", package / "draft"):
    (init / "__init__.py").write_text("")
  (package / "validation.py").write_text("")
  (package / "kernels" / "a.py").write_text("def f():\n  from dspark_jax.draft import b\n")
  (package / "draft" / "b.py").write_text("from . import c\n")
  (package / "draft" / "c.py").write_text("from dspark_jax.draft.b import x\n")
  bad = upward_imports(package)
  assert len(bad) == 1 and bad[0].startswith("dspark_jax/kernels/a.py:2: dspark_jax.kernels.a")
  assert cycles(package) == [["dspark_jax.draft.b", "dspark_jax.draft.c"]]
