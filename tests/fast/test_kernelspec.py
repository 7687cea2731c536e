"""Every lesson carries JupyterLab's own kernelspec, so opening it does not mark it modified (walkthrough W-3).

After merging a branch whose notebooks say "Python 3", re-apply with:  python -m helpers.tools.kernelspec
"""
from helpers import REPO_ROOT
from helpers.tools.kernelspec import fix


def test_every_notebook_names_the_kernel_as_jupyterlab_does():
    differing = [path.name for path in sorted((REPO_ROOT / "notebooks").glob("*.ipynb")) if fix(path, write=False)]
    assert not differing, f"run `python -m helpers.tools.kernelspec` to fix: {differing}"
