"""`gptoss keys`: the cluster's API keys in its secret (moto's Secrets Manager), as an operator sees them."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path
from typing import Any

import boto3
import pytest

from cluster_ops import cli
from cluster_ops.api_keys import Keys, KeysError
from tests.cluster_ops.cli_helpers import PROD, REGION

SECRET = "gptoss/gptoss-prod/api-keys"  # the production example's cluster: vLLM's router, keys by default


@pytest.fixture
def secret(aws: None) -> Any:
    sm = boto3.client("secretsmanager", region_name=REGION)
    # As the stack creates it: the template and the generated 'initial'.
    sm.create_secret(Name=SECRET, SecretString=json.dumps({"keys": [], "initial": "x" * 48}))
    return sm


def value(sm: Any) -> dict[str, Any]:
    return json.loads(sm.get_secret_value(SecretId=SECRET)["SecretString"])


def gptoss(capsys: Any, *argv: str) -> tuple[int, str, str]:
    code = cli.main(["keys", *argv, *PROD, "--width", "160"])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_create_prints_the_key_once_and_list_shows_names_dates_and_limits_never_a_key(secret: Any, capsys: Any) -> None:
    code, out, err = gptoss(capsys, "create", "team-search", "--requests-per-s", "50")
    assert code == 0, err
    key = out.strip()
    assert key.startswith("gk-") and len(key) == 46, "256 random bits, url-safe"
    assert err.splitlines()[0] == "stack GptOss8k1kProd · region us-east-2 · cluster tag gptoss:cluster=gptoss-prod"
    assert f"created key team-search in {SECRET}: every router takes it within 30 s" in err
    entry = value(secret)["keys"][0]
    assert (entry["name"], entry["key"], entry["requests_per_s"], entry["concurrency"], entry["expires"]) == ("team-search", key, 50, None, None)
    code, out, err = gptoss(capsys, "list")
    assert code == 0, err
    assert "team-search" in out and "initial" in out and "50" in out and "256 (default)" in out
    assert key not in out + err and "x" * 48 not in out + err, "list never shows a key"
    assert gptoss(capsys, "create", "team-search")[0] == 1, "a second key of one name is a rotation"
    code, _, err = gptoss(capsys, "create", "bad name!")
    assert code == 1 and "key name 'bad name!'" in err


def test_rotate_keeps_the_old_key_for_its_grace_and_revoke_asks_then_removes_every_key_of_the_name(secret: Any, capsys: Any) -> None:
    old = gptoss(capsys, "create", "team-a")[1].strip()
    code, out, err = gptoss(capsys, "rotate", "team-a", "--grace", "600")
    new = out.strip()
    assert code == 0 and new != old and "the old one until" in err, err
    keys = value(secret)["keys"]
    assert [(k["key"], k["expires"] is None) for k in keys] == [(old, False), (new, True)]
    ends = dt.datetime.fromisoformat(keys[0]["expires"].replace("Z", "+00:00"))
    assert 590 <= (ends - dt.datetime.now(dt.UTC)).total_seconds() <= 600
    # Without a terminal and without --yes, nothing is revoked.
    code, _, err = gptoss(capsys, "revoke", "team-a")
    assert code == 1 and "without confirmation" in err and len(value(secret)["keys"]) == 2
    code, _, err = gptoss(capsys, "revoke", "team-a", "--yes")
    assert code == 0 and "revoked 2 keys named team-a" in err, err
    assert value(secret)["keys"] == [] and value(secret)["initial"] == "x" * 48
    code, _, err = gptoss(capsys, "revoke", "initial", "--yes")
    assert code == 0 and value(secret)["initial"] is None
    code, out, err = gptoss(capsys, "list")
    assert "no valid key: every /v1/ request is refused 401" in err


def test_a_change_made_by_someone_else_meanwhile_is_not_overwritten(secret: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    keys = Keys(secret, SECRET)
    now = dt.datetime.now(dt.UTC)
    real_read = keys.read

    def read_then_someone_writes() -> tuple[dict[str, Any], str]:
        doc, version = real_read()
        secret.put_secret_value(SecretId=SECRET, SecretString=json.dumps({"keys": [], "initial": "y" * 48}))
        return doc, version

    monkeypatch.setattr(keys, "read", read_then_someone_writes)
    with pytest.raises(KeysError, match="changed while this ran"):
        keys.create("team-b", now)
    assert value(secret) == {"keys": [], "initial": "y" * 48}


def test_a_cluster_without_keys_and_a_secret_of_another_form_are_one_line_each(secret: Any, capsys: Any, tmp_path: Path) -> None:
    code = cli.main(["keys", "list"])  # the default stack: the toy proxy, no gate
    err = capsys.readouterr().err
    assert code == 2 and "gptoss keys: gptoss-8k1k checks no API key (no keys: the toy proxy has no API gate" in err, err
    secret.put_secret_value(SecretId=SECRET, SecretString="not json")
    code, _, err = gptoss(capsys, "create", "team-c")
    assert code == 1 and "is not of the keys' form" in err and "Traceback" not in err
