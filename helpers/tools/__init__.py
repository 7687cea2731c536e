"""Teachers' and maintainers' commands: ``python -m helpers.tools.NAME`` (helpers/README.md lists them)."""
