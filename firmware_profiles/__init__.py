"""Firmware profiles (one TOML per device class), shipped as package data."""
