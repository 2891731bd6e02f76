"""The fleet layout computed from the prefill:decode ratio: examples and properties."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from clusterspec.errors import SpecError
from clusterspec.instance_types import KNOWN_INSTANCE_TYPES
from clusterspec.layout import Layout, compute_layout
from clusterspec.loading import load_config
from clusterspec.sections.serving import Serving

TRN3 = KNOWN_INSTANCE_TYPES["trn3.48xlarge"]


def layout(decode: int, ratio: int = 6, per_node: int | None = None) -> Layout:
    return compute_layout(
        decode_instances=decode, prefill_per_decode=ratio, instance_type=TRN3, serving=Serving(), replicas_per_prefill_instance=per_node
    )


def test_production_layout_uses_every_core() -> None:
    lay = layout(8)
    assert [n.name for n in lay.prefill_nodes] == ["prefill-0", "prefill-1", "prefill-2"]
    assert len(lay.decode_nodes) == 8 and len(lay.nodes) == 11
    assert len(lay.replicas) == 48
    assert [n.idle_cores for n in lay.nodes] == [0] * 11
    # Decode server 2 is fed by replicas 12-17: four on prefill-0, two on prefill-1.
    feeds = [(r.node, r.index, r.http_port) for r in lay.replicas if r.decode_server == 2]
    assert feeds == [("prefill-0", 12, 8112), ("prefill-0", 13, 8113), ("prefill-0", 14, 8114), ("prefill-0", 15, 8115),
                     ("prefill-1", 0, 8100), ("prefill-1", 1, 8101)]  # fmt: skip
    assert [p.node for p in lay.proxies] == [f"decode-{d}" for d in range(8)]
    assert lay.load_balanced


def test_tested_layout_is_one_prefill_and_one_decode_instance() -> None:
    lay = layout(1)
    assert [(n.name, len(n.replicas), n.idle_cores) for n in lay.nodes] == [("prefill-0", 6, 40), ("decode-0", 0, 0)]
    assert [(r.first_core, r.last_core, r.http_port, r.side_channel_port) for r in lay.replicas] == [
        (4 * i, 4 * i + 3, 8100 + i, 5559 + 100 * i) for i in range(6)
    ]
    assert [p.node for p in lay.proxies] == ["prefill-0"] and not lay.load_balanced


def test_a_partly_filled_last_prefill_instance_shows_its_idle_cores() -> None:
    lay = layout(3)  # 18 replicas: 16 + 2
    assert [(n.name, len(n.replicas), n.idle_cores) for n in lay.prefill_nodes] == [("prefill-0", 16, 0), ("prefill-1", 2, 56)]


def test_replicas_per_instance_can_be_capped() -> None:
    lay = layout(2, per_node=6)
    assert [len(n.replicas) for n in lay.prefill_nodes] == [6, 6]


def test_config_with_eight_decode_instances() -> None:
    cfg = load_config({"decode_instances": "8"})
    assert (len(cfg.layout.prefill_nodes), len(cfg.layout.decode_nodes)) == (3, 8)


@settings(max_examples=150, deadline=None, derandomize=True, database=None)  # the same examples every run; nothing written to the checkout
@given(
    decode=st.integers(1, 64),
    ratio=st.integers(1, 32),
    per_node=st.one_of(st.none(), st.integers(1, 16)),
)
def test_layout_properties(decode: int, ratio: int, per_node: int | None) -> None:
    capacity = TRN3.logical_cores(2) // 4
    instances = decode + -(-decode * ratio // (per_node or capacity))
    if instances > 1400:  # one stack's most: refused, naming the limit, before a node is placed
        with pytest.raises(SpecError, match=f"= {instances:,} instances; one stack holds at most 1,400"):
            layout(decode, ratio, per_node)
        return
    lay = layout(decode, ratio, per_node)
    # Every decode server gets exactly its ratio of replicas.
    for d in range(decode):
        assert sum(1 for r in lay.replicas if r.decode_server == d) == ratio
        (proxy,) = [p for p in lay.proxies if p.decode_server == d]
        assert [r.global_index for r in proxy.replicas] == list(range(d * ratio, (d + 1) * ratio))
    for node in lay.prefill_nodes:
        cores = [c for r in node.replicas for c in range(r.first_core, r.last_core + 1)]
        ports = [p for r in node.replicas for p in (r.http_port, *range(r.side_channel_port, r.side_channel_last + 1))]
        assert len(cores) == len(set(cores)), "two replicas share a core"
        assert len(ports) == len(set(ports)), "two listeners share a port"
        assert max(cores) < node.cores, "a replica is bound past the instance's cores"
        assert node.used_cores + node.idle_cores == node.cores
        assert 1 <= len(node.replicas) <= (per_node or capacity)
    # Only the last prefill instance may be partly filled.
    assert all(len(n.replicas) == lay.replicas_per_prefill_instance for n in lay.prefill_nodes[:-1])
    assert len(lay.prefill_nodes) == -(-decode * ratio // lay.replicas_per_prefill_instance)
    for node in lay.decode_nodes:
        assert node.idle_cores >= 0


def test_rendering_a_fleet_computes_its_layout_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The work's shape, not the clock: every node's rendering asks for the layout; it is computed once."""
    import clusterspec.config as config_module
    from clusterspec.loading import load_config
    from node_render.limits import check
    from node_render.render import render_cluster

    calls = []
    real = config_module.compute_layout
    monkeypatch.setattr(config_module, "compute_layout", lambda **kw: calls.append(kw) or real(**kw))
    cfg = load_config({"decode_instances": 8})
    calls.clear()
    render_cluster(cfg)
    assert len(calls) == 0, "load_config validated the fleet: its layout is already there"
    fresh = cfg.model_copy(update={"decode_instances": 9})
    render_cluster(fresh)
    check(fresh)
    assert len(calls) == 1 and calls[0]["decode_instances"] == 9
