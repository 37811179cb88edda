"""
Start an exercise: a workspace holding a copy of the files it needs, in which the functions
you are to write keep their signature and docstring and raise NotImplementedError, a hint
above the raise.

    python exercises/start.py --list                  # the exercises, in the lecture's order
    python exercises/start.py ring_all_gather         # -> exercises/work/ring_all_gather/
    python exercises/start.py ring_all_gather --dir /tmp/mine
    python exercises/grade.py ring_all_gather         # then, until every line says PASS

The workspace runs like the project: `torchrun --nproc_per_node=2 ddp.py` from inside it uses
your copy. start.py refuses to overwrite a workspace that exists (your work): --force does.
"""
import argparse
import ast
import functools
import os
import shutil
import sys
import textwrap

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
from exercises.table import EXERCISES, BY_NAME  # noqa: E402


def default_dir(name):
    return os.path.join(HERE, "work", name)


def project_imports(filename, root=ROOT):
    """The project's .py files that `filename` needs, itself first: the closure of its imports."""
    need, todo = [], [filename]
    while todo:
        f = todo.pop(0)
        if f not in need:
            need.append(f)
            todo += [n + ".py" for n in _imports(os.path.join(root, f))
                     if os.path.isfile(os.path.join(root, n + ".py"))]
    return need


@functools.lru_cache(maxsize=None)
def _imports(path):
    """The absolute imports of a file, wherever they stand (a function may import lazily)."""
    with open(path) as fh:
        tree = ast.parse(fh.read())
    return tuple(a.name for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names) + \
        tuple(node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module
              and not node.level)


def find_def(tree, qualname):
    """The FunctionDef of "f" or "Class.method" in a module's tree, or None."""
    body, node = tree.body, None
    for part in qualname.split("."):
        node = next((n for n in body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                     and n.name == part), None)
        if node is None:
            return None
        body = node.body
    return node if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else None


def _docstring_end(fn):
    """-> the last line of fn's docstring, or None if it has none."""
    first = fn.body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        return first.end_lineno
    return None


def is_stub(fn):
    """True if fn's body (after its docstring) is only `raise NotImplementedError(...)`."""
    body = fn.body[1:] if _docstring_end(fn) is not None else fn.body
    if len(body) != 1 or not isinstance(body[0], ast.Raise) or body[0].exc is None:
        return False
    exc = body[0].exc.func if isinstance(body[0].exc, ast.Call) else body[0].exc
    return isinstance(exc, ast.Name) and exc.id == "NotImplementedError"


def replace_bodies(source, bodies, exercise="?"):
    """source with the body of each function named in `bodies` ({qualname: new body, unindented
    text}) replaced, after its docstring. Line ranges come from the ast, so comments and nested
    functions in the old body go too, and nothing outside it moves."""
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    edits = []
    for q, body in bodies.items():
        fn = find_def(tree, q)
        if fn is None:
            raise SystemExit(f"error: exercise {exercise}: no function {q} in the file (retarget it in "
                             f"exercises/table.py)")
        if fn.body[0].lineno == fn.lineno:
            raise SystemExit(f"error: exercise {exercise}: {q} is written on one line: nothing to replace")
        doc_end = _docstring_end(fn)
        start = doc_end + 1 if doc_end is not None else fn.body[0].lineno  # 1-based, the first line replaced
        while doc_end is None and start - 1 > fn.lineno and lines[start - 2].strip().startswith("#"):
            start -= 1  # a comment opening the body is part of it
        new = textwrap.indent(textwrap.dedent(body).strip("\n") + "\n", " " * fn.body[0].col_offset)
        edits.append((start, fn.end_lineno, new))
    for start, end, new in sorted(edits, reverse=True):
        lines[start - 1:end] = [new]
    out = "".join(lines)
    ast.parse(out)  # what we wrote must still be Python
    return out


def stub_source(source, qualnames, hint, exercise):
    """source with each function's body, after its docstring, replaced by the hint (as comments)
    and `raise NotImplementedError`."""
    bodies = {}
    for i, q in enumerate(qualnames):  # the hint once, above the first; the others point to it
        text = hint if i == 0 else f"Exercise {exercise}: see the hint in {qualnames[0]}."
        comment = "".join("# " + line + "\n" for line in textwrap.wrap(text, 90))
        bodies[q] = comment + f'raise NotImplementedError("{q}: not written yet (exercise {exercise})")'
    return replace_bodies(source, bodies, exercise)


def start(name, folder=None, force=False, root=ROOT):
    """Make the workspace of exercise `name`: -> its folder."""
    ex = BY_NAME[name]
    folder = folder or default_dir(name)
    if os.path.exists(folder) and os.listdir(folder) and not force:
        raise SystemExit(f"error: {folder} exists (your work?): grade it, or start again with --force")
    os.makedirs(folder, exist_ok=True)
    for f in project_imports(ex.file, root):
        shutil.copyfile(os.path.join(root, f), os.path.join(folder, f))
    with open(os.path.join(root, ex.file)) as fh:
        source = stub_source(fh.read(), ex.functions, ex.hint, name)
    with open(os.path.join(folder, ex.file), "w") as fh:
        fh.write(source)
    return folder


def listing():
    lines = []
    for i, ex in enumerate(EXERCISES, 1):
        lines.append(f"{i:2d}. {ex.name:22s} {ex.minutes:3d} min  {ex.file}: {', '.join(ex.functions)}")
        lines.append(f"    {ex.teaches}")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("name", nargs="?", help="the exercise (see --list)")
    ap.add_argument("--dir", help="the workspace (default exercises/work/NAME/)")
    ap.add_argument("--list", action="store_true", help="the exercises in the lecture's order")
    ap.add_argument("--force", action="store_true", help="overwrite an existing workspace")
    args = ap.parse_args(argv)
    if args.list or not args.name:
        print(listing())
        return 0
    if args.name not in BY_NAME:
        print(f"error: no exercise {args.name!r}; `python exercises/start.py --list` names them", file=sys.stderr)
        return 2
    folder = start(args.name, args.dir, args.force)
    ex = BY_NAME[args.name]
    print(f"{folder}: write {', '.join(ex.functions)} in {os.path.join(folder, ex.file)}, then\n"
          f"    python exercises/grade.py {args.name}" + (f" --dir {args.dir}" if args.dir else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
