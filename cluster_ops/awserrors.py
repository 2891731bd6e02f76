"""AWS errors as one line an operator can act on: what is missing, and how to fix it."""

from __future__ import annotations

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
        if code in {"OptInRequired", "InvalidRegion", "UnrecognizedRegion"}:
            return f"region {region} is not enabled for this account ({code}). Fix: enable it, or set region in the config."
        return f"{_action(e)} failed: {code}: {message[:200]}"
    if isinstance(e, BotoCoreError):
        return f"AWS client error: {e}"
    return None
