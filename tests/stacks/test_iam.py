"""The nodes' role and what it may do, read from the synthesized template (least privilege, one statement
at a time)."""

from __future__ import annotations

import json
from typing import Any

from clusterspec.loading import load_config
from tests.conftest import Synth
from tests.stacks.template import of_type


class TestIam:
    def _statements(self, t: dict[str, Any]) -> list[dict[str, Any]]:
        """Every statement a node's role holds (the shared policy's and the roles' own), one per action
        and resource: the CLI's policy minimization may merge statements, which says nothing of what is granted."""
        out = []
        for p in of_type(t, "AWS::IAM::Policy").values():
            if any(r["Ref"].startswith(("Prefill", "Decode", "Server")) for r in p["Properties"]["Roles"]):
                out += p["Properties"]["PolicyDocument"]["Statement"]
        for lid, r in of_type(t, "AWS::IAM::Role").items():
            if lid.startswith(("Prefill", "Decode", "Server")):
                out += [st for doc in r["Properties"].get("Policies", []) for st in doc["PolicyDocument"]["Statement"]]
        flat: dict[str, dict[str, Any]] = {}  # each cell's copy of the shared policy grants the same: once
        for st in out:
            for a in st["Action"] if isinstance(st["Action"], list) else [st["Action"]]:
                for res in st["Resource"] if isinstance(st["Resource"], list) else [st["Resource"]]:
                    one = {k: v for k, v in st.items() if k not in ("Action", "Resource")} | {"Action": a, "Resource": res}
                    flat[json.dumps(one, sort_keys=True)] = one
        return list(flat.values())

    def test_no_managed_policy_no_parameter_store_and_no_wildcard_action(self, default_synth: Synth) -> None:
        t = default_synth.template
        roles = {k: v for k, v in of_type(t, "AWS::IAM::Role").items() if k.startswith(("Prefill", "Decode"))}
        assert len(roles) == 2, "one role per node identity"
        for role in roles.values():
            assert "ManagedPolicyArns" not in role["Properties"], "AmazonSSMManagedInstanceCore reads every parameter of the account"
        for s in self._statements(t):
            actions = s["Action"] if isinstance(s["Action"], list) else [s["Action"]]
            assert not any(a == "*" or a.endswith(":*") for a in actions), s
            # Parameter Store: the one parameter naming the software version (rollout.software=in-place), nothing else.
            if any(a.startswith("ssm:GetParameter") for a in actions):
                assert actions == ["ssm:GetParameter"] and s["Resource"]["Fn::Join"][1][-1] == ":parameter/gptoss/gptoss-8k1k/software", s

    def test_every_optional_permission_is_exactly_the_allowlist(self, synth_variant: Any) -> None:
        """Model and examples in S3, the compile cache, results, KMS keys and the token's secret: each grant on its own resource."""
        from tests.stacks.least_privilege import assert_least_privilege

        key = "arn:aws:kms:us-east-2:123456789012:key/0123abcd-0123-4567-89ab-0123456789ab"
        for secret in ("arn:aws:secretsmanager:us-east-2:123456789012:secret:hf-token-AbCdEf", "arn:aws:secretsmanager:us-east-2:123456789012:secret:hf-token"):
            context = {"model": {"source": "s3", "s3_uri": "s3://models-bucket/gpt-oss-120b", "hf_token_secret_arn": secret},
                       "examples": {"s3_uri": "s3://models-bucket/vllm-neuron"}, "compile_cache_s3_uri": "s3://cache-bucket/neuron/2.33",
                       "results_s3_uri": "s3://results-bucket/runs", "kms_key_arns": [key]}  # fmt: skip
            assert_least_privilege(synth_variant(**context), load_config(context))

    def test_the_default_nodes_read_the_scripts_and_their_own_and_the_fleets_compile_cache(self, default_synth: Synth) -> None:
        from tests.stacks.least_privilege import assert_least_privilege

        assert_least_privilege(default_synth.template, load_config({}))
        t = default_synth.template
        resources = [s["Resource"] for s in self._statements(t) if s["Action"] == "s3:GetObject"]
        (scripts,) = [r for r in resources if ".xz" in json.dumps(r)]
        bucket = {"Fn::Sub": "cdk-hnb659fds-assets-${AWS::AccountId}-us-east-2"}
        parts = scripts["Fn::Join"][1]
        assert parts[:4] == ["arn:", {"Ref": "AWS::Partition"}, ":s3:::", bucket]
        assert len(parts) == 5 and parts[4].startswith("/") and parts[4].endswith(".xz") and "*" not in parts[4]
        manifest = json.loads((default_synth.outdir / "GptOss8k1kStack.assets.json").read_text())
        keys = {dest["objectKey"]: f["source"]["path"] for f in manifest["files"].values() for dest in f["destinations"].values()}
        assert keys[parts[4][1:]].startswith("asset.") and keys[parts[4][1:]].endswith(".xz")

    def test_model_prefix_read_only_when_configured(self, default_synth: Synth, synth_variant: Any) -> None:
        t = synth_variant(model={"source": "s3", "s3_uri": "s3://models-bucket/gpt-oss-120b"})
        stmts = [s for s in self._statements(t) if "s3:" in json.dumps(s["Action"]) and "models-bucket" in json.dumps(s)]
        get = next(s for s in stmts if s["Action"] == "s3:GetObject")
        assert get["Resource"] == {"Fn::Join": ["", ["arn:", {"Ref": "AWS::Partition"}, ":s3:::models-bucket/gpt-oss-120b/*"]]}
        lst = next(s for s in stmts if s["Action"] == "s3:ListBucket")
        assert lst["Condition"] == {"StringLike": {"s3:prefix": ["gpt-oss-120b", "gpt-oss-120b/*"]}}

    def test_nodes_read_the_promoted_compile_cache_and_write_only_their_own_identitys_area(self, synth_variant: Any) -> None:
        t = synth_variant(compile_cache_s3_uri="s3://cache-bucket/neuron/2.33")
        roles = {lid: r for lid, r in of_type(t, "AWS::IAM::Role").items() if lid.startswith(("Prefill", "Decode"))}
        for lid, role in roles.items():
            node = "prefill-0" if lid.startswith("Prefill") else "decode-0"
            own = [st for doc in role["Properties"]["Policies"] for st in doc["PolicyDocument"]["Statement"] if "cache-bucket" in json.dumps(st)]
            writes = [st for st in own if "s3:PutObject" in st["Action"]]
            (w,) = writes
            assert w["Resource"] == {"Fn::Join": ["", ["arn:", {"Ref": "AWS::Partition"}, f":s3:::cache-bucket/neuron/2.33/nodes/{node}/*"]]}
        shared = [st for st in self._statements(t) if "cache-bucket" in json.dumps(st) and st["Action"] == "s3:GetObject"]
        fleet = {"Fn::Join": ["", ["arn:", {"Ref": "AWS::Partition"}, ":s3:::cache-bucket/neuron/2.33/fleet/*"]]}
        assert fleet in [st["Resource"] for st in shared]
        puts = [st for st in self._statements(t) if st["Action"] == "s3:PutObject"]
        assert puts and all("/nodes/prefill-0/" in json.dumps(st) or "/nodes/decode-0/" in json.dumps(st) for st in puts), "no shared write"

    def test_a_node_may_mark_only_its_own_instance_unhealthy(self, default_synth: Synth) -> None:
        t = default_synth.template
        for lid, role in of_type(t, "AWS::IAM::Role").items():
            if not lid.startswith(("Prefill", "Decode")):
                continue
            node = "prefill-0" if lid.startswith("Prefill") else "decode-0"
            sts = [st for doc in role["Properties"]["Policies"] for st in doc["PolicyDocument"]["Statement"] if "autoscaling:" in json.dumps(st)]
            def actions(st: dict[str, Any]) -> list[str]:
                return st["Action"] if isinstance(st["Action"], list) else [st["Action"]]

            # The replacement budget reads Auto Scaling's record (no narrower resource exists; CDK may merge it with another read on '*').
            assert [st["Resource"] for st in sts if "autoscaling:DescribeScalingActivities" in actions(st)] == ["*"], sts
            (st,) = [st for st in sts if "autoscaling:SetInstanceHealth" in actions(st)]
            assert actions(st) == ["autoscaling:SetInstanceHealth"]
            parts = st["Resource"]["Fn::Join"][1]
            assert parts[-1] == f":autoScalingGroup:*:autoScalingGroupName/gptoss-8k1k-{node}", parts
        everyone = [st for p in of_type(t, "AWS::IAM::Policy").values() for st in p["Properties"]["PolicyDocument"]["Statement"]]
        assert not [st for st in everyone if "autoscaling:" in json.dumps(st)], "no shared permission on any group"

    def test_customer_managed_keys_are_used_through_s3_and_secrets_manager_only(self, synth_variant: Any) -> None:
        key = "arn:aws:kms:us-east-2:123456789012:key/0123abcd-0123-4567-89ab-0123456789ab"
        t = synth_variant(kms_key_arns=[key], compile_cache_bucket=False, model={"source": "s3", "s3_uri": "s3://models-bucket/gpt-oss-120b"})
        (st,) = [s for s in self._statements(t) if "kms:" in json.dumps(s["Action"])]
        assert (st["Action"], st["Resource"]) == ("kms:Decrypt", key), "reads only: no data keys without a write prefix"
        assert st["Condition"] == {"StringEquals": {"kms:ViaService": "s3.us-east-2.amazonaws.com"}}
        secret = "arn:aws:secretsmanager:us-east-2:123456789012:secret:hf-token-AbCdEf"
        t = synth_variant(kms_key_arns=[key], compile_cache_bucket=False, model={"hf_token_secret_arn": secret})
        (st,) = [s for s in self._statements(t) if "kms:" in json.dumps(s["Action"])]
        assert st["Condition"] == {"StringEquals": {"kms:ViaService": ["s3.us-east-2.amazonaws.com", "secretsmanager.us-east-2.amazonaws.com"]}}
        t = synth_variant(kms_key_arns=[key], results_s3_uri="s3://results-bucket/runs")
        assert sorted(s["Action"] for s in self._statements(t) if "kms:" in s["Action"]) == ["kms:Decrypt", "kms:GenerateDataKey"]
        assert not [s for s in self._statements(synth_variant()) if "kms:" in json.dumps(s)]

    def test_each_launch_template_names_its_own_nodes_instance_profile(self, default_synth: Synth) -> None:
        t = default_synth.template
        profiles = of_type(t, "AWS::IAM::InstanceProfile")
        named = [lt["Properties"]["LaunchTemplateData"]["IamInstanceProfile"]["Arn"]["Fn::GetAtt"][0] for lt in of_type(t, "AWS::EC2::LaunchTemplate").values()]
        assert sorted(named) == sorted(profiles), "one profile per node identity, each in its node's template"
