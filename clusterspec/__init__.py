"""Deployment spec of the Trn3 gpt-oss-120b serving cluster: pure Python, no CDK."""
