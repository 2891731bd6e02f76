"""Thin stacks that compose the cluster components."""
