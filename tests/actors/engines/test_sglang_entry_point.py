"""pyproject.toml's `sglang.srt.plugins` entry point, which SGLang reads from the install's metadata in each of its
processes, names the engine's register function, in a module that imports without SGLang."""
import importlib
import tomllib
from pathlib import Path

from actors.engines.sglang.engine import register_sglang_plugin

ROOT = Path(__file__).resolve().parents[3]


def test_the_sglang_plugin_entry_point_names_the_register_function():
    plugins = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["sglang.srt.plugins"]
    module, _, attr = plugins["sparse_rl_kv"].partition(":")
    assert getattr(importlib.import_module(module), attr) is register_sglang_plugin
