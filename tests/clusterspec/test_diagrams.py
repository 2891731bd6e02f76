"""The layout pictures: what an operator reads in them, and the committed PNGs as `make diagrams`
draws them today (redrawn here, byte for byte)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from clusterspec.diagram import dot_source
from clusterspec.loading import load_config
from tests.conftest import ROOT

COMMITTED = {f"{r}.png": ["-c", f"recipe={r}"] for r in ("gptoss-120b-8k1k", "gptoss-120b-single", "gptoss-20b-single", "gptoss-120b-di", "gptoss-20b-di")}
COMMITTED["production-3p8d.png"] = ["-c", "config=examples/production-3p8d.yaml"]


def test_the_makefile_draws_exactly_the_committed_pictures() -> None:
    r = subprocess.run(["make", "-n", "diagrams"], cwd=ROOT, capture_output=True, text=True, check=True)
    (recipes,) = re.findall(r"for r in ([a-z0-9 -]+);", r.stdout)
    drawn = [f"{n}.png" for n in recipes.split()] + re.findall(r"--diagram docs/diagrams/([a-z0-9-]+\.png)", r.stdout)
    assert sorted(drawn) == sorted(COMMITTED) == sorted(p.name for p in (ROOT / "docs" / "diagrams").iterdir())


@pytest.mark.parametrize("name", sorted(COMMITTED))
def test_each_committed_picture_is_what_make_diagrams_draws_today(name: str, tmp_path: Path) -> None:
    out = tmp_path / name
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "cluster.py"), "plan", *COMMITTED[name], "--diagram", str(out)],
                       cwd=ROOT, capture_output=True, text=True)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert out.read_bytes() == (ROOT / "docs" / "diagrams" / name).read_bytes(), f"docs/diagrams/{name} is stale: make diagrams"


def _edges(dot: str, color: str) -> list[tuple[str, str]]:
    return re.findall(rf"^  (\w+) -> (\w+) \[[^\]]*color={color}\b", dot, re.M)


def _x_order(svg: str, names: list[str]) -> list[str]:
    """The names sorted by where dot drew them, left to right."""
    at = {m.group(1): float(m.group(2)) for m in re.finditer(r"<title>(\w+)</title>.*?<text[^>]*x=\"([0-9.]+)\"", svg, re.S)}
    return sorted(names, key=lambda n: at[n])


def test_the_router_fleet_reads_in_order_with_one_edge_per_leg_and_a_legend() -> None:
    """3 + 8 behind the router: decode-0..7 and prefill-0..2 left to right, the request path from the
    load balancer to the routers and on to the prefill tier, one KV edge back (any replica feeds
    any decode server: not 24 edges across the labels), and the legend naming each colour."""
    dot = dot_source(load_config({"config": "examples/production-3p8d.yaml"}))
    svg = subprocess.run(["dot", "-Tsvg"], input=dot, capture_output=True, text=True, check=True).stdout
    decode, prefill = [f"d{i}" for i in range(8)], [f"p{i}_g0" for i in range(3)]
    assert _x_order(svg, decode) == decode and _x_order(svg, prefill) == prefill
    assert re.search(r"^  nlb -> d\d \[lhead=cluster_decode, label=\"requests: any ready router\"\];$", dot, re.M)
    assert len(_edges(dot, "royalblue3")) == 1 and "lhead=cluster_prefill, color=royalblue3" in dot, "the prefill leg: routers to the prefill tier"
    assert len(_edges(dot, "firebrick3")) == 1, "one KV edge between the tiers"
    legend = re.search(r"^  legend \[.*$", dot, re.M)
    assert legend and all(t in legend.group(0) for t in ("client requests", "prefill leg (max_tokens 1)", "KV cache, NIXL over EFA"))
    assert "router :8000" in dot and "health check :8000 /readiness" in dot


def test_the_toy_proxy_fleet_draws_each_fixed_group_to_its_decode_server() -> None:
    """3 + 8 with the toy proxy: each decode server's group of six replicas (split where a group spans
    two prefill instances) has its prefill leg from that server's proxy and its KV edge to it."""
    cfg = load_config({"decode_instances": "8", "serving.proxy.kind": "toy"})
    dot = dot_source(cfg)
    kv = _edges(dot, "firebrick3")
    assert sorted({d for d, _ in kv}) == [f"d{i}" for i in range(8)]
    boxes = dict(re.findall(r'^    (p\d_g\d+) \[label="([^"]+)"', dot, re.M))
    for d, box in kv:
        first, last = (int(x) for x in re.search(r"replicas (\d+)(?:-(\d+))?", boxes[box]).groups(default="-1"))  # type: ignore[union-attr]
        node = int(box[1])
        served = {rep.decode_server for rep in cfg.layout.prefill_nodes[node].replicas if first <= rep.index <= (last if last >= 0 else first)}
        assert served == {int(d[1:])}, (box, served)
    assert sorted(_edges(dot, "royalblue3")) == sorted(kv), "each group's prefill leg comes from its own decode server's proxy"


def test_the_default_layout_shows_the_proxy_on_prefill_0_and_both_legs() -> None:
    dot = dot_source(load_config({}))
    assert re.search(r'p0_proxy0 \[label="prefill-0\\nproxy :8000"', dot)
    assert ("client", "p0_proxy0") in re.findall(r"^  (\w+) -> (\w+) \[", dot, re.M)
    assert _edges(dot, "darkgreen") == [("p0_proxy0", "d0")] and _edges(dot, "royalblue3") == [("p0_proxy0", "p0_g0")]
    assert _edges(dot, "firebrick3") == [("d0", "p0_g0")], "drawn decode-side with dir=back: the KV flows from the replicas up to decode-0"


def test_the_same_config_gives_the_same_picture() -> None:
    cfg = {"config": "examples/production-3p8d.yaml"}
    assert dot_source(load_config(cfg)) == dot_source(load_config(cfg))
