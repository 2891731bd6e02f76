"""The model and examples sections: where a node gets the checkpoint and the vLLM Neuron examples."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from clusterspec import validate
from clusterspec.base import Frozen
from clusterspec.errors import rule_error

SECRET_ARN = r"^arn:(aws[a-z-]*):secretsmanager:([a-z0-9-]+):([0-9]{12}):secret:[A-Za-z0-9/_+=.@-]+$"


class ModelSource(Frozen):
    """Where each node gets the checkpoint at boot."""

    source: Literal["huggingface", "s3"] = "huggingface"
    s3_uri: str | None = None
    hf_token_secret_arn: str | None = Field(None, pattern=SECRET_ARN)
    expected_shards: int = Field(15, gt=0, le=1000, description="safetensors shards of the servable checkpoint.")

    @field_validator("s3_uri")
    @classmethod
    def _s3(cls, v: str | None) -> str | None:
        return v if v is None else validate.s3_uri("model.s3_uri", v)

    @model_validator(mode="after")
    def _source_rules(self) -> ModelSource:
        if self.source == "s3" and not self.s3_uri:
            raise rule_error(
                "model.s3_uri", None, "source 's3' needs the S3 location of the checkpoint", "set model.s3_uri=s3://bucket/prefix"
            )
        if self.source == "s3" and self.s3_uri and not validate.s3_parts(self.s3_uri)[1]:
            raise rule_error("model.s3_uri", self.s3_uri, "the checkpoint's files sit under a prefix, not at the bucket root", "give s3://bucket/prefix")
        return self


class ExamplesSource(Frozen):
    """Where the vLLM Neuron examples (proxy, schedule helper) come from."""

    repo_url: str = "https://github.com/vllm-project/vllm-neuron.git"
    ref: str = Field(
        "release-2.33",
        min_length=1,
        description="Tag or commit of the SDK 2.33 examples; the exact tag name is UNCONFIRMED.",
    )
    s3_uri: str | None = None

    @field_validator("repo_url")
    @classmethod
    def _repo(cls, v: str) -> str:
        return validate.https_url("examples.repo_url", v)

    @field_validator("ref")
    @classmethod
    def _pinned(cls, v: str) -> str:
        return validate.git_ref("examples.ref", v)

    @field_validator("s3_uri")
    @classmethod
    def _s3(cls, v: str | None) -> str | None:
        if v is None:
            return v
        validate.s3_uri("examples.s3_uri", v)
        if not validate.s3_parts(v)[1]:
            raise rule_error("examples.s3_uri", v, "the examples sit under a prefix, not at the bucket root", "give s3://bucket/prefix")
        return v
