"""The pytest plugin's fixtures under their former name (``-p tinker_sr.testing.plugin``,
``pytest_plugins``); installed, the plugin is the top-level `tinker_sr_pytest_plugin`,
registered through the ``pytest11`` entry point.

Its hooks come with it: where the entry point is not loaded (``PYTEST_DISABLE_PLUGIN_AUTOLOAD``,
``-p no:tinker_sr``), this module registers the plugin itself, once (a star import brings the
fixtures only, and the ``-W error`` guard for the server fixtures was missing)."""

from typing import Any

import tinker_sr_pytest_plugin as _plugin
from tinker_sr_pytest_plugin import *  # noqa: F403


def pytest_configure(config: Any) -> None:
    if not config.pluginmanager.is_registered(_plugin):
        config.pluginmanager.register(_plugin, "tinker_sr_pytest_plugin")
