"""The pytest plugin's fixtures under their former name (``-p tinker_sr.testing.plugin``,
``pytest_plugins``); installed, the plugin is the top-level `tinker_sr_pytest_plugin`,
registered through the ``pytest11`` entry point."""

from tinker_sr_pytest_plugin import *  # noqa: F403
