"""The node's scripts as they are shipped: userdata/bin read once, comments and docstrings stripped.

render decides which of them a node runs; userdata packages them (its user data, the scripts asset).
"""

from __future__ import annotations

import ast
import functools
import re

from node_render.paths import USERDATA_DIR

# Scripts every node carries in its user data: the boot itself, fetching the others, the status
# report and the deploy gate's failure answer (both must work when the fetch does not), and the
# module the status report imports. The other
# scripts are the same on every node: the stack ships them once, as a file asset in S3 (see
# scripts_asset), which keeps each node's user data far below EC2's 16 KB.
NODE_SCRIPTS = frozenset({"gptoss-bootstrap", "gptoss-fetch-scripts", "gptoss-gate-failure", "gptoss-status", "gptoss_node.py"})


def strip_comments(name: str, text: str) -> str:
    """A script as shipped to a node: comment-only lines dropped (the repository keeps them).

    User data is limited to 16 KB per node and the template to 1 MB per stack; the comments
    explain the scripts to their maintainers, not to the node. The shebang, shellcheck
    directives and heredoc bodies are kept verbatim.
    """
    lines = text.splitlines()
    out = [lines[0], f"# {name}: userdata/bin/{name} of the cluster project, comments stripped"]
    heredoc_end: str | None = None
    for line in lines[1:]:
        if heredoc_end is not None:
            out.append(line)
            if line.strip() == heredoc_end:
                heredoc_end = None
            continue
        stripped = line.strip()
        if stripped.startswith("#") and not stripped.startswith("# shellcheck"):
            continue
        out.append(line)
        m = re.search(r"<<-?\s*'?(\w+)'?\s*$", line)
        if m:
            heredoc_end = m.group(1)
    return "\n".join(out) + "\n"


# The fields of a statement that hold statements (match's cases and try's handlers hold bodies).
_STATEMENT_LISTS = ("body", "orelse", "finalbody", "handlers", "cases")


def strip_python(name: str, text: str) -> str:
    """A Python script as shipped: docstrings and comments dropped, the code re-printed by `ast`.

    The same reason as strip_comments; the repository keeps the documented source.
    """
    tree = ast.parse(text)
    # A docstring opens a module's, a class's or a function's body, and those are statements:
    # only statement lists are walked (ast.walk would visit every expression, three times the work).
    todo: list[ast.AST] = [tree]
    while todo:
        node = todo.pop()
        body = getattr(node, "body", None)
        if (
            isinstance(node, ast.Module | ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
            and body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)
        ):
            node.body = body[1:] or [ast.Pass()]  # type: ignore[attr-defined]
        for field in _STATEMENT_LISTS:
            todo.extend(getattr(node, field, None) or ())
    shebang = text.splitlines()[0]
    return f"{shebang}\n# {name}: userdata/bin/{name} of the cluster project, docstrings stripped\n{ast.unparse(tree)}\n"


def ship(name: str, text: str) -> str:
    """A script as a node receives it (bash or Python, by its shebang)."""
    return strip_python(name, text) if text.startswith("#!/usr/bin/env python3") else strip_comments(name, text)


@functools.cache
def shipped_scripts() -> dict[str, str]:
    """Every script of userdata/bin as a node receives it, by name."""
    return {p.name: ship(p.name, p.read_text()) for p in sorted((USERDATA_DIR / "bin").iterdir()) if p.is_file()}


def node_script(name: str) -> str:
    """The text of a script as a node receives it."""
    return shipped_scripts()[name]
