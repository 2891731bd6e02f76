"""What a node runs, rendered from the spec: its units, command lines and environment, its user data,
the scripts bundle, the API gate's configuration, and the stack-size estimate of all of it."""
