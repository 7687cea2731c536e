"""Run the article's train(rank, world_size) under torchrun, with some of its bugs fixed.

    torchrun --standalone --nproc-per-node 2 helpers/workers/ddp_article_run.py --fix imports --fix gloo

Each rank does what the article's mp.spawn child would do: call train(rank, world_size). The
fixes (see helpers.kit.ddp.ARTICLE_FIXES) are applied to the text of ddp_article_original.py, so the
notebook can show, one fix at a time, where the tutorial breaks next.
"""
import argparse
import os
import types

from helpers.kit.ddp import ARTICLE_FIXES, article_source


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fix", action="append", default=[], choices=sorted(ARTICLE_FIXES))
    args = parser.parse_args()
    if "port" not in args.fix:
        # The article picks its own MASTER_PORT, so meet as its mp.spawn children would: rank 0 hosts
        # the store on that port (under torchrun, ranks would otherwise look for torchrun's store there).
        os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    article = types.ModuleType("article")  # not __main__: its own mp.spawn must not run
    exec(compile(article_source(args.fix), "ddp_article_original.py", "exec"), article.__dict__)
    article.train(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))


if __name__ == "__main__":
    main()
