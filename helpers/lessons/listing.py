"""Show the lines of a worker that matter, not the whole file.

    from helpers.lessons.listing import listing
    listing("../helpers/workers/rpc_basics.py", "drive")                      # one function
    listing("../helpers/workers/rpc_parameter_server.py", "ParameterServer.parameters", "train")

Each part is a top-level function or class, or `Class.method`, with its decorators, headed by the file name and its
line numbers, so that the learner can open the file at that place. A name that is not there is an error.
"""
from __future__ import annotations

import ast
import os
from pathlib import Path

from IPython.display import Code

_DEFINITIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def _find(tree: ast.Module, name: str) -> ast.AST | None:
    outer, _, inner = name.partition(".")
    for node in tree.body:
        if isinstance(node, _DEFINITIONS) and node.name == outer:
            if not inner:
                return node
            return next((child for child in node.body if isinstance(child, _DEFINITIONS) and child.name == inner),
                        None)
    return None


def listing_text(path: str | os.PathLike, *names: str) -> str:
    """The source of each named definition in `path`, each headed by '# file, lines a-b'."""
    text = Path(path).read_text(encoding="utf-8")
    lines, tree = text.splitlines(), ast.parse(text)
    parts = []
    for name in names:
        node = _find(tree, name)
        if node is None:
            raise ValueError(f"{Path(path).name} has no function or class {name!r}")
        start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
        body = "\n".join(lines[start - 1:node.end_lineno])
        indent = len(body) - len(body.lstrip(" "))
        body = "\n".join(line[indent:] for line in body.splitlines())
        parts.append(f"# {Path(path).name}, lines {start}-{node.end_lineno} of {len(lines)}\n{body}")
    return "\n\n".join(parts)


def listing(path: str | os.PathLike, *names: str) -> Code:
    """The named functions, classes or `Class.method`s of `path`, highlighted (see listing_text)."""
    return Code(listing_text(path, *names), language="python")
