"""The every-60-s worker schedule as a package, so ``from launchd import schedule`` works
wherever this checkout's root is on sys.path (doctor and the MCP server need its status and
names); ``python launchd/schedule.py`` stays the command.

Env: none. Not run on its own.
"""
