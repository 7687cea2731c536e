"""binder/requirements.txt (CPU-only torch; Binder, and CPU-only Linux laptops per the README) pins the same versions
as requirements.txt, so that the two installs run the same lessons. Reads the files; installs nothing."""
from __future__ import annotations

import re

from helpers import REPO_ROOT

# Only in requirements.txt: the browser tests' driver (the tests skip without it), the maintainers' checks that .ci/run
# runs (import-linter, ruff), and the project itself (binder's postBuild and the README's CPU-only line install it
# with `-e .`).
ONLY_IN_MAIN = {"playwright", "import-linter", "ruff", "-e ."}


def pins(path) -> dict[str, str]:
    found = {}
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if not line or line.startswith("--"):
            continue
        name, _, version = line.partition("==")
        found[name.strip().lower()] = version.strip()
    return found


def test_binder_pins_the_same_versions_with_cpu_only_torch():
    main, binder = pins(REPO_ROOT / "requirements.txt"), pins(REPO_ROOT / "binder" / "requirements.txt")
    # Catches a version bumped in one file only, or a package added to one file only.
    assert set(main) - ONLY_IN_MAIN == set(binder), (set(main) ^ set(binder)) - ONLY_IN_MAIN
    for name, version in binder.items():
        expected = f"{main[name]}+cpu" if name in ("torch", "torchvision") else main[name]
        assert version == expected, (name, version, expected)
    # The +cpu wheels live only on PyTorch's own index.
    assert re.search(r"^--extra-index-url https://download.pytorch.org/whl/cpu$",
                     (REPO_ROOT / "binder" / "requirements.txt").read_text(), re.M)
