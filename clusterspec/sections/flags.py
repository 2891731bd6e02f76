"""What a server's environment and extra flags may hold: the tested tables (reference 000) and the rules every table and flag follows."""

from __future__ import annotations

import json
import re
from typing import Any

from pydantic import Field, field_validator

from clusterspec import validate
from clusterspec.base import Frozen
from clusterspec.errors import rule_error


class EnvSetting(Frozen):
    """One environment variable of a server, with the reason it is set."""

    value: str
    reason: str

    @field_validator("value")
    @classmethod
    def _carried(cls, v: str) -> str:
        return validate.carried("serving env value", v)


class ExtraFlag(Frozen):
    """A serving flag the spec does not model; added after the tested flags."""

    name: str = Field(pattern=r"^--[a-z0-9][a-z0-9-]*$", max_length=100)
    value: str | None = None
    reason: str = Field(min_length=1)

    @field_validator("value")
    @classmethod
    def _carried(cls, v: str | None) -> str | None:
        if v is None:
            return v
        if v == "--":
            raise rule_error("extra flag value", v, "'--' ends the wrappers' own arguments on the node", "pass the flag's real value")
        if v == "":
            raise rule_error("extra flag value", v, "is empty: the server's parser would take the next flag as this one's value",
                             "give the value, or leave value out for a flag that takes none")  # fmt: skip
        if v.startswith("-") and not re.fullmatch(r"-[0-9]+(\.[0-9]+)?", v):
            raise rule_error("extra flag value", v, "starts with '-': the server's parser would read it as a flag of its own, not as this flag's value",
                             "give the value itself (a negative number such as -1 is taken), or add the flag as its own extra flag")  # fmt: skip
        # A backslash starts one of systemd's C escapes on an Exec line.
        return validate.carried("extra flag value", v, extra={"\\": "a backslash"})


def _env(**pairs: tuple[str, str]) -> dict[str, EnvSetting]:
    return {k: EnvSetting(value=v, reason=r) for k, (v, r) in pairs.items()}


COMMON_ENV = _env(
    VLLM_NEURON_BACKEND=(
        "neuron_native",
        "The compile route; libtorch-neuronx-lite selects its native-route setup only for an explicit value.",
    ),
    NEURON_LIBTORCH_DISABLE_GRAPH_CAPTURE_BACKEND=("1", "The native route needs the graph-capture backend off."),
    TORCH_NEURONX_VOCAB_SHARDING_SPMD_DISABLE=(
        "1",
        "Turns off the vocab-sharding FX pass, so the per-rank vocab offset stays out of the graph.",
    ),
    NEURON_RT_DBG_VECTOR_DGE_SKIP_NOTIF=(
        "1",
        "Packed-FP8 KV writes benign out-of-bound skip notifications that otherwise stop the decode server on a long run.",
    ),
    VLLM_NEURON_NIXL_PROGRESS_THREAD_DELAY_US=(
        "250",
        "The NIXL progress thread polls with no delay by default and takes a core from the worker.",
    ),
    VLLM_NIXL_SIDE_CHANNEL_HOST=("0.0.0.0", "The side channel must accept the KV handshake from the other node."),
    NEURON_LIBTORCH_COMPILATION_TIMEOUT=(
        "2400",
        "Seconds for the compile of one graph; the default 600 is shorter than one prefill graph compile.",
    ),
    VLLM_ENGINE_READY_TIMEOUT_S=(
        "14400",
        "Seconds for the startup of one server; the first prefill replica compiles its graph during startup.",
    ),
)

DECODE_ENV = _env(
    VLLM_NEURON_MEGA_COLLECTIVE_PRIVATE_SRC=(
        "1",
        "Keeps the source tensors of a collective off shared HBM; a toolchain that requires it stops the trace without it.",
    ),
    VLLM_NEURON_BATCH_QUEUE_DEPTH=("4", "Four batches in flight hide the host time of a step."),
    NEURON_RT_XU_WORKER_ENABLE_LOW_LATENCY_COMPLETION=(
        "0",
        "The completion poll backs off and gives host cores back to the workers.",
    ),
    VLLM_NEURON_MEGA_FUSE_EMBED=("1", "The token embedding inside the megakernel."),
    VLLM_NEURON_TAIL_FLAT_ROW_GATHER=("1", "One row gather in the fused tail."),
)

# Variables the renderer computes from typed fields; an env table may not set them by hand.
DERIVED_ENV = frozenset(
    {
        "NEURON_LOGICAL_NC_CONFIG",
        "NEURON_VISIBLE_DEVICES",
        "VLLM_NIXL_SIDE_CHANNEL_PORT",
        "VLLM_NEURON_MEGA_DMA_ORDER_CONSTRAINTS_FILE",
        # Behind vLLM's router: the drain middleware's module path and its files (node_render.command_lines.drain_env).
        "PYTHONPATH",
        "PYTHONDONTWRITEBYTECODE",
        "GPTOSS_DRAIN_FILE",
        "GPTOSS_DRAIN_HEALTH_PATH",
    }
)


# Environment values the servers read as whole seconds; a bad one stops them hours in.
SECONDS_ENV = {
    "VLLM_ENGINE_READY_TIMEOUT_S": 43200,
    "NEURON_LIBTORCH_COMPILATION_TIMEOUT": 43200,
    "VLLM_NEURON_COMPILATION_TIMEOUT": 43200,
    "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": 43200,
}


# What a server's process needs as the units and the venv set it: an env table may not replace it.
UNIT_ENV = frozenset({"PATH", "HOME", "LD_PRELOAD", "LD_LIBRARY_PATH", "PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "NEURON_RT_VISIBLE_CORES"})


def drop_removed(v: Any) -> Any:
    """An env table entry set to null is removed (-c serving.common_env.X=null): tables merge key by key."""
    return {k: e for k, e in v.items() if e is not None} if isinstance(v, dict) else v


def check_env(field: str, env: dict[str, EnvSetting]) -> None:
    for name, setting in env.items():
        validate.env_name(f"{field}.{name}", name)
        if name in SECONDS_ENV:
            validate.positive_int_text(f"{field}.{name}", setting.value, maximum=SECONDS_ENV[name])
    owned = sorted(UNIT_ENV & set(env))
    if owned:
        raise rule_error(
            field, owned,
            "the units and the venv set these for every server (the command search path, the loader, the NeuronCores a server binds)",
            "remove them from the env table (NeuronCores follow the layout: replicas_per_prefill_instance and lnc)",
        )  # fmt: skip
    derived = sorted(DERIVED_ENV & set(env))
    if derived:
        raise rule_error(
            field,
            derived,
            "these variables are derived from typed fields (lnc, ports, layout, schedule path, the drain middleware behind the router)",
            "remove them from the env table and set the typed field instead",
        )


# Flags the spec models with typed fields; an extra flag may not set one of them a second time.
MODELED_FLAGS = frozenset(
    ["--tensor-parallel-size", "--data-parallel-size", "--enable-expert-parallel", "--optimization-level", "--max-model-len", "--max-num-batched-tokens", "--max-num-seqs", "--block-size", "--kv-cache-dtype", "--max-logprobs", "--no-disable-hybrid-kv-cache-manager", "--distributed-executor-backend", "--port", "--hf-overrides", "--kv-transfer-config", "--additional-config", "--dtype", "--enable-prefix-caching", "--host"]
)


# Flags the units and the deploy gate depend on without a typed field: the model's name (the gate
# and the proxy ask for the model by its path) and a file of flags that would override the rest.
OWNED_FLAGS = frozenset(["--model", "--served-model-name", "--config"])


def _owned_spellings() -> frozenset[str]:
    """Every spelling argparse maps to a modeled or owned flag: the flag, its --no- negation
    (BooleanOptionalAction) and, for a --no- flag, its positive form."""
    out = set(MODELED_FLAGS | OWNED_FLAGS)
    for flag in MODELED_FLAGS:
        out.add(f"--{flag[5:]}" if flag.startswith("--no-") else f"--no-{flag[2:]}")
    return frozenset(out)


OWNED_SPELLINGS = _owned_spellings()


def check_extra_flags(field: str, flags: tuple[ExtraFlag, ...]) -> None:
    seen: set[str] = set()
    for flag in flags:
        # vLLM's parser takes any unambiguous prefix of a flag (--max-num-seq is --max-num-seqs).
        owned = sorted(o for o in OWNED_SPELLINGS if o.startswith(flag.name))
        as_read = "" if flag.name in owned else f" (vLLM reads it as {' or '.join(owned)})"
        if any(o not in OWNED_FLAGS for o in owned):
            raise rule_error(
                field, flag.name, f"the spec sets this flag from a typed field{as_read}; a second copy would decide which one vLLM reads",
                "set the typed field under serving.* instead (docs/parameters.md)",
            )  # fmt: skip
        if owned:
            raise rule_error(
                field, flag.name, f"the units set this flag themselves{as_read}: the deploy gate and the proxy ask for the model by its path",
                "remove it",
            )  # fmt: skip
        if flag.name in seen:
            raise rule_error(field, flag.name, "is given twice", "keep one")
        seen.add(flag.name)


def carried_json(field: str, value: Any) -> None:
    """A JSON argument must survive systemd's quoting: no single quote, no backslash (json escapes)."""
    text = json_arg(value)
    for ch, name in (("'", "a single quote"), ("\\", "a backslash or an escaped character")):
        if ch in text:
            raise rule_error(field, text, f"its JSON holds {name}, which cannot be carried into a unit's command line", "remove it")


def repo_path(field: str, value: str) -> str:
    """A relative path inside the examples repository."""
    parts = value.split("/")
    if value.startswith("/") or ".." in parts or "." in parts or "" in parts or not re.fullmatch(r"^[A-Za-z0-9_./-]+$", value):
        raise rule_error(field, value, "must be a relative path inside the vLLM Neuron repository (no '..', no leading '/')", "give the path as in the repository")
    return value


def route_path(field: str, value: str) -> str:
    if not re.fullmatch(r"^/[A-Za-z0-9/_.-]*$", value):
        raise rule_error(field, value, "must be an HTTP path starting with /", "give a route like /health")
    return value


def json_arg(value: Any) -> str:
    """Serialize a JSON command-line argument the same way everywhere (stable, compact)."""
    return json.dumps(value, separators=(", ", ": "))
