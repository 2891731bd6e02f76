#!/usr/bin/env python3
"""CDK app: read the parameters, validate them into the spec, build the stack. No AWS calls."""

from __future__ import annotations

import os
import sys
from pathlib import Path


def _in_the_project_venv() -> None:
    """Run under the checkout's .venv, which `make setup` made with the pinned packages.

    cdk.json runs `python3 app.py`, and the CDK CLI takes whichever python3 comes first on PATH:
    without an activated venv that is the system's, which lacks aws_cdk (`npx cdk deploy` failed
    with "No module named 'aws_cdk'"). So `cdk synth`, `cdk deploy GptOss8k1kStack`, `cdk diff` and
    `cdk destroy` work as typed, with or without `source .venv/bin/activate`.
    """
    venv = Path(__file__).resolve().parent / ".venv"
    if Path(sys.prefix).resolve() == venv.resolve():
        return
    python = venv / "bin" / "python"
    if python.exists():
        os.execv(str(python), [str(python), __file__, *sys.argv[1:]])  # the environment (the CDK's context) carries over
    print(f"app.py: {venv} does not exist, so the pinned Python packages (aws_cdk among them) are not installed. Fix: make setup", file=sys.stderr)
    sys.exit(1)


_in_the_project_venv()

# CDK's built-in CloudFormation validator (a WASM linter, about 1.3 s of every synth) checks
# what cfn-lint checks; `make test` runs cfn-lint on every recipe and capacity mode, and cdk-nag
# runs at every synth below. CDK_VALIDATION=true cdk synth turns the built-in one back on. Set
# before aws_cdk starts its runtime, which reads it.
os.environ.setdefault("CDK_VALIDATION", "false")

# The imports below come after the venv check and the validator's switch on purpose.
import aws_cdk as cdk  # noqa: E402
from cdk_nag import AwsSolutionsChecks  # noqa: E402

from clusterspec.errors import SpecError  # noqa: E402
from clusterspec.loading import load_config  # noqa: E402
from node_render import limits  # noqa: E402
from stacks.cluster_stack import GptOssClusterStack  # noqa: E402


def main() -> None:
    """Synthesize the cluster stack, or exit with the validation errors before writing anything."""
    app = cdk.App(stack_traces=False)  # no construct traces in the metadata: the CLI printed a jsii frame before each warning
    try:
        config = load_config(app.node.get_all_context())
        limits.check(config)
        for line in config.ignored_settings():
            print(f"note: {line}", file=sys.stderr)
    except SpecError as e:
        print(f"invalid deployment parameters:\n{e}", file=sys.stderr)
        sys.exit(1)
    except Exception as e:  # a bug, not a bad value: one line unless asked for the traceback
        if os.environ.get("GPTOSS_DEBUG"):
            raise
        print(f"internal error while reading the parameters: {type(e).__name__}: {e} (set GPTOSS_DEBUG=1 for the traceback)", file=sys.stderr)
        sys.exit(1)
    GptOssClusterStack(app, config.stack_name, config=config)
    cdk.Validations.of(app).add_plugins(AwsSolutionsChecks(app))
    app.synth()


if __name__ == "__main__":
    main()
