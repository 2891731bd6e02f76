"""What a deployment bills per hour: the items and counts from the config, prices from the AWS
Price List API when there are credentials.

Offline the counts alone are shown. Usage-priced items (data through the NAT gateway and the
endpoints, NLB capacity units, CloudWatch logs and metrics, S3 requests) are listed as such:
their cost depends on traffic, not on the hour.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from clusterspec.config import ClusterConfig, interface_endpoints

HOURS_PER_MONTH = 730  # AWS's convention for GB-month prices


@dataclass(frozen=True)
class Item:
    """One billable thing: its count, what one costs, and how AWS prices it."""

    name: str
    count: float
    unit: str  # "hour" (per item-hour) or "GB-month"
    service: str = ""  # Price List service code
    filters: tuple[tuple[str, str], ...] = ()
    price_unit: str = "Hrs"  # the price dimension's unit to use
    note: str = ""
    usd: float | None = None  # unit price, once looked up

    @property
    def per_hour(self) -> float | None:
        if self.usd is None:
            return None
        return self.count * (self.usd / HOURS_PER_MONTH if self.unit == "GB-month" else self.usd)


def items(cfg: ClusterConfig) -> list[Item]:
    """The hourly-billed resources the stack makes, with their Price List filters."""
    region = ("regionCode", cfg.region)
    nodes = len(cfg.layout.nodes)
    out = []
    block = cfg.capacity.type == "capacity-block"
    out.append(
        Item(
            f"{cfg.instance_type} ({cfg.capacity.type})", nodes, "hour", "AmazonEC2",
            (("instanceType", cfg.instance_type), region, ("operatingSystem", "Linux"), ("tenancy", "Shared"),
             ("preInstalledSw", "NA"), ("capacitystatus", "Used")),
            note="paid up front when the block was bought" if block else "",
        )
    )  # fmt: skip
    out.append(
        Item(f"root volumes, gp3 {cfg.root_volume_gb} GB", nodes * cfg.root_volume_gb, "GB-month", "AmazonEC2",
             (("productFamily", "Storage"), ("volumeApiName", "gp3"), region), price_unit="GB-Mo")
    )
    if cfg.network.vpc_id is None and cfg.network.egress == "nat":
        out.append(Item("NAT gateway", 1, "hour", "AmazonEC2", (("productFamily", "NAT Gateway"), region), note="+ per GB processed"))
    if cfg.load_balanced:
        out.append(
            Item("internal Network Load Balancer", 1, "hour", "AWSELB", (("productFamily", "Load Balancer-Network"), region),
                 note="+ capacity units")
        )
    endpoints = interface_endpoints(cfg)
    if endpoints:
        out.append(
            Item(f"interface endpoints ({', '.join(endpoints)})", len(endpoints), "hour", "AmazonVPC",
                 (("productFamily", "VpcEndpoint"), region), note="+ per GB processed")
        )
    return out


def usage_priced(cfg: ClusterConfig) -> list[str]:
    """What bills by use rather than by the hour."""
    out = ["S3 requests and transfer (model, caches, results)"]
    if cfg.observability.enabled:
        out.append(f"CloudWatch: 1 dashboard, alarms, logs and metrics of {len(cfg.layout.nodes)} nodes")
    if cfg.network.flow_logs and cfg.network.vpc_id is None:
        out.append("VPC flow logs")
    return out


def _unit_price(pricing: Any, item: Item) -> float | None:
    """The On-Demand USD price of one unit: the first price dimension in the item's unit."""
    filters = [{"Type": "TERM_MATCH", "Field": k, "Value": v} for k, v in item.filters]
    token = None
    while True:
        kwargs: dict[str, Any] = {"ServiceCode": item.service, "Filters": filters, "MaxResults": 100}
        if token:
            kwargs["NextToken"] = token
        page = pricing.get_products(**kwargs)
        for raw in page.get("PriceList", []):
            doc = json.loads(raw) if isinstance(raw, str) else raw
            for term in doc.get("terms", {}).get("OnDemand", {}).values():
                for dim in term.get("priceDimensions", {}).values():
                    usd = float(dim.get("pricePerUnit", {}).get("USD", "0") or 0)
                    if dim.get("unit") == item.price_unit and usd > 0:
                        return usd
        token = page.get("NextToken")
        if not token:
            return None


def priced(cfg: ClusterConfig, pricing: Any) -> list[Item]:
    """The items with their prices (None where the Price List has none, e.g. a type not yet listed)."""
    out = []
    for item in items(cfg):
        usd = None if (item.note.startswith("paid up front")) else _unit_price(pricing, item)
        out.append(Item(**{**item.__dict__, "usd": usd}))
    return out


def price_rows(cfg: ClusterConfig, pricing: Any) -> list[dict[str, Any]]:
    """The priced items as `plan --json --cost` gives them (pricing: a Price List API client)."""
    return [{"item": i.name, "count": i.count, "unit": i.unit, "usd_per_unit": i.usd, "usd_per_hour": i.per_hour, "note": i.note}
            for i in priced(cfg, pricing)]  # fmt: skip
