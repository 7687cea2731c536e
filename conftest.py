"""Test-wide settings. Notebook kernels and the workers they launch inherit this environment."""
import os

# The same data on every machine, online or not, so that checked outputs match the committed ones.
os.environ.setdefault("LESSONS_DATA", "digits")
