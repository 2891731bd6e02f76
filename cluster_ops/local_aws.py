"""The local AWS: moto's server, with what the stack needs of CloudFormation and moto 5.2 lacks.

1. moto 5.2 skips `AWS::EC2::PlacementGroup` silently, so its `Ref` (the group's name, which the
stack passes to each cell) is empty and the deploy fails with "Missing parameter
...PlacementGroup...Ref". On AWS the resource exists and its Ref is its name. This model gives
moto's CloudFormation exactly that: a name, nothing else (moto's EC2 ignores placement anyway).

2. DescribeStackResources answers 500 when the stack holds a resource moto does not model (the
deploy gate's wait condition is one); the CDK asks it when it looks into a failed deploy. Here
it skips those.

3. A nested stack's physical id is its name; on AWS it is the stack's ARN, from which the CDK
takes the name it reads the deployed template by (`cdk diff` then showed every cell as new).

4. DeleteChangeSet of a change set that does not exist answers 500 (an unbound variable), which
the CDK retries for most of a minute before each `cdk diff`. Here it answers what AWS answers.

5. UpdateStack with UsePreviousValue for a parameter the stack took from its template's default
(the CDK's BootstrapVersion) answers 500 (KeyError): moto keeps only the values it was given. On
AWS the previous value is the one the stack resolved, the default here: the parameter is left to it.

`gptoss local up` starts moto this way, and so do the tests that deploy to a local AWS. Nothing
here runs against AWS: it changes only the moto server it starts.

    python -m cluster_ops.local_aws -H 127.0.0.1 -p PORT   (moto_server's own arguments)
"""

from __future__ import annotations

import sys
from typing import Any

from moto.cloudformation.utils import random_suffix
from moto.core.common_models import CloudFormationModel


class PlacementGroup(CloudFormationModel):
    """A cluster placement group as CloudFormation sees it: a name (its Ref)."""

    # moto files each model under the service its module names (moto.<service>...): EC2's.
    __module__ = "moto.ec2.placement_groups"

    def __init__(self, name: str, strategy: str) -> None:
        self.name = name
        self.strategy = strategy

    @property
    def physical_resource_id(self) -> str:
        return self.name

    @staticmethod
    def cloudformation_name_type() -> str:
        return ""

    @staticmethod
    def cloudformation_type() -> str:
        return "AWS::EC2::PlacementGroup"

    @classmethod
    def has_cfn_attr(cls, attr: str) -> bool:
        return attr == "GroupName"

    def get_cfn_attribute(self, attribute_name: str) -> str:
        return self.name

    @classmethod
    def create_from_cloudformation_json(  # type: ignore[override]
        cls, resource_name: str, cloudformation_json: dict[str, Any], account_id: str, region_name: str, **kwargs: Any
    ) -> PlacementGroup:
        strategy = cloudformation_json.get("Properties", {}).get("Strategy", "cluster")
        return cls(f"{resource_name}-{random_suffix()}", strategy)

    @classmethod
    def update_from_cloudformation_json(  # type: ignore[override]
        cls, original_resource: Any, new_resource_name: str, cloudformation_json: dict[str, Any], account_id: str, region_name: str
    ) -> Any:
        return original_resource

    @classmethod
    def delete_from_cloudformation_json(  # type: ignore[override]
        cls, resource_name: str, cloudformation_json: dict[str, Any], account_id: str, region_name: str
    ) -> None:
        return None

    def is_created(self) -> bool:
        return True


def _describe_stack_resources(self: Any, stack_name: str, logical_resource_id: str | None) -> tuple[Any, list[Any]]:
    stack = self.get_stack(stack_name)
    modeled = [r for r in stack.stack_resources if r is not None]
    if logical_resource_id is not None:
        return stack, [r for r in modeled if r.logical_resource_id == logical_resource_id][:1]
    return stack, modeled


def _delete_change_set(self: Any, change_set_name: str) -> None:
    from moto.cloudformation.exceptions import ValidationError

    found = [k for k, cs in self.change_sets.items() if change_set_name in (k, cs.change_set_name)]
    if not found:
        raise ValidationError(change_set_name, message=f"ChangeSet [{change_set_name}] does not exist")
    del self.change_sets[found[0]]


def _resolve_update_parameters(self: Any, instance: Any, incoming_params: list[dict[str, str]]) -> dict[str, str]:
    parameters = {p["ParameterKey"]: p["ParameterValue"] for p in incoming_params if "ParameterValue" in p}
    previous = {p["ParameterKey"]: instance.parameters[p["ParameterKey"]] for p in incoming_params
                if p.get("UsePreviousValue", False) and p["ParameterKey"] in instance.parameters}  # fmt: skip
    return parameters | previous


if __name__ == "__main__":
    from moto.cloudformation.models import CloudFormationBackend, Stack
    from moto.server import main

    CloudFormationBackend.describe_stack_resources = _describe_stack_resources  # type: ignore[method-assign,assignment]
    CloudFormationBackend.delete_change_set = _delete_change_set  # type: ignore[method-assign]
    CloudFormationBackend._resolve_update_parameters = _resolve_update_parameters  # type: ignore[method-assign]
    Stack.physical_resource_id = property(lambda self: self.stack_id)  # type: ignore[assignment,method-assign]
    main(sys.argv[1:])
