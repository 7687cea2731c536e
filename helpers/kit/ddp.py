"""The source article's DDP tutorial, as printed, and the fixes that make it run here (lesson 02). Worker kit.

    from helpers.kit.ddp import article_source, ARTICLE_FIXES
    article_source(["imports", "gloo"])     # the tutorial's text with two of its bugs fixed

The tutorial itself is helpers/workers/ddp_article_original.py, unchanged; helpers/workers/ddp_article_run.py
runs it with the fixes a notebook cell names, so the lesson can show where it breaks next.
"""
from __future__ import annotations

from helpers.kit import WORKERS

ARTICLE = WORKERS / "ddp_article_original.py"


ARTICLE_FIXES = {
    "imports": [("import torch.multiprocessing as mp\n",
                 "import torch.multiprocessing as mp\nimport os\nimport torch.optim as optim\n")],
    "gloo": [('dist.init_process_group("nccl"', 'dist.init_process_group("gloo"')],
    "data": [("from torchvision import datasets, transforms", "from helpers.kit.data import load"),
             ("    transform = transforms.Compose([transforms.ToTensor()])\n", ""),
             ("datasets.MNIST(root='./data', train=True, download=True, transform=transform)",
              "load(train=True)[0]")],
    "cpu": [("create_model().to(rank)", "create_model()"), ("DDP(model, device_ids=[rank])", "DDP(model)"),
            ("data.to(rank), target.to(rank)", "data, target")],
    "port": [("    os.environ['MASTER_ADDR'] = 'localhost'  # noqa: F821\n", ""),
             ("    os.environ['MASTER_PORT'] = '12355'  # noqa: F821\n", "")],
}


def article_source(fixes: list[str] | tuple[str, ...] = ()) -> str:
    """The article's tutorial with the named fixes applied (see ARTICLE_FIXES)."""
    text = ARTICLE.read_text()
    for name in fixes:
        for old, new in ARTICLE_FIXES[name]:
            if old not in text:
                raise ValueError(f"fix {name!r}: {old!r} not found in {ARTICLE.name}")
            text = text.replace(old, new)
    return text
