"""Embedded configurations: the demo the README runs and the paper-scale preset."""
