#!/usr/bin/env python3
"""Checks rules of the source tree that the compiler does not:

- layers: a file in engine/LAYER/ includes headers of the layers below it
  only (docs/DESIGN.md, "Layers"), and the include graph between layers
  has no cycle;
- protocols: above backend/ (engine/ckpt, gpu, fuse, tools), no file
  includes an S3 header (backend/s3_*.h); stores are opened by URL through
  backend/store_url.h;
- commit protocols: in engine/ckpt only repository.cc reads whether a
  repository is on an object store (RepositoryImpl::remote), to choose its
  commit protocol when it opens; everything else asks the protocol
  (ckpt/commit.h);
- configuration: no engine file reads the environment (getenv): settings
  reach the engine as options, and OpenOptionsFromEnvironment and
  ObjectStoreOptions::FromEnvironment are handed a lookup by their callers;
- Python imports: no module of the package (tools/python/ckptfs) takes
  another module's private name (`from .memory import _x`, `ckptfs._x`,
  `formats._x`); what modules share is public in the module that owns it.
  The binding module `_core` is the one private module they all use.
- the package's face: ckptfs/__init__.py only re-exports (a docstring,
  imports, __version__ and __all__); the code lives in the module of its
  concept.

Prints each violation as FILE:LINE: message and exits 1 when there is one.
"""
import ast
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# What each engine layer may include, itself aside.
ENGINE_LAYERS = {
    "core": set(),
    "codec": {"core"},
    "backend": {"core"},
    "store": {"core", "codec", "backend"},
    "meta": {"core", "store"},
    "io": {"core"},
    "ckpt": {"core", "codec", "backend", "store", "meta", "io"},
}
# Above the engine: which engine layers each may use.
UPPER = {
    "gpu": {"core", "ckpt"},
    "fuse": {"core", "backend", "ckpt"},
}

INCLUDE = re.compile(r'^\s*#\s*include\s+"([a-z_]+)/[^"]+"')
S3_INCLUDE = re.compile(r'^\s*#\s*include\s+"backend/s3_[^"]*"')
ABOVE_BACKEND = ("engine/ckpt", "gpu", "fuse", "tools")
GETENV = re.compile(r"\bgetenv\s*\(")
# impl_->remote, repo.remote, repo_->remote: a branch on the kind of store.
REMOTE_FIELD = re.compile(r"(->|\.)remote\b(?!\s*\()")
CHOOSES_PROTOCOL = "engine/ckpt/repository.cc"


def sources(folder):
    for dirpath, _, files in os.walk(os.path.join(ROOT, folder)):
        for f in sorted(files):
            if f.endswith((".h", ".cc", ".cu", ".h.in")):
                yield os.path.join(dirpath, f)


PACKAGE = os.path.join("tools", "python", "ckptfs")


def private(name):
    return name.startswith("_") and not name.startswith("__") and name != "_core"


def python_import_problems():
    """Private names of one package module used by another."""
    folder = os.path.join(ROOT, PACKAGE)
    files = sorted(os.path.relpath(os.path.join(d, f), folder) for d, _, fs in os.walk(folder)
                   for f in fs if f.endswith(".py"))
    modules = {os.path.basename(f)[:-3] for f in files if not f.endswith("__init__.py")}
    modules |= {os.path.dirname(f) for f in files if f.endswith(os.sep + "__init__.py")}
    problems = []
    for f in files:
        rel = os.path.join(PACKAGE, f)
        with open(os.path.join(folder, f), encoding="utf-8") as src:
            tree = ast.parse(src.read(), rel)
        bound = set()  # local names of the package and its modules
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name == "ckptfs" or a.name.startswith("ckptfs."):
                        bound.add(a.asname or a.name.split(".")[0])
            elif isinstance(node, ast.ImportFrom):
                ours = node.level > 0 or (node.module or "").split(".")[0] == "ckptfs"
                if not ours:
                    continue
                for a in node.names:
                    if private(a.name):
                        problems.append(f"{rel}:{node.lineno}: imports {a.name}, private to its module; make it "
                                        "public there (or move it to the module that uses it)")
                    elif a.name in modules or a.name == "ckptfs":
                        bound.add(a.asname or a.name)
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound
                    and private(node.attr)):
                problems.append(f"{rel}:{node.lineno}: uses {node.value.id}.{node.attr}, private to that module")
    return problems


def face_problems():
    """The package's __init__.py re-exports and holds nothing else: a
    docstring, imports, and assignments to __version__ and __all__."""
    rel = os.path.join(PACKAGE, "__init__.py")
    with open(os.path.join(ROOT, rel), encoding="utf-8") as src:
        tree = ast.parse(src.read(), rel)
    problems = []
    for i, node in enumerate(tree.body):
        if i == 0 and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue  # the docstring
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        if (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
                and node.targets[0].id in ("__version__", "__all__")):
            continue
        problems.append(f"{rel}:{node.lineno}: the package's face only re-exports; put this in the module of "
                        "its concept")
    return problems


def main():
    problems = python_import_problems() + face_problems()
    for layer, allowed in list(ENGINE_LAYERS.items()) + list(UPPER.items()):
        folder = layer if layer in UPPER else os.path.join("engine", layer)
        for path in sources(folder):
            rel = os.path.relpath(path, ROOT)
            with open(path, encoding="utf-8") as f:
                for n, line in enumerate(f, 1):
                    m = INCLUDE.match(line)
                    if m and m.group(1) in ENGINE_LAYERS and m.group(1) != layer and m.group(1) not in allowed:
                        problems.append(f"{rel}:{n}: {layer} includes {m.group(1)}/, which it may not "
                                        f"(it may include {', '.join(sorted(allowed)) or 'nothing else'})")
                    code = line.split("//", 1)[0]
                    if folder.startswith("engine") and GETENV.search(code):
                        problems.append(f"{rel}:{n}: the engine reads no environment variable; take the "
                                        "setting as an option")
    for path in sources(os.path.join("engine", "ckpt")):
        rel = os.path.relpath(path, ROOT)
        if rel == CHOOSES_PROTOCOL or not rel.endswith(".cc"):
            continue
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if REMOTE_FIELD.search(line.split("//", 1)[0]):
                    problems.append(f"{rel}:{n}: ask the repository's commit protocol (ckpt/commit.h) "
                                    "instead of branching on whether it is on an object store")
    for folder in ABOVE_BACKEND:
        for path in sources(folder):
            rel = os.path.relpath(path, ROOT)
            with open(path, encoding="utf-8") as f:
                for n, line in enumerate(f, 1):
                    if S3_INCLUDE.match(line):
                        problems.append(f"{rel}:{n}: above backend/, stores are opened by URL "
                                        "(backend/store_url.h), never through an S3 header")
    # The table itself must be a DAG, or the rule would allow a cycle.
    seen, done = set(), set()

    def visit(layer, path):
        if layer in done:
            return
        if layer in seen:
            problems.append("layers: the allowed includes form a cycle: " + " -> ".join(path + [layer]))
            return
        seen.add(layer)
        for below in ENGINE_LAYERS.get(layer, ()):
            visit(below, path + [layer])
        done.add(layer)

    for layer in ENGINE_LAYERS:
        visit(layer, [])
    for p in problems:
        print(p)
    if problems:
        print(f"check_source: {len(problems)} problems", file=sys.stderr)
        return 1
    print("check_source: layers, protocol, commit protocol, configuration, Python import and package face "
          "rules hold")
    return 0


if __name__ == "__main__":
    sys.exit(main())
