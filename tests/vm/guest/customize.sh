#!/usr/bin/env bash
# mmdebstrap customize hook: turn the Debian root into the test guest. Runs on the host with
# the root folder as $1; GUEST_SRC, HUB_PY, MIDDLEWARE_PY, WHEELS and PUBKEY come from tests/vm/image.py.
# Everything here is a fake for what cannot exist in a VM (Trainium, EC2, the Hub, GitHub);
# the project's own files reach the guest only through the user data.
set -euo pipefail

root=$1
venv=/opt/aws_neuronx_venv_pytorch_inference_vllm_fake
# Commands inside the guest root see none of the host's environment (pip settings, proxies).
in_root() { chroot "$root" env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8 "$@"; }

cp -a "$GUEST_SRC/rootfs/." "$root/"
cp "$HUB_PY" "$root/usr/local/lib/fakes/hub.py"
cp "$MIDDLEWARE_PY" "$root/usr/local/lib/fakes/vllm_middleware.py"
install -d -m 700 "$root/root/.ssh"
install -m 600 "$PUBKEY" "$root/root/.ssh/authorized_keys"
echo "/dev/vda / ext4 defaults 0 1" >"$root/etc/fstab"

# The DLAMI's vLLM venv: a real venv with the real huggingface_hub, and a fake `vllm`.
in_root python3 -m venv "$venv"
cp -r "$WHEELS" "$root/tmp/wheels"
in_root "$venv/bin/pip" install --quiet --no-index --find-links /tmp/wheels huggingface_hub
# The AWS CLI the node scripts call (the DLAMI ships one), in its own venv; it reaches the
# cluster's AWS (the host's moto) through AWS_ENDPOINT_URL.
in_root python3 -m venv /opt/awscli
in_root /opt/awscli/bin/pip install --quiet --no-index --find-links /tmp/wheels awscli
ln -sf /opt/awscli/bin/aws "$root/usr/local/bin/aws"
rm -rf "$root/tmp/wheels"
# NIXL, which the DLAMI's vLLM venv ships (the node check imports it before any server starts).
site=$(in_root "$venv/bin/python3" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
mkdir -p "$root$site/nixl"
echo '"""Stand-in for NIXL: importable, as on the DLAMI."""' >"$root$site/nixl/__init__.py"
printf '#!%s/bin/python3\nimport runpy\nrunpy.run_path("/usr/local/lib/fakes/vllm.py", run_name="__main__")\n' "$venv" >"$root$venv/bin/vllm"
chmod 755 "$root$venv/bin/vllm"

# The fake Hub's repository: 15 tiny shards in the published layout, plus the folders the
# node must not download.
in_root python3 -c 'import sys; sys.path.insert(0, "/usr/local/lib/fakes"); import hub, pathlib; hub.make_checkpoint(pathlib.Path("/srv/hub/openai/gpt-oss-120b"), 15)'

# The vLLM Neuron examples at the default ref, and a later commit the node must not get.
work=$(mktemp -d)
git init -q "$work/repo"
cp -a "$GUEST_SRC/examples/." "$work/repo/"
git=(git -C "$work/repo" -c user.name=harness -c user.email=harness@example.invalid)
"${git[@]}" add -A
"${git[@]}" commit -qm "examples of the release"
"${git[@]}" tag release-2.33
echo "not part of the release" >"$work/repo/LATER"
"${git[@]}" add -A
"${git[@]}" commit -qm "a later commit"
mkdir -p "$root/srv/git"
git clone -q --bare "$work/repo" "$root/srv/git/vllm-neuron.git"
rm -rf "$work"

in_root systemctl enable --quiet fake-devices.service fake-imds.service fake-hub.service fake-waitcondition.service systemd-networkd.service ssh.service
# Nothing the tests need, and each costs seconds of a software-emulated boot.
in_root systemctl mask --quiet apt-daily.timer apt-daily-upgrade.timer e2scrub_all.timer fstrim.timer 2>/dev/null || true
