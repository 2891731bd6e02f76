"""The model and examples sections: where a node gets the checkpoint and the vLLM Neuron examples."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from clusterspec import validate
from clusterspec.base import Frozen
from clusterspec.errors import rule_error

SECRET_ARN = r"^arn:(aws[a-z-]*):secretsmanager:([a-z0-9-]+):([0-9]{12}):secret:[A-Za-z0-9/_+=.@-]+$"
COMMIT = r"^[0-9a-f]{40}$"
# One pip requirement pinned by version and by the sha256 of each file pip may take for it.
PINNED_REQUIREMENT = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([A-Za-z0-9][A-Za-z0-9.+!_-]*)((?: --hash=sha256:[0-9a-f]{64})+)$")


class ModelSource(Frozen):
    """Where each node gets the checkpoint at boot."""

    source: Literal["huggingface", "s3"] = "huggingface"
    s3_uri: str | None = None
    hf_token_secret_arn: str | None = Field(None, pattern=SECRET_ARN)
    expected_shards: int = Field(15, gt=0, le=1000, description="safetensors shards of the servable checkpoint.")
    revision: str | None = Field(
        None,
        description="The Hub commit (40 hex characters) every node downloads, recorded in the staging seal; "
        "unset, a node downloads the repository's main as it is on that day (the synth warns: gptoss:unpinned-model).",
    )

    @field_validator("revision")
    @classmethod
    def _revision(cls, v: str | None) -> str | None:
        if v is not None and not re.fullmatch(COMMIT, v):
            raise rule_error(
                "model.revision", v, "is not a commit id: a branch or a tag moves under a running fleet",
                "give the repository's 40-character lowercase commit id (the Hub's 'Files and versions' history)",
            )  # fmt: skip
        return v

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
        if self.source == "s3" and self.revision is not None:
            raise rule_error(
                "model.revision", self.revision, "applies to the Hub; an S3 checkpoint is the copy in model.s3_uri", "unset model.revision"
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
    commit: str | None = Field(
        None,
        description="The commit the ref must resolve to (40 hex characters): a node refuses examples whose tag has "
        "moved. Unset, the tag is trusted as it is on the day a node boots (the synth warns: gptoss:unpinned-examples).",
    )
    s3_uri: str | None = None

    @field_validator("commit")
    @classmethod
    def _commit(cls, v: str | None) -> str | None:
        if v is not None and not re.fullmatch(COMMIT, v):
            raise rule_error(
                "examples.commit", v, "is not a full commit id", "give the 40-character lowercase id (git rev-parse <tag>^{commit})"
            )
        return v

    @model_validator(mode="after")
    def _same_commit(self) -> ExamplesSource:
        if self.commit and re.fullmatch(COMMIT, self.ref) and self.ref != self.commit:
            raise rule_error(
                "examples.commit", self.commit, f"differs from examples.ref, itself a commit ({self.ref})", "give one commit id, or unset examples.commit"
            )
        return self

    @property
    def pinned_commit(self) -> str | None:
        """The commit a node must check out: the ref when it is one, else examples.commit."""
        return self.ref if re.fullmatch(COMMIT, self.ref) else self.commit

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


class NixlSource(Frozen):
    """The NIXL a DI node's vLLM venv imports: the image's own, or an install pinned by version and hash."""

    requirements: tuple[str, ...] = Field(
        (),
        max_length=50,
        description="pip requirement lines, each `name==version --hash=sha256:<64 hex>` (every package pip would take, "
        "nixl itself among them; pip --require-hashes refuses any other file). Empty: the image's NIXL is used and a node "
        "whose venv lacks it refuses to install one unpinned.",
    )

    @field_validator("requirements")
    @classmethod
    def _pinned(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        names = []
        for line in v:
            m = PINNED_REQUIREMENT.fullmatch(line)
            if m is None:
                raise rule_error(
                    "nixl.requirements", line, "is not one package pinned by version and hash",
                    "write name==version --hash=sha256:<64 lowercase hex> (pip hash FILE, or the sha256 PyPI lists for the file)",
                )  # fmt: skip
            names.append(re.sub(r"[-_.]+", "-", m.group(1)).lower())
        if v and "nixl" not in names:
            raise rule_error("nixl.requirements", list(v), "pins other packages but not nixl itself", "add a line nixl==<version> --hash=sha256:...")
        if len(set(names)) != len(names):
            raise rule_error("nixl.requirements", list(v), "names a package twice", "one line per package, with every hash of it on that line")
        return v

    @property
    def version(self) -> str | None:
        """The pinned NIXL version, or None when the image's is used."""
        for line in self.requirements:
            m = PINNED_REQUIREMENT.fullmatch(line)
            if m and re.sub(r"[-_.]+", "-", m.group(1)).lower() == "nixl":
                return m.group(2)
        return None
