"""The gptoss commands, one module each: `register(sub)` adds its subcommand, `run` carries it out.

What they share (which cluster, the target line, the console, errors) is cluster_ops.common;
what they show is cluster_ops.plan_view and each command's own tables; what they ask AWS is
in cluster_ops (status, bench, cache, preflight, stack, ...). None imports the entry point.
"""

from __future__ import annotations

from cluster_ops.commands import (
    bench,
    blocks,
    deploy,
    destroy,
    diff,
    keys,
    local,
    pin_ami,
    plan,
    preflight,
    recipes,
    save_cache,
    size,
    status,
    wait_ready,
)

# The order `gptoss --help` lists them in.
COMMANDS = (plan, recipes, preflight, blocks, pin_ami, deploy, destroy, diff, status, wait_ready, keys, bench, size, save_cache, local)
