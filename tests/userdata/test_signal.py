"""gptoss-signal, the deploy gate's verdict, run for real as shipped against loopback peers (the wait
condition handle, the proxy): when it says SUCCESS or FAILURE, its deadline, the handle's expiry."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

Shipped = Callable[[str], Path]


# ---- gptoss-signal --------------------------------------------------------------------------------


def test_signal_succeeds_after_a_real_completion_through_the_proxy_and_only_once(signal_node: Any, peers: Any) -> None:
    r = signal_node(extra_env={"GPTOSS_NODE_KEY": str(Path(r"/nonexistent/node-api-key"))})
    assert r.returncode == 0, r.stderr
    assert peers.authorizations == [None], "no gate, no key"
    (put,) = peers.puts
    assert put["content_type"] == "", "the presigned URL was signed without a content type"
    assert put["doc"]["Status"] == "SUCCESS" and put["doc"]["UniqueId"] == "prefill-0"
    assert put["doc"]["Reason"] == f"prefill-0: a completion through {peers.url}/v1/completions returned 16 tokens"
    assert signal_node().returncode == 0 and len(peers.puts) == 1, "a reboot does not signal again"


def test_behind_a_gate_that_checks_keys_the_test_completion_carries_the_nodes_own_key(signal_node: Any, peers: Any, tmp_path: Path) -> None:
    """A router node's endpoint is its API gate, which takes only keys: the deploy gate's completion sends the node's own
    (gptoss-api init made it, root only, this boot's); a node without one (no gate) sends none."""
    key = tmp_path / "node-api-key"
    key.write_text("gk-node-" + "n" * 43 + "\n")
    assert signal_node(extra_env={"GPTOSS_NODE_KEY": str(key)}).returncode == 0
    assert peers.authorizations == ["Bearer gk-node-" + "n" * 43] and peers.puts[0]["doc"]["Status"] == "SUCCESS"


def test_signal_waits_while_the_completion_returns_no_tokens(signal_node: Any, peers: Any) -> None:
    peers.completion = {"choices": [{"text": ""}], "usage": {"completion_tokens": 0}}
    r = signal_node(timeout=121)
    assert r.returncode == 0
    (put,) = peers.puts
    assert put["doc"]["Status"] == "FAILURE"
    assert "not ready before the deploy gate's timeout: completion returned no tokens" in put["doc"]["Reason"]


def test_signal_fails_naming_the_failed_unit_and_its_last_log_line(signal_node: Any, peers: Any) -> None:
    r = signal_node({"gptoss-node-check.service": "ActiveState=failed\nNRestarts=0"})
    assert r.returncode == 0, r.stderr
    (put,) = peers.puts
    assert put["doc"] == {"Status": "FAILURE", "UniqueId": "prefill-0",
                          "Reason": "prefill-0: gptoss-node-check.service failed: last line of gptoss-node-check.service",
                          "Data": "prefill-0: gptoss-node-check.service failed: last line of gptoss-node-check.service"}  # fmt: skip


def test_signal_fails_when_staging_keeps_failing(signal_node: Any, peers: Any) -> None:
    signal_node({"gptoss-stage.service": "ActiveState=activating\nSubState=auto-restart\nNRestarts=3"})
    assert (
        peers.puts[0]["doc"]["Reason"]
        == "prefill-0: gptoss-stage.service staging keeps failing (3 restarts): last line of gptoss-stage.service"
    )


def _amz(signed_ago_s: float, expires_s: int = 86399) -> str:
    """The query of a SigV4 presigned URL signed that long ago (as CloudFormation's handles are)."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(time.time() - signed_ago_s))
    return f"X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Date={stamp}&X-Amz-SignedHeaders=host&X-Amz-Expires={expires_s}&X-Amz-Signature=abc"


# S3's answers to a PUT on a presigned URL (its REST error format): past the URL's expiry, and
# refused by a policy (a VPC endpoint policy, an SCP, a bucket policy) while the URL is still valid.
S3_EXPIRED = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>AccessDenied</Code><Message>Request has expired</Message>'
              b"<X-Amz-Expires>86399</X-Amz-Expires><RequestId>R1</RequestId></Error>")  # fmt: skip
S3_DENIED = b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>AccessDenied</Code><Message>Access Denied</Message><RequestId>R2</RequestId></Error>'


def test_an_expired_handle_is_told_nothing_and_asked_nothing_again(signal_node: Any, peers: Any, tmp_path: Path) -> None:
    """S3 answers 403 "Request has expired" to a presigned URL past its expiry: log once, stop
    (Restart=on-failure would ask for the node's life); the verdict is kept for the group."""
    peers.put_answers = [(403, S3_EXPIRED)]
    r = signal_node({"gptoss-node-check.service": "ActiveState=failed\nNRestarts=0"})
    assert r.returncode == 0, r.stderr
    assert len(peers.puts) == 1, "one PUT: an expired handle is not asked again"
    assert "the handle answered 403 AccessDenied: Request has expired" in r.stdout and "the deploy gate is over" in r.stdout
    again = signal_node({"gptoss-node-check.service": "ActiveState=failed\nNRestarts=0"})
    assert again.returncode == 0 and len(peers.puts) == 1 and "already signalled (FAILURE" in again.stdout
    assert "(the gate not told: the handle answered 403 AccessDenied: Request has expired)" in again.stdout


def test_a_403_that_is_not_expiry_is_named_and_tried_again_until_the_policy_lets_it_through(signal_node: Any, peers: Any) -> None:
    """A policy that denies the wait-condition bucket is not the end of the gate: the node says what
    refuses it at every attempt and signals as soon as the policy is fixed (here: after three refusals)."""
    peers.put_answers = [(403, S3_DENIED), (403, S3_DENIED), (403, S3_DENIED), (200, b"")]
    r = signal_node({"gptoss-node-check.service": "ActiveState=failed\nNRestarts=0"}, query=_amz(signed_ago_s=60))
    assert r.returncode == 0, r.stderr
    assert len(peers.puts) == 4 and all(p["doc"]["Status"] == "FAILURE" for p in peers.puts)
    refused = [line for line in r.stdout.splitlines() if "the wait-condition bucket refuses this node" in line]
    assert len(refused) == 3 and "(403 AccessDenied: Access Denied) although the handle has not expired" in refused[0]
    assert "VPC endpoint policy" in refused[0]
    assert "gptoss-signal: FAILURE: prefill-0: gptoss-node-check.service failed" in r.stdout
    assert "EXPIRED" not in r.stdout


def test_a_403_that_outlasts_the_handle_ends_when_the_handle_expires(signal_node: Any, peers: Any) -> None:
    peers.put_answers = [(403, S3_DENIED)]
    # 12 s of validity: room for a slow start on a busy machine, and for many 0.2 s retries after it.
    r = signal_node({"gptoss-node-check.service": "ActiveState=failed\nNRestarts=0"}, query=_amz(signed_ago_s=0, expires_s=12))
    assert r.returncode == 0, r.stderr
    assert len(peers.puts) >= 2, "tried again while the handle was valid"
    assert r.stdout.count("the wait-condition bucket refuses this node") >= len(peers.puts) - 1, "each refusal named while the handle was valid"
    assert ("the deploy gate is over; not signalling FAILURE to it (gptoss-node-check.service failed: last line of "
            "gptoss-node-check.service)") in r.stdout  # fmt: skip


def test_an_endpoint_that_refuses_the_test_completion_fails_the_gate_in_four_tries(signal_node: Any, peers: Any) -> None:
    """A 4xx that waiting does not change (the model name, the request) is a FAILURE with the answer, not a wait to the deadline."""
    peers.completion_status = 404
    peers.completion = {"error": {"message": "The model `/opt/dlami/nvme/models/gpt-oss-120b` does not exist.", "code": 404}}
    r = signal_node()
    assert r.returncode == 0, r.stderr
    (put,) = peers.puts
    assert put["doc"]["Status"] == "FAILURE"
    assert put["doc"]["Reason"].startswith("prefill-0: every unit is ready but the endpoint refused the test completion 4 times in a row: HTTP 404: ")
    assert "does not exist" in put["doc"]["Reason"]


def test_a_busy_endpoint_is_waited_for_not_failed(signal_node: Any, peers: Any) -> None:
    """429 (too many requests) passes: the gate waits for it (here until its short timeout)."""
    peers.completion_status = 429
    r = signal_node(timeout=121)
    assert r.returncode == 0
    (put,) = peers.puts
    assert "not ready before the deploy gate's timeout: completion request failed: HTTP 429" in put["doc"]["Reason"]


def test_a_handle_past_its_expiry_is_not_signalled_but_the_node_still_reaches_its_verdict(signal_node: Any, peers: Any) -> None:
    """A rollback's instance boots the previous template, whose handle was made at the previous deploy
    (here 25 hours ago: its URL has expired): nothing is PUT, and the node still watches its units to
    its verdict, which its group hears (the surge tests below)."""
    r = signal_node(query=_amz(signed_ago_s=90000))
    assert r.returncode == 0 and peers.puts == [], r.stdout
    assert "the deploy gate will not be told (its URL has expired)" in r.stdout
    assert f"gptoss-signal: SUCCESS: prefill-0: a completion through {peers.url}/v1/completions returned 16 tokens" in r.stdout


def _ready_after(peers: Any, calls: int) -> None:
    """The endpoint answers no tokens to its first CALLS test completions, then tokens."""
    answers = iter([{"choices": [{"text": ""}], "usage": {"completion_tokens": 0}}] * calls)
    done = {"choices": [{"text": " Paris."}], "usage": {"completion_tokens": 16}}
    original = peers.do_POST

    def do_post(self: Any) -> None:
        type(self).completion = next(answers, done)
        original(self)

    peers.do_POST = do_post


def test_a_node_launched_hours_after_its_handle_was_made_gets_its_full_deadline(signal_node: Any, peers: Any) -> None:
    """The clock starts at the node's own turn: the later of its instance's first boot and its handle's
    making. A handle made 5 hours before this instance booted (a lane's late node, a replacement) leaves
    the node the gate's whole timeout: it waits for its completion and signals SUCCESS, where a clock
    from the handle (400 s, less the 300 s margin, long past) would have failed it at once."""
    _ready_after(peers, 3)
    r = signal_node(timeout=400, query=_amz(signed_ago_s=5 * 3600))
    assert r.returncode == 0, r.stderr
    (put,) = peers.puts
    assert put["doc"]["Status"] == "SUCCESS", put
    assert "not ready before the deploy gate's timeout" not in r.stdout


def test_a_handle_made_after_the_instance_booted_starts_the_clock_then(signal_node: Any, peers: Any) -> None:
    """An instance that booted 5 hours ago and is handed a handle made now counts from the handle: the
    later of the two, never the earlier."""
    _ready_after(peers, 3)
    r = signal_node(timeout=400, query=_amz(signed_ago_s=0), booted_ago_s=5 * 3600)
    assert r.returncode == 0, r.stderr
    assert [p["doc"]["Status"] for p in peers.puts] == ["SUCCESS"]


def test_the_deadline_ends_the_wait_with_a_failure_that_says_so(signal_node: Any, peers: Any) -> None:
    """A node that does not serve within its own deadline (booted now, 400 s - 300 s margin) reports FAILURE before CloudFormation's timeout."""
    peers.completion = {"choices": [{"text": ""}], "usage": {"completion_tokens": 0}}
    r = signal_node(timeout=302, query=_amz(signed_ago_s=0))
    assert r.returncode == 0
    (put,) = peers.puts
    assert put["doc"]["Status"] == "FAILURE" and "not ready before the deploy gate's timeout" in put["doc"]["Reason"]


def test_a_crashed_collector_does_not_fail_the_deploy_gate(signal_node: Any, peers: Any, tmp_path: Path) -> None:
    """The telemetry collector is listed for `gptoss status` but is not what the node serves with: the gate hears SUCCESS."""
    health = tmp_path / "etc" / "health"
    health.write_text(health.read_text() + "gptoss-telemetry.service - -\n")
    r = signal_node({"gptoss-telemetry.service": "ActiveState=failed\nSubState=failed\nNRestarts=3"})
    assert r.returncode == 0, r.stderr
    (put,) = peers.puts
    assert put["doc"]["Status"] == "SUCCESS", put
