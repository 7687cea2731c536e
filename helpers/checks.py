"""What every exercise check in the lessons shares: telling a learner where they stand.

Every exercise check returns a bool and prints one line that starts with "Correct: " or "Not yet: ",
saying exactly what is still wrong. A check must say "Not yet" on the untouched starting code.
"""
from __future__ import annotations


def correct(message: str) -> bool:
    """Print "Correct: message" and return True."""
    print(f"Correct: {message}")
    return True


def not_yet(message: str) -> bool:
    """Print "Not yet: message" and return False."""
    print(f"Not yet: {message}")
    return False
