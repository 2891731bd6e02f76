"""CDK components of the cluster, one capability per module.

Not named `constructs`: a top-level package of that name shadows the library aws-cdk-lib
imports, and synth fails with "No module named 'constructs._jsii'" (aws-cdk issue 19301).
"""
