"""Bad inputs: each named with its field, value, rule and fix, at plan and at synth, and never a traceback
(the table of at least 120 distinct cases, broken config files, a directory given as config)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from clusterspec.errors import SpecError
from clusterspec.loading import load_config
from node_render import limits
from tests.conftest import ROOT


def row(case: str, context: dict[str, Any], field_value: str, rule: str, fix: str) -> tuple[str, dict[str, Any], list[str]]:
    """One bad input: the message must start its entry with field=value, state the rule, and give the fix."""
    return case, context, [field_value, rule, "Fix: " + fix]


ENV = {"value": "1", "reason": "why"}
LONG = "x" * 129
BAD_INPUTS: list[tuple[str, dict[str, Any], list[str]]] = [
    # -- the parameters themselves
    row("unknown key", {"decode_instance": "2"}, "decode_instance='2'", "is not a known setting", "remove -c decode_instance"),
    row("unknown nested key", {"serving": {"decode": {"max_num_seq": 8}}}, "serving.decode.max_num_seq=8", "is not a known setting", "remove `serving.decode.max_num_seq`"),
    row("unknown dotted key", {"network.egres": "none"}, "network.egres='none'", "is not a known setting", "remove `network.egres`"),
    row("dotted key into a value", {"region.name": "x"}, "region.name: region is a value", "not a section", "-c region=VALUE"),
    row("malformed JSON", {"network": "{egress: none}"}, "network='{egress: none}'", "is not valid JSON", 'quote names and strings with double quotes'),
    row("section given as a string", {"network": "none"}, "network='none'", "must be a mapping of settings", "give it as JSON, e.g. -c 'network={\""),
    row("not a number", {"decode_instances": "many"}, "decode_instances='many'", "valid integer", "set `decode_instances` to a whole number"),
    row("no decode server", {"decode_instances": "0"}, "decode_instances=0", "at least one decode server", "set decode_instances >= 1"),
    row("negative fleet", {"decode_instances": "-3"}, "decode_instances=-3", "at least one decode server", "set decode_instances >= 1"),
    row("absurd fleet", {"decode_instances": "5000"}, "decode_instances=5,000: with prefill_per_decode=6 and replicas_per_prefill_instance=fill",
        "= 6,875 instances; one stack holds at most 1,400", "at most 1,018 decode instances with these ratios"),
    row("fleet of one replica per prefill instance", {"decode_instances": "300", "replicas_per_prefill_instance": "1"},
        "decode_instances=300: with prefill_per_decode=6 and replicas_per_prefill_instance=1", "300 decode + 1,800 prefill = 2,100 instances; one stack holds at most 1,400",
        "at most 200 decode instances with these ratios"),
    row("more prefill replicas than the decode server has slots", {"prefill_per_decode": "1000"}, "prefill_per_decode=1,000",
        "a decode server holds at most 128 sequences at a time", "set prefill_per_decode <= 128"),
    row("a prefill fleet past one stack for one decode server", {"prefill_per_decode": "128", "replicas_per_prefill_instance": "1", "decode_instances": "11"},
        "decode_instances=11: with prefill_per_decode=128", "= 1,419 instances; one stack holds at most 1,400", "at most 10 decode instances"),
    row("an instance override past any instance", {"instance_overrides": '{"neuron_devices": 100000000000000000000000}'},
        "instance_overrides.neuron_devices=100000000000000000000000", "less than or equal to 64", "to what AWS reports"),
    row("a model id with a double dash", {"serving.model_id": "openai/gpt--oss"}, "serving.model_id='openai/gpt--oss'", "huggingface_hub accepts", "give e.g. openai/gpt-oss-120b"),
    row("a model id ending in a dot", {"serving.model_id": "openai/gpt-oss."}, "serving.model_id='openai/gpt-oss.'", "huggingface_hub accepts", "give e.g. openai/gpt-oss-120b"),
    row("an extra flag value that is a flag", {"serving.decode.extra_flags": '[{"name": "--seed", "value": "--port", "reason": "r"}]'},
        "extra flag value='--port'", "starts with '-'", "give the value itself"),
    row("an empty extra flag value", {"serving.decode.extra_flags": '[{"name": "--seed", "value": "", "reason": "r"}]'},
        "extra flag value=''", "is empty", "give the value"),
    row("ratio below one", {"prefill_per_decode": "0"}, "prefill_per_decode=0", "at least one prefill replica", "set prefill_per_decode >= 1"),
    row("too many replicas on an instance", {"replicas_per_prefill_instance": "17"}, "replicas_per_prefill_instance=17", "1 to 16", "set it between 1 and 16"),
    row("no replica on an instance", {"replicas_per_prefill_instance": "0"}, "replicas_per_prefill_instance=0", "1 to 16", "set it between 1 and 16"),
    row("cell beyond one template", {"decode_instances": "60", "cell_nodes": "60"}, "cell_nodes=60: cell DecodeCell0 (60 nodes): about 1.",
        "MB of template (CloudFormation allows 1 MB)", "lower cell_nodes"),
    row("more cells than the stack holds", {"decode_instances": "1000", "cell_nodes": "1"}, "decode_instances=1000: 1375 instances in 1375 cells need",
        "the stack: about", "keep one stack at or below"),
    row("stack name starts with a digit", {"stack_name": "1stack"}, "stack_name='1stack'", "should match pattern", "set `stack_name` to a value of that form"),
    row("stack name with an underscore", {"stack_name": "my_stack"}, "stack_name='my_stack'", "should match pattern", "set `stack_name`"),
    row("stack name too long", {"stack_name": "S" + LONG}, "stack_name='S" + LONG[:60], "should match pattern", "set `stack_name`"),
    row("cluster name in capitals", {"cluster_name": "Prod"}, "cluster_name='Prod'", "should match pattern", "set `cluster_name`"),
    row("cluster name with a double hyphen", {"cluster_name": "a--b"}, "cluster_name='a--b'", "should match pattern", "set `cluster_name`"),
    row("cluster name ending in a hyphen", {"cluster_name": "prod-"}, "cluster_name='prod-'", "should match pattern", "set `cluster_name`"),
    row("cluster name too long", {"cluster_name": "a" * 32}, "cluster_name='" + "a" * 32, "at most 31 characters", "shorten `cluster_name`"),
    row("unknown region", {"region": "us-east-9", "availability_zone": "us-east-9a"}, "region='us-east-9'", "not a region in botocore's partition data", "use one of"),
    row("made-up region", {"region": "mars-1", "availability_zone": "mars-1a"}, "region='mars-1'", "not a region", "use one of"),
    row("region in capitals", {"region": "US-EAST-2"}, "region='US-EAST-2'", "not a region", "use one of"),
    row("AZ of another region", {"availability_zone": "eu-west-1a"}, "availability_zone='eu-west-1a'", "must be a zone of region us-east-2", "set availability_zone to e.g. us-east-2a"),
    row("AZ given as a zone id", {"availability_zone": "use2-az1"}, "availability_zone='use2-az1'", "is a zone id", "aws ec2 describe-availability-zones --zone-ids use2-az1"),
    row("AZ without its letter", {"availability_zone": "us-east-2"}, "availability_zone='us-east-2'", "must be a zone of region", "us-east-2a"),
    row("AZ with two letters", {"availability_zone": "us-east-2ab"}, "availability_zone='us-east-2ab'", "must be a zone of region", "us-east-2a"),
    row("unknown instance type", {"instance_type": "p5.48xlarge"}, "instance_type='p5.48xlarge'", "no hardware table entry", "use a known type"),
    row("MXFP4 on Trn2", {"instance_type": "trn2.48xlarge"}, "instance_type='trn2.48xlarge'", "only on Trainium3", "set serving.shape.quantization to 'bf16'"),
    row("override of an unknown field", {"instance_overrides": '{"gpus": 8}'}, "instance_overrides=['gpus']", "only hardware counts can be overridden", "use some of"),
    row("override of the type's name", {"instance_overrides": '{"name": 1}'}, "instance_overrides=['name']", "only hardware counts", "use some of"),
    row("no network card", {"instance_overrides": '{"network_cards": 0}'}, "instance_overrides.network_cards=0", "greater than 0", "set instance_overrides.network_cards to what AWS reports"),
    row("negative EFA count", {"instance_overrides": '{"efa_interfaces": -4}'}, "instance_overrides.efa_interfaces=-4", "greater than or equal to 0", "set instance_overrides.efa_interfaces"),
    row("more EFA than cards", {"instance_overrides": '{"network_cards": 8, "efa_interfaces": 16}'}, "instance_overrides.efa_interfaces=16", "at most one EFA interface per network card (8)", "set efa_interfaces <= network_cards"),
    row("no EFA at all", {"instance_overrides": '{"efa_interfaces": 0}'}, "instance_overrides.efa_interfaces=0", "runs over EFA", "at least 1"),
    row("override as text", {"instance_overrides": '{"network_cards": "eight"}'}, "instance_overrides.network_cards='eight'", "valid integer", "set `instance_overrides.network_cards` to a whole number"),
    row("override as a boolean", {"instance_overrides": '{"network_cards": true}'}, "instance_overrides.network_cards=true", "valid integer", "a whole number"),
    row("no vCPU", {"instance_overrides": '{"vcpus": 0}'}, "instance_overrides.vcpus=0", "greater than 0", "set instance_overrides.vcpus"),
    row("both AMI sources", {"ami_id": "ami-0123456789abcdef0", "ami_ssm_parameter": "/gptoss/dlami"}, "ami_id='ami-0123456789abcdef0'",
        "exactly one of ami_ssm_parameter and ami_id", "give ami_id=ami-... alone (it pins the image)"),
    row("no AMI source", {"ami_ssm_parameter": "null"}, "ami_id=null", "exactly one of ami_ssm_parameter and ami_id", "give ami_id=ami-... alone"),
    row("malformed AMI id", {"ami_id": "ami-xyz", "ami_ssm_parameter": "null"}, "ami_id='ami-xyz'", "should match pattern", "set `ami_id`"),
    row("relative SSM parameter", {"ami_ssm_parameter": "aws/service/x"}, "ami_ssm_parameter='aws/service/x'", "should match pattern", "set `ami_ssm_parameter`"),
    row("SSM parameter with a space", {"ami_ssm_parameter": "/a b"}, "ami_ssm_parameter='/a b'", "should match pattern", "set `ami_ssm_parameter`"),
    row("root volume too small", {"root_volume_gb": "100"}, "root_volume_gb=100", "at least 512 GB", "set root_volume_gb >= 512"),
    row("root volume beyond gp3", {"root_volume_gb": "20000"}, "root_volume_gb=20000", "at most 16,384 GiB", "set root_volume_gb <= 16384"),
    row("root volume as text", {"root_volume_gb": "big"}, "root_volume_gb='big'", "valid integer", "a whole number"),
    row("staging timeout too short", {"stage_timeout_s": "10"}, "stage_timeout_s='10'", "greater than or equal to 600", "raise `stage_timeout_s`"),
    row("staging timeout beyond a day", {"stage_timeout_s": "100000"}, "stage_timeout_s='100000'", "less than or equal to 86400", "lower `stage_timeout_s`"),
    row("negative staging timeout", {"stage_timeout_s": "-5"}, "stage_timeout_s='-5'", "greater than or equal to 600", "raise `stage_timeout_s`"),
    # -- capacity
    row("the old reservation key", {"capacity_reservation_id": "cr-0123456789abcdef0"}, "capacity_reservation_id='cr-0123456789abcdef0'", "moved into the capacity section", """-c capacity='{"type": "odcr", "reservation_id": "cr-0123456789abcdef0"}'"""),
    row("malformed reservation id", {"capacity.type": "odcr", "capacity.reservation_id": "cr-xyz"}, "capacity.reservation_id='cr-xyz'", "should match pattern", "set `capacity.reservation_id`"),
    row("unknown capacity type", {"capacity.type": "spot"}, "capacity.type='spot'", "should be 'on-demand', 'odcr' or 'capacity-block'", "one of the values listed"),
    row("reservation without a reserved type", {"capacity.reservation_id": "cr-0123456789abcdef0"}, "capacity.reservation_id='cr-0123456789abcdef0'", "capacity.type is on-demand", "set capacity.type to odcr or capacity-block"),
    row("block without its id", {"capacity.type": "capacity-block"}, "capacity.reservation_id=null", "a Capacity Block is used only by launches that name it, and the prefill instances have none", "set capacity.reservation_id=cr-"),
    row("targeted reservation without an id", {"capacity.type": "odcr"}, "capacity.reservation_id=null", "a targeted launch names its reservation", "or capacity.preference=open"),
    row("one role without a reservation", {"capacity": {"type": "odcr", "roles": {"decode": {"reservation_id": "cr-0123456789abcdef0"}}}}, "capacity.reservation_id=null", "the prefill instances have none", "capacity.roles.prefill.reservation_id"),
    row("reservation and group at once", {"capacity": {"type": "odcr", "reservation_id": "cr-0123456789abcdef0", "reservation_group_arn": "arn:aws:resource-groups:us-east-2:123456789012:group/g"}}, "capacity.reservation_group_arn='arn:aws:resource-groups:us-east-2:123456789012:group/g'", "one reservation or one group, not both", "remove capacity.reservation_id or capacity.reservation_group_arn"),
    row("group of another region", {"capacity": {"type": "odcr", "reservation_group_arn": "arn:aws:resource-groups:us-west-2:123456789012:group/g"}}, "capacity.reservation_group_arn='arn:aws:resource-groups:us-west-2", "launch into reservations of us-east-2", "give a resource group of us-east-2"),
    row("group that is not a group", {"capacity": {"type": "odcr", "reservation_group_arn": "arn:aws:ec2:us-east-2:123456789012:capacity-reservation/cr-1"}}, "capacity.reservation_group_arn='arn:aws:ec2", "should match pattern", "set `capacity.reservation_group_arn`"),
    row("block with open preference", {"capacity": {"type": "capacity-block", "reservation_id": "cr-0123456789abcdef0", "preference": "open"}}, "capacity.preference='open'", "used only by launches that target it", "remove capacity.preference"),
    row("block in a placement group", {"capacity": {"type": "capacity-block", "reservation_id": "cr-0123456789abcdef0", "placement_group": "pg"}}, "capacity.placement_group='pg'", "places its instances close together itself", "remove capacity.placement_group"),
    row("open preference with a group", {"capacity": {"type": "odcr", "preference": "open", "reservation_group_arn": "arn:aws:resource-groups:us-east-2:123456789012:group/g"}}, "capacity.reservation_group_arn=", "never into a named target", "set capacity.preference=targeted"),
    row("reservation for a role the recipe lacks", {"capacity": {"type": "odcr", "reservation_id": "cr-0123456789abcdef0", "roles": {"server": {"reservation_id": "cr-0123456789abcdef0"}}}}, "capacity.roles.server=", "has no server instances (its roles: prefill, decode)", "use capacity.roles.prefill or capacity.roles.decode"),
    row("unknown role", {"capacity": {"type": "odcr", "reservation_id": "cr-0123456789abcdef0", "roles": {"proxy": {}}}}, "capacity.roles.proxy", "should be 'prefill', 'decode' or 'server'", "capacity.roles"),
    row("placement group name with a space", {"capacity": {"type": "odcr", "reservation_id": "cr-0123456789abcdef0", "placement_group": "my group"}}, "capacity.placement_group='my group'", "should match pattern", "set `capacity.placement_group`"),
    row("negative hours", {"capacity": {"type": "capacity-block", "reservation_id": "cr-0123456789abcdef0", "min_hours_left": -1}}, "capacity.min_hours_left=-1", "greater than or equal to 0", "raise `capacity.min_hours_left`"),
    row("ready timeout below the boot budgets + staging + start", {"ready_timeout_s": "3600"}, "ready_timeout_s=3600", "boot retries 2950 s + staging 7200 s + server start 14400 s + the signal's margin 300 s = 24850 s", "raise ready_timeout_s to 24850 or more (or leave it unset), or set wait_for_ready=false"),
    row("ready timeout below a longer boot budget", {"ready_timeout_s": "24850", "boot": {"nvme_s": 601}}, "ready_timeout_s=24850", "boot retries 2951 s", "raise ready_timeout_s to 24851 or more"),
    row("boot budget below its bound", {"boot": {"nvme_attempts": 0}}, "boot.nvme_attempts=0", "greater than or equal to 1", "raise `boot.nvme_attempts`"),
    row("boot budget that is not a field", {"boot": {"mdadm_s": 30}}, "boot.mdadm_s=30", "is not a known setting", "remove `boot.mdadm_s`"),
    row("ready timeout beyond CloudFormation's", {"ready_timeout_s": "50000"}, "ready_timeout_s='50000'", "less than or equal to 43200", "lower `ready_timeout_s`"),
    row("limits no gate can wait for", {"stage_timeout_s": "36000"}, "stage_timeout_s=36000", "= 53650 s; CloudFormation waits 43200 s at most", "lower stage_timeout_s, VLLM_ENGINE_READY_TIMEOUT_S or the boot budgets"),
    row("limits no set gate can wait for", {"stage_timeout_s": "36000", "ready_timeout_s": "43200"}, "ready_timeout_s=43200", "= 53650 s", "lower stage_timeout_s, VLLM_ENGINE_READY_TIMEOUT_S or the boot budgets"),
    row("gate as a word", {"wait_for_ready": "maybe"}, "wait_for_ready='maybe'", "valid boolean", "set `wait_for_ready` to true or false"),
    row("log retention CloudWatch lacks", {"observability.log_retention_days": "31"}, "observability.log_retention_days=31", "is not a retention CloudWatch Logs offers", "use one of 1, 3, 5"),
    row("metrics every second", {"observability.interval_s": "5"}, "observability.interval_s='5'", "greater than or equal to 10", "raise `observability.interval_s`"),
    row("alarm topic by name", {"observability.alarm_topic_arn": "pager"}, "observability.alarm_topic_arn='pager'", "should match pattern", "set `observability.alarm_topic_arn`"),
    row("alarm topic of another region", {"observability.alarm_topic_arn": "arn:aws:sns:eu-west-1:123456789012:pager"}, "observability.alarm_topic_arn='arn:aws:sns:eu-west-1", "alarms in us-east-2 notify topics of us-east-2", "give a topic of us-east-2"),
    row("alarm e-mail without a domain", {"observability.alarm_emails": '["oncall"]'}, "observability.alarm_emails='oncall'", "is not an e-mail address", 'give addresses like "oncall@example.com"'),
    row("alarm e-mail twice", {"observability.alarm_emails": '["a@example.com", "a@example.com"]'}, "observability.alarm_emails=", "names an address twice", "give each address once"),
    row("alarm e-mails as one string", {"observability.alarm_emails": "a@example.com"}, "observability.alarm_emails='a@example.com'", "must be a list",
        """give it as JSON, e.g. -c 'observability.alarm_emails=["a@example.com"]'"""),
    row("gate packages as one file name", {"serving.proxy.gate.packages": "haproxy_2.8.16-0ubuntu0.24.04.1_amd64.deb"},
        "serving.proxy.gate.packages='haproxy_2.8.16-0ubuntu0.24.04.1_amd64.deb'", "must be a list",
        """give it as JSON, e.g. -c 'serving.proxy.gate.packages=[{"file": "haproxy_2.8.16-0ubuntu0.24.04.1_amd64.deb", "sha256": "..."}]'"""),
    row("a gate package as a bare name", {"serving.proxy.gate.packages": '["haproxy_2.8.16-0ubuntu0.24.04.1_amd64.deb"]'},
        "serving.proxy.gate.packages.0='haproxy_2.8.16-0ubuntu0.24.04.1_amd64.deb'", "must be a mapping of settings",
        """give it as JSON, e.g. -c 'serving.proxy.gate.packages=[{"file": "haproxy_2.8.16-0ubuntu0.24.04.1_amd64.deb", "sha256": "..."}]'"""),
    row("a tag longer than a file name", {"examples.ref": "v1" + "a" * 300}, "examples.ref='v1aaa", "is longer than a git tag can be (255 bytes",
        "give the tag's real name, or a 40-character commit id"),
    row("an unbounded text setting", {"examples.ref": "v1" + "a" * 24_000}, "examples.ref='v1aaa", "at most 4096 characters", "shorten `examples.ref`"),
    row("an environment value of 5,000 characters", {"serving.decode.env": {"X": {"value": "a" * 5000, "reason": "r"}}},
        "serving.decode.env.X.value='aaa", "at most 4096 characters", "shorten `serving.decode.env.X.value`"),
    row("a section as a number", {"observability": "3"}, "observability='3'", "must be a mapping of settings", "give it as JSON, e.g. -c 'observability={"),
    row("boolean as a word", {"termination_protection": "maybe"}, "termination_protection='maybe'", "valid boolean", "set `termination_protection` to true or false"),
    # -- the network
    row("IPv6 VPC", {"network": '{"vpc_cidr": "fd00::/48"}'}, "network.vpc_cidr='fd00::/48'", "is IPv6", "give an IPv4 block"),
    row("VPC too large", {"network": '{"vpc_cidr": "10.0.0.0/8"}'}, "network.vpc_cidr='10.0.0.0/8'", "AWS allows /16 to /28", "choose a prefix length from /16 to /28"),
    row("VPC too small", {"network": '{"vpc_cidr": "10.42.0.0/29"}'}, "network.vpc_cidr='10.42.0.0/29'", "AWS allows /16 to /28", "/16 to /28"),
    row("VPC with host bits", {"network": '{"vpc_cidr": "10.42.1.0/16"}'}, "network.vpc_cidr='10.42.1.0/16'", "has host bits set (the network is 10.42.0.0/16)", "write 10.42.0.0/16"),
    row("VPC not a CIDR", {"network": '{"vpc_cidr": "ten"}'}, "network.vpc_cidr='ten'", "is not a CIDR block", "give a block like 10.42.0.0/16"),
    row("loopback VPC", {"network": '{"vpc_cidr": "127.0.0.0/16"}'}, "network.vpc_cidr='127.0.0.0/16'", "loopback, link-local, multicast or reserved", "use a private range"),
    row("subnet outside the VPC", {"network": '{"subnet_cidr": "10.99.0.0/20"}'}, "network.subnet_cidr='10.99.0.0/20'", "must lie inside vpc_cidr 10.42.0.0/16", "pick a block inside"),
    row("subnet too small", {"network": '{"subnet_cidr": "10.42.0.0/29"}'}, "network.subnet_cidr='10.42.0.0/29'", "AWS allows /16 to /28", "/16 to /28"),
    row("subnet with host bits", {"network": '{"subnet_cidr": "10.42.0.7/20"}'}, "network.subnet_cidr='10.42.0.7/20'", "has host bits set", "write 10.42.0.0/20"),
    row("subnets overlap", {"network": '{"public_subnet_cidr": "10.42.1.0/28"}'}, "network.public_subnet_cidr='10.42.1.0/28'", "overlaps subnet_cidr", "pick disjoint blocks"),
    row("public subnet outside the VPC", {"network": '{"public_subnet_cidr": "10.43.0.0/28"}'}, "network.public_subnet_cidr='10.43.0.0/28'", "must lie inside vpc_cidr", "pick a block inside"),
    row("subnet too small for the fleet", {"decode_instances": "8", "network": '{"subnet_cidr": "10.42.0.0/28"}'}, "network.subnet_cidr='10.42.0.0/28'", "the fleet needs 19 (11 nodes, 8 for the load balancer)", "use a /27 or larger subnet"),
    row("half an existing network", {"network": '{"vpc_id": "vpc-0123456789abcdef0"}'}, "network.vpc_id='vpc-0123456789abcdef0'", "needs both vpc_id and subnet_id", "set both network.vpc_id and network.subnet_id"),
    row("subnet without its VPC", {"network": '{"subnet_id": "subnet-0123456789abcdef0"}'}, "network.subnet_id='subnet-0123456789abcdef0'", "needs both", "set both"),
    row("malformed VPC id", {"network": '{"vpc_id": "vpc-1", "subnet_id": "subnet-0123456789abcdef0"}'}, "network.vpc_id='vpc-1'", "should match pattern", "set `network.vpc_id`"),
    row("existing VPC with a CIDR", {"network": '{"vpc_id": "vpc-0123456789abcdef0", "subnet_id": "subnet-0123456789abcdef0", "vpc_cidr": "10.9.0.0/16"}'}, "network.vpc_cidr='10.9.0.0/16'", "describes a new VPC", "remove network.vpc_cidr"),
    row("existing VPC without egress or S3 route", {"network": '{"vpc_id": "vpc-0123456789abcdef0", "subnet_id": "subnet-0123456789abcdef0", "egress": "none"}', "model": '{"source": "s3", "s3_uri": "s3://models-bucket/gpt-oss-120b"}', "examples": '{"s3_uri": "s3://models-bucket/vllm-neuron"}'}, "network.route_table_id=null", "reach S3 only through a gateway endpoint", "set network.route_table_id=rtb-..."),
    row("route table of a new VPC", {"network": '{"route_table_id": "rtb-0123456789abcdef0"}'}, "network.route_table_id='rtb-0123456789abcdef0'", "belongs to an existing VPC", "remove network.route_table_id"),
    row("unknown egress", {"network": '{"egress": "public"}'}, "network.egress='public'", "should be 'nat' or 'none'", "set `network.egress` to one of the values listed"),
    row("no egress but Hugging Face", {"network.egress": "none"}, "model.source='huggingface'", "cannot reach Hugging Face or GitHub", "stage the checkpoint and the examples in S3"),
    row("no egress without examples in S3", {"network.egress": "none", "model": '{"source": "s3", "s3_uri": "s3://models-bucket/gpt-oss-120b"}'}, "examples.s3_uri=null", "cannot reach Hugging Face or GitHub", "examples.s3_uri"),
    row("no egress and no S3 endpoint", {"network": '{"egress": "none", "s3_gateway_endpoint": false}', "model": '{"source": "s3", "s3_uri": "s3://models-bucket/gpt-oss-120b"}', "examples": '{"s3_uri": "s3://models-bucket/vllm-neuron"}'}, "network.s3_gateway_endpoint=false", "only through the gateway endpoint", "set network.s3_gateway_endpoint=true"),
    row("unknown flow-log filter", {"network.flow_logs_traffic": "SOME"}, "network.flow_logs_traffic='SOME'", "should be 'REJECT' or 'ALL'", "one of the values listed"),
    row("proxy open to the world", {"proxy_ingress_cidr": "0.0.0.0/0"}, "proxy_ingress_cidr='0.0.0.0/0'", "refused (no public ingress)", "give your office or VPN CIDR"),
    row("proxy open to a sixteenth of the internet", {"proxy_ingress_cidr": "0.0.0.0/4"}, "proxy_ingress_cidr='0.0.0.0/4'", "wider than /8", "(/8 or narrower)"),
    row("IPv6 operator network", {"proxy_ingress_cidr": "::/0"}, "proxy_ingress_cidr='::/0'", "is IPv6", "give an IPv4 block"),
    row("operator CIDR with host bits", {"proxy_ingress_cidr": "203.0.113.5/24"}, "proxy_ingress_cidr='203.0.113.5/24'", "has host bits set", "write 203.0.113.0/24"),
    row("operator CIDR not a CIDR", {"proxy_ingress_cidr": "office"}, "proxy_ingress_cidr='office'", "is not a CIDR block", "give a block like"),
    row("CIDR and prefix list", {"proxy_ingress_cidr": "203.0.113.0/24", "proxy_ingress_prefix_list_id": "pl-0123456789abcdef0"}, "proxy_ingress_prefix_list_id='pl-0123456789abcdef0'", "not both", "unset one of"),
    row("malformed prefix list", {"proxy_ingress_prefix_list_id": "pl-1"}, "proxy_ingress_prefix_list_id='pl-1'", "should match pattern", "set `proxy_ingress_prefix_list_id`"),
    # -- model, examples and S3
    row("S3 model without a location", {"model": '{"source": "s3"}'}, "model.s3_uri=null", "needs the S3 location", "set model.s3_uri"),
    row("invalid bucket", {"model": '{"source": "s3", "s3_uri": "s3://My_Bucket/x"}'}, "model.s3_uri='s3://My_Bucket/x'", "is not a valid S3 bucket name", "use 3-63 lowercase letters"),
    row("not an S3 location", {"model": '{"source": "s3", "s3_uri": "https://bucket/x"}'}, "model.s3_uri='https://bucket/x'", "must be an s3:// location", "give s3://bucket/prefix"),
    row("checkpoint at a bucket root", {"model": '{"source": "s3", "s3_uri": "s3://models-bucket"}'}, "model.s3_uri='s3://models-bucket'", "not at the bucket root", "give s3://bucket/prefix"),
    row("prefix with a trailing slash", {"model": '{"source": "s3", "s3_uri": "s3://models-bucket/x/"}'}, "model.s3_uri='s3://models-bucket/x/'", "no trailing '/'", "write it as s3://models-bucket/x"),
    row("prefix with a double slash", {"model": '{"source": "s3", "s3_uri": "s3://models-bucket/a//b"}'}, "model.s3_uri='s3://models-bucket/a//b'", "no '//'", "write it as s3://models-bucket/a//b"),
    row("prefix with a space", {"model": '{"source": "s3", "s3_uri": "s3://models-bucket/a b"}'}, "model.s3_uri='s3://models-bucket/a b'", "S3's safe characters", "write it as"),
    row("prefix with a quote", {"model": '{"source": "s3", "s3_uri": "s3://models-bucket/it\'s"}'}, "model.s3_uri=", "S3's safe characters", "write it as"),
    row("bucket named like an address", {"model": '{"source": "s3", "s3_uri": "s3://192.168.1.1/x"}'}, "model.s3_uri='s3://192.168.1.1/x'", "is not a valid S3 bucket name", "use 3-63"),
    row("unknown model source", {"model": '{"source": "gcs"}'}, "model.source='gcs'", "should be 'huggingface' or 's3'", "one of the values listed"),
    row("malformed secret ARN", {"model": '{"hf_token_secret_arn": "hf-token"}'}, "model.hf_token_secret_arn='hf-token'", "should match pattern", "set `model.hf_token_secret_arn`"),
    row("secret in another region", {"model": '{"hf_token_secret_arn": "arn:aws:secretsmanager:eu-west-1:123456789012:secret:hf-AbCdEf"}'}, "model.hf_token_secret_arn='arn:aws:secretsmanager:eu-west-1", "ask Secrets Manager in their own region (us-east-2", "replicate the secret to us-east-2"),
    row("no shard expected", {"model": '{"expected_shards": 0}'}, "model.expected_shards=0", "greater than 0", "raise `model.expected_shards`"),
    row("moving examples branch", {"examples.ref": "main"}, "examples.ref='main'", "looks like a branch (a moving target", "pin a release tag"),
    row("develop branch", {"examples.ref": "develop"}, "examples.ref='develop'", "looks like a branch", "pin a release tag"),
    row("branch ref", {"examples.ref": "refs/heads/release-2.33"}, "examples.ref='refs/heads/release-2.33'", "names a branch or another moving ref", "pin a tag"),
    row("ref that is an option", {"examples.ref": "-oops1"}, "examples.ref='-oops1'", "is not a valid git tag name", "give a tag such as"),
    row("ref with a slash", {"examples.ref": "feature/x1"}, "examples.ref='feature/x1'", "is not a valid git tag name", "give a tag such as"),
    row("ref with two dots", {"examples.ref": "v1..2"}, "examples.ref='v1..2'", "is not a valid git tag name", "give a tag"),
    row("empty ref", {"examples.ref": ""}, "examples.ref=''", "at least 1 character", "set `examples.ref`"),
    row("plain HTTP repository", {"examples.repo_url": "http://github.com/vllm-project/vllm-neuron.git"}, "examples.repo_url='http://github.com", "must be an https:// URL", "give the repository's https:// URL"),
    row("SSH repository", {"examples.repo_url": "git@github.com:vllm-project/vllm-neuron.git"}, "examples.repo_url='git@github.com", "must be an https:// URL", "https://"),
    row("repository URL with a token", {"examples.repo_url": "https://user:tok@github.com/x.git"}, "examples.repo_url='https://user:tok@github.com/x.git'", "holds credentials", "use a public URL"),
    row("repository URL with a space", {"examples.repo_url": "https://github.com/a b.git"}, "examples.repo_url='https://github.com/a b.git'", "is not a plain https:// URL", "https:// URL"),
    row("examples at a bucket root", {"examples.s3_uri": "s3://models-bucket"}, "examples.s3_uri='s3://models-bucket'", "not at the bucket root", "give s3://bucket/prefix"),
    row("results at a bucket root", {"results_s3_uri": "s3://results-bucket"}, "results_s3_uri='s3://results-bucket'", "a bucket root would open the whole bucket", "give a prefix of its own, e.g. s3://results-bucket/results"),
    row("cache at a bucket root", {"compile_cache_s3_uri": "s3://cache-bucket"}, "compile_cache_s3_uri='s3://cache-bucket'", "a bucket root would open the whole bucket", "e.g. s3://cache-bucket/neuron-cache"),
    row("results inside the checkpoint", {"model": '{"source": "s3", "s3_uri": "s3://bk1/models"}', "results_s3_uri": "s3://bk1/models/results"}, "results_s3_uri='s3://bk1/models/results'", "overlaps model.s3_uri (s3://bk1/models); nodes get write access", "give each location a prefix of its own"),
    row("cache holding the examples", {"examples.s3_uri": "s3://bk1/cache/vllm-neuron", "compile_cache_s3_uri": "s3://bk1/cache"}, "compile_cache_s3_uri='s3://bk1/cache'", "overlaps examples.s3_uri", "a prefix of its own"),
    row("results inside the cache", {"compile_cache_s3_uri": "s3://bk1/cache", "results_s3_uri": "s3://bk1/cache/results"}, "results_s3_uri='s3://bk1/cache/results'", "overlaps compile_cache_s3_uri", "a prefix of its own"),
    row("KMS alias instead of a key", {"kms_key_arns": '["alias/s3"]'}, "kms_key_arns='alias/s3'", "is not a KMS key ARN", "give arn:aws:kms:REGION:ACCOUNT:key/KEY-ID"),
    row("KMS key of another region", {"kms_key_arns": '["arn:aws:kms:eu-west-1:123456789012:key/0123abcd-0123-4567-89ab-0123456789ab"]'}, "kms_key_arns='arn:aws:kms:eu-west-1", "S3 in us-east-2 uses keys of us-east-2", "give the key of the bucket in us-east-2"),
    # -- paths on the node
    row("relative NVMe mount", {"nvme_mount": "data/nvme"}, "nvme_mount='data/nvme'", "must be an absolute path", "start it with /"),
    row("NVMe mounted over the root", {"nvme_mount": "/"}, "nvme_mount='/'", "is a system directory", "use a directory of its own"),
    row("NVMe mounted over /opt", {"nvme_mount": "/opt"}, "nvme_mount='/opt'", "is a system directory", "/opt/gptoss"),
    row("NVMe mounted over /etc", {"nvme_mount": "/etc"}, "nvme_mount='/etc'", "is a system directory", "use a directory of its own"),
    row("NVMe path with ..", {"nvme_mount": "/data/../etc"}, "nvme_mount='/data/../etc'", "must be a normalized path", "write it as /data/../etc"),
    row("NVMe path with a trailing slash", {"nvme_mount": "/data/nvme/"}, "nvme_mount='/data/nvme/'", "must be a normalized path", "write it as /data/nvme"),
    row("NVMe path with a specifier", {"nvme_mount": "/data/%i"}, "nvme_mount='/data/%i'", "no %, $, spaces", "rename the directory"),
    row("NVMe path with a variable", {"nvme_mount": "/data/${HOME}"}, "nvme_mount='/data/${HOME}'", "no %, $, spaces", "rename the directory"),
    row("NVMe path with a space", {"nvme_mount": "/data/my nvme"}, "nvme_mount='/data/my nvme'", "no %, $, spaces", "rename the directory"),
    row("NVMe over the project's files", {"nvme_mount": "/opt/gptoss"}, "nvme_mount='/opt/gptoss'", "overlaps /opt/gptoss", "choose a directory outside it"),
    row("NVMe over the DLAMI venv", {"venv_glob": "/data/venv*", "nvme_mount": "/data"}, "nvme_mount='/data'", "overlaps /data/venv", "choose a directory outside it"),
    row("NVMe path too long", {"nvme_mount": "/" + "n" * 200}, "nvme_mount='/nnn", "longer than 200 characters", "choose a shorter path"),
    row("results in /root itself", {"results_dir": "/root"}, "results_dir='/root'", "is a system directory", "use a directory of its own below it, e.g. /root/gptoss"),
    row("results among the project's files", {"results_dir": "/etc/gptoss/results"}, "results_dir='/etc/gptoss/results'", "overlaps /etc/gptoss", "choose a directory outside it"),
    row("relative results directory", {"results_dir": "results"}, "results_dir='results'", "must be an absolute path", "start it with /"),
    row("relative venv glob", {"venv_glob": "venv*"}, "venv_glob='venv*'", "must be an absolute path", "start it with /"),
    row("venv glob at a system directory", {"venv_glob": "/usr"}, "venv_glob='/usr'", "is a system directory", "use a directory of its own"),
    row("venv glob with a variable", {"venv_glob": "/opt/$VENV*"}, "venv_glob='/opt/$VENV*'", "no %, $, spaces", "rename the directory"),
    row("result file with a directory", {"serving": {"bench": {"result_file": "out/bench.json"}}}, "serving.bench.result_file='out/bench.json'", "must be a file name", "give only the name"),
    row("result file ..", {"serving": {"bench": {"result_file": ".."}}}, "serving.bench.result_file='..'", "must be a file name", "give only the name"),
    row("both legs in one file", {"serving": {"bench": {"warmup_result_file": "bench_clean.json"}}}, "serving.bench.warmup_result_file='bench_clean.json'", "would overwrite the measured result", "different file names"),
    row("relative netrc", {"serving": {"bench": {"netrc": "netrc"}}}, "serving.bench.netrc='netrc'", "must be an absolute path", "start it with /"),
    # -- serving
    row("decode batch above the partition cap", {"serving": {"decode": {"max_num_seqs": 16}}}, "serving.decode.max_num_seqs=16", "128*TP/EP = 8 for TP8 EP128", "set max_num_seqs <= 8"),
    row("EP is not TP x DP on decode", {"serving": {"decode": {"data_parallel": 8}}}, "serving.decode.ep_degree=128", "must equal TP x DP = 8 x 8 = 64", "set ep_degree to 64"),
    row("lm_head not over every DP rank", {"serving": {"decode": {"lm_head_dp_size": 8}}}, "serving.decode.lm_head_dp_size=8", "must equal data_parallel=16", "set lm_head_dp_size to 16"),
    row("port collision", {"serving": {"proxy": {"port": 8103}}}, "serving.prefill.http_port_base=8100", "collide with 8103-8103 (serving.proxy.port)", "move one of the two port bases"),
    row("side channel over the decode port", {"serving": {"decode": {"side_channel_port": 6500}}}, "serving.prefill.side_channel_port_base=6559", "collide with 6500-6627 (serving.decode.side_channel_port)", "move one of the two port bases"),
    row("privileged port", {"serving": {"proxy": {"port": 80}}}, "serving.proxy.port=80", "greater than or equal to 1024", "raise `serving.proxy.port`"),
    row("port beyond 65535", {"serving": {"decode": {"http_port": 70000}}}, "serving.decode.http_port=70000", "less than or equal to 65535", "lower `serving.decode.http_port`"),
    row("group health on the proxy's port", {"serving": {"proxy": {"group_health_port": 8000}}}, "serving.proxy.group_health_port=8000", "collide with 8000-8000 (serving.proxy.port)", "move one of the two port bases"),
    row("env table sets a derived variable", {"serving": {"common_env": {"NEURON_LOGICAL_NC_CONFIG": {"value": "2", "reason": "x"}, "VLLM_ENGINE_READY_TIMEOUT_S": {"value": "14400", "reason": "x"}}}}, "serving.common_env=['NEURON_LOGICAL_NC_CONFIG']", "derived from typed fields", "remove them"),
    row("env name starting with a digit", {"serving": {"decode": {"env": {"1BAD": ENV}}}}, "serving.decode.env.1BAD='1BAD'", "is not a valid environment variable name", "use letters, digits and _"),
    row("env name of the project's own", {"serving": {"decode": {"env": {"GPTOSS_X": ENV}}}}, "serving.decode.env.GPTOSS_X='GPTOSS_X'", "the project's own", "choose another name"),
    row("env value with a newline", {"serving": {"decode": {"env": {"X": {"value": "a\nb", "reason": "r"}}}}}, "serving.decode.env.X.value='a\\nb'", "holds the control character '\\n'", "remove it"),
    row("env value with a quote", {"serving": {"decode": {"env": {"X": {"value": "it's", "reason": "r"}}}}}, "serving env value=", "holds a single quote", "remove it"),
    row("negative ready timeout", {"serving": {"common_env": {"VLLM_ENGINE_READY_TIMEOUT_S": {"value": "-1", "reason": "r"}}}}, "serving.common_env.VLLM_ENGINE_READY_TIMEOUT_S='-1'", "a whole number of seconds from 1 to 43200", "systemd drop the unit's timeouts"),
    row("ready timeout with a unit", {"serving": {"common_env": {"VLLM_ENGINE_READY_TIMEOUT_S": {"value": "4h", "reason": "r"}}}}, "serving.common_env.VLLM_ENGINE_READY_TIMEOUT_S='4h'", "a whole number of seconds", "set it to a positive whole number"),
    row("zero compile timeout", {"serving": {"common_env": {"VLLM_ENGINE_READY_TIMEOUT_S": {"value": "14400", "reason": "r"}, "NEURON_LIBTORCH_COMPILATION_TIMEOUT": {"value": "0", "reason": "r"}}}}, "serving.common_env.NEURON_LIBTORCH_COMPILATION_TIMEOUT='0'", "from 1 to 43200", "a positive whole number"),
    row("ready timeout removed", {"serving.common_env.VLLM_ENGINE_READY_TIMEOUT_S": "null"}, "serving.common_env=[", "VLLM_ENGINE_READY_TIMEOUT_S is required", "add VLLM_ENGINE_READY_TIMEOUT_S"),
    row("extra flag without dashes", {"serving": {"decode": {"extra_flags": [{"name": "-x", "reason": "r"}]}}}, "serving.decode.extra_flags.0.name='-x'", "should match pattern", "set `serving.decode.extra_flags.0.name`"),
    row("extra flag the spec models", {"serving": {"decode": {"extra_flags": [{"name": "--max-num-seqs", "value": "4", "reason": "r"}]}}}, "serving.decode.extra_flags='--max-num-seqs'", "sets this flag from a typed field", "set the typed field under serving.*"),
    row("extra flag value with a quote", {"serving": {"prefill": {"extra_flags": [{"name": "--x", "value": "it's", "reason": "r"}]}}}, "extra flag value=", "holds a single quote", "remove it"),
    row("extra flag value with a backslash", {"serving": {"prefill": {"extra_flags": [{"name": "--x", "value": "a\\b", "reason": "r"}]}}}, "extra flag value=", "holds a backslash", "remove it"),
    row("extra flag value --", {"serving": {"prefill": {"extra_flags": [{"name": "--x", "value": "--", "reason": "r"}]}}}, "extra flag value='--'", "ends the wrappers' own arguments", "pass the flag's real value"),
    row("extra flag given twice", {"serving": {"prefill": {"extra_flags": [{"name": "--x", "reason": "r"}, {"name": "--x", "reason": "r"}]}}}, "serving.prefill.extra_flags='--x'", "is given twice", "keep one"),
    row("extra flag without a reason", {"serving": {"prefill": {"extra_flags": [{"name": "--x", "reason": ""}]}}}, "serving.prefill.extra_flags.0.reason=''", "at least 1 character", "set `serving.prefill.extra_flags.0.reason`"),
    row("replica cores do not divide the instance", {"serving": {"prefill": {"tensor_parallel": 3}}}, "serving.prefill.tensor_parallel=3", "must divide the 64 logical cores of trn3.48xlarge at LNC=2", "choose a tensor_parallel that divides it"),
    row("decode larger than an instance", {"serving": {"decode": {"data_parallel": 32, "ep_degree": 256, "lm_head_dp_size": 32, "max_num_seqs": 4}}}, "serving.decode.data_parallel=32", "needs 256 logical cores", "lower data_parallel or tensor_parallel"),
    row("context too short for the shape", {"serving": {"shape": {"max_model_len": 9000}}}, "serving.shape.max_model_len=9000", "must hold max_num_batched_tokens + 1024 output tokens = 9216", "set max_model_len >= 9216"),
    row("unknown KV cache type", {"serving": {"shape": {"kv_cache_dtype": "fp16"}}}, "serving.shape.kv_cache_dtype='fp16'", "should be 'fp8'", "one of the values listed"),
    row("unknown quantization", {"serving": {"shape": {"quantization": "int4"}}}, "serving.shape.quantization='int4'", "should be 'mxfp4' or 'bf16'", "one of the values listed"),
    row("HF overrides with a quote", {"serving": {"shape": {"hf_overrides": {"note": "it's"}}}}, "serving.shape.hf_overrides=", "holds a single quote", "remove it"),
    row("proxy bound to a name", {"serving": {"proxy": {"bind_host": "localhost"}}}, "serving.proxy.bind_host='localhost'", "must be an IPv4 address", "use 0.0.0.0"),
    row("absolute proxy script", {"serving": {"proxy": {"script": "/tmp/proxy.py"}}}, "serving.proxy.script='/tmp/proxy.py'", "a relative path inside the vLLM Neuron repository", "give the path as in the repository"),
    row("proxy script outside the repository", {"serving": {"proxy": {"script": "../proxy.py"}}}, "serving.proxy.script='../proxy.py'", "no '..'", "give the path as in the repository"),
    row("health route without a slash", {"serving": {"proxy": {"health_path": "healthcheck"}}}, "serving.proxy.health_path='healthcheck'", "must be an HTTP path starting with /", "give a route like /health"),
    row("model id without its org", {"serving": {"model_id": "gpt-oss-120b"}}, "serving.model_id='gpt-oss-120b'", "is not a Hugging Face model id", "give e.g. openai/gpt-oss-120b"),
    row("model id with ..", {"serving": {"model_id": "openai/../x"}}, "serving.model_id='openai/../x'", "is not a Hugging Face model id", "openai/gpt-oss-120b"),
    row("absolute examples directory", {"serving": {"examples_dir": "/opt/x"}}, "serving.examples_dir='/opt/x'", "a relative path inside the vLLM Neuron repository", "give the path as in the repository"),
    row("schedule given as a path", {"serving": {"decode": {"schedule_file": "../x.json"}}}, "serving.decode.schedule_file='../x.json'", "must be a file name", "give only the name"),
    row("megakernel scope as a word", {"serving": {"decode": {"megakernel_scope": "big"}}}, "serving.decode.megakernel_scope='big'", "should match pattern", "set `serving.decode.megakernel_scope`"),
    row("zero tail hop", {"serving": {"decode": {"tail_hops": [0]}}}, "serving.decode.tail_hops.0=0", "greater than 0", "raise `serving.decode.tail_hops.0`"),
    row("NIXL backend in lower case", {"serving": {"shape": {"nixl_backends": ["efa"]}}}, "serving.shape.nixl_backends.0='efa'", "should match pattern", "set `serving.shape.nixl_backends.0`"),
    row("optimization level 5", {"serving": {"decode": {"optimization_level": 5}}}, "serving.decode.optimization_level=5", "less than or equal to 3", "lower `serving.decode.optimization_level`"),
    row("LNC 3", {"serving": {"prefill": {"lnc": 3}}}, "serving.prefill.lnc=3", "should be 1 or 2", "one of the values listed"),
    # -- the second hostile sweep's classes (issue 24): one line of printable text everywhere,
    # ASCII digits, full matches, bounded sizes, flags and variables the units own
    row("health path ending in a newline", {"serving": {"server_health_path": "/health\n"}}, "serving.server_health_path='/health\\n'", "holds the control character '\\n' at position 7", "remove it"),
    row("env name ending in a newline", {"serving": {"decode": {"env": {"FOO\n": ENV}}}}, "serving.decode.env (a name in it)='FOO\\n'", "holds the control character", "remove it"),
    row("nvme mount with a tab", {"nvme_mount": "/opt/dlami/\tnvme"}, "nvme_mount='/opt/dlami/\\tnvme'", "holds the control character '\\t'", "remove it"),
    row("line separator in a reason", {"serving": {"decode": {"env": {"X": {"value": "1", "reason": "a\u2028b"}}}}}, "serving.decode.env.X.reason=", "holds the control character", "remove it"),
    row("flag value not UTF-8", {"serving": {"decode": {"extra_flags": [{"name": "--x", "value": "a\udcffb", "reason": "r"}]}}}, "serving.decode.extra_flags[0].value=", "is not valid UTF-8 text", "give the value as UTF-8 text"),
    row("KMS account in Arabic-Indic digits", {"kms_key_arns": ["arn:aws:kms:us-east-2:\u0661\u0662\u0663\u0664\u0665\u0666\u0667\u0668\u0669\u0660\u0661\u0662:key/0123abcd-0123-4567-89ab-0123456789ab"]}, "kms_key_arns='arn:aws:kms:us-east-2:", "is not a KMS key ARN", "give arn:aws:kms:REGION:ACCOUNT:key/KEY-ID"),
    row("KMS key with a trailing newline", {"kms_key_arns": ["arn:aws:kms:us-east-2:123456789012:key/0123abcd-0123-4567-89ab-0123456789ab\n"]}, "kms_key_arns[0]=", "holds the control character '\\n'", "remove it"),
    row("KMS key id not a UUID", {"kms_key_arns": ["arn:aws:kms:us-east-2:123456789012:key/------------------------------------"]}, "kms_key_arns=", "is not a KMS key ARN", "give arn:aws:kms"),
    row("more KMS keys than IAM holds", {"kms_key_arns": [f"arn:aws:kms:us-east-2:123456789012:key/0123abcd-0123-4567-89ab-{i:012x}" for i in range(65)]}, "kms_key_arns='65 keys'", "IAM caps at 10,240", "list only the keys"),
    row("secret in another script's digits", {"model": {"source": "huggingface", "hf_token_secret_arn": "arn:aws:secretsmanager:us-east-2:\u0661\u0662\u0663\u0664\u0665\u0666\u0667\u0668\u0669\u0660\u0661\u0662:secret:hf"}}, "model.hf_token_secret_arn=", "should match pattern", "set `model.hf_token_secret_arn` to a value of that form"),
    row("a list where the recipe name goes", {"recipe": ["gptoss-20b-di"]}, "recipe=['gptoss-20b-di']", "is not a recipe", "use one of"),
    row("lists nested without end", {"serving": "[" * 5000 + "]" * 5000}, "serving: nests lists or mappings too deeply", "too deeply to read", "quote names"),
    row("a number with an underscore", {"decode_instances": "1_0"}, "decode_instances='1_0'", "a number with an underscore or a leading zero", "without underscores or leading zeros"),
    row("a number with a leading zero", {"prefill_per_decode": "010"}, "prefill_per_decode='010'", "octal", "without underscores or leading zeros"),
    row("extra flag as a prefix of a modeled one", {"serving": {"decode": {"extra_flags": [{"name": "--max-num-seq", "value": "16", "reason": "r"}]}}}, "serving.decode.extra_flags='--max-num-seq'", "(vLLM reads it as --max-num-seqs)", "set the typed field"),
    row("extra flag as a prefix of the port", {"serving": {"prefill": {"extra_flags": [{"name": "--por", "value": "9000", "reason": "r"}]}}}, "serving.prefill.extra_flags='--por'", "(vLLM reads it as --port)", "set the typed field"),
    row("extra flag negating a modeled one", {"serving": {"decode": {"extra_flags": [{"name": "--no-enable-prefix-caching", "reason": "r"}]}}}, "serving.decode.extra_flags='--no-enable-prefix-caching'", "sets this flag from a typed field", "set the typed field"),
    row("extra flag the positive of a modeled negation", {"serving": {"decode": {"extra_flags": [{"name": "--disable-hybrid-kv-cache-manager", "reason": "r"}]}}}, "serving.decode.extra_flags='--disable-hybrid-kv-cache-manager'", "sets this flag from a typed field", "set the typed field"),
    row("extra flag renaming the model", {"serving": {"decode": {"extra_flags": [{"name": "--served-model-name", "value": "gpt", "reason": "r"}]}}}, "serving.decode.extra_flags='--served-model-name'", "the units set this flag themselves", "remove it"),
    row("extra flag reading flags from a file", {"serving": {"prefill": {"extra_flags": [{"name": "--config", "value": "/tmp/x.yaml", "reason": "r"}]}}}, "serving.prefill.extra_flags='--config'", "the units set this flag themselves", "remove it"),
    row("env table replacing PATH", {"serving": {"decode": {"env": {"PATH": {"value": "/tmp", "reason": "r"}}}}}, "serving.decode.env=['PATH']", "the units and the venv set these", "remove them"),
    row("env table binding NeuronCores", {"serving": {"common_env": {"NEURON_RT_VISIBLE_CORES": {"value": "0-3", "reason": "r"}}}}, "serving.common_env=['NEURON_RT_VISIBLE_CORES']", "the NeuronCores a server binds", "remove them"),
    row("IAM wildcard in an S3 location", {"compile_cache_s3_uri": "s3://shared-bucket/*"}, "compile_cache_s3_uri='s3://shared-bucket/*'", "IAM reads as a wildcard", "name one prefix without '*' (e.g. s3://shared-bucket/gptoss)"),
    row("wildcard covering the model prefix", {"model": '{"source": "s3", "s3_uri": "s3://models-bucket/models"}', "results_s3_uri": "s3://models-bucket/m*"}, "results_s3_uri='s3://models-bucket/m*'", "every prefix it matches", "s3://models-bucket/m)"),
    row("dot-dot segment in an S3 prefix", {"compile_cache_s3_uri": "s3://cache-bucket/a/../model"}, "compile_cache_s3_uri='s3://cache-bucket/a/../model'", "a '.' or '..' segment", "s3://cache-bucket/a/model"),
    row("leading double slash in an S3 prefix", {"results_s3_uri": "s3://results-bucket//runs"}, "results_s3_uri='s3://results-bucket//runs'", "no '//'", "s3://results-bucket/runs"),
    row("S3 directory bucket", {"compile_cache_s3_uri": "s3://cache--use2-az1--x-s3/c"}, "compile_cache_s3_uri='s3://cache--use2-az1--x-s3/c'", "S3 directory bucket (S3 Express One Zone)", "use a general purpose bucket"),
    row("examples over SSH's port", {"examples.repo_url": "https://github.com:22/vllm-project/vllm-neuron.git"}, "examples.repo_url='https://github.com:22/vllm-project/vllm-neuron.git'", "uses port 22", "port 443"),
    row("short commit id", {"examples.ref": "3f9c2ab"}, "examples.ref='3f9c2ab'", "not a full lowercase one", "40-character commit id in lowercase"),
    row("upper-case commit id", {"examples.ref": "3F9C2AB" + "0" * 33}, "examples.ref='3F9C2AB" + "0" * 33 + "'", "not a full lowercase one", "git rev-parse REF"),
    row("model pinned by a branch", {"model.revision": "main"}, "model.revision='main'", "is not a commit id", "40-character lowercase commit id"),
    row("model pinned by a short commit", {"model.revision": "3f9c2ab"}, "model.revision='3f9c2ab'", "is not a commit id", "40-character lowercase commit id"),
    row("model revision for an S3 checkpoint", {"model": '{"source": "s3", "s3_uri": "s3://models-bucket/gpt-oss-120b", "revision": "bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb"}'}, "model.revision='bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb'", "applies to the Hub", "unset model.revision"),
    row("examples commit too short", {"examples.commit": "3f9c2ab"}, "examples.commit='3f9c2ab'", "is not a full commit id", "git rev-parse <tag>^{commit}"),
    row("examples commit against a commit ref", {"examples": '{"ref": "cccccccccccccccccccccccccccccccccccccccc", "commit": "dddddddddddddddddddddddddddddddddddddddd"}'}, "examples.commit='dddddddddddddddddddddddddddddddddddddddd'", "differs from examples.ref", "give one commit id"),
    row("NIXL pinned by a range", {"nixl.requirements": '["nixl>=1.5"]'}, "nixl.requirements='nixl>=1.5'", "is not one package pinned by version and hash", "name==version --hash=sha256:"),
    row("NIXL pinned without a hash", {"nixl.requirements": '["nixl==1.5.1"]'}, "nixl.requirements='nixl==1.5.1'", "is not one package pinned by version and hash", "--hash=sha256:<64 lowercase hex>"),
    row("NIXL requirements without NIXL", {"nixl.requirements": '["nixl-cu12==1.5.1 --hash=sha256:aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"]'}, "nixl.requirements=", "pins other packages but not nixl itself", "add a line nixl==<version>"),
    row("NIXL named twice", {"nixl.requirements": '["nixl==1.5.1 --hash=sha256:aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa", "NIXL==1.5.0 --hash=sha256:aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"]'}, "nixl.requirements=", "names a package twice", "one line per package"),
    row("pinned NIXL with no egress", {"network": '{"egress": "none"}', "model": '{"source": "s3", "s3_uri": "s3://models-bucket/gpt-oss-120b"}', "examples": '{"s3_uri": "s3://models-bucket/vllm-neuron"}', "nixl.requirements": '["nixl==1.5.1 --hash=sha256:aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"]'}, "nixl.requirements=", "cannot reach PyPI", "network.egress='nat'"),
    row("gate retries over two", {"serving.proxy.gate.retries": "3"}, "serving.proxy.gate.retries='3'", "less than or equal to 2", "lower `serving.proxy.gate.retries`"),
    row("gate buffer under a request head and its rewrites", {"serving.proxy.gate.buffer_kib": "16"}, "serving.proxy.gate.buffer_kib='16'", "greater than or equal to 32", "raise `serving.proxy.gate.buffer_kib`"),
    row("proxy back-off ceiling below its base", {"serving": {"proxy": {"restart_backoff_s": 10, "restart_backoff_max_s": 5}}}, "serving.proxy.restart_backoff_max_s=5", "is below restart_backoff_s=10", "raise it or lower restart_backoff_s"),
    row("an S3 prefix list with NAT egress", {"network": '{"s3_prefix_list_id": "pl-7ba54012"}'}, "network.s3_prefix_list_id='pl-7ba54012'",
        "not S3 alone", "use network.egress=none"),
    row("an S3 prefix list that is not one", {"network": '{"egress": "none", "s3_prefix_list_id": "sg-7ba54012"}', "model": '{"source": "s3", "s3_uri": "s3://models-bucket/gpt-oss-120b"}',
        "examples": '{"s3_uri": "s3://models-bucket/vllm-neuron"}'}, "network.s3_prefix_list_id='sg-7ba54012'", "should match pattern", "set `network.s3_prefix_list_id`"),
    row("no egress and no SSM endpoints", {"network": '{"egress": "none", "ssm_endpoints": false}', "model": '{"source": "s3", "s3_uri": "s3://models-bucket/gpt-oss-120b"}', "examples": '{"s3_uri": "s3://models-bucket/vllm-neuron"}'}, "network.ssm_endpoints=false", "only through the interface endpoints", "remove network.ssm_endpoints"),
    row("netmask instead of a prefix length", {"proxy_ingress_cidr": "10.0.0.0/255.0.0.0"}, "proxy_ingress_cidr='10.0.0.0/255.0.0.0'", "not written as address/prefix length", "write 10.0.0.0/8"),
    row("a yes where a count belongs", {"decode_instances": "true"}, "decode_instances=true", "is a yes/no, not a number", "give decode_instances as a number (e.g. 1)"),
    row("a no deep in a section", {"serving": {"decode": {"max_num_seqs": False}}}, "serving.decode.max_num_seqs=false", "is a yes/no, not a number", "as a number (e.g. 8)"),
    row("load balancer over a single-instance recipe", {"recipe": "gptoss-20b-single", "proxy_load_balancer": "true"}, "proxy_load_balancer=true", "a port nothing serves", "remove proxy_load_balancer"),
    row("EP guard removed", {"recipe": "gptoss-120b-di", "serving": {"tested_decode_ep": None}}, "serving.tested_decode_ep=null", "what the gptoss-120b-di recipe's reference tested (64), not a setting", "remove serving.tested_decode_ep"),
    row("EP guard moved", {"recipe": "gptoss-20b-di", "serving.tested_decode_ep": "64"}, "serving.tested_decode_ep='64'", "reference tested (32)", "remove serving.tested_decode_ep"),
    row("topology switched under a recipe", {"serving.topology": "single"}, "serving.topology='single'", "reference tested ('disaggregated')", "choose the recipe that runs what you want"),
    row("120B checkpoint in a 20B recipe", {"recipe": "gptoss-20b-single", "serving.model_id": "openai/gpt-oss-120b"}, "serving.model_id='openai/gpt-oss-120b'", "names a 120B checkpoint", "choose the 120B recipe"),
    row("rollout batch of none", {"rollout.max_unavailable": "0"}, "rollout.max_unavailable=0", "is a count of nodes (1 or more) or a percentage",
        "set rollout.max_unavailable=1 (the default), a larger count, or a percentage such as 25%"),
    row("rollout batch as a word", {"rollout.max_unavailable": "half"}, "rollout.max_unavailable='half'", "or a percentage of a role's nodes (1% to 100%)",
        "a percentage such as 25%"),
    row("rollout percentage over 100", {"rollout.max_unavailable": "150%"}, "rollout.max_unavailable='150%'", "(1% to 100%)", "such as 25%"),
    row("surge longer than CloudFormation waits", {"rollout.surge_timeout_s": "7200"}, "rollout.surge_timeout_s='7200'", "less than or equal to 3600",
        "lower `rollout.surge_timeout_s`"),
    row("surge without the deploy gate", {"wait_for_ready": "false", "rollout.surge": "on"}, "rollout.surge='on'", "which the deploy gate's checks say",
        "set wait_for_ready=true, or rollout.surge=off"),
    row("drain shorter than two members polls", {"rollout.drain_s": "60"}, "rollout.drain_s=60", "2 x healing.members_poll_s 30 s + 10 s",
        "set rollout.drain_s to 70 or more, or lower healing.members_poll_s"),
    row("surge mode misspelled", {"rollout.surge": "yes"}, "rollout.surge='yes'", "'auto', 'on' or 'off'", "rollout.surge"),
    row("20B checkpoint in the 120B recipe", {"serving": {"model_id": "acme/GPT-OSS-20B-tuned"}}, "serving.model_id='acme/GPT-OSS-20B-tuned'", "sized for 120B", "or a checkpoint of the recipe's size"),
    # -- who may call the model (serving.endpoint)
    row("keys where no gate runs", {"serving.endpoint.auth": "keys"}, "serving.endpoint.auth='keys'", "the toy proxy has no API gate to check keys", "set serving.proxy.kind=vllm-router, or serving.endpoint.auth=none"),
    row("keys on a single-instance recipe", {"recipe": "gptoss-20b-single", "serving.endpoint.auth": "keys"}, "serving.endpoint.auth='keys'", "single server has no API gate", "serving.endpoint.auth=none"),
    row("a keys secret no key is checked against", {"serving.endpoint.keys_secret_arn": "arn:aws:secretsmanager:us-east-2:123456789012:secret:keys"}, "serving.endpoint.keys_secret_arn=", "no key is checked", "remove keys_secret_arn"),
    row("a keys secret of another region", {"serving.proxy.kind": "vllm-router", "serving.endpoint.keys_secret_arn": "arn:aws:secretsmanager:eu-west-1:123456789012:secret:keys"}, "serving.endpoint.keys_secret_arn=", "uses Secrets Manager in us-east-2", "replicate it in us-east-2"),
    row("a certificate without a load balancer", {"serving.endpoint.certificate_arn": "arn:aws:acm:us-east-2:123456789012:certificate/11111111-2222-3333-4444-555555555555"}, "serving.endpoint.certificate_arn=", "this cluster has none", "set proxy_load_balancer=true"),
    row("a certificate of another region", {"decode_instances": "8", "serving.endpoint.certificate_arn": "arn:aws:acm:us-west-2:123456789012:certificate/11111111-2222-3333-4444-555555555555"}, "serving.endpoint.certificate_arn=", "uses ACM in us-east-2", "give that ARN"),
    row("a certificate that is not an ACM ARN", {"serving.endpoint.certificate_arn": "arn:aws:iam::123456789012:server-certificate/x"}, "serving.endpoint.certificate_arn=", "should match pattern", "set `serving.endpoint.certificate_arn`"),
    row("a TLS policy that offers TLS 1.0", {"serving.endpoint.tls_policy": "ELBSecurityPolicy-2016-08"}, "serving.endpoint.tls_policy='ELBSecurityPolicy-2016-08'", "is not a TLS 1.3/1.2-only policy", "use one of ELBSecurityPolicy-TLS13-1-2-2021-06"),
    row("the TLS port on the plain port", {"decode_instances": "8", "serving.endpoint.certificate_arn": "arn:aws:acm:us-east-2:123456789012:certificate/11111111-2222-3333-4444-555555555555", "serving.endpoint.tls_port": "8000"}, "serving.endpoint.tls_port=8000", "is the plain port", "a port of its own (443)"),
    row("no listener at all", {"serving.endpoint.plain_port": "false"}, "serving.endpoint.plain_port=false", "the only listener", "set serving.endpoint.certificate_arn"),
    row("any account, unasked", {"serving.endpoint.allowed_principals": '["*"]', "serving.endpoint.acceptance_required": "false"}, "serving.endpoint.acceptance_required=false", "any AWS account could connect", "keep acceptance_required=true"),
    row("a principal that is not an IAM ARN", {"serving.endpoint.allowed_principals": '["210987654321"]'}, "serving.endpoint.allowed_principals='210987654321'", "is not an IAM principal ARN", "give arn:aws:iam::<account>:root"),
    row("PrivateLink without a load balancer", {"serving.endpoint.allowed_principals": '["arn:aws:iam::210987654321:root"]'}, "serving.endpoint.allowed_principals=", "this cluster has none", "set proxy_load_balancer=true"),
    row("a refresh slower than a minute", {"serving.endpoint.keys_refresh_s": "300"}, "serving.endpoint.keys_refresh_s='300'", "less than or equal to 60", "lower `serving.endpoint.keys_refresh_s`"),
]


@pytest.mark.parametrize(("case", "context", "expected"), BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_names_field_value_rule_and_fix(case: str, context: dict[str, Any], expected: list[str]) -> None:
    with pytest.raises(SpecError) as err:
        limits.check(load_config(context))
    message = str(err.value)
    field_value, rule, fix = expected
    entries = [e for e in message.split("\n  - ") if e.lstrip(" -").startswith(field_value)]
    assert entries, f"{case}: no entry starts with {field_value!r}: {message!r}"
    entry = entries[0]
    before, _, after = entry.partition(" Fix: ")
    assert rule in before, f"{case}: the rule {rule!r} is not in {entry!r}"
    assert fix.removeprefix("Fix: ") in after, f"{case}: the fix {fix!r} is not in {entry!r}"


def test_the_table_has_at_least_120_distinct_bad_inputs() -> None:
    assert len(BAD_INPUTS) >= 120
    assert len({c for c, _, _ in BAD_INPUTS}) == len(BAD_INPUTS)
    assert len({json.dumps(ctx, sort_keys=True) for _, ctx, _ in BAD_INPUTS}) == len(BAD_INPUTS)
    # The README's count is this table's.
    readme = (ROOT / "docs" / "parameters.md").read_text()
    assert f"({len(BAD_INPUTS)} bad inputs are tested" in readme, f"docs/parameters.md: update the count to {len(BAD_INPUTS)}"


# ---- no traceback, whatever the input -------------------------------------------------------


def _as_cli_args(context: dict[str, Any]) -> list[str]:
    args = []
    for k, v in context.items():
        args += ["-c", f"{k}={v if isinstance(v, str) else json.dumps(v)}"]
    return args


def test_plan_answers_every_bad_input_with_one_message_and_exit_2(capsys: Any) -> None:
    """The tried-as-a-new-user sweep: every row of the table through `cluster.py plan`."""
    from cluster_ops import cli

    for case, context, (_field_value, _, _) in BAD_INPUTS:
        code = cli.main(["plan", "--json", *_as_cli_args(context)])
        out, err = capsys.readouterr()
        assert code == 2, case
        assert out == "" and err.startswith("invalid deployment parameters:\n  - "), case
        # No traceback and no Python exception's name ("TypeError: ...", "internal error"): the user's field, value, rule and fix.
        assert "Traceback" not in err and not re.search(r"\b[A-Z]\w*(Error|Exception):", err) and "internal error" not in err, (case, err)


@pytest.mark.parametrize(
    ("name", "content", "expected"),
    [
        ("syntax.yaml", "decode_instances: [1\n", "is not valid YAML (line 2, column 1: "),
        ("tagged.yaml", "decode_instances: !!python/object/apply:os.system ['true']\n", "uses a YAML tag a config may not use"),
        ("list.yaml", "- decode_instances: 8\n", "the file must hold a mapping of settings"),
        ("latin1.yaml", "cluster_name: caf\xe9\n".encode("latin-1"), "is not UTF-8 text"),
        ("numbers.yaml", "1: 2\n", "key 1 is not a setting name"),
        ("tabs.yaml", "network:\n\tegress: none\n", "is not valid YAML"),
        ("alias.yaml", "a: &big [1, 2]\nserving: *big\n", "sets the anchor &big (line 1, column 4)"),
        ("duplicate.yaml", "network:\n  egress: none\n  egress: nat\n", "gives the key 'egress' twice in one mapping (line 3, column 3)"),
        ("binary.yaml", "cluster_name: !!binary Z3B0b3Nz\n", "uses a YAML tag a config may not use (tag:yaml.org,2002:binary)"),
        ("octal.yaml", "decode_instances: 01000\n", "'01000' means different things in YAML 1.1 and 1.2"),
        ("underscore.yaml", "decode_instances: 1_0\n", "'1_0' means different things in YAML 1.1 and 1.2"),
        ("onoff.yaml", "wait_for_ready: on\n", "'on' means different things in YAML 1.1 and 1.2"),
        ("deep.yaml", "serving: " + "[" * 5000 + "]" * 5000 + "\n", "nests lists or mappings too deeply to read (serving nests them)"),
        ("deep.json", '{"region": "us-east-2", "network": ' + "[" * 5000 + "]" * 5000 + "}", "nests lists or mappings too deeply to read (network nests them)"),
        ("huge.yaml", "kms_key_arns:\n" + "  - arn:aws:kms:us-east-2:123456789012:key/0123abcd-0123-4567-89ab-0123456789ab\n" * 4000, "is 320,014 bytes (kms_key_arns takes 320,014 of them); a config file is at most 262,144"),
    ],
    ids=lambda v: v if isinstance(v, str) and v.endswith('.yaml') else '',
)
def test_a_broken_config_file_is_one_clear_message(tmp_path: Path, name: str, content: str | bytes, expected: str) -> None:
    f = tmp_path / name
    f.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(SpecError) as err:
        load_config({"config": str(f)})
    assert f"config={str(f)!r}: {expected}" in str(err.value) and "Fix:" in str(err.value)


def test_a_directory_given_as_config_is_named(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match=r"is a directory\. Fix: name a YAML or JSON file in it"):
        load_config({"config": str(tmp_path)})
