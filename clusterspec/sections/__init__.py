"""The spec's sections, one module each, with the checks that need only that section beside its
fields: network, sources (model, examples), capacity, boot, healing, observability, and serving
(servers, their flags and environment, the proxy or router, the benchmark). ClusterConfig
(clusterspec/config.py) composes them and holds the rules that span sections."""
