"""Operator commands that talk to AWS (boto3): preflight, status, wait-ready, bench.

Kept apart from the spec and the CDK app, which never call AWS.
"""
