"""Show the lines of a worker that matter, not the whole file.

    from helpers.lessons.listing import listing
    listing("../helpers/workers/rpc_basics.py", "drive")                      # one function
    listing("../helpers/workers/rpc_parameter_server.py", "ParameterServer.parameters", "train")
    excerpt("../helpers/workers/collectives_ring.py", "def exchange", "copy_(buffer)")   # from one line to another
    folded_listing(WORKERS / "ddp_equivalence.py", "what it runs")                     # the whole file, folded

Each part is a top-level function or class, or `Class.method`, with its decorators, headed by the file name and its
line numbers, so that the learner can open the file at that place. A name that is not there is an error.
"""
from __future__ import annotations

import ast
import html
import os
import textwrap
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


def excerpt(path: str | os.PathLike, first: str, last: str) -> Code:
    """The lines of `path` from the first one that contains `first` to the next one that contains `last`, under a
    comment that names the file and the lines, with syntax highlighting (the rest of the file is one click away)."""
    lines = Path(path).read_text().splitlines()
    start = next(index for index, line in enumerate(lines) if first in line)
    end = next(index for index in range(start, len(lines)) if last in lines[index])
    shown = textwrap.dedent("\n".join(lines[start:end + 1]))
    return Code(f"# {Path(path).name}, lines {start + 1}-{end + 1}\n{shown}", language="python")


def folded_listing(path: str | os.PathLike, summary: str):
    """A script, syntax-highlighted inside a closed <details> fold that says what it is: open it to read."""
    from IPython.display import HTML
    from pygments import highlight
    from pygments.formatters import HtmlFormatter
    from pygments.lexers import PythonLexer

    code = highlight(Path(path).read_text(), PythonLexer(), HtmlFormatter(noclasses=True, nobackground=True))
    lines = len(Path(path).read_text().splitlines())
    return HTML(f"<details><summary><b>{html.escape(Path(path).name)}</b> ({lines} lines): "
                f"{html.escape(summary)}. Click to open.</summary>{code}</details>")
