"""Per-instance-type hardware table: what the launch templates and the layout are built from."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class InstanceType(BaseModel):
    """Hardware of one instance type, with the values no public source confirms named (bounded: an
    override of 10**23 devices would otherwise be laid out core by core)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    vcpus: int = Field(gt=0, le=4096)
    neuron_devices: int = Field(gt=0, le=64)
    physical_cores_per_device: int = Field(gt=0, le=64)
    network_cards: int = Field(gt=0, le=64, description="NetworkInfo.MaximumNetworkCards")
    efa_interfaces: int = Field(ge=0, le=64, description="NetworkInfo.EfaInfo.MaximumEfaInterfaces")
    nvme_disks: int = Field(ge=0, le=64, description="InstanceStorageInfo.Disks[].Count")
    nvme_disk_gb: int = Field(ge=0, le=1000000, description="InstanceStorageInfo.Disks[].SizeInGB")
    mxfp4: bool = Field(description="The tested MXFP4 path exists only on Trainium3.")
    unpublished: tuple[str, ...] = Field(
        default=(),
        description="Fields whose value no public source confirms; preflight checks them.",
    )

    @property
    def physical_cores(self) -> int:
        """Physical NeuronCores of the whole instance."""
        return self.neuron_devices * self.physical_cores_per_device

    def logical_cores(self, lnc: int) -> int:
        """Logical NeuronCores at a logical-NeuronCore config (LNC=1 or 2)."""
        return self.physical_cores // lnc

    @property
    def vcpu_family(self) -> str:
        """The instance family, as the vCPU quota groups it (trn3.48xlarge -> trn3)."""
        return self.name.split(".", 1)[0]


# trn2.48xlarge: 16 Trainium2 devices of 8 physical cores, 192 vCPU, 16 network cards
# (EFAv3, 3,200 Gbps), 4 x 1,900 GB instance-store NVMe (EC2 instance-type docs).
TRN2_48XL = InstanceType(
    name="trn2.48xlarge",
    vcpus=192,
    neuron_devices=16,
    physical_cores_per_device=8,
    network_cards=16,
    efa_interfaces=16,
    nvme_disks=4,
    nvme_disk_gb=1900,
    mxfp4=False,
)

# trn3.48xlarge: 16 Trainium3 devices (Neuron driver platform table) of 8 physical
# NeuronCore-v4, 192 vCPU; its network cards, EFA count and instance storage are not
# published, so they are assumed to be trn2.48xlarge's. Preflight compares them with
# DescribeInstanceTypes and names the override to set.
TRN3_48XL = TRN2_48XL.model_copy(
    update={
        "name": "trn3.48xlarge",
        "mxfp4": True,
        "unpublished": ("network_cards", "efa_interfaces", "nvme_disks", "nvme_disk_gb"),
    }
)

KNOWN_INSTANCE_TYPES: dict[str, InstanceType] = {t.name: t for t in (TRN3_48XL, TRN2_48XL)}
