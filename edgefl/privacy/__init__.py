"""Differential privacy: the accountant (:mod:`edgefl.privacy.accounting`), the noise filters
(:mod:`edgefl.filters.dp`) and DP-SGD for local training. docs/privacy.md says what each mode
protects against and how to choose its parameters."""
