"""Test stand-in for the reference ``afd_plugin`` package (see ../README.md)."""

from afd_plugin.config import AFDConfig, parse_afd_config

__all__ = ["AFDConfig", "parse_afd_config"]
