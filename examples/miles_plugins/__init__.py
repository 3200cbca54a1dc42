"""An example plug-in package for miles-lite: a custom reward, a reward server, and more.

Put the directory holding this package on PYTHONPATH (or install it) and name its functions in the
configuration, e.g. ``rewards.custom=[miles_plugins.rewards:brevity]``.
"""
