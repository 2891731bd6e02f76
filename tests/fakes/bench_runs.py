"""SYNTHETIC benchmark results, in the format of `vllm bench serve --save-result`, from a known model.

Nothing here was measured: this machine has no Trainium. The sizer's tests and the docs' example
use these files to show what `gptoss size` does with a sweep; real numbers come from `gptoss bench
--sweep` on a deployed cluster. The model (per decode server and per prefill replica):

- TPOT mean = base + slope x sequences on the server; p50 = mean; p99 = 1.25 x mean.
- a request spends (output tokens - 1) x TPOT mean on its decode server.
- TTFT = prefill service S + the prefill-to-decode overhead, plus queueing at the prefill replica
  when the load is a rate: p50 + S rho / (2 (1 - rho)), p99 + 4 S rho / (1 - rho), rho = rate x S.
- every closed-loop run keeps its concurrency in flight (throughput = C / E2EL: Little's law).

    python -m tests.fakes.bench_runs DIR   writes the example set (tests/fixtures/bench-synthetic)
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Model:
    """The known truth the files are made from (times in ms)."""

    tpot_base: float = 9.0
    tpot_slope: float = 0.06
    service: float = 700.0  # prefill of one 8K prompt on one replica
    overhead: float = 60.0  # the KV handoff and the decode server's first token
    isl: int = 8192
    osl: int = 1024

    def tpot_mean(self, per_server: float) -> float:
        return self.tpot_base + self.tpot_slope * per_server

    def tpot_p99(self, per_server: float) -> float:
        return 1.25 * self.tpot_mean(per_server)

    def residence_s(self, per_server: float) -> float:
        return (self.osl - 1) * self.tpot_mean(per_server) / 1000

    def rho(self, per_replica: float) -> float:
        return per_replica * self.service / 1000

    def ttft_p50(self, per_replica: float, leg: str = "endpoint") -> float:
        rho = self.rho(per_replica)
        return self.service + (self.overhead if leg == "endpoint" else 0) + self.service * rho / (2 * (1 - rho))

    def ttft_p99(self, per_replica: float, leg: str = "endpoint") -> float:
        rho = self.rho(per_replica)
        return self.service + (self.overhead if leg == "endpoint" else 0) + 4 * self.service * rho / (1 - rho)


def result(model: Model, *, leg: str, prefill_replicas: int, decode_servers: int, concurrency: int | None = None,
           rate: float | None = None, prompts: int = 1000, image: str = "ami-0123456789abcdef0") -> dict[str, Any]:  # fmt: skip
    """One run's JSON document as vllm bench serve saves it, with gptoss bench --sweep's metadata."""
    if concurrency is not None:  # closed loop: spread over the decode servers, light on prefill
        per_server = concurrency / decode_servers
        ttft_mean = model.service + model.overhead
        ttft_p50, ttft_p99 = ttft_mean, ttft_mean * 1.1
        e2el = ttft_mean + model.residence_s(per_server) * 1000
        throughput = concurrency / (e2el / 1000)
        tpot = model.tpot_mean(per_server)
        tpot_p99 = model.tpot_p99(per_server)
    else:
        assert rate is not None
        per_replica = rate / prefill_replicas
        ttft_p50, ttft_p99 = model.ttft_p50(per_replica, leg), model.ttft_p99(per_replica, leg)
        ttft_mean = (ttft_p50 + ttft_p99) / 2
        per_server = 8.0  # an open-loop run at these rates keeps decode lightly loaded
        tpot, tpot_p99 = model.tpot_mean(per_server), model.tpot_p99(per_server)
        e2el = ttft_mean + (model.osl - 1 if leg == "endpoint" else 0) * tpot
        throughput = rate
    osl = model.osl if leg == "endpoint" else 1
    return {
        "date": "20261203-000000", "endpoint_type": "vllm", "label": None, "model_id": "/opt/dlami/nvme/models/gpt-oss-120b",
        "tokenizer_id": "/opt/dlami/nvme/models/gpt-oss-120b", "num_prompts": prompts,
        "request_rate": "inf" if rate is None else rate, "burstiness": 1.0, "max_concurrency": concurrency,
        "duration": prompts / throughput, "completed": prompts, "failed": 0,
        "total_input_tokens": prompts * model.isl, "total_output_tokens": prompts * osl,
        "request_throughput": throughput, "request_goodput": None, "output_throughput": throughput * osl,
        "total_token_throughput": throughput * (model.isl + osl),
        "mean_ttft_ms": ttft_mean, "median_ttft_ms": ttft_p50, "std_ttft_ms": 0.0, "p50_ttft_ms": ttft_p50, "p99_ttft_ms": ttft_p99,
        "mean_tpot_ms": tpot, "median_tpot_ms": tpot, "std_tpot_ms": 0.0, "p50_tpot_ms": tpot, "p99_tpot_ms": tpot_p99,
        "mean_itl_ms": tpot, "median_itl_ms": tpot, "std_itl_ms": 0.0, "p50_itl_ms": tpot, "p99_itl_ms": tpot_p99,
        "mean_e2el_ms": e2el, "median_e2el_ms": e2el, "std_e2el_ms": 0.0, "p50_e2el_ms": e2el, "p99_e2el_ms": e2el * 1.1,
        "gptoss_recipe": "gptoss-120b-8k1k", "gptoss_instance_type": "trn3.48xlarge", "gptoss_image": image,
        "gptoss_prefill_replicas": prefill_replicas, "gptoss_decode_servers": decode_servers, "gptoss_leg": leg,
        "gptoss_synthetic": "made by tests/fakes/bench_runs.py from a known model; not a measurement",
    }  # fmt: skip


def sweep(model: Model | None = None, *, prefill_replicas: int = 48, decode_servers: int = 8, rates: bool = True) -> dict[str, dict[str, Any]]:
    """The runs gptoss bench --sweep makes on 3 + 8 (48 replicas, 8 decode servers), by file name."""
    model = model or Model()
    out = {}
    for per_server in (1, 8, 32, 64, 96, 128):
        c = per_server * decode_servers
        out[f"sweep-c{c}.json"] = result(model, leg="endpoint", prefill_replicas=prefill_replicas, decode_servers=decode_servers, concurrency=c)
    if rates:
        for per_replica in (0.1, 0.3, 0.5, 0.7, 0.9, 1.1, 1.25):
            r = round(per_replica * prefill_replicas, 3)
            out[f"sweep-r{r:g}.json"] = result(model, leg="endpoint", prefill_replicas=prefill_replicas, decode_servers=decode_servers, rate=r)
    return out


if __name__ == "__main__":
    dest = Path(sys.argv[1])
    dest.mkdir(parents=True, exist_ok=True)
    for name, doc in sweep().items():
        (dest / name).write_text(json.dumps(doc, indent=2) + "\n")
    print(f"{len(sweep())} synthetic runs in {dest}")
