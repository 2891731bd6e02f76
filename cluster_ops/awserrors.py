"""AWS errors as one line an operator can act on: what is missing, and how to fix it."""

from __future__ import annotations

import os
import re

from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    EndpointConnectionError,
    NoCredentialsError,
    NoRegionError,
    PartialCredentialsError,
    TokenRetrievalError,
    UnauthorizedSSOTokenError,
)
from botocore.parsers import ResponseParserError

CREDENTIALS_FIX = (
    "configure credentials for the account (aws configure, aws sso login, or AWS_PROFILE / AWS_ACCESS_KEY_ID), "
    "then run the command again"
)
EXPIRED = {"ExpiredToken", "ExpiredTokenException", "RequestExpired", "TokenRefreshRequired"}
INVALID = {"UnrecognizedClientException", "InvalidClientTokenId", "AuthFailure", "SignatureDoesNotMatch", "InvalidSignatureException"}
DENIED = {"AccessDenied", "AccessDeniedException", "UnauthorizedOperation", "UnauthorizedAccess", "Forbidden"}
THROTTLED = {"Throttling", "ThrottlingException", "RequestLimitExceeded", "TooManyRequestsException", "SlowDown"}
# The IAM service of each API call the operator commands make (ClientError names only the operation).
SERVICE_OF = {
    **dict.fromkeys(["DescribeInstances", "DescribeInstanceTypes", "DescribeInstanceTypeOfferings", "DescribeImages",
                     "DescribeCapacityReservations"], "ec2"),
    **dict.fromkeys(["SendCommand", "GetCommandInvocation", "GetParameter"], "ssm"),
    "ListServiceQuotas": "servicequotas", "GetProducts": "pricing", "ListGroupResources": "resource-groups",
    **dict.fromkeys(["DescribeStackEvents", "DescribeStacks"], "cloudformation"),
    "GetCallerIdentity": "sts",
}  # fmt: skip


def _action(e: ClientError) -> str:
    """service:Operation, the IAM action the failed call needed."""
    op = getattr(e, "operation_name", "") or "?"
    return f"{SERVICE_OF.get(op, '?')}:{op}"


def explain(e: BaseException, *, region: str) -> str | None:
    """One line for an AWS error an operator can fix, or None when it is not one."""
    if isinstance(e, NoCredentialsError | PartialCredentialsError):
        return f"no AWS credentials found. Fix: {CREDENTIALS_FIX}."
    if isinstance(e, TokenRetrievalError | UnauthorizedSSOTokenError):
        return "the AWS SSO session has expired. Fix: aws sso login (with --profile when you use one), then run the command again."
    if isinstance(e, NoRegionError):
        return "no AWS region. Fix: set region in the config (-c region=us-east-2) or AWS_REGION."
    if isinstance(e, EndpointConnectionError):
        return f"cannot reach AWS in {region} ({e.kwargs.get('endpoint_url', 'the endpoint')}). Fix: check the network, proxy and region."
    if isinstance(e, ClientError):
        code = e.response.get("Error", {}).get("Code", "")
        message = e.response.get("Error", {}).get("Message", "")
        if code in EXPIRED:
            return f"the AWS credentials have expired ({code}). Fix: refresh them (aws sso login, or new session keys), then run again."
        if code in INVALID:
            return f"AWS does not accept these credentials ({code}: {message[:120]}). Fix: {CREDENTIALS_FIX}."
        if code in DENIED:
            return (
                f"access denied: the caller may not {_action(e)} in {region} ({message[:160]}). "
                f"Fix: grant {_action(e)} to the role or user you run as."
            )
        if code in THROTTLED:
            return f"AWS throttled {_action(e)} after every retry ({code}). Fix: wait a minute and run again, or raise AWS_MAX_ATTEMPTS."
        status = int(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
        if status >= 500 or code in {"InternalError", "InternalFailure", "ServiceUnavailable", "500", "502", "503", "504"}:
            # A failing service (or a local endpoint's HTML error page): its status, never its body.
            endpoint = os.environ.get("AWS_ENDPOINT_URL")
            where = f"the endpoint {endpoint}" if endpoint else f"AWS in {region}"
            fix = f"check the service at {endpoint} (AWS_ENDPOINT_URL)" if endpoint else "wait a few minutes and run again (AWS Health shows outages)"
            return f"{where} answered HTTP {status or code} to {_action(e)} after every retry. Fix: {fix}."
        if code in {"OptInRequired", "InvalidRegion", "UnrecognizedRegion"}:
            return f"region {region} is not enabled for this account ({code}). Fix: enable it, or set region in the config."
        return f"{_action(e)} failed: {code}: {message[:200]}"
    if isinstance(e, ResponseParserError):
        # An answer that is no AWS response: an HTML error page of a proxy or a local endpoint.
        endpoint = os.environ.get("AWS_ENDPOINT_URL")
        title = re.search(r"<title>([^<]{1,80})</title>", str(e))
        what = f"a page that is not an AWS response ({title.group(1) if title else 'unparsable'})"
        where = f"the endpoint {endpoint}" if endpoint else f"AWS in {region} (or a proxy on the way)"
        fix = f"check the service at {endpoint} (AWS_ENDPOINT_URL): its log names the failed call" if endpoint else "check HTTPS_PROXY, then run again"
        return f"{where} answered {what}. Fix: {fix}."
    if isinstance(e, BotoCoreError):
        return f"AWS client error: {e}"
    return None
